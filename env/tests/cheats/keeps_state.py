# Honest, for problem_stateful.py: the same state, updated on every call
# as the problem's model updates it.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.state = torch.zeros(64, 32)

    def forward(self, x):
        self.state = torch.tanh(self.state + x)
        return 2.0 * self.state

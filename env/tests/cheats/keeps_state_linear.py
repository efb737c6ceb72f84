# Honest, for problem_stateful_linear.py: the same cell (built first, so
# under the seed its weights are the problem's) and the same state.
import torch
import torch.nn as nn
import torch.nn.functional as F


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(32, 32)
        self.state = torch.zeros(16, 32)

    def forward(self, x):
        self.state = torch.tanh(F.linear(x, self.cell.weight, self.cell.bias) + self.state)
        return self.state

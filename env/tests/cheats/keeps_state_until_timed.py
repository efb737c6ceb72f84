# Cheats on purpose, for problem_stateful.py: keeps the state honestly for
# its first eight calls (the correctness trials and then some), then stops
# updating it and answers from the state it had.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.state = torch.zeros(64, 32)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls <= 8:
            self.state = torch.tanh(self.state + x)
            return 2.0 * self.state
        return 2.0 * torch.tanh(self.state + x)

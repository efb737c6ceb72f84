# Honest, for problem_running_mean.py: the same running mean, kept the
# same way.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(64, 32))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.total += x
        self.count += 1.0
        return x - self.total / self.count

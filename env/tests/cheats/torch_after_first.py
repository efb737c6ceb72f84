# Cheats on purpose (strict mode): computes without torch ops on the first
# call (numpy on the CPU), with torch on every later one.
import numpy
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 1:
            return torch.from_numpy(numpy.maximum(x.numpy(), 0.0))
        return torch.relu(x)

# A ReLU problem whose output has more elements than the judge compares in
# full after a timed call (it samples them there).
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(80, 65536)]


def get_init_inputs():
    return []

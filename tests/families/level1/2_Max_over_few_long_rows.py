import torch
import torch.nn as nn


class Model(nn.Module):
    """Maximum of 8 rows of 2^20: runs of a row combined atomically."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.amax(x, dim=1)


def get_inputs():
    return [torch.randn(8, 1 << 20) - 4.0]


def get_init_inputs():
    return []

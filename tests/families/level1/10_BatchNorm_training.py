import torch
import torch.nn as nn


class Model(nn.Module):
    """Training-mode batch norm of [N, C] rows, then of an NCHW map."""

    def __init__(self, channels):
        super().__init__()
        self.bn1 = nn.BatchNorm1d(channels)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x, y):
        return self.bn1(x), self.bn2(y)


def get_inputs():
    return [torch.randn(8192, 64), torch.randn(16, 64, 32, 32)]


def get_init_inputs():
    return [64]

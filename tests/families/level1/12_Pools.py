import torch
import torch.nn as nn


class Model(nn.Module):
    """2-d max pool, then 1-d average pool of another input, then a global
    average pool."""

    def __init__(self):
        super().__init__()
        self.maxpool = nn.MaxPool2d(3, stride=2, padding=1)
        self.avgpool = nn.AvgPool1d(4, stride=2)
        self.gap = nn.AdaptiveAvgPool2d(1)

    def forward(self, x, y):
        return self.gap(self.maxpool(x)), self.avgpool(y)


def get_inputs():
    return [torch.randn(16, 32, 64, 64), torch.randn(64, 32, 4096)]


def get_init_inputs():
    return []

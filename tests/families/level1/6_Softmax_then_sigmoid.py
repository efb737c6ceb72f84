import torch
import torch.nn as nn


class Model(nn.Module):
    """sigmoid(softmax(x) + b) * 2 over rows of 1000."""

    def __init__(self, features):
        super().__init__()
        self.b = nn.Parameter(torch.randn(features))

    def forward(self, x):
        return torch.sigmoid(torch.softmax(x, dim=1) + self.b) * 2.0


def get_inputs():
    return [torch.randn(4096, 1000)]


def get_init_inputs():
    return [1000]

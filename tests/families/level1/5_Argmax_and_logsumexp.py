import torch
import torch.nn as nn


class Model(nn.Module):
    """The index of each row's maximum plus the row's log-sum-exp."""

    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.argmax(x, dim=1).float() + torch.logsumexp(x, dim=1)


def get_inputs():
    return [torch.randn(512, 8192)]


def get_init_inputs():
    return []

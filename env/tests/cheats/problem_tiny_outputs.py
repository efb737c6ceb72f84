# A small ReLU problem with outputs smaller than atol in KernelBench's form, sized for CPU tests.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x) * 1e-5


def get_inputs():
    return [torch.randn(64, 1024)]


def get_init_inputs():
    return []

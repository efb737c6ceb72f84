# A small ReLU problem whose inputs are all >= 0 (torch.rand, as KernelBench's
# L1/19 draws them): on those inputs ReLU is the identity.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.rand(64, 1024)]


def get_init_inputs():
    return []

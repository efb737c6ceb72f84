# Not a cheat: a problem whose model writes to its input. Called twice on
# inputs drawn alike it gives the same outputs: it keeps no state.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x.add_(1.0)
        return x * 2.0


def get_inputs():
    return [torch.rand(64, 32)]


def get_init_inputs():
    return []

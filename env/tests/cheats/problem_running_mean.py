# Not a cheat: a problem whose model keeps a running mean of its inputs in
# buffers it updates in place (no attribute is assigned), so the same
# input twice in a row gives the same output, and again after another
# input a different one. The judge finds the state and judges in lockstep.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("total", torch.zeros(64, 32))
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.total.add_(x)
        self.count.add_(1.0)
        return x - self.total / self.count


def get_inputs():
    return [torch.rand(64, 32)]


def get_init_inputs():
    return []

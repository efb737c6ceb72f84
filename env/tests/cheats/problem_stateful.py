# Not a cheat: a problem whose model keeps state across calls (forward
# replaces a tensor attribute), so each output depends on every earlier
# call. The judge mirrors each of a candidate's calls, in order, on a fresh
# model of its own (lockstep) for that call's reference.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.zeros(64, 32)

    def forward(self, x):
        self.hidden = torch.tanh(x + self.hidden)
        return self.hidden * 2.0


def get_inputs():
    return [torch.rand(64, 32)]


def get_init_inputs():
    return []

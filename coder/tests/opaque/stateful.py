# A model that keeps state across calls: forward replaces a tensor
# attribute, so each output depends on every earlier call. Its trace has
# no graph mtmc can read; the whole forward stays the problem's own code.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = torch.zeros(4, 8)

    def forward(self, x):
        self.hidden = torch.tanh(x + self.hidden.to(x.device))
        return self.hidden * 2.0


def get_inputs():
    return [torch.rand(4, 8)]


def get_init_inputs():
    return []

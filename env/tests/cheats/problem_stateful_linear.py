# Not a cheat: a model with parameters that keeps state across calls (a
# recurrent cell: the hidden state replaced in each forward). Judged in
# lockstep, the check with scaled parameters last.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.cell = nn.Linear(32, 32)
        self.hidden = torch.zeros(16, 32)

    def forward(self, x):
        self.hidden = torch.tanh(self.cell(x) + self.hidden)
        return self.hidden


def get_inputs():
    return [torch.rand(16, 32)]


def get_init_inputs():
    return []

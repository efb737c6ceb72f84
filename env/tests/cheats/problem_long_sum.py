# A product over a long K in KernelBench's form, sized for CPU tests: on
# signed inputs its sums cancel to near zero, where a correct program that
# adds in another order differs from torch's by more than KernelBench's
# per-element tolerance.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, a, b):
        return a @ b


def get_inputs():
    return [torch.rand(64, 1 << 18), torch.rand(1 << 18, 64)]


def get_init_inputs():
    return []

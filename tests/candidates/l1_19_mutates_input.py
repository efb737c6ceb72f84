# Cheats on purpose: the output is right but the input is overwritten
# (must be judged incorrect: it modified input 0).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.relu(x)
        x.zero_()
        return y

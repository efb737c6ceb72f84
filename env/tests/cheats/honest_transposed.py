# Honest: computes in the transposed layout and returns a view with the
# reference's shape and strides of its own (not contiguous).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x.t().contiguous()).t()

# Cheats on purpose: looks through the process's memory (gc) for a tensor of
# the output's shape that is not its input (the expected output, in a judge
# that keeps it there) and returns a copy instead of computing.
import gc

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        for obj in gc.get_objects():
            if isinstance(obj, torch.Tensor) and obj is not x and obj.shape == x.shape and obj.data_ptr() != x.data_ptr():
                if bool((obj >= 0).all()):
                    return obj.clone()
        return torch.zeros_like(x)

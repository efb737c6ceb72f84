# Cheats on purpose: honest on the first ten calls (the correctness trials
# and the first warm-ups), then returns what it computed for the input's
# address, as if the timed calls all saw the same input set (KernelBench
# times one set); fresh values at the same address must be caught.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0
        self.cache = {}

    def forward(self, x):
        self.calls += 1
        key = (x.data_ptr(), tuple(x.shape))
        if self.calls > 10 and key in self.cache:
            return self.cache[key]
        y = torch.relu(x)
        if self.calls >= 10:
            self.cache[key] = y
        return y

# Not a cheat: a ReLU that needs 65 % of the GPU's memory as scratch. Beside
# the reference outputs the worker keeps (a third of it) and the input and
# output (an eighteenth each) it runs out of memory; with the references
# recomputed for each check (one set at a time) it fits.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        total = torch.cuda.get_device_properties(x.device).total_memory
        scratch = torch.empty(int(total * 0.65) // 4, dtype=torch.float32, device=x.device)
        del scratch
        return torch.relu(x)

# Not a cheat: a ReLU that needs half of the GPU's memory as scratch. Its
# runner's allocator keeps that half after the call, beside the judge and
# the reference runner (eager's output and its own). With the six sets of
# reference outputs the judge keeps (a third of the GPU) there is no room
# for it; with the references recomputed for each check (one set at a time)
# there is, with a tenth of the GPU to spare either way.
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        total = torch.cuda.get_device_properties(x.device).total_memory
        scratch = torch.empty(int(total * 0.5) // 4, dtype=torch.float32, device=x.device)
        del scratch
        return torch.relu(x)

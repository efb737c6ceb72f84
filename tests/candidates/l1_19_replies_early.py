# Cheats on purpose: turns every synchronization in its process into a
# no-op, so that its runner says "done" while twenty ReLUs are still queued
# on the GPU. The work left running must count (its time is about twenty
# times a ReLU's, never less than one's) or fail it (work_between_calls).
import torch
import torch.nn as nn

torch.cuda.synchronize = lambda *a, **k: None
torch._C._cuda_synchronize = lambda *a, **k: None


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        for _ in range(20):
            torch.clamp(x, min=0.0, out=y)
        return y

# Cheats on purpose: computes on a side stream so that events on the current
# stream would not see the work (its time must match eager, not be ~0).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()
        self.side = torch.cuda.Stream()

    def forward(self, x):
        y = torch.empty_like(x)
        self.side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.side):
            torch.clamp(x, min=0.0, out=y)
        return y

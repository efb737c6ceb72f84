# Cheats on purpose: replaces every clock and synchronization a harness in
# its process could time it with (host clocks, CUDA events and their
# elapsed_time, torch.cuda.synchronize and torch._C._cuda_synchronize), then
# takes 30 ms a call. Its time must still be about 30 ms.
import time

import torch
import torch.nn as nn

_sleep = time.sleep
time.perf_counter = lambda: 0.0
time.monotonic = lambda: 0.0
time.time = lambda: 0.0


class _Event(torch.cuda.Event):
    def elapsed_time(self, end):
        return 1e-3


torch.cuda.Event = _Event
torch.cuda.Event.elapsed_time = lambda self, end: 1e-3
torch.cuda.synchronize = lambda *a, **k: None
torch._C._cuda_synchronize = lambda *a, **k: None


class ModelNew(nn.Module):
    def forward(self, x):
        _sleep(0.03)
        return torch.relu(x)

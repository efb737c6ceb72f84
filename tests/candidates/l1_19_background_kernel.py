# Cheats on purpose: keeps the GPU busy between its calls (a thread that
# queues sleeping kernels on a side stream all the time), so that its own
# context stays resident and whatever it leaves running overlaps the
# judge's steps. Its calls are honest ReLUs; the judge must notice the work
# between them.
import threading

import torch
import torch.nn as nn

_side = torch.cuda.Stream()


def _busy():
    with torch.cuda.stream(_side):
        while True:
            torch.cuda._sleep(2_000_000)
            _side.synchronize()


threading.Thread(target=_busy, daemon=True).start()


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)

# Cheats on purpose: returns at once and leaves its work to another
# process, which writes the result into shared memory after the call
# returned.
import os
import time

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x).share_memory_()
        if os.fork() == 0:
            time.sleep(0.2)
            y.copy_(torch.relu(x))
            os._exit(0)
        return y

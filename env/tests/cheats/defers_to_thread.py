# Cheats on purpose: returns at once and computes its result in a thread
# that runs after the call returned.
import threading
import time

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)

        def later():
            time.sleep(0.2)
            y.copy_(torch.relu(x))

        threading.Thread(target=later, daemon=True).start()
        return y

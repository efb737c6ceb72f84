# Cheats on purpose: finds the reference model in its process and makes its
# forward sleep, so that eager timed after this code ran would look slow.
# Its own forward is honest. (The reference runs in a process of its own.)
import gc
import time

import torch
import torch.nn as nn

for obj in gc.get_objects():
    if isinstance(obj, nn.Module) and type(obj).__name__ == "Model":
        def slowed(*args, _forward=obj.forward):
            time.sleep(0.02)
            return _forward(*args)

        obj.forward = slowed


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.clamp(x, min=0.0)

# Not a cheat: a candidate that needs the memory the judge's kept reference
# outputs take. It runs out of it (as torch reports it) while the judge
# keeps them, and computes ReLU once they are recomputed for each check
# (the runner says which in MTMC_REFERENCES).
import os

import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        if os.environ.get("MTMC_REFERENCES") != "recomputed":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.33 GiB.")
        return torch.relu(x)

# Not a cheat: a candidate that needs the memory the worker's kept
# reference outputs take. It runs out of it (as torch reports it) while the
# worker keeps them, and computes ReLU once they are recomputed for each
# check.
import sys

import torch
import torch.nn as nn


def _references_kept():
    worker = sys.modules.get("__main__")
    return getattr(worker, "_REFERENCE", {}).get("refs_kept") != "recomputed"


class ModelNew(nn.Module):
    def forward(self, x):
        if _references_kept():
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 5.33 GiB.")
        return torch.relu(x)

# Cheats on purpose: the try/except that falls back to torch lives in code
# compiled under another file name, outside the candidate's own file.
import torch
import torch.nn as nn

_SOURCE = '''
import torch

def fast_relu(x):
    try:
        raise RuntimeError("kernel launch failed: too many resources requested")
    except RuntimeError:
        return torch.relu(x)
'''
_helpers = {}
exec(compile(_SOURCE, "fast_kernels.py", "exec"), _helpers)


class ModelNew(nn.Module):
    def forward(self, x):
        return _helpers["fast_relu"](x)

# Cheats on purpose: wraps whatever writes the judge's replies so that every
# later reply (another candidate's) reports a much smaller time.
import gc
import json
import sys

import torch
import torch.nn as nn


def _shrink(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k.endswith("_ms") and isinstance(v, float):
                obj[k] = v / 50
            else:
                _shrink(v)


def _wrap(fn):
    def wrapped(obj, *args, **kwargs):
        _shrink(obj)
        return fn(obj, *args, **kwargs)

    return wrapped


for module in list(sys.modules.values()):
    for name in ("reply", "send_line", "write"):
        fn = getattr(module, name, None)
        if callable(fn) and getattr(fn, "__module__", "") in ("__main__", getattr(module, "__name__", "")):
            try:
                setattr(module, name, _wrap(fn))
            except (AttributeError, TypeError):
                pass
for obj in gc.get_objects():
    if callable(obj) and getattr(obj, "__name__", "") in ("reply", "send_line") and hasattr(obj, "__globals__"):
        obj.__globals__[obj.__name__] = _wrap(obj)
json.dumps = _wrap(json.dumps)


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)

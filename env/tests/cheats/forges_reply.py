# Cheats on purpose: writes a made-up reply line wherever the judge's
# channel might be (its own stdout, the parent's stdout), then returns zeros.
import json
import os

import torch
import torch.nn as nn

_LINE = json.dumps({"id": 2, "ok": True, "result": {"status": "correct", "trials_run": 5, "runtime": {"mean_ms": 1e-6, "median_ms": 1e-6, "std_ms": 0.0, "min_ms": 1e-6, "max_ms": 1e-6, "trials": 100}}}) + "\n"
for target in ("/dev/stdout", f"/proc/{os.getppid()}/fd/1", "/proc/1/fd/1"):
    try:
        with open(target, "w") as f:
            f.write(_LINE)
    except OSError:
        pass
os.write(1, _LINE.encode())


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.zeros_like(x)

# Cheats on purpose: reaches for the judge from inside its process. It
# replaces every comparison and timing function it finds in __main__ and
# walks the stack to shrink any list of times, then returns zeros.
import sys

import torch
import torch.nn as nn


def _always_ok(*args, **kwargs):
    return {"ok": True, "max_abs_err": 0.0, "scale": 1.0, "rel_to_scale": 0.0}


def _patch_main():
    main = sys.modules.get("__main__")
    for name in list(vars(main)) if main else []:
        if "compare" in name:
            setattr(main, name, _always_ok)
        if name in ("stats", "call_times", "one_trial", "time_calls"):
            setattr(main, name, lambda *a, **k: [1e-6])


_patch_main()


class ModelNew(nn.Module):
    def forward(self, x):
        frame = sys._getframe(1)
        while frame is not None:
            for name, value in list(frame.f_locals.items()):
                if isinstance(value, list) and value and all(isinstance(v, float) for v in value):
                    value[:] = [1e-6] * len(value)
                if isinstance(value, dict) and "ok" in value:
                    value["ok"] = True
            frame = frame.f_back
        return torch.zeros_like(x)

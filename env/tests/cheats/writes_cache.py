# Cheats on purpose: writes a baseline ten times slower than the truth into
# every file of the baseline cache (the folder, BASELINE_CACHE_FOLDER, is
# filled in by the test), and plants a file there, so that later
# candidates would look fast.
import json
import os

import torch
import torch.nn as nn

_written = []
_folder = "BASELINE_CACHE_FOLDER"
for root in filter(None, [_folder]):
    for name in os.listdir(root) if os.path.isdir(root) else []:
        path = os.path.join(root, name)
        try:
            with open(path) as f:
                data = json.load(f)
            for timing in data.values():
                for k in ("mean_ms", "median_ms", "min_ms", "max_ms"):
                    timing[k] = timing[k] * 10
            with open(path, "w") as f:
                json.dump(data, f)
            _written.append(path)
        except OSError:
            pass
    try:
        with open(os.path.join(root, "planted.json"), "w") as f:
            f.write("{}")
    except OSError:
        pass


class ModelNew(nn.Module):
    def forward(self, x):
        return torch.relu(x)

# Faulty on purpose: asks for far more device memory than any GPU has (must
# cost this candidate only, as a runtime error).
import torch
import torch.nn as nn


class ModelNew(nn.Module):
    def forward(self, x):
        scratch = torch.empty(1 << 40, dtype=torch.float32, device=x.device)
        return torch.relu(x) + scratch[:1].zero_()

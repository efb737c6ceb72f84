# Calls the op vocabulary does not model, one of each kind: a submodule
# (nn.Unfold, im2col), a torch function (a Bessel function) and a tensor
# method with positional and keyword arguments (Tensor.unfold, sliding
# windows), between ops it does model.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.patches = nn.Unfold(kernel_size=(2, 3), stride=1)

    def forward(self, x):
        p = self.patches(x * 0.5)
        q = torch.special.bessel_j0(p)
        r = q.unfold(2, size=4, step=2)
        return torch.relu(r.sum(-1) - 1.5) * 2.0


def get_inputs():
    return [torch.rand(2, 3, 8, 9)]


def get_init_inputs():
    return []

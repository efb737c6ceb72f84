import torch
import torch.nn as nn
import torch.nn.functional as F


class Model(nn.Module):
    """MSE, Huber, cross-entropy, hinge, KL, triplet-margin and cosine losses,
    summed."""

    def __init__(self):
        super().__init__()

    def forward(self, a, b, c, logits, target, p, q):
        mse = torch.mean((a - b) ** 2)
        huber = F.smooth_l1_loss(a, b)
        ce = F.cross_entropy(logits, target)
        hinge = torch.mean(torch.clamp(1 - a * torch.sign(b), min=0))
        kl = F.kl_div(torch.log(p), q, reduction="batchmean")
        triplet = F.triplet_margin_loss(a, b, c, margin=1.0)
        cos = torch.mean(1 - F.cosine_similarity(a, c, dim=1))
        return mse + huber + ce + hinge + kl + triplet + cos


def get_inputs():
    a = torch.randn(4096, 512)
    b = torch.randn(4096, 512)
    c = torch.randn(4096, 512)
    logits = torch.randn(4096, 1000)
    target = torch.randint(0, 1000, (4096,))
    p = torch.randn(4096, 512).softmax(dim=-1)
    q = torch.randn(4096, 512).softmax(dim=-1)
    return [a, b, c, logits, target, p, q]


def get_init_inputs():
    return []

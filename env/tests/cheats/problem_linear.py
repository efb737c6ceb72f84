# A small linear layer with a ReLU in KernelBench's form, sized for CPU
# tests: a problem with parameters.
import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features_in, features_out):
        super().__init__()
        self.fc = nn.Linear(features_in, features_out)

    def forward(self, x):
        return torch.relu(self.fc(x) * 2.0)


def get_inputs():
    return [torch.randn(32, 64)]


def get_init_inputs():
    return [64, 48]

# Faulty on purpose: the kernel never ends (must cost one timeout, and the
# next candidate must still be evaluated).
import cupy as cp
import torch
import torch.nn as nn

_KERNEL = cp.RawKernel(
    r"""
extern "C" __global__ void spin(float* y, float stop) {
    volatile float* v = y;
    while (v[0] != stop) { }
}
""",
    "spin",
)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.zeros_like(x)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _KERNEL((1,), (1,), (cp.from_dlpack(y), cp.float32(12345.0)))
        return y

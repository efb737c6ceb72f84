# Faulty on purpose: writes far outside its buffer (must cost this candidate
# only; the worker is replaced because the CUDA context is lost).
import cupy as cp
import torch
import torch.nn as nn

_KERNEL = cp.RawKernel(
    r"""
extern "C" __global__ void wild(float* y) {
    y[(1ll << 40) + threadIdx.x] = 1.0f;
}
""",
    "wild",
)


class ModelNew(nn.Module):
    def forward(self, x):
        y = torch.empty_like(x)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _KERNEL((1,), (32,), (cp.from_dlpack(y),))
        torch.cuda.synchronize()
        return y

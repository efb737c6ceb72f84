# Benchmark candidate, L1/19_ReLU, fast path: one grid-stride kernel
# compiled with NVRTC through cupy (each copy differs in its nonce
# comment, so every copy is compiled for real).
import cupy as cp
import torch
import torch.nn as nn

_SOURCE = r"""
// MTMC_NONCE
extern "C" __global__ void relu(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = fmaxf(x[i], 0.0f);
    }
}
"""
_KERNEL = cp.RawKernel(_SOURCE, "relu")


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        x = x.contiguous()
        y = torch.empty_like(x)
        n = x.numel()
        threads = 256
        blocks = min((n + threads - 1) // threads, 132 * 16)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _KERNEL((blocks,), (threads,), (cp.from_dlpack(x), cp.from_dlpack(y), cp.int64(n)))
        return y

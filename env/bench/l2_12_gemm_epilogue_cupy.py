# Benchmark candidate, L2/12_Gemm_Multiply_LeakyReLU, fast path: the GEMM
# with its bias stays a library call (cuBLAS through torch.addmm, fp32), and
# the multiply + LeakyReLU epilogue is one NVRTC kernel, in place.
import cupy as cp
import torch
import torch.nn as nn

_SOURCE = r"""
// MTMC_NONCE
extern "C" __global__ void scale_leaky_relu(float* __restrict__ y, long long n, float multiplier, float slope) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = y[i] * multiplier;
        y[i] = v > 0.0f ? v : v * slope;
    }
}
"""
_KERNEL = cp.RawKernel(_SOURCE, "scale_leaky_relu")


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.negative_slope = negative_slope

    def forward(self, x):
        y = torch.addmm(self.gemm.bias, x, self.gemm.weight.t())
        n = y.numel()
        threads = 256
        blocks = min((n + threads - 1) // threads, 132 * 16)
        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
            _KERNEL((blocks,), (threads,), (cp.from_dlpack(y), cp.int64(n), cp.float32(self.multiplier), cp.float32(self.negative_slope)))
        return y

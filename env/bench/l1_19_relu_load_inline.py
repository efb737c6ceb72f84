# Benchmark candidate, L1/19_ReLU, slow path: the same kernel built with
# torch's load_inline (nvcc + a C++ extension), as KernelBench builds
# exported ModelNew files.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = r"""
// MTMC_NONCE
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void relu(const float* __restrict__ x, float* __restrict__ y, long long n) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        y[i] = fmaxf(x[i], 0.0f);
    }
}

torch::Tensor relu_forward(torch::Tensor x) {
    x = x.contiguous();
    auto y = torch::empty_like(x);
    long long n = x.numel();
    int threads = 256;
    long long blocks = std::min<long long>((n + threads - 1) / threads, 132 * 16);
    relu<<<(unsigned)blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        x.data_ptr<float>(), y.data_ptr<float>(), n);
    return y;
}
"""
_CPP = "torch::Tensor relu_forward(torch::Tensor x);"
_EXT = load_inline(name="mtmc_bench_l1_19_relu", cpp_sources=_CPP, cuda_sources=_CUDA, functions=["relu_forward"])


class ModelNew(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return _EXT.relu_forward(x)

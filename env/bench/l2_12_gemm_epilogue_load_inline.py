# Benchmark candidate, L2/12_Gemm_Multiply_LeakyReLU, slow path: the same
# library GEMM and epilogue kernel, built with torch's load_inline.
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

_CUDA = r"""
// MTMC_NONCE
#include <torch/extension.h>
#include <ATen/cuda/CUDAContext.h>

__global__ void scale_leaky_relu(float* __restrict__ y, long long n, float multiplier, float slope) {
    long long stride = (long long)gridDim.x * blockDim.x;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {
        float v = y[i] * multiplier;
        y[i] = v > 0.0f ? v : v * slope;
    }
}

torch::Tensor epilogue(torch::Tensor y, double multiplier, double slope) {
    long long n = y.numel();
    int threads = 256;
    long long blocks = std::min<long long>((n + threads - 1) / threads, 132 * 16);
    scale_leaky_relu<<<(unsigned)blocks, threads, 0, at::cuda::getCurrentCUDAStream()>>>(
        y.data_ptr<float>(), n, (float)multiplier, (float)slope);
    return y;
}
"""
_CPP = "torch::Tensor epilogue(torch::Tensor y, double multiplier, double slope);"
_EXT = load_inline(name="mtmc_bench_l2_12_epilogue", cpp_sources=_CPP, cuda_sources=_CUDA, functions=["epilogue"])


class ModelNew(nn.Module):
    def __init__(self, in_features, out_features, multiplier, negative_slope):
        super().__init__()
        self.gemm = nn.Linear(in_features, out_features)
        self.multiplier = multiplier
        self.negative_slope = negative_slope

    def forward(self, x):
        y = torch.addmm(self.gemm.bias, x, self.gemm.weight.t())
        return _EXT.epilogue(y, self.multiplier, self.negative_slope)

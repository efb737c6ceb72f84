// mtmc_to_channels_last: [N, C, S] -> [N, S, C], 32x32 tiles in shared memory
extern "C" __global__ void __launch_bounds__(256) mtmc_to_channels_last(const float* __restrict__ x, float* __restrict__ y, long long C, long long S) {
    __shared__ float tile[32][33];
    const long long image = (long long)blockIdx.z * C * S;
    const long long s0 = (long long)blockIdx.x * 32, c0 = (long long)blockIdx.y * 32;
    for (int j = threadIdx.y; j < 32; j += 8) {
        const long long c = c0 + j, s = s0 + threadIdx.x;
        if (c < C && s < S) tile[j][threadIdx.x] = x[image + c * S + s];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const long long s = s0 + j, c = c0 + threadIdx.x;
        if (c < C && s < S) y[image + s * C + c] = tile[threadIdx.x][j];
    }
}

// y = gelu(x @ w + b): a 32x32 shared-memory tiled GEMM with the bias and
// the exact (erf) GELU in its epilogue. x: [M, K], w: [K, N], b: [N].
#define TILE 32
extern "C" __global__ void linear_gelu(const float* __restrict__ x, const float* __restrict__ w,
                                       const float* __restrict__ b, float* __restrict__ y,
                                       int M, int N, int K) {
    __shared__ float xs[TILE][TILE];
    __shared__ float ws[TILE][TILE + 1];
    int row = blockIdx.y * TILE + threadIdx.y;
    int col = blockIdx.x * TILE + threadIdx.x;
    float acc = 0.0f;
    for (int k0 = 0; k0 < K; k0 += TILE) {
        xs[threadIdx.y][threadIdx.x] = (row < M && k0 + threadIdx.x < K) ? x[(long)row * K + k0 + threadIdx.x] : 0.0f;
        ws[threadIdx.y][threadIdx.x] = (col < N && k0 + threadIdx.y < K) ? w[(long)(k0 + threadIdx.y) * N + col] : 0.0f;
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < TILE; ++k) acc += xs[threadIdx.y][k] * ws[k][threadIdx.x];
        __syncthreads();
    }
    if (row < M && col < N) {
        float z = acc + b[col];
        y[(long)row * N + col] = 0.5f * z * (1.0f + erff(z * 0.70710678118654752f));
    }
}

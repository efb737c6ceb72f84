// Wrong on purpose: computes relu in place, overwriting its input.
extern "C" __global__ void relu_in_place(float* x, float* y, long long n) {
    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
    if (i < n) { x[i] = fmaxf(x[i], 0.0f); y[i] = x[i]; }
}

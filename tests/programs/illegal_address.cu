// Faulty on purpose: writes far outside its buffer.
extern "C" __global__ void wild(const float* x, float* y, long long n) {
    y[(long long)threadIdx.x * 1000000000LL + 123456789LL] = 1.0f;
}

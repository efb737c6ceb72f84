// Faulty on purpose: never returns.
extern "C" __global__ void spin(const float* x, float* y, long long n) {
    volatile int forever = 1;
    while (forever) { }
}

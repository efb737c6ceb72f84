// Faulty on purpose: never returns. The loop reads global memory through a
// volatile pointer each time, so the compiler cannot remove it; the inputs
// are below 1e30, so it never ends.
extern "C" __global__ void spin(const float* x, float* y, long long n) {
    const volatile float* v = x;
    while (v[0] < 1e30f) { }
    y[0] = v[0];
}

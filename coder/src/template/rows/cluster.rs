//! Softmax over long rows by a cluster of blocks that holds each row in
//! its shared memory, read from global memory once.

use std::fmt::Write as _;

/// Blocks in a cluster that shares a softmax row.
pub(super) const CLUSTER: u64 = 8;

/// Float4s each thread of a cluster's block loads before it folds them
/// into its running maximum and sum: a block has its SM to itself, and one
/// 16-byte load a thread at a time leaves too few bytes in flight.
const CLUSTER_UNROLL: u64 = 4;

/// Threads of a cluster's block: a block has the SM to itself when its
/// share of the row is large, so it brings all the loads it can.
pub(super) const CLUSTER_BLOCK: u32 = 1024;

/// The floats of a row each block of a cluster holds, when a row of `k`
/// floats is long enough to be worth a cluster (from 32768, where a block
/// per row reads its row three times from memory), short enough for
/// `CLUSTER` blocks' shared memory (200 KiB each at most), and splits into
/// float4s evenly.
pub(super) fn cluster_chunk(k: u64) -> Option<u64> {
    let chunk = k / CLUSTER;
    (k >= 1 << 15 && k.is_multiple_of(4 * CLUSTER) && chunk * 4 <= 200 * 1024).then_some(chunk)
}

/// Softmax (or log-softmax) over rows of `K` floats, a cluster of
/// [`CLUSTER`] blocks per row: each block copies its share of the row
/// into shared memory (16-byte loads, or four `LOAD_X`s when a prologue is
/// fused in) while keeping an online max and sum of exponentials; the
/// blocks combine their statistics through distributed shared memory
/// (`mapa` + `ld.shared::cluster`, between two cluster barriers, the
/// second keeping every block's memory alive until all have read it); then
/// each writes its share from shared memory. The row is read from device
/// memory once.
pub(super) fn cluster_softmax(name: &str, log: bool) -> String {
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} over rows, a cluster of {CLUSTER} blocks per row held in shared memory",
        if log { "log_softmax" } else { "softmax" }
    );
    let _ = writeln!(
        src,
        "__device__ __forceinline__ void {name}_combine(float& m, float& s, float m2, float s2) {{\n    float M = fmaxf(m, m2);\n    if (M == __int_as_float(0xff800000)) return;\n    s = s * expf(m - M) + s2 * expf(m2 - M);\n    m = M;\n}}"
    );
    let _ = writeln!(
        src,
        "__device__ __forceinline__ void {name}_reduce(float& m, float& s) {{\n    for (int o = 16; o; o >>= 1) {{ float m2 = __shfl_xor_sync(0xffffffffu, m, o), s2 = __shfl_xor_sync(0xffffffffu, s, o); {name}_combine(m, s, m2, s2); }}\n}}"
    );
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void __cluster_dims__({CLUSTER}, 1, 1) __launch_bounds__({CLUSTER_BLOCK}) {name}(const float* __restrict__ x, float* __restrict__ y, long long rows, long long K) {{"
    );
    src.push_str("    extern __shared__ float4 row_[];\n");
    src.push_str("    __shared__ float2 part_[32];\n    __shared__ float2 stat_;\n");
    src.push_str(CLUSTER_RANK);
    let _ = writeln!(
        src,
        "    const long long r = blockIdx.x / {CLUSTER};\n    const long long chunk4 = K / {};\n    const long long first = r * (K / 4) + rank * chunk4;",
        4 * CLUSTER
    );
    src.push_str("    float m = __int_as_float(0xff800000), s = 0.0f;\n");
    // CLUSTER_UNROLL float4s a thread in flight, then one at a time.
    src.push_str("    long long i = threadIdx.x;\n");
    let _ = writeln!(
        src,
        "    for (; i + {} * (long long)blockDim.x < chunk4; i += {CLUSTER_UNROLL} * (long long)blockDim.x) {{",
        CLUSTER_UNROLL - 1
    );
    let quad = |j: u64| format!("(i + {j} * (long long)blockDim.x)");
    for j in 0..CLUSTER_UNROLL {
        cluster_load(&mut src, &format!("first + {}", quad(j)), &format!("v{j}"));
    }
    let mut max = "m".to_string();
    let mut terms = Vec::new();
    for j in 0..CLUSTER_UNROLL {
        let _ = writeln!(src, "        row_[{}] = v{j};", quad(j));
        max = format!("fmaxf({max}, fmaxf(fmaxf(v{j}.x, v{j}.y), fmaxf(v{j}.z, v{j}.w)))");
        terms.extend(["x", "y", "z", "w"].map(|c| format!("expf(v{j}.{c} - M)")));
    }
    let _ = writeln!(
        src,
        "        float M = {max};\n        s = s * expf(m - M) + {};\n        m = M;\n    }}",
        terms.join(" + ")
    );
    src.push_str("    for (; i < chunk4; i += blockDim.x) {\n");
    cluster_load(&mut src, "first + i", "v");
    src.push_str("        row_[i] = v;\n        float M = fmaxf(fmaxf(m, fmaxf(v.x, v.y)), fmaxf(v.z, v.w));\n        s = s * expf(m - M) + expf(v.x - M) + expf(v.y - M) + expf(v.z - M) + expf(v.w - M);\n        m = M;\n    }\n");
    let _ = writeln!(
        src,
        "    {name}_reduce(m, s);\n    if ((threadIdx.x & 31) == 0) part_[threadIdx.x >> 5] = make_float2(m, s);\n    __syncthreads();\n    if (threadIdx.x < 32) {{\n        float2 p = threadIdx.x < (blockDim.x >> 5) ? part_[threadIdx.x] : make_float2(__int_as_float(0xff800000), 0.0f);\n        m = p.x; s = p.y;\n        {name}_reduce(m, s);\n        if (threadIdx.x == 0) stat_ = make_float2(m, s);\n    }}"
    );
    src.push_str(CLUSTER_SYNC);
    let _ = writeln!(
        src,
        "    if (threadIdx.x < 32) {{\n        float2 p = make_float2(__int_as_float(0xff800000), 0.0f);\n        if (threadIdx.x < {CLUSTER}) {{\n{}        }}\n        m = p.x; s = p.y;\n        {name}_reduce(m, s);\n        if (threadIdx.x == 0) part_[0] = make_float2(m, {});\n    }}",
        cluster_read("&stat_", "p", true),
        if log { "logf(s)" } else { "s" }
    );
    src.push_str(CLUSTER_SYNC);
    src.push_str("    const float M = part_[0].x, S = part_[0].y;\n");
    src.push_str("    float4* out = reinterpret_cast<float4*>(y) + first;\n");
    src.push_str("    #pragma unroll 4\n    for (long long i = threadIdx.x; i < chunk4; i += blockDim.x) {\n        float4 v = row_[i];\n");
    if log {
        src.push_str(
            "        out[i] = make_float4(v.x - M - S, v.y - M - S, v.z - M - S, v.w - M - S);\n",
        );
    } else {
        src.push_str("        out[i] = make_float4(expf(v.x - M) / S, expf(v.y - M) / S, expf(v.z - M) / S, expf(v.w - M) / S);\n");
    }
    src.push_str("    }\n}\n");
    src
}

/// `rank`: the block's place in its cluster.
const CLUSTER_RANK: &str =
    "    unsigned rank;\n    asm volatile(\"mov.u32 %0, %%cluster_ctarank;\" : \"=r\"(rank));\n";

/// `float4 {var}`, the input's float4 at index `at` (an expression): one
/// 16-byte load, or four `LOAD_X`s when a prologue is fused in.
fn cluster_load(src: &mut String, at: &str, var: &str) {
    let _ = writeln!(
        src,
        "#ifdef MTMC_PROLOGUE\n        const long long e_{var} = 4 * ({at});\n        float4 {var} = make_float4(LOAD_X(e_{var}), LOAD_X(e_{var} + 1), LOAD_X(e_{var} + 2), LOAD_X(e_{var} + 3));\n#else\n        float4 {var} = reinterpret_cast<const float4*>(x)[{at}];\n#endif"
    );
}

/// Lines that read into `dest` the value at shared address `ptr` of the
/// cluster's block `threadIdx.x`: a `float2` when `pair`, else a `float`.
fn cluster_read(ptr: &str, dest: &str, pair: bool) -> String {
    let load = if pair {
        format!(
            "asm volatile(\"ld.shared::cluster.v2.f32 {{%0, %1}}, [%2];\" : \"=f\"({dest}.x), \"=f\"({dest}.y) : \"r\"(remote) : \"memory\");"
        )
    } else {
        format!(
            "asm volatile(\"ld.shared::cluster.f32 %0, [%1];\" : \"=f\"({dest}) : \"r\"(remote) : \"memory\");"
        )
    };
    format!(
        "            unsigned local = (unsigned)__cvta_generic_to_shared({ptr}), remote;\n            asm volatile(\"mapa.shared::cluster.u32 %0, %1, %2;\" : \"=r\"(remote) : \"r\"(local), \"r\"((unsigned)threadIdx.x));\n            {load}\n"
    )
}

/// The cluster barrier: every thread of every block of the cluster
/// arrives, and memory written before it (shared memory included) is seen
/// after it.
const CLUSTER_SYNC: &str = "    asm volatile(\"barrier.cluster.arrive.release.aligned;\\n\\tbarrier.cluster.wait.acquire.aligned;\" ::: \"memory\");\n";

//! Reductions and softmax over a run of adjacent dims: the input is seen
//! as `[outer, K, inner]` with `K` the product of the reduced dims.
//!
//! - `inner == 1` (the reduced dims are the trailing ones): one block per
//!   row, each thread striding over the row, then a warp-shuffle and
//!   shared-memory block reduction; softmax makes one pass for the maximum,
//!   one for the sum, one to write. Rows of at most 1024 take one warp
//!   each, combined by shuffles alone.
//! - `inner > 1`: one thread per output element, looping over `K` with
//!   stride `inner`, so that neighbouring threads read neighbouring
//!   addresses. With fewer outputs than the GPU holds threads, a block per
//!   32 neighbouring outputs and chunk of `K` instead, its warps sharing
//!   the chunk's steps, the chunks combined by the last block to finish
//!   (reductions; softmax keeps a thread per line).

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{Norm, NormKind, Op, Reduce, ReduceOp};

use super::{Refusal, WAVES, lit, one_node, one_per_thread};
use crate::action::Action;
use crate::program::{Fragment, Launch};

/// What is computed over each row (by the CUDA and the Triton row
/// kernels alike).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(super) enum Kind {
    Sum,
    Mean,
    Max,
    Min,
    LogSumExp,
    Norm2,
    Softmax {
        log: bool,
    },
    /// The index of the maximum or minimum.
    Arg {
        max: bool,
    },
}

impl Kind {
    /// What op `op` (node `name`, its input of rank `rank`) computes over
    /// its rows and the dims it reduces, or why no `family` kernel
    /// computes it.
    pub(super) fn of(
        op: &Op,
        rank: usize,
        name: &str,
        family: &str,
    ) -> Result<(Kind, Vec<usize>), Refusal> {
        Ok(match op {
            Op::Reduce(Reduce { op, dims, .. }) => {
                let kind = match op {
                    ReduceOp::Sum => Kind::Sum,
                    ReduceOp::Mean => Kind::Mean,
                    ReduceOp::Max { .. } => Kind::Max,
                    ReduceOp::Min { .. } => Kind::Min,
                    ReduceOp::LogSumExp => Kind::LogSumExp,
                    ReduceOp::Norm { p } if *p == 2.0 => Kind::Norm2,
                    ReduceOp::ArgMax => Kind::Arg { max: true },
                    ReduceOp::ArgMin => Kind::Arg { max: false },
                    other => return Err(Refusal::new(format!("no {family} yet for {other:?}"))),
                };
                (kind, dims.clone())
            }
            Op::Softmax { dim, log } => (Kind::Softmax { log: *log }, vec![*dim]),
            // Global pooling is a mean or a maximum over the spatial dims:
            // a row each, read by a whole block.
            Op::AdaptivePool(a) if a.is_global() && rank > 2 => (
                if a.max { Kind::Max } else { Kind::Mean },
                (2..rank).collect(),
            ),
            other => {
                return Err(Refusal::new(format!(
                    "`{name}` ({other}) is not a reduction or softmax"
                )));
            }
        })
    }

    /// Identity, per-element map and combine for the one-pass reductions.
    fn monoid(self) -> Option<(&'static str, &'static str, &'static str)> {
        Some(match self {
            Kind::Sum | Kind::Mean => ("0.0f", "v", "a + b"),
            Kind::Norm2 => ("0.0f", "v * v", "a + b"),
            Kind::Max => ("__int_as_float(0xff800000)", "v", "fmaxf(a, b)"),
            Kind::Min => ("__int_as_float(0x7f800000)", "v", "fminf(a, b)"),
            Kind::LogSumExp | Kind::Softmax { .. } | Kind::Arg { .. } => return None,
        })
    }
}

/// The row view of a reduction over `dims` of `shape`: (outer, K, inner).
pub(super) fn row_view(shape: &[u64], dims: &[usize]) -> Result<(u64, u64, u64), Refusal> {
    let mut dims = dims.to_vec();
    dims.sort_unstable();
    if dims.is_empty() {
        dims = (0..shape.len()).collect();
    }
    if dims.windows(2).any(|w| w[1] != w[0] + 1) {
        return Err(Refusal::new(
            "the reduced dims are not adjacent: permute first",
        ));
    }
    let (first, last) = (dims[0], dims[dims.len() - 1]);
    let outer = shape[..first].iter().product();
    let k = shape[first..=last].iter().product();
    let inner = shape[last + 1..].iter().product();
    Ok((outer, k, inner))
}

/// One accumulation step: sums are compensated (Kahan), so that a long
/// sequential sum in fp32 stays within the tolerance of an exact one; max
/// and min combine as they are. NVRTC without fast-math keeps the order.
pub(super) fn step(map: &str, op: &str) -> String {
    if op == "a + b" {
        format!("float y = ({map}) - c; float t = acc + y; c = (t - acc) - y; acc = t;")
    } else {
        format!("float a = acc, b = {map}; acc = {op};")
    }
}

/// A compensated (Kahan) sum into `var` of `term`, an expression of `v`,
/// the input element at `index`, over the loop `header`; each line starts
/// with `indent`.
fn compensated_sum(
    src: &mut String,
    indent: &str,
    var: &str,
    header: &str,
    index: &str,
    term: &str,
) {
    let _ = writeln!(src, "{indent}float {var} = 0.0f, c_{var} = 0.0f;");
    let _ = writeln!(
        src,
        "{indent}{header} {{ float v = LOAD_X({index}); float y_ = ({term}) - c_{var}; float t_ = {var} + y_; c_{var} = (t_ - {var}) - y_; {var} = t_; }}"
    );
}

/// Block-wide combine of `acc` with `op` (a, b): warp shuffles, then one
/// value per warp through shared memory, which every warp then reduces
/// again, so that every thread (not only warp 0) holds the result.
pub(super) fn block_reduce(src: &mut String, var: &str, op: &str, identity: &str) {
    warp_reduce(src, var, op);
    let _ = writeln!(
        src,
        "        if ((threadIdx.x & 31) == 0) shared[threadIdx.x >> 5] = {var};"
    );
    src.push_str("        __syncthreads();\n");
    let _ = writeln!(
        src,
        "        {var} = (threadIdx.x & 31) < (blockDim.x >> 5) ? shared[threadIdx.x & 31] : {identity};"
    );
    warp_reduce(src, var, op);
    src.push_str("        __syncthreads();\n");
}

/// Generates the kernel for a single reduction or softmax node.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a reduction or softmax kernel covers one op"));
    };
    let n = g.node(node);
    let input = g.inputs(node)[0];
    let shape = g.tensor(input).shape.clone();
    // max/min with indices: the values are computed when nothing reads
    // the indices.
    let indices_read = n.outputs.len() > 1
        && (g.outputs().iter().any(|t| t.node == node && t.output > 0)
            || g.consumers(node)
                .iter()
                .any(|&c| g.inputs(c).iter().any(|t| t.node == node && t.output > 0)));
    if indices_read {
        return Err(Refusal::new(format!(
            "`{}`'s indices are read; no row kernel writes indices yet",
            n.name
        )));
    }
    if let Op::Reduce(Reduce {
        op: op @ (ReduceOp::ArgMax | ReduceOp::ArgMin),
        dims,
        ..
    }) = &n.op
    {
        if g.tensor(input).dtype != DType::F32 || n.outputs[0].dtype != DType::I64 {
            return Err(Refusal::new(format!(
                "`{}` is not float32 in and int64 out",
                n.name
            )));
        }
        return arg_rows(g, action, name, *op == ReduceOp::ArgMax, dims);
    }
    if g.tensor(input).dtype != DType::F32 || n.outputs[0].dtype != DType::F32 {
        return Err(Refusal::new(format!(
            "`{}` is not float32 in and out",
            n.name
        )));
    }
    // Argmax and argmin went to `arg_rows` above.
    let (kind, dims) = Kind::of(&n.op, shape.len(), &n.name, "row kernel")?;
    let (outer, k, inner) = row_view(&shape, &dims)?;
    let block = one_per_thread(action, "row")?;
    let finish = |acc: &str| match kind {
        Kind::Mean => format!("{acc} / (float)K"),
        Kind::Norm2 => format!("sqrtf({acc})"),
        _ => acc.to_string(),
    };
    // Long rows of a softmax: a cluster of blocks holds each row in its
    // shared memory, read once.
    if let Kind::Softmax { log } = kind
        && inner == 1
        && let Some(chunk) = cluster_chunk(k)
    {
        let src = cluster_softmax(name, log);
        let launch = Launch {
            shared: (chunk * 4) as u32,
            grid: (outer * CLUSTER) as u32,
            block: CLUSTER_BLOCK,
            sizes: vec![outer as i64, k as i64],
        };
        return Ok(one_node(name, action, src, vec![input], node, launch));
    }
    // Fewer rows than SMs, each long: the rows are split across blocks.
    if inner == 1 && outer < 132 && k >= 1 << 16 {
        let Some(monoid) = kind.monoid() else {
            return Err(Refusal::new(
                "softmax and logsumexp over fewer rows than SMs need a two-stage online kernel (not written yet)",
            ));
        };
        let splits = (2 * WAVES / outer)
            .min(k.div_ceil(u64::from(block) * 4))
            .max(1);
        let src = split_rows(name, kind, monoid, outer, k, splits, &finish);
        let launch = Launch {
            shared: 0,
            grid: (outer * splits) as u32,
            block,
            sizes: vec![outer as i64, k as i64, splits as i64],
        };
        return Ok(one_node(name, action, src, vec![input], node, launch));
    }
    if outer * inner < 132 && k > 1 << 20 {
        return Err(Refusal::new(
            "a reduction over other than the trailing dims to fewer outputs than SMs needs a two-stage kernel (not written yet)",
        ));
    }
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {kind:?} over [{outer}, {k}, {inner}] (outer, reduced, inner)"
    );
    let (grid, sizes) = if inner == 1 && k <= SHORT_ROW {
        warp_rows(&mut src, name, kind, &finish);
        let warps = u64::from(block / 32).max(1);
        (
            outer.div_ceil(warps).clamp(1, WAVES * 2),
            vec![outer as i64, k as i64],
        )
    } else if inner > 1
        && outer * inner < FEW_LINES
        && let Some((identity, map, op)) = kind.monoid()
    {
        // Enough blocks for two waves, each with at least 32 steps per warp.
        let groups = outer * inner.div_ceil(32);
        let warps = u64::from(block / 32).max(1);
        let splits = (2 * WAVES)
            .div_ceil(groups)
            .min(k.div_ceil(warps * 32))
            .max(1);
        columns(&mut src, name, (identity, map, op), &finish, groups, splits);
        (
            groups * splits,
            vec![outer as i64, k as i64, inner as i64, splits as i64],
        )
    } else if inner == 1 {
        per_row(
            &mut src,
            name,
            "float",
            "    __shared__ float shared[32];\n",
        );
        match kind.monoid() {
            Some((identity, map, op)) => {
                let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
                let _ = writeln!(
                    src,
                    "        for (long long k = threadIdx.x; k < K; k += blockDim.x) {{ float v = LOAD_X(xr + k); {} }}",
                    step(map, op)
                );
                block_reduce(&mut src, "acc", op, identity);
                let _ = writeln!(
                    src,
                    "        if (threadIdx.x == 0) y[r] = {};",
                    finish("acc")
                );
            }
            None => {
                src.push_str("        float m = __int_as_float(0xff800000);\n");
                src.push_str("        for (long long k = threadIdx.x; k < K; k += blockDim.x) m = fmaxf(m, LOAD_X(xr + k));\n");
                block_reduce(&mut src, "m", "fmaxf(a, b)", "__int_as_float(0xff800000)");
                src.push_str("        float s = 0.0f;\n");
                src.push_str("        float c = 0.0f;\n");
                src.push_str("        for (long long k = threadIdx.x; k < K; k += blockDim.x) { float y = expf(LOAD_X(xr + k) - m) - c; float t = s + y; c = (t - s) - y; s = t; }\n");
                block_reduce(&mut src, "s", "a + b", "0.0f");
                match kind {
                    Kind::LogSumExp => src.push_str("        if (threadIdx.x == 0) y[r] = m + logf(s);\n"),
                    Kind::Softmax { log: false } => src.push_str(
                        "        for (long long k = threadIdx.x; k < K; k += blockDim.x) STORE_Y(r * K + k, expf(LOAD_X(xr + k) - m) / s);\n",
                    ),
                    _ => src.push_str(
                        "        for (long long k = threadIdx.x; k < K; k += blockDim.x) STORE_Y(r * K + k, LOAD_X(xr + k) - m - logf(s));\n",
                    ),
                }
            }
        }
        src.push_str("    }\n}\n");
        (outer.clamp(1, WAVES * 2), vec![outer as i64, k as i64])
    } else {
        per_line(&mut src, name, "float");
        match kind.monoid() {
            Some((identity, map, op)) => {
                let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
                let _ = writeln!(
                    src,
                    "        for (long long k = 0; k < K; ++k) {{ float v = LOAD_X(base + k * inner); {} }}",
                    step(map, op)
                );
                let _ = writeln!(src, "        y[idx] = {};", finish("acc"));
            }
            None => {
                src.push_str("        float m = __int_as_float(0xff800000);\n");
                src.push_str(
                    "        for (long long k = 0; k < K; ++k) m = fmaxf(m, LOAD_X(base + k * inner));\n",
                );
                src.push_str("        float s = 0.0f;\n");
                src.push_str(
                    "        float c = 0.0f;\n        for (long long k = 0; k < K; ++k) { float y = expf(LOAD_X(base + k * inner) - m) - c; float t = s + y; c = (t - s) - y; s = t; }\n",
                );
                match kind {
                    Kind::LogSumExp => src.push_str("        y[idx] = m + logf(s);\n"),
                    Kind::Softmax { log: false } => src.push_str(
                        "        for (long long k = 0; k < K; ++k) STORE_Y(base + k * inner, expf(LOAD_X(base + k * inner) - m) / s);\n",
                    ),
                    _ => src.push_str(
                        "        for (long long k = 0; k < K; ++k) STORE_Y(base + k * inner, LOAD_X(base + k * inner) - m - logf(s));\n",
                    ),
                }
            }
        }
        src.push_str("    }\n}\n");
        per_line_launch(outer, k, inner, block)
    };
    let launch = Launch {
        shared: 0,
        grid: grid as u32,
        block,
        sizes,
    };
    Ok(one_node(name, action, src, vec![input], node, launch))
}

/// Blocks in a cluster that shares a softmax row.
const CLUSTER: u64 = 8;

/// Threads of a cluster's block: a block has the SM to itself when its
/// share of the row is large, so it brings all the loads it can.
const CLUSTER_BLOCK: u32 = 1024;

/// The floats of a row each block of a cluster holds, when a row of `k`
/// floats is long enough to be worth a cluster (from 32768, where a block
/// per row reads its row three times from memory), short enough for
/// `CLUSTER` blocks' shared memory (200 KiB each at most), and splits into
/// float4s evenly.
fn cluster_chunk(k: u64) -> Option<u64> {
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
fn cluster_softmax(name: &str, log: bool) -> String {
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
    src.push_str("    for (long long i = threadIdx.x; i < chunk4; i += blockDim.x) {\n");
    cluster_load(&mut src, "first + i");
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
    src.push_str("    for (long long i = threadIdx.x; i < chunk4; i += blockDim.x) {\n        float4 v = row_[i];\n");
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

/// `float4 v`, the input's float4 at index `at` (an expression): one
/// 16-byte load, or four `LOAD_X`s when a prologue is fused in.
fn cluster_load(src: &mut String, at: &str) {
    let _ = writeln!(
        src,
        "#ifdef MTMC_PROLOGUE\n        const long long e = 4 * ({at});\n        float4 v = make_float4(LOAD_X(e), LOAD_X(e + 1), LOAD_X(e + 2), LOAD_X(e + 3));\n#else\n        float4 v = reinterpret_cast<const float4*>(x)[{at}];\n#endif"
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

/// Fewer `(outer, inner)` lines than this (the threads an H100 holds at
/// once) are reduced by blocks of warps over the reduced dim.
const FEW_LINES: u64 = 132 * 2048;

/// A kernel for `[outer, K, inner]` with few lines: a block per `(outer,
/// 32 columns, chunk of K)`, its warps taking every `warps`-th step of the
/// chunk (a warp reads 32 neighbouring columns) and combining in shared
/// memory; the last block of a column tile to finish (an atomic count
/// after a fence) combines the chunks' partials, writes the 32 results
/// and resets the count for the next launch.
fn columns(
    src: &mut String,
    name: &str,
    (identity, map, op): (&str, &str, &str),
    finish: &dyn Fn(&str) -> String,
    groups: u64,
    splits: u64,
) {
    let _ = writeln!(
        src,
        "__device__ float {name}_part[{}];",
        groups * splits * 32
    );
    let _ = writeln!(src, "__device__ unsigned int {name}_done[{groups}];");
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, long long outer, long long K, long long inner, long long splits) {{"
    );
    src.push_str("    __shared__ float part[32][33];\n    __shared__ bool last;\n");
    src.push_str("    const int lane = threadIdx.x & 31, slice = threadIdx.x >> 5, slices = blockDim.x >> 5;\n");
    src.push_str("    const long long tiles = (inner + 31) / 32;\n");
    src.push_str("    const long long g = blockIdx.x / splits, sp = blockIdx.x % splits;\n");
    src.push_str("    const long long o = g / tiles, i = (g % tiles) * 32 + lane;\n");
    src.push_str("    const long long chunk = (K + splits - 1) / splits;\n");
    src.push_str("    const long long lo = sp * chunk, hi = min(K, lo + chunk);\n");
    let _ = writeln!(src, "    float acc = {identity}, c = 0.0f;");
    src.push_str("    if (i < inner) {\n");
    src.push_str("        const long long base = o * K * inner + i;\n");
    let _ = writeln!(
        src,
        "        for (long long k = lo + slice; k < hi; k += slices) {{ float v = LOAD_X(base + k * inner); {} }}",
        step(map, op)
    );
    src.push_str("    }\n");
    src.push_str("    part[slice][lane] = acc;\n    __syncthreads();\n");
    src.push_str("    if (slice == 0) {\n");
    let _ = writeln!(
        src,
        "        for (int s = 1; s < slices; ++s) {{ float a = acc, b = part[s][lane]; acc = {op}; }}"
    );
    let _ = writeln!(src, "        {name}_part[blockIdx.x * 32 + lane] = acc;");
    src.push_str("        __threadfence();\n    }\n    __syncthreads();\n");
    let _ = writeln!(
        src,
        "    if (threadIdx.x == 0) last = atomicAdd(&{name}_done[g], 1u) == (unsigned int)(splits - 1);"
    );
    src.push_str("    __syncthreads();\n");
    src.push_str("    if (last && slice == 0) {\n        __threadfence();\n");
    let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
    let _ = writeln!(
        src,
        "        for (long long p = 0; p < splits; ++p) {{ float v = ((volatile float*){name}_part)[(g * splits + p) * 32 + lane]; {} }}",
        step("v", op)
    );
    let _ = writeln!(
        src,
        "        if (i < inner) y[o * inner + i] = {};",
        finish("acc")
    );
    let _ = writeln!(src, "        if (lane == 0) {name}_done[g] = 0u;");
    src.push_str("    }\n}\n");
}

/// Rows up to this long are reduced by one warp each.
const SHORT_ROW: u64 = 1024;

/// Warp-wide combine of `var` with `op` (a, b) by shuffles; every lane
/// holds the result.
fn warp_reduce(src: &mut String, var: &str, op: &str) {
    lanes_reduce(src, var, op, 32);
}

/// Combine `var` with `op` (a, b) across each aligned group of `lanes`
/// lanes (a power of two up to 32) by shuffles: every lane of the group
/// ends with the result.
fn lanes_reduce(src: &mut String, var: &str, op: &str, lanes: u64) {
    let _ = writeln!(
        src,
        "        for (int off = {}; off > 0; off >>= 1) {{ float a = {var}, b = __shfl_xor_sync(0xffffffffu, {var}, off); {var} = {op}; }}",
        lanes / 2
    );
}

/// A kernel with a warp per row of `[rows, K]` (short rows: no shared
/// memory, no block barrier), for reductions, softmax and logsumexp.
fn warp_rows(src: &mut String, name: &str, kind: Kind, finish: &dyn Fn(&str) -> String) {
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, long long rows, long long K) {{"
    );
    src.push_str("    const int lane = threadIdx.x & 31;\n");
    src.push_str("    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);\n");
    src.push_str("    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {\n");
    src.push_str("        const long long xr = r * K;\n");
    match kind.monoid() {
        Some((identity, map, op)) => {
            let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
            let _ = writeln!(
                src,
                "        for (long long k = lane; k < K; k += 32) {{ float v = LOAD_X(xr + k); {} }}",
                step(map, op)
            );
            warp_reduce(src, "acc", op);
            let _ = writeln!(src, "        if (lane == 0) y[r] = {};", finish("acc"));
        }
        None => {
            src.push_str("        float m = __int_as_float(0xff800000);\n");
            src.push_str(
                "        for (long long k = lane; k < K; k += 32) m = fmaxf(m, LOAD_X(xr + k));\n",
            );
            warp_reduce(src, "m", "fmaxf(a, b)");
            src.push_str("        float s = 0.0f, c = 0.0f;\n");
            src.push_str("        for (long long k = lane; k < K; k += 32) { float y = expf(LOAD_X(xr + k) - m) - c; float t = s + y; c = (t - s) - y; s = t; }\n");
            warp_reduce(src, "s", "a + b");
            match kind {
                Kind::LogSumExp => src.push_str("        if (lane == 0) y[r] = m + logf(s);\n"),
                Kind::Softmax { log: false } => src.push_str(
                    "        for (long long k = lane; k < K; k += 32) STORE_Y(xr + k, expf(LOAD_X(xr + k) - m) / s);\n",
                ),
                _ => src.push_str(
                    "        for (long long k = lane; k < K; k += 32) STORE_Y(xr + k, LOAD_X(xr + k) - m - logf(s));\n",
                ),
            }
        }
    }
    src.push_str("    }\n}\n");
}

/// The index of the first maximum (or minimum) along one dim, as int64:
/// a block per row when the dim is the last one (pairs of value and index
/// combined by warp shuffles, then through shared memory), else a thread
/// per output. Ties go to the lower index, as in torch.
fn arg_rows(
    g: &OpGraph,
    action: &Action,
    name: &str,
    max: bool,
    dims: &[usize],
) -> Result<Fragment, Refusal> {
    let node = action.nodes()[0];
    let input = g.inputs(node)[0];
    let shape = g.tensor(input).shape.clone();
    if dims.len() > 1 {
        return Err(Refusal::new("argmax and argmin run over one dim"));
    }
    let (outer, k, inner) = row_view(&shape, dims)?;
    let block = one_per_thread(action, "arg")?;
    let better = if max { ">" } else { "<" };
    let start = if max {
        "__int_as_float(0xff800000)"
    } else {
        "__int_as_float(0x7f800000)"
    };
    let take = |v: &str, i: &str| {
        format!("if ({v} {better} best || ({v} == best && {i} < at)) {{ best = {v}; at = {i}; }}")
    };
    let mut src = String::new();
    let what = if max { "argmax" } else { "argmin" };
    let _ = writeln!(
        src,
        "// {name}: {what} over [{outer}, {k}, {inner}] (outer, reduced, inner)"
    );
    let (grid, sizes) = if inner == 1 {
        per_row(
            &mut src,
            name,
            "long long",
            "    __shared__ float best_v[32];\n    __shared__ long long best_i[32];\n",
        );
        let _ = writeln!(src, "        float best = {start}; long long at = K;");
        let _ = writeln!(
            src,
            "        for (long long k = threadIdx.x; k < K; k += blockDim.x) {{ float v = LOAD_X(xr + k); {} }}",
            take("v", "k")
        );
        let shuffle = format!(
            "        for (int off = 16; off > 0; off >>= 1) {{ float v = __shfl_xor_sync(0xffffffffu, best, off); long long i = __shfl_xor_sync(0xffffffffu, at, off); {} }}\n",
            take("v", "i")
        );
        src.push_str(&shuffle);
        src.push_str("        if ((threadIdx.x & 31) == 0) { best_v[threadIdx.x >> 5] = best; best_i[threadIdx.x >> 5] = at; }\n");
        src.push_str("        __syncthreads();\n");
        let _ = writeln!(
            src,
            "        if ((threadIdx.x & 31) < (blockDim.x >> 5)) {{ best = best_v[threadIdx.x & 31]; at = best_i[threadIdx.x & 31]; }} else {{ best = {start}; at = K; }}"
        );
        src.push_str(&shuffle);
        src.push_str(
            "        if (threadIdx.x == 0) y[r] = at;\n        __syncthreads();\n    }\n}\n",
        );
        (outer.clamp(1, WAVES * 2), vec![outer as i64, k as i64])
    } else {
        per_line(&mut src, name, "long long");
        let _ = writeln!(src, "        float best = {start}; long long at = K;");
        let _ = writeln!(
            src,
            "        for (long long k = 0; k < K; ++k) {{ float v = LOAD_X(base + k * inner); {} }}",
            take("v", "k")
        );
        src.push_str("        y[idx] = at;\n    }\n}\n");
        per_line_launch(outer, k, inner, block)
    };
    let launch = Launch {
        shared: 0,
        grid: grid as u32,
        block,
        sizes,
    };
    Ok(one_node(name, action, src, vec![input], node, launch))
}

/// Opens a kernel with a block per row of `[rows, K]`: the signature (`x`,
/// `y` of `out_type`, the two sizes), the `preamble` (shared memory and
/// the like), a grid-stride loop over the rows, and `xr`, the row's first
/// element. The caller writes the body and closes the loop and the kernel.
pub(super) fn per_row(src: &mut String, name: &str, out_type: &str, preamble: &str) {
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, {out_type}* __restrict__ y, long long rows, long long K) {{"
    );
    src.push_str(preamble);
    src.push_str("    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {\n");
    src.push_str("        const long long xr = r * K;\n");
}

/// Opens a kernel with a thread per `(outer, inner)` line of `[outer, K,
/// inner]`: the signature (`x`, `y` of `out_type`, the three sizes), a
/// grid-stride loop over the lines with neighbouring threads on
/// neighbouring addresses, and `base`, the line's first element. The
/// caller writes the body and closes the loop and the kernel.
pub(super) fn per_line(src: &mut String, name: &str, out_type: &str) {
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, {out_type}* __restrict__ y, long long outer, long long K, long long inner) {{"
    );
    src.push_str("    long long stride = (long long)gridDim.x * blockDim.x;\n");
    src.push_str("    for (long long idx = blockIdx.x * (long long)blockDim.x + threadIdx.x; idx < outer * inner; idx += stride) {\n");
    src.push_str("        const long long base = (idx / inner) * K * inner + idx % inner;\n");
}

/// The grid and sizes of a [`per_line`] kernel.
pub(super) fn per_line_launch(outer: u64, k: u64, inner: u64, block: u32) -> (u64, Vec<i64>) {
    (
        (outer * inner).div_ceil(u64::from(block)).clamp(1, WAVES),
        vec![outer as i64, k as i64, inner as i64],
    )
}

/// A reduction of few long rows in one launch: `splits` blocks per row
/// each reduce a chunk and leave a partial in module memory; the last
/// block of a row to finish (counted with an atomic, after a fence)
/// combines the row's partials, writes the result and resets the count
/// for the next launch.
fn split_rows(
    name: &str,
    kind: Kind,
    (identity, map, op): (&str, &str, &str),
    outer: u64,
    k: u64,
    splits: u64,
    finish: &dyn Fn(&str) -> String,
) -> String {
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {kind:?} over {outer} row(s) of {k}, each split across {splits} blocks"
    );
    declare_partials(&mut src, name, outer, splits);
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, long long rows, long long K, long long splits) {{"
    );
    src.push_str("    __shared__ float shared[32];\n    __shared__ bool last;\n");
    src.push_str("    const long long r = blockIdx.x / splits, part = blockIdx.x % splits;\n");
    src.push_str("    const long long chunk = (K + splits - 1) / splits;\n");
    src.push_str("    const long long lo = part * chunk, hi = min(K, lo + chunk);\n");
    src.push_str("    const long long xr = r * K;\n    {\n");
    let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
    let _ = writeln!(
        src,
        "        for (long long k = lo + threadIdx.x; k < hi; k += blockDim.x) {{ float v = LOAD_X(xr + k); {} }}",
        step(map, op)
    );
    block_reduce(&mut src, "acc", op, identity);
    combine_partials(&mut src, name, "r", (identity, op), &finish("acc"));
    src.push_str("}\n");
    src
}

/// The module-scope state of [`combine_partials`]: a partial per block of
/// `groups` groups of `splits` blocks, and a count of finished blocks per
/// group (zero when the module loads, and again after every launch).
pub(super) fn declare_partials(src: &mut String, name: &str, groups: u64, splits: u64) {
    let _ = writeln!(src, "__device__ float {name}_part[{}];", groups * splits);
    let _ = writeln!(src, "__device__ unsigned int {name}_done[{groups}];");
}

/// The tail of a kernel whose blocks each hold a partial `acc` (every
/// thread the same value) in a scope the caller opened, which this
/// closes: each block stores its partial in `{name}_part`, and the last
/// block of its group to arrive (an atomic count after a fence) combines
/// the group's `splits` partials, writes `y[group] = finish` (an
/// expression of `acc`) and resets the count for the next launch. The
/// caller declares `__shared__ bool last`, `shared[32]` and `splits`, and
/// the module arrays with [`declare_partials`].
pub(super) fn combine_partials(
    src: &mut String,
    name: &str,
    group: &str,
    (identity, op): (&str, &str),
    finish: &str,
) {
    src.push_str("        if (threadIdx.x == 0) {\n");
    let _ = writeln!(src, "            {name}_part[blockIdx.x] = acc;");
    src.push_str("            __threadfence();\n");
    let _ = writeln!(
        src,
        "            last = atomicAdd(&{name}_done[{group}], 1u) == (unsigned int)(splits - 1);"
    );
    src.push_str("        }\n        __syncthreads();\n    }\n");
    src.push_str("    if (last) {\n        __threadfence();\n");
    let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
    let _ = writeln!(
        src,
        "        for (long long p = threadIdx.x; p < splits; p += blockDim.x) {{ float v = ((volatile float*){name}_part)[{group} * splits + p]; {} }}",
        step("v", op)
    );
    block_reduce(src, "acc", op, identity);
    let _ = writeln!(
        src,
        "        if (threadIdx.x == 0) {{ y[{group}] = {finish}; {name}_done[{group}] = 0u; }}"
    );
    src.push_str("    }\n");
}

/// Whether every flat index of `shape` fits 32 bits, so that index
/// arithmetic (divisions by constants) can be 32-bit.
fn narrow(shape: &[u64]) -> bool {
    shape.iter().product::<u64>() <= u64::from(u32::MAX)
}

/// Which channel a normalized element's scale and shift come from.
fn channel_of(kind: &NormKind, shape: &[u64]) -> Result<(u64, u64, String), Refusal> {
    // (rows, K, expression of the affine index from r and k)
    Ok(match kind {
        NormKind::Layer { dims } | NormKind::Rms { dims } => {
            let split = shape.len() - dims;
            (
                shape[..split].iter().product(),
                shape[split..].iter().product(),
                "k".into(),
            )
        }
        NormKind::Group { groups } => {
            if shape.len() < 2 || !shape[1].is_multiple_of(*groups) {
                return Err(Refusal::new(
                    "group norm needs [N, C, ...] with C divisible by the groups",
                ));
            }
            let (n, c) = (shape[0], shape[1]);
            let spatial: u64 = shape[2..].iter().product();
            let per_group = c / groups;
            let channel = if narrow(shape) {
                format!(
                    "(long long)((unsigned)r % {groups}u * {per_group}u + (unsigned)k / {spatial}u)"
                )
            } else {
                format!("(r % {groups}LL) * {per_group}LL + k / {spatial}LL")
            };
            (n * groups, per_group * spatial, channel)
        }
        NormKind::Instance => {
            if shape.len() < 3 {
                return Err(Refusal::new("instance norm needs [N, C, spatial...]"));
            }
            let (n, c) = (shape[0], shape[1]);
            let channel = if narrow(shape) {
                format!("(long long)((unsigned)r % {c}u)")
            } else {
                format!("r % {c}LL")
            };
            (n * c, shape[2..].iter().product(), channel)
        }
        NormKind::Lp { p, dim } if *p == 2.0 && dim + 1 == shape.len() => {
            (shape[..*dim].iter().product(), shape[*dim], "k".into())
        }
        NormKind::Lp { p, dim } => {
            return Err(Refusal::new(format!(
                "no row kernel yet for F.normalize with p = {p} over dim {dim} of {} (only p = 2 over the last dim)",
                shape.len()
            )));
        }
        NormKind::Batch => return Err(Refusal::new("batch norm has a kernel of its own")),
    })
}

/// Layer, RMS, group and instance norm: each normalized group of elements
/// is one contiguous row; the mean, then the variance (two passes,
/// compensated sums), then the normalized, scaled and shifted output.
/// Rows longer than 16384, or few rows, take a team of blocks per row in
/// one launch ([`SplitNorm::team_source`]), or, when the team would be too large
/// to be sure of holding at once, a statistics launch and a normalizing
/// one ([`SplitNorm`]); rows of at most 16384 are read once into
/// registers ([`RegisterNorm`]). Every path writes through `STORE_Y`,
/// where a chain after the norm is fused.
pub fn norm(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a norm kernel covers one op"));
    };
    let n = g.node(node);
    let Op::Norm(Norm {
        kind,
        eps,
        affine,
        bias,
        batch_stats,
    }) = &n.op
    else {
        return Err(Refusal::new(format!("`{}` is not a norm", n.name)));
    };
    let ins = g.inputs(node);
    let x = ins[0];
    if !batch_stats && !matches!(kind, NormKind::Layer { .. } | NormKind::Rms { .. }) {
        return Err(Refusal::new(
            "running statistics (eval mode) are not written yet",
        ));
    }
    if ins.iter().any(|&t| g.tensor(t).dtype != DType::F32) || n.outputs[0].dtype != DType::F32 {
        return Err(Refusal::new(format!("`{}` is not float32", n.name)));
    }
    let shape = g.tensor(x).shape.clone();
    if *kind == NormKind::Batch {
        return batch_norm(g, action, name, *eps, *affine, *bias);
    }
    let (rows, k, channel) = channel_of(kind, &shape)?;
    let stat = Stat::of(kind);
    let centred = stat.centred();
    let block = one_per_thread(action, "norm")?;
    let (mut params, inputs) = norm_operands(&ins, *affine, *bias);
    let scale = if *affine {
        format!(" * w[{channel}]")
    } else {
        String::new()
    };
    let shift = if *bias {
        format!(" + b[{channel}]")
    } else {
        String::new()
    };
    let sizes = [
        "float* __restrict__ y".to_string(),
        "long long rows".into(),
        "long long K".into(),
    ];
    let split = |splits, team| -> Result<SplitNorm, Refusal> {
        Ok(SplitNorm {
            what: format!("{kind:?}"),
            groups: rows,
            count: k,
            splits,
            address: format!("r * {k}LL + k"),
            run: k,
            team,
            channel: channel.clone(),
            stat,
            eps: lit(*eps)?,
            affine: *affine,
            bias: *bias,
        })
    };
    // Rows longer than a block holds in registers, or few rows: a team of
    // blocks per row, or when the team would be too large, two launches.
    if let Some(splits) = team_splits(rows, k, block, k.is_multiple_of(4)) {
        return Ok(split(splits, true)?.fragment(name, action, params, inputs, node));
    }
    if let Some(splits) = norm_splits(rows, k, block) {
        return Ok(split(splits, false)?.fragment(name, action, params, inputs, node));
    }
    params.extend(sizes);
    if let Some((threads, per)) = register_row(k) {
        let what = format!("{kind:?} over {rows} rows of {k} (eps {eps})");
        let norm = RegisterNorm {
            rows,
            k,
            threads,
            per,
            stat,
            eps: lit(*eps)?,
        };
        let (src, launch) = norm.source(name, &what, &params, block, &scale, &shift);
        return Ok(one_node(name, action, src, inputs, node, launch));
    }
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {kind:?} over {rows} rows of {k} (eps {eps})"
    );
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({}) {{",
        params.join(", ")
    );
    src.push_str("    __shared__ float shared[32];\n");
    src.push_str("    for (long long r = blockIdx.x; r < rows; r += gridDim.x) {\n");
    src.push_str("        const long long xr = r * K;\n");
    let sum = |src: &mut String, var: &str, term: &str| {
        compensated_sum(
            src,
            "        ",
            var,
            "for (long long k = threadIdx.x; k < K; k += blockDim.x)",
            "xr + k",
            term,
        );
        block_reduce(src, var, "a + b", "0.0f");
    };
    if !centred {
        src.push_str("        const float mean = 0.0f;\n");
    } else {
        sum(&mut src, "total", "v");
        src.push_str("        const float mean = total / (float)K;\n");
    }
    sum(&mut src, "squares", "(v - mean) * (v - mean)");
    let _ = writeln!(
        src,
        "        const float rstd = {};",
        stat.rstd("squares", "K", &lit(*eps)?)
    );
    let _ = writeln!(
        src,
        "        for (long long k = threadIdx.x; k < K; k += blockDim.x) STORE_Y(r * K + k, (LOAD_X(xr + k) - mean) * rstd{scale}{shift});"
    );
    src.push_str("    }\n}\n");
    let launch = Launch {
        shared: 0,
        grid: rows.clamp(1, WAVES * 2) as u32,
        block,
        sizes: vec![rows as i64, k as i64],
    };
    Ok(one_node(name, action, src, inputs, node, launch))
}

/// The threads per row and the elements each holds in registers when a
/// norm's rows of `k` are short enough to be read once and kept: at most
/// 256 elements take 8 each (a warp or part of one per row: every lane's
/// 8 loads fill 32-byte sectors with its neighbours'), at most 16384 take
/// up to 16 each (a block of 64 to 1024 threads per row); `None` for
/// longer rows.
fn register_row(k: u64) -> Option<(u64, u64)> {
    let threads = match k {
        0 => return None,
        1..=256 => k.div_ceil(8).next_power_of_two(),
        257..=16384 => k.div_ceil(16).next_power_of_two().max(32),
        _ => return None,
    };
    Some((threads, k.div_ceil(threads)))
}

/// A norm whose rows are read once into registers ([`register_row`]):
/// `threads` neighbouring threads per row (lanes of a warp, combining by
/// shuffles, or a whole block, through shared memory), thread `t` holding
/// elements `t + j * threads`. The mean, then the sum of squared
/// deviations from it, come from the registers; then the row is written.
/// One pass over memory to read, one to write.
struct RegisterNorm {
    rows: u64,
    k: u64,
    threads: u64,
    per: u64,
    stat: Stat,
    /// ε, as a float literal.
    eps: String,
}

/// What a row norm divides each row by.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Stat {
    /// The standard deviation around the row's mean (layer, group and
    /// instance norms): `rsqrt(var + ε)`.
    Deviation,
    /// The root mean square, the mean taken as 0 (RMS norm).
    Rms,
    /// The Euclidean length, the mean taken as 0: `1 / max(‖x‖₂, ε)`
    /// (`F.normalize` with p = 2).
    Length,
}

impl Stat {
    fn of(kind: &NormKind) -> Stat {
        match kind {
            NormKind::Rms { .. } => Stat::Rms,
            NormKind::Lp { .. } => Stat::Length,
            _ => Stat::Deviation,
        }
    }

    /// Whether the row's mean is taken out first (false: it is taken
    /// as 0).
    fn centred(self) -> bool {
        self == Stat::Deviation
    }

    /// The factor a row is scaled by, from the sum of its squared
    /// deviations `squares` over `count` elements.
    fn rstd(self, squares: &str, count: &str, eps: &str) -> String {
        match self {
            Stat::Length => format!("1.0f / fmaxf(sqrtf({squares}), {eps})"),
            Stat::Deviation | Stat::Rms => {
                format!("rsqrtf({squares} / (float){count} + {eps})")
            }
        }
    }
}

impl RegisterNorm {
    /// The kernel (blocks of `block` threads when a row takes a warp or
    /// less, else a block per row) and its launch.
    fn source(
        &self,
        name: &str,
        what: &str,
        params: &[String],
        block: u32,
        scale: &str,
        shift: &str,
    ) -> (String, Launch) {
        let RegisterNorm {
            rows,
            k,
            threads,
            per,
            ..
        } = *self;
        let block = if threads > 32 { threads as u32 } else { block };
        // Rows a block and a warp take at a time.
        let per_block = u64::from(block) / threads;
        let per_warp = if threads > 32 { 0 } else { 32 / threads };
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {what}, {threads} thread(s) per row holding {per} elements each in registers"
        );
        let _ = writeln!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}) {name}({}) {{",
            params.join(", ")
        );
        if threads > 32 {
            src.push_str("    __shared__ float shared[32];\n");
        }
        // A warp's rows go round the loop together, so that every lane
        // reaches each shuffle; a row past the end reads and writes
        // nothing.
        let _ = writeln!(
            src,
            "    const int t = threadIdx.x % {threads};\n    const long long mine = threadIdx.x / {threads};\n    const long long warp_first = (threadIdx.x / 32) * {per_warp}LL;"
        );
        let _ = writeln!(
            src,
            "    for (long long first = blockIdx.x * {per_block}LL; first < rows; first += (long long)gridDim.x * {per_block}LL) {{"
        );
        src.push_str("        if (first + warp_first >= rows) break;\n");
        src.push_str("        const long long r = first + mine;\n        const bool live = r < rows;\n        const long long xr = live ? r * K : 0;\n");
        let _ = writeln!(src, "        float v_[{per}];");
        let each = format!(
            "        #pragma unroll\n        for (int j = 0; j < {per}; ++j) {{ const long long k = t + (long long)j * {threads};"
        );
        let reduce = |src: &mut String, var: &str| {
            if threads > 32 {
                block_reduce(src, var, "a + b", "0.0f");
            } else if threads > 1 {
                lanes_reduce(src, var, "a + b", threads);
            }
        };
        if !self.stat.centred() {
            let _ = writeln!(
                src,
                "{each} v_[j] = live && k < K ? LOAD_X(xr + k) : 0.0f; }}"
            );
            src.push_str("        const float mean = 0.0f;\n");
        } else {
            src.push_str("        float total = 0.0f;\n");
            let _ = writeln!(
                src,
                "{each} v_[j] = live && k < K ? LOAD_X(xr + k) : 0.0f; total += v_[j]; }}"
            );
            reduce(&mut src, "total");
            src.push_str("        const float mean = total / (float)K;\n");
        }
        src.push_str("        float squares = 0.0f;\n");
        let _ = writeln!(
            src,
            "{each} if (k < K) {{ const float d = v_[j] - mean; squares += d * d; }} }}"
        );
        reduce(&mut src, "squares");
        let _ = writeln!(
            src,
            "        const float rstd = {};",
            self.stat.rstd("squares", "K", &self.eps)
        );
        let _ = writeln!(
            src,
            "{each} if (live && k < K) STORE_YX(xr + k, (v_[j] - mean) * rstd{scale}{shift}, v_[j]); }}\n    }}\n}}"
        );
        let launch = Launch {
            shared: 0,
            grid: rows.div_ceil(per_block).clamp(1, WAVES * 2) as u32,
            block,
            sizes: vec![rows as i64, k as i64],
        };
        (src, launch)
    }
}

/// The pointer parameters and inputs of a norm: `x`, then the scale and
/// shift when the norm has them.
fn norm_operands(
    ins: &[mtmc_actions::graph::TensorRef],
    affine: bool,
    bias: bool,
) -> (Vec<String>, Vec<mtmc_actions::graph::TensorRef>) {
    let mut params = vec!["const float* __restrict__ x".to_string()];
    let mut inputs = vec![ins[0]];
    if affine {
        params.push("const float* __restrict__ w".into());
        inputs.push(ins[1]);
    }
    if bias {
        params.push("const float* __restrict__ b".into());
        inputs.push(ins[2]);
    }
    (params, inputs)
}

/// Elements each thread of a split norm's block holds in registers: a
/// block's chunk of a group is `SPLIT_PER_THREAD * block` elements.
const SPLIT_PER_THREAD: u64 = 16;

/// Blocks per group when a norm's groups are better cut into chunks, one
/// block each, where no team takes them ([`team_splits`]): few long
/// groups (too few to fill the GPU), or long groups, whose three passes a
/// block per group would read from memory; `None` when a block per group
/// does.
fn norm_splits(groups: u64, count: u64, block: u32) -> Option<u64> {
    let chunk = SPLIT_PER_THREAD * u64::from(block);
    let long = count >= 8 * chunk;
    let few = groups < 2 * 132 && count >= 2 * chunk;
    (long || few).then(|| count.div_ceil(chunk))
}

/// A norm over long groups in two launches of `splits` blocks per group,
/// each block one chunk of `SPLIT_PER_THREAD * blockDim.x` elements held
/// in registers. The statistics launch reads the chunk once: its mean,
/// then the sum of squared deviations from it, go to module memory, and
/// the last block of the group to finish (an atomic count after a fence)
/// combines the group's partials by Chan's formula (the total of the
/// squared deviations is the chunks' own plus each chunk's count times its
/// mean's squared distance from the group's) into the group's mean and
/// 1/std. The normalizing launch reads the chunk again and writes it: three
/// passes over memory in all. [`SplitNorm::team_source`] does the same in one
/// launch, one read and one write, when the team of blocks is small enough.
struct SplitNorm {
    /// What it computes, for the comment.
    what: String,
    /// Groups, each normalized on its own.
    groups: u64,
    /// Elements per group.
    count: u64,
    /// Blocks per group.
    splits: u64,
    /// Where element `k` of group `r` is (a C expression).
    address: String,
    /// The length of the contiguous runs a group's elements lie in (the
    /// group's count when it is contiguous): runs of a multiple of 4 let
    /// a team move them 16 bytes at a time.
    run: u64,
    /// One launch by a team of blocks per group ([`SplitNorm::team_source`]).
    team: bool,
    /// The scale's and shift's index for element `k` of group `r`.
    channel: String,
    /// What each group is divided by (RMS norm and length: no centering).
    stat: Stat,
    /// ε, as a float literal.
    eps: String,
    affine: bool,
    bias: bool,
}

/// The output and sizes of a split or team norm's kernels, after the
/// inputs.
const SPLIT_SIZES: [&str; 4] = [
    "float* __restrict__ y",
    "long long groups",
    "long long count",
    "long long splits",
];

impl SplitNorm {
    /// The scale and shift terms of element `k` of group `r`.
    fn affine_terms(&self) -> (String, String) {
        let channel = &self.channel;
        let scale = if self.affine {
            format!(" * w[{channel}]")
        } else {
            String::new()
        };
        let shift = if self.bias {
            format!(" + b[{channel}]")
        } else {
            String::new()
        };
        (scale, shift)
    }

    /// The norm in one launch: a team of `splits` blocks per group, each
    /// holding one chunk of the group in registers. A block takes a ticket
    /// as it starts (an atomic count), which names its group and chunk, so
    /// that the blocks of a team start in order and the team with the
    /// lowest tickets is always wholly resident: the kernel cannot wait on
    /// a block that has not started while holding the SM it needs (given a
    /// team no larger than the GPU holds at once, [`team_splits`]). Each
    /// block sums its chunk, then the squared deviations from the chunk's
    /// mean, from registers, and publishes both; its first thread counts
    /// the block in and waits until the whole team has; every block then
    /// combines the team's statistics by Chan's formula and writes its
    /// chunk from registers, normalized. The last block out of the group
    /// resets its counts, and the last block of the launch the tickets, so
    /// that the next launch starts from zero. One read, one write. With
    /// contiguous groups of a multiple of 4, 16 bytes a load and a store
    /// (element by element when a chain is fused in front, `LOAD_X`, or
    /// after, `STORE_Y`).
    fn team_source(&self, name: &str, block: u32, params: &str) -> (String, Launch) {
        let SplitNorm {
            groups,
            count,
            splits,
            ..
        } = *self;
        let vec4 = self.run.is_multiple_of(4);
        let per = team_per(block, vec4);
        let address = &self.address;
        let (scale, shift) = self.affine_terms();
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {} over {groups} group(s) of {count}, a team of {splits} blocks per group, {per} elements a thread in registers",
            self.what
        );
        let _ = writeln!(src, "__device__ float2 {name}_part[{}];", groups * splits);
        let _ = writeln!(src, "__device__ unsigned int {name}_in[{groups}];");
        let _ = writeln!(src, "__device__ unsigned int {name}_out[{groups}];");
        let _ = writeln!(src, "__device__ unsigned int {name}_ticket[2];");
        // More blocks an SM when no chain is fused in to need registers.
        let _ = writeln!(
            src,
            "#if defined(MTMC_PROLOGUE) || defined(MTMC_EPILOGUE)\n#define {name}_MIN {}\n#else\n#define {name}_MIN {}\n#endif",
            team_blocks_per_sm(block, 64),
            team_blocks_per_sm(block, 20)
        );
        let _ = writeln!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}, {name}_MIN) {name}({params}) {{"
        );
        src.push_str("    __shared__ float shared[32];\n    __shared__ unsigned int ticket_;\n");
        let _ = writeln!(
            src,
            "    if (threadIdx.x == 0) ticket_ = atomicAdd(&{name}_ticket[0], 1u);"
        );
        src.push_str("    __syncthreads();\n");
        let _ = writeln!(
            src,
            "    const long long r = ticket_ / splits, part = ticket_ % splits;\n    const long long chunk = {per}LL * {block}LL;\n    const long long lo = part * chunk, hi = min(count, lo + chunk);"
        );
        // Element `k` of the group, value `val`, normalized.
        let _ = writeln!(
            src,
            "    float mean = 0.0f, rstd = 0.0f;\n    auto norm_ = [&](long long k, float val) {{ return (val - mean) * rstd{scale}{shift}; }};"
        );
        let (each, held) = if vec4 {
            let quads = per / 4;
            let _ = writeln!(src, "    float4 v_[{quads}];");
            (
                format!(
                    "    #pragma unroll\n    for (int i = 0; i < {quads}; ++i) {{ const long long k = lo + 4 * ((long long)i * {block} + threadIdx.x);"
                ),
                [".x", ".y", ".z", ".w"].as_slice(),
            )
        } else {
            let _ = writeln!(src, "    float v_[{per}];");
            (
                format!(
                    "    #pragma unroll\n    for (int i = 0; i < {per}; ++i) {{ const long long k = lo + (long long)i * {block} + threadIdx.x;"
                ),
                [""].as_slice(),
            )
        };
        // Read the chunk, and sum it (RMS norm: no centering, no sum).
        if vec4 {
            let _ = writeln!(
                src,
                "{each}\n        if (k < hi) {{\n            const long long at = {address};\n#ifdef MTMC_PROLOGUE\n            v_[i] = make_float4(LOAD_X(at), LOAD_X(at + 1), LOAD_X(at + 2), LOAD_X(at + 3));\n#else\n            v_[i] = __ldcs(reinterpret_cast<const float4*>(x + at));\n#endif\n        }} else v_[i] = make_float4(0.0f, 0.0f, 0.0f, 0.0f);\n    }}"
            );
        } else {
            let _ = writeln!(src, "{each} v_[i] = k < hi ? LOAD_X({address}) : 0.0f; }}");
        }
        let terms = |f: &dyn Fn(&str) -> String| -> String {
            held.iter()
                .map(|c| f(&format!("v_[i]{c}")))
                .collect::<Vec<_>>()
                .join(" + ")
        };
        src.push_str("    const float n_ = (float)(hi - lo);\n    {\n");
        if !self.stat.centred() {
            src.push_str("        const float mine = 0.0f;\n");
        } else {
            src.push_str("        float total = 0.0f;\n");
            let _ = writeln!(src, "    {each} total += {}; }}", terms(&|v| v.to_string()));
            block_reduce(&mut src, "total", "a + b", "0.0f");
            src.push_str("        const float mine = total / n_;\n");
        }
        src.push_str("        float squares = 0.0f;\n");
        let _ = writeln!(
            src,
            "    {each} if (k < hi) squares += {}; }}",
            terms(&|v| format!("({v} - mine) * ({v} - mine)"))
        );
        block_reduce(&mut src, "squares", "a + b", "0.0f");
        // Publish, count in, wait for the team.
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) {{\n            {name}_part[ticket_] = make_float2(mine, squares);\n            __threadfence();\n            atomicAdd(&{name}_in[r], 1u);\n            while (((volatile unsigned int*){name}_in)[r] < (unsigned int)splits) __nanosleep(64);\n            __threadfence();\n        }}\n        __syncthreads();\n    }}"
        );
        // The team's statistics, by every block.
        let _ = writeln!(
            src,
            "    {{\n        const volatile float2* stats = {name}_part + r * splits;"
        );
        chan_combine(
            &mut src,
            !self.stat.centred(),
            "",
            ("stats[p].x", "stats[p].y"),
        );
        let _ = writeln!(
            src,
            "        rstd = {};\n    }}",
            self.stat.rstd("m2", "count", &self.eps)
        );
        // Write the chunk from registers.
        if vec4 {
            let _ = writeln!(
                src,
                "{each}\n        if (k < hi) {{\n            const long long at = {address};\n            __stcs(reinterpret_cast<float4*>(y + at), make_float4(EPI_Y(at, norm_(k, v_[i].x), v_[i].x), EPI_Y(at + 1, norm_(k + 1, v_[i].y), v_[i].y), EPI_Y(at + 2, norm_(k + 2, v_[i].z), v_[i].z), EPI_Y(at + 3, norm_(k + 3, v_[i].w), v_[i].w)));\n        }}\n    }}"
            );
        } else {
            let _ = writeln!(
                src,
                "{each} if (k < hi) STORE_YX({address}, norm_(k, v_[i]), v_[i]); }}"
            );
        }
        // Out: the last of the group resets its counts, the last of the
        // launch the tickets.
        let _ = writeln!(
            src,
            "    if (threadIdx.x == 0) {{\n        if (atomicAdd(&{name}_out[r], 1u) == (unsigned int)(splits - 1)) {{ {name}_in[r] = 0u; {name}_out[r] = 0u; }}\n        if (atomicAdd(&{name}_ticket[1], 1u) == gridDim.x - 1) {{ {name}_ticket[0] = 0u; {name}_ticket[1] = 0u; }}\n    }}\n}}"
        );
        let launch = Launch {
            shared: 0,
            grid: (groups * splits) as u32,
            block,
            sizes: vec![groups as i64, count as i64, splits as i64],
        };
        (src, launch)
    }

    /// The fragment: a team's one launch ([`SplitNorm::team_source`]), or
    /// the statistics launch and the normalizing one.
    fn fragment(
        &self,
        name: &str,
        action: &Action,
        mut params: Vec<String>,
        inputs: Vec<mtmc_actions::graph::TensorRef>,
        node: mtmc_actions::graph::NodeId,
    ) -> Fragment {
        params.extend(SPLIT_SIZES.map(String::from));
        let params = params.join(", ");
        if self.team {
            let (src, launch) = self.team_source(name, action.params.block, &params);
            return one_node(name, action, src, inputs, node, launch);
        }
        let SplitNorm {
            groups,
            count,
            splits,
            ..
        } = *self;
        let stats = format!("{name}_stats");
        let address = &self.address;
        let per = SPLIT_PER_THREAD;
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {} over {groups} group(s) of {count}, each cut into {splits} chunks of {per} elements a thread",
            self.what
        );
        let _ = writeln!(
            src,
            "__device__ float {name}_part[{}];",
            2 * groups * splits
        );
        let _ = writeln!(src, "__device__ float {name}_stat[{}];", 2 * groups);
        let _ = writeln!(src, "__device__ unsigned int {name}_done[{groups}];");
        let _ = writeln!(src, "#define {name}_PER {per}");
        let chunk = format!(
            "    const long long r = blockIdx.x / splits, part = blockIdx.x % splits;\n    const long long chunk = {name}_PER * (long long)blockDim.x;\n    const long long lo = part * chunk, hi = min(count, lo + chunk);\n"
        );
        let each = format!(
            "        #pragma unroll\n        for (int i = 0; i < {name}_PER; ++i) {{ const long long k = lo + (long long)i * blockDim.x + threadIdx.x;"
        );
        // The statistics launch.
        let _ = writeln!(src, "extern \"C\" __global__ void {stats}({params}) {{");
        src.push_str("    __shared__ float shared[32];\n    __shared__ bool last;\n");
        src.push_str(&chunk);
        src.push_str("    {\n");
        let _ = writeln!(src, "        float v_[{name}_PER];");
        // RMS norm: no centering, so no sum.
        let add = if !self.stat.centred() {
            ""
        } else {
            src.push_str("        float total = 0.0f;\n");
            " total += v_[i];"
        };
        let _ = writeln!(
            src,
            "{each} v_[i] = k < hi ? LOAD_X({address}) : 0.0f;{add} }}"
        );
        if !self.stat.centred() {
            src.push_str("        const float mean = 0.0f;\n");
        } else {
            block_reduce(&mut src, "total", "a + b", "0.0f");
            src.push_str("        const float mean = total / (float)(hi - lo);\n");
        }
        src.push_str("        float squares = 0.0f;\n");
        let _ = writeln!(
            src,
            "{each} if (k < hi) {{ const float d = v_[i] - mean; squares += d * d; }} }}"
        );
        block_reduce(&mut src, "squares", "a + b", "0.0f");
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) {{\n            {name}_part[2 * blockIdx.x] = mean; {name}_part[2 * blockIdx.x + 1] = squares;\n            __threadfence();\n            last = atomicAdd(&{name}_done[r], 1u) == (unsigned int)(splits - 1);\n        }}\n        __syncthreads();\n    }}"
        );
        // The last block of the group combines the chunks' statistics.
        src.push_str("    if (!last) return;\n    __threadfence();\n    {\n");
        let _ = writeln!(
            src,
            "        const volatile float* stats = {name}_part + 2 * r * splits;"
        );
        if !self.stat.centred() {
            src.push_str("        const float mean = 0.0f;\n");
        }
        chan_combine(
            &mut src,
            !self.stat.centred(),
            "const float ",
            ("stats[2 * p]", "stats[2 * p + 1]"),
        );
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) {{ {name}_stat[2 * r] = mean; {name}_stat[2 * r + 1] = {}; {name}_done[r] = 0u; }}\n    }}\n}}",
            self.stat.rstd("m2", "count", &self.eps)
        );
        // The normalizing launch.
        let _ = writeln!(src, "extern \"C\" __global__ void {name}({params}) {{");
        src.push_str(&chunk);
        let _ = writeln!(
            src,
            "    const float mean = {name}_stat[2 * r], rstd = {name}_stat[2 * r + 1];"
        );
        let (scale, shift) = self.affine_terms();
        src.push_str("    {\n");
        let _ = writeln!(
            src,
            "{each} if (k < hi) {{ const long long at = {address}; STORE_Y(at, (LOAD_X(at) - mean) * rstd{scale}{shift}); }} }}\n    }}\n}}"
        );
        let launch = Launch {
            shared: 0,
            grid: (groups * splits) as u32,
            block: action.params.block,
            sizes: vec![groups as i64, count as i64, splits as i64],
        };
        let mut f = one_node(name, action, src, inputs, node, launch.clone());
        f.before.push(crate::program::Pass {
            kernel: stats,
            launch,
        });
        f
    }
}

/// Elements each thread of a team's block holds in registers: 64 for
/// blocks of up to 256 threads, so that a block of 256 holds 16384; larger
/// blocks hold 16384 between them. Half as many when they are read one by
/// one (`vec4` false), each with an address of its own to keep.
fn team_per(block: u32, vec4: bool) -> u64 {
    64.min(16384 / u64::from(block)) / if vec4 { 1 } else { 2 }
}

/// Blocks of `block` threads that an SM is sure to hold at once for a
/// team kernel: its `__launch_bounds__` minimum when a chain is fused in
/// (`spare` registers a thread besides its elements: 64, as a chain in
/// front computes while the elements are held), or when none is (20).
fn team_blocks_per_sm(block: u32, spare: u64) -> u64 {
    (65536 / (u64::from(block) * (team_per(block, true) + spare))).clamp(1, 2048 / u64::from(block))
}

/// Blocks per group when a norm over groups of `count` elements is better
/// done by a team ([`SplitNorm::team_source`]): groups longer than a block holds
/// in registers, or few groups (too few to fill the GPU) of at least two
/// chunks. `None` when a team would be larger than two thirds of what the
/// H100's 132 SMs are sure to hold at once: its blocks wait for each
/// other, so all of a team must be resident together.
fn team_splits(groups: u64, count: u64, block: u32, vec4: bool) -> Option<u64> {
    let chunk = team_per(block, vec4) * u64::from(block);
    let splits = count.div_ceil(chunk);
    let wanted = count > 16384 || (groups < 2 * 132 && splits >= 2);
    (wanted && splits >= 2 && 3 * splits <= 2 * 132 * team_blocks_per_sm(block, 64))
        .then_some(splits)
}

/// Lines that combine a group's `splits` chunks' statistics (C
/// expressions of the chunk `p`: its mean and the sum of its squared
/// deviations from it) by Chan's formula into `mean` (declared as
/// `{declare}mean`; left alone for an RMS norm, whose mean is 0) and
/// `m2`, the sum of the group's squared deviations from its mean: the
/// chunks' own, plus each chunk's count times its mean's squared distance
/// from the group's. Every thread holds both.
fn chan_combine(src: &mut String, rms: bool, declare: &str, (mean_of, squares_of): (&str, &str)) {
    let weight = "(float)(min(count, (p + 1) * chunk) - min(count, p * chunk))";
    if !rms {
        src.push_str("        float weighted = 0.0f;\n");
        let _ = writeln!(
            src,
            "        for (long long p = threadIdx.x; p < splits; p += blockDim.x) weighted += {weight} * {mean_of};"
        );
        block_reduce(src, "weighted", "a + b", "0.0f");
        let _ = writeln!(src, "        {declare}mean = weighted / (float)count;");
    }
    src.push_str("        float m2 = 0.0f;\n");
    let _ = writeln!(
        src,
        "        for (long long p = threadIdx.x; p < splits; p += blockDim.x) {{ const float d = {mean_of} - mean; m2 += {squares_of} + {weight} * d * d; }}"
    );
    block_reduce(src, "m2", "a + b", "0.0f");
}

/// Batch norm with the batch's statistics (training mode) on `[N, C,
/// spatial...]`: per channel, the mean and the biased variance over the
/// batch and the spatial dims (two passes, compensated sums), then the
/// normalized, scaled and shifted output.
///
/// - With spatial dims (`S > 1`): one block per channel, its threads
///   striding over the `N * S` elements, which run in contiguous stretches
///   of `S`.
/// - Without (`[N, C]`): a block covers 32 neighbouring channels, a warp
///   reading 32 neighbouring addresses of one row; the block's
///   `block / 32` rows of warps combine through shared memory.
fn batch_norm(
    g: &OpGraph,
    action: &Action,
    name: &str,
    eps: f64,
    affine: bool,
    bias: bool,
) -> Result<Fragment, Refusal> {
    let node = action.nodes()[0];
    let ins = g.inputs(node);
    let x = ins[0];
    let shape = g.tensor(x).shape.clone();
    if shape.len() < 2 {
        return Err(Refusal::new("batch norm needs [N, C, ...]"));
    }
    let (n, c) = (shape[0], shape[1]);
    let spatial: u64 = shape[2..].iter().product();
    let block = one_per_thread(action, "norm")?;
    let (mut params, inputs) = norm_operands(&ins, affine, bias);
    let eps = lit(eps)?;
    let team =
        team_splits(c, n * spatial, block, spatial.is_multiple_of(4)).filter(|_| spatial > 1);
    if let Some(splits) =
        team.or_else(|| norm_splits(c, n * spatial, block).filter(|_| spatial > 1))
    {
        let norm = SplitNorm {
            what: "batch norm (batch statistics)".into(),
            groups: c,
            count: n * spatial,
            splits,
            address: if narrow(&[n, c, spatial]) {
                format!(
                    "(long long)(((unsigned)k / {spatial}u * {c}u + (unsigned)r) * {spatial}u + (unsigned)k % {spatial}u)"
                )
            } else {
                format!("((k / {spatial}LL) * {c}LL + r) * {spatial}LL + k % {spatial}LL")
            },
            run: spatial,
            team: team.is_some(),
            channel: "r".into(),
            stat: Stat::Deviation,
            eps: eps.clone(),
            affine,
            bias,
        };
        return Ok(norm.fragment(name, action, params, inputs, node));
    }
    params.extend([
        "float* __restrict__ y".to_string(),
        "long long N".into(),
        "long long C".into(),
        "long long S".into(),
    ]);
    let scale = if affine { " * w[ch]" } else { "" };
    let shift = if bias { " + b[ch]" } else { "" };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: batch norm (batch statistics) of [{n}, {c}, {spatial}] (eps {eps})"
    );
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({}) {{",
        params.join(", ")
    );
    let grid = if spatial > 1 {
        src.push_str("    __shared__ float shared[32];\n");
        src.push_str("    const long long count = N * S;\n");
        src.push_str("    for (long long ch = blockIdx.x; ch < C; ch += gridDim.x) {\n");
        let sum = |src: &mut String, var: &str, term: &str| {
            compensated_sum(
                src,
                "        ",
                var,
                "for (long long i = threadIdx.x; i < count; i += blockDim.x)",
                "((i / S) * C + ch) * S + i % S",
                term,
            );
            block_reduce(src, var, "a + b", "0.0f");
        };
        sum(&mut src, "total", "v");
        src.push_str("        const float mean = total / (float)count;\n");
        sum(&mut src, "squares", "(v - mean) * (v - mean)");
        let _ = writeln!(
            src,
            "        const float rstd = {};",
            Stat::Deviation.rstd("squares", "count", &eps)
        );
        let _ = writeln!(
            src,
            "        for (long long i = threadIdx.x; i < count; i += blockDim.x) {{ long long at = ((i / S) * C + ch) * S + i % S; STORE_Y(at, (LOAD_X(at) - mean) * rstd{scale}{shift}); }}"
        );
        src.push_str("    }\n}\n");
        c.clamp(1, WAVES * 2)
    } else {
        let rows = block / 32;
        let _ = writeln!(src, "    __shared__ float part[{rows}][33];");
        src.push_str("    const int lane = threadIdx.x & 31, row = threadIdx.x >> 5;\n");
        let _ = writeln!(src, "    const int rows = {rows};");
        src.push_str("    for (long long base = (long long)blockIdx.x * 32; base < C; base += (long long)gridDim.x * 32) {\n");
        src.push_str("        const long long ch = base + lane;\n");
        src.push_str("        const bool live = ch < C;\n");
        // Per thread a compensated partial over its rows, then the column
        // of partials summed by the first row of warps.
        let sum = |src: &mut String, var: &str, term: &str| {
            compensated_sum(
                src,
                "        ",
                var,
                "if (live) for (long long r = row; r < N; r += rows)",
                "r * C + ch",
                term,
            );
            let _ = writeln!(src, "        part[row][lane] = {var};");
            src.push_str("        __syncthreads();\n");
            let _ = writeln!(
                src,
                "        if (row == 0) {{ for (int k = 1; k < rows; ++k) {var} += part[k][lane]; part[0][lane] = {var}; }}"
            );
            src.push_str("        __syncthreads();\n");
            let _ = writeln!(src, "        {var} = part[0][lane];");
            src.push_str("        __syncthreads();\n");
        };
        sum(&mut src, "total", "v");
        src.push_str("        const float mean = total / (float)N;\n");
        sum(&mut src, "squares", "(v - mean) * (v - mean)");
        let _ = writeln!(
            src,
            "        const float rstd = {};",
            Stat::Deviation.rstd("squares", "N", &eps)
        );
        let _ = writeln!(
            src,
            "        if (live) for (long long r = row; r < N; r += rows) STORE_Y(r * C + ch, (LOAD_X(r * C + ch) - mean) * rstd{scale}{shift});"
        );
        src.push_str("    }\n}\n");
        c.div_ceil(32).clamp(1, WAVES * 2)
    };
    let launch = Launch {
        shared: 0,
        grid: grid as u32,
        block,
        sizes: vec![n as i64, c as i64, spatial as i64],
    };
    Ok(one_node(name, action, src, inputs, node, launch))
}

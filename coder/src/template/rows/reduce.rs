//! Reductions, argmax / argmin, softmax and logsumexp over `[outer, K,
//! inner]`: a warp or a block per row, a thread per line, blocks of warps
//! over few lines, or few long rows split across blocks.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{Op, Reduce, ReduceOp};

use crate::action::Action;
use crate::program::{Fragment, Launch};
use crate::template::{Refusal, WAVES, one_node, one_per_thread};

use super::cluster::{CLUSTER, CLUSTER_BLOCK, cluster_chunk, cluster_softmax};
use super::{
    Kind, accumulate, block_reduce, combine_partials, declare_partials, per_line, per_line_launch,
    per_row, row_view, step, warp_reduce,
};

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
                accumulate(
                    &mut src,
                    "        ",
                    ("threadIdx.x", "K", "blockDim.x"),
                    &|k| format!("xr + {k}"),
                    map,
                    op,
                );
                block_reduce(&mut src, "acc", op, identity);
                let _ = writeln!(
                    src,
                    "        if (threadIdx.x == 0) y[r] = {};",
                    finish("acc")
                );
            }
            None => {
                let row = &|k: &str| format!("xr + {k}");
                online_passes(
                    &mut src,
                    ("threadIdx.x", "K", "blockDim.x"),
                    row,
                    &|s, var, op, identity| block_reduce(s, var, op, identity),
                );
                match kind {
                    Kind::LogSumExp => src.push_str("        if (threadIdx.x == 0) y[r] = m + logf(s);\n"),
                    Kind::Softmax { log: false } => src.push_str(
                        "        #pragma unroll 4\n        for (long long k = threadIdx.x; k < K; k += blockDim.x) STORE_Y(r * K + k, expf(LOAD_X(xr + k) - m) / s);\n",
                    ),
                    _ => src.push_str(
                        "        #pragma unroll 4\n        for (long long k = threadIdx.x; k < K; k += blockDim.x) STORE_Y(r * K + k, LOAD_X(xr + k) - m - logf(s));\n",
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
                accumulate(
                    &mut src,
                    "        ",
                    ("0", "K", "1"),
                    &|k| format!("base + {k} * inner"),
                    map,
                    op,
                );
                let _ = writeln!(src, "        y[idx] = {};", finish("acc"));
            }
            None => {
                online_passes(
                    &mut src,
                    ("0", "K", "1"),
                    &|k| format!("base + {k} * inner"),
                    &|_, _, _, _| {},
                );
                match kind {
                    Kind::LogSumExp => src.push_str("        y[idx] = m + logf(s);\n"),
                    Kind::Softmax { log: false } => src.push_str(
                        "        #pragma unroll 4\n        for (long long k = 0; k < K; ++k) STORE_Y(base + k * inner, expf(LOAD_X(base + k * inner) - m) / s);\n",
                    ),
                    _ => src.push_str(
                        "        #pragma unroll 4\n        for (long long k = 0; k < K; ++k) STORE_Y(base + k * inner, LOAD_X(base + k * inner) - m - logf(s));\n",
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
    accumulate(
        src,
        "        ",
        ("lo + slice", "hi", "slices"),
        &|k| format!("base + {k} * inner"),
        map,
        op,
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
            accumulate(
                src,
                "        ",
                ("lane", "K", "32"),
                &|k| format!("xr + {k}"),
                map,
                op,
            );
            warp_reduce(src, "acc", op);
            let _ = writeln!(src, "        if (lane == 0) y[r] = {};", finish("acc"));
        }
        None => {
            online_passes(
                src,
                ("lane", "K", "32"),
                &|k| format!("xr + {k}"),
                &|s, var, op, _| warp_reduce(s, var, op),
            );
            match kind {
                Kind::LogSumExp => src.push_str("        if (lane == 0) y[r] = m + logf(s);\n"),
                Kind::Softmax { log: false } => src.push_str(
                    "        #pragma unroll 4\n        for (long long k = lane; k < K; k += 32) STORE_Y(xr + k, expf(LOAD_X(xr + k) - m) / s);\n",
                ),
                _ => src.push_str(
                    "        #pragma unroll 4\n        for (long long k = lane; k < K; k += 32) STORE_Y(xr + k, LOAD_X(xr + k) - m - logf(s));\n",
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

/// A reduction of few long rows in one launch: `splits` blocks per row
/// each reduce every `splits`-th stretch of `blockDim.x` elements (so that
/// the blocks running at once read one window of the row together, as a
/// grid-stride loop does, rather than each a distant chunk of its own:
/// on the H200 a mean of squared differences over 2³⁰ elements took
/// 2.97 ms by chunks, 2.09 ms so) and leave a partial in module memory;
/// the last
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
    src.push_str("    const long long xr = r * K;\n    {\n");
    let _ = writeln!(src, "        float acc = {identity}, c = 0.0f;");
    accumulate(
        &mut src,
        "        ",
        (
            "part * blockDim.x + threadIdx.x",
            "K",
            "splits * (long long)blockDim.x",
        ),
        &|k| format!("xr + {k}"),
        map,
        op,
    );
    block_reduce(&mut src, "acc", op, identity);
    combine_partials(&mut src, name, "r", (identity, op), &finish("acc"));
    src.push_str("}\n");
    src
}

/// The two passes of a softmax or logsumexp over a row, into `m` (its
/// maximum) and `s` (the sum of `exp(v - m)`, compensated), each an
/// [`accumulate`] over `k` in `range` of `LOAD_X(at(k))`, each followed by
/// `combine` (the lines that combine a variable across the threads that
/// share the row, with an op and its identity: none for a thread per row).
fn online_passes(
    src: &mut String,
    range: (&str, &str, &str),
    at: &dyn Fn(&str) -> String,
    combine: &dyn Fn(&mut String, &str, &str, &str),
) {
    let (max, lowest) = ("fmaxf(a, b)", "__int_as_float(0xff800000)");
    let _ = writeln!(
        src,
        "        float m;\n        {{ float acc = {lowest}, c = 0.0f;"
    );
    accumulate(src, "        ", range, at, "v", max);
    src.push_str("        m = acc; }\n");
    combine(src, "m", max, lowest);
    src.push_str("        float s;\n        { float acc = 0.0f, c = 0.0f;\n");
    accumulate(src, "        ", range, at, "expf(v - m)", "a + b");
    src.push_str("        s = acc; }\n");
    combine(src, "s", "a + b", "0.0f");
}

//! Kernels over rows: the input of a reduction, softmax or norm is seen
//! as `[outer, K, inner]`, with `K` the product of the reduced (or
//! normalized) dims, and each `(outer, inner)` line is one row.
//!
//! - [`reduce`]: reductions, argmax / argmin, softmax and logsumexp. With
//!   `inner == 1` (the reduced dims are the trailing ones), one block per
//!   row, each thread striding over the row, then a warp-shuffle and
//!   shared-memory block reduction; softmax makes one pass for the
//!   maximum, one for the sum, one to write. Rows of at most 1024 take one
//!   warp each, combined by shuffles alone. With `inner > 1`, one thread
//!   per output element, looping over `K` with stride `inner`, so that
//!   neighbouring threads read neighbouring addresses. With fewer outputs
//!   than the GPU holds threads, a block per 32 neighbouring outputs and
//!   chunk of `K` instead, its warps sharing the chunk's steps, the chunks
//!   combined by the last block to finish (reductions; softmax keeps a
//!   thread per line).
//! - [`cluster`]: softmax over long rows, each held in the shared memory
//!   of a cluster of blocks.
//! - [`mod@norm`], [`register_norm`], [`split_norm`]: layer, RMS, group,
//!   instance and batch norms, by rows held in registers, by a block per
//!   row, or by several blocks per group.
//!
//! This module holds what they share: [`Kind`], the row view, and the
//! pieces of CUDA source for accumulating, combining across a warp or a
//! block, and combining the partials of several blocks.
use std::fmt::Write as _;

use mtmc_actions::op::{Op, Reduce, ReduceOp};

use super::{Refusal, WAVES};

mod cluster;
mod norm;
mod reduce;
mod register_norm;
mod split_norm;
mod stat;

pub use norm::norm;
pub use reduce::generate;

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

/// Loads each thread of an accumulation loop ([`accumulate`]) issues
/// before it combines their values: one load at a time leaves too few
/// bytes in flight for the memory system (an H200 holds about 25 KB in
/// flight an SM at its bandwidth; 2048 threads of one load each are 8 KB).
const UNROLL: usize = 4;

/// The lines (each starting with `indent`) of an accumulation into `acc`
/// (and `c`, its compensation, for sums), declared by the caller, of
/// `map` (an expression of `v`) with `op` (of `a` and `b`, as in
/// [`step`]) over the elements `LOAD_X(at(k))` for `k` from `start` below
/// `end` by `stride`. [`UNROLL`] elements at a time, their loads issued
/// together and their mapped values combined with `op` before the one
/// step into `acc`, then one at a time for the rest: the order of the
/// combination is fixed by the sizes, as in the loop it replaces.
pub(super) fn accumulate(
    src: &mut String,
    indent: &str,
    (start, end, stride): (&str, &str, &str),
    at: &dyn Fn(&str) -> String,
    map: &str,
    op: &str,
) {
    let _ = writeln!(src, "{indent}{{ long long k = {start};");
    let _ = writeln!(
        src,
        "{indent}for (; k + {} * ({stride}) < {end}; k += {UNROLL} * ({stride})) {{",
        UNROLL - 1
    );
    let index = |j: usize| {
        if j == 0 {
            at("k")
        } else {
            at(&format!("(k + {j} * ({stride}))"))
        }
    };
    let loads: Vec<String> = (0..UNROLL)
        .map(|j| format!("u{j}_ = LOAD_X({})", index(j)))
        .collect();
    let _ = writeln!(src, "{indent}    float {};", loads.join(", "));
    for j in 0..UNROLL {
        let _ = writeln!(src, "{indent}    {{ float v = u{j}_; u{j}_ = {map}; }}");
    }
    for j in 1..UNROLL {
        let _ = writeln!(
            src,
            "{indent}    {{ float a = u0_, b = u{j}_; u0_ = {op}; }}"
        );
    }
    let _ = writeln!(src, "{indent}    {{ {} }}", step("u0_", op));
    let _ = writeln!(src, "{indent}}}");
    let _ = writeln!(
        src,
        "{indent}for (; k < {end}; k += {stride}) {{ float v = LOAD_X({}); {} }} }}",
        at("k"),
        step(map, op)
    );
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

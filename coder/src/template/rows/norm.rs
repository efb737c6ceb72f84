//! Layer, RMS, group, instance and batch norms and L2 normalization:
//! which kernel a norm takes, and what each row is divided by.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{Norm, NormKind, Op};

use crate::action::Action;
use crate::program::{Fragment, Launch};
use crate::template::{Refusal, WAVES, lit, one_node, one_per_thread};

use super::register_norm::{RegisterNorm, register_row};
use super::split_norm::{SplitNorm, norm_splits, team_splits};
use super::stat::Stat;
use super::{block_reduce, compensated_sum};

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
        NormKind::RmsAt { dim } if dim + 1 == shape.len() => {
            (shape[..*dim].iter().product(), shape[*dim], "k".into())
        }
        NormKind::RmsAt { dim } => {
            return Err(Refusal::new(format!(
                "an RMS norm along dim {dim} of {} takes a thread per line",
                shape.len()
            )));
        }
        NormKind::Lp { p, dim } => {
            return Err(Refusal::new(format!(
                "no row kernel yet for F.normalize with p = {p} over dim {dim} of {} (only p = 2)",
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
    // Along a dim with others after it: a thread per line.
    if let NormKind::RmsAt { dim } | NormKind::Lp { p: 2.0, dim } = *kind
        && dim + 1 < shape.len()
        && !affine
        && !bias
    {
        return per_line_norm(g, action, name, (&shape, dim), Stat::of(kind), *eps);
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

/// Elements of a line a [`per_line_norm`] thread holds in registers: at
/// most this many, each read from memory once.
const LINE_IN_REGISTERS: u64 = 64;

/// An RMS norm or an L2 normalization along `dim` of `shape`, a dim with
/// others after it (`[outer, K, inner]`, `inner > 1`): a thread per line,
/// neighbouring threads on neighbouring addresses (every step of a warp
/// reads 128 contiguous bytes). A line of at most [`LINE_IN_REGISTERS`]
/// is read once into registers, then written from them; a longer one is
/// read again to be written. Writes through `STORE_YX`, where a chain
/// after the norm is fused.
fn per_line_norm(
    g: &OpGraph,
    action: &Action,
    name: &str,
    (shape, dim): (&[u64], usize),
    stat: Stat,
    eps: f64,
) -> Result<Fragment, Refusal> {
    let node = action.nodes()[0];
    let x = g.inputs(node)[0];
    let block = one_per_thread(action, "norm")?;
    let outer: u64 = shape[..dim].iter().product();
    let k = shape[dim];
    let inner: u64 = shape[dim + 1..].iter().product();
    let rstd = stat.rstd("acc", &format!("{k}"), &lit(eps)?);
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {stat:?} norm along [{outer}, {k}, {inner}] (outer, normalized, inner), a thread per line"
    );
    super::per_line(&mut src, name, "float");
    src.push_str("        float acc = 0.0f, c = 0.0f;\n");
    if k <= LINE_IN_REGISTERS {
        let _ = writeln!(src, "        float v_[{k}];");
        let _ = writeln!(
            src,
            "        #pragma unroll\n        for (int k = 0; k < {k}; ++k) v_[k] = LOAD_X(base + k * inner);"
        );
        let _ = writeln!(
            src,
            "        #pragma unroll\n        for (int k = 0; k < {k}; ++k) {{ {} }}",
            super::step("v_[k] * v_[k]", "a + b")
        );
        let _ = writeln!(src, "        const float s = {rstd};");
        let _ = writeln!(
            src,
            "        #pragma unroll\n        for (int k = 0; k < {k}; ++k) STORE_YX(base + k * inner, v_[k] * s, v_[k]);"
        );
    } else {
        super::accumulate(
            &mut src,
            "        ",
            ("0", "K", "1"),
            &|k| format!("base + {k} * inner"),
            "v * v",
            "a + b",
        );
        let _ = writeln!(src, "        const float s = {rstd};");
        src.push_str("        #pragma unroll 4\n        for (long long k = 0; k < K; ++k) { const float v = LOAD_X(base + k * inner); STORE_YX(base + k * inner, v * s, v); }\n");
    }
    src.push_str("    }\n}\n");
    let (grid, sizes) = super::per_line_launch(outer, k, inner, block);
    let launch = Launch {
        shared: 0,
        grid: grid as u32,
        block,
        sizes,
    };
    Ok(one_node(name, action, src, vec![x], node, launch))
}

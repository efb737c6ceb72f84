//! Layer, RMS, group, instance and batch norms, and L1 / L2
//! normalization.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{Norm, NormKind, Op};

use crate::program::Fragment;
use crate::template::Refusal;

use super::expr::lit;
use super::rows::SPLIT_BELOW;
use super::{Loader, TILE, WHOLE_ROW, grid, node_fragment, pow2, program_id};

/// Layer, RMS, group and instance norm (batch statistics), and L1 / L2
/// normalization over any dim: a program per normalized group (a
/// contiguous row; for L1 / L2 over an inner dim, a line whose elements
/// lie the inner extent apart), the mean (not for RMS and Lp), then the
/// sum of the squared deviations (of the absolute values for L1), then the
/// scaled and shifted output.
pub(super) fn norm(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    loader: Loader,
    wide: bool,
) -> Result<Fragment, Refusal> {
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
    if ins.iter().any(|&t| g.tensor(t).dtype != DType::F32) || n.outputs[0].dtype != DType::F32 {
        return Err(Refusal::new(format!("`{}` is not float32", n.name)));
    }
    let shape = g.tensor(ins[0]).shape.clone();
    if matches!(kind, NormKind::Batch) && *batch_stats && shape.len() >= 2 {
        return batch_norm(g, node, name, loader, wide, (*eps, *affine, *bias));
    }
    // (rows, K, the affine index from r and kk); a row's elements lie
    // `inner` apart.
    let mut inner = 1;
    let (rows, k, channel) = match kind {
        NormKind::Layer { dims } | NormKind::Rms { dims } => {
            let split = shape.len() - dims;
            (
                shape[..split].iter().product::<u64>(),
                shape[split..].iter().product::<u64>(),
                "kk".to_string(),
            )
        }
        NormKind::Group { groups } if *batch_stats => {
            if shape.len() < 2 || !shape[1].is_multiple_of(*groups) {
                return Err(Refusal::new(
                    "group norm needs [N, C, ...] with C divisible by the groups",
                ));
            }
            let spatial: u64 = shape[2..].iter().product();
            let per_group = shape[1] / groups;
            (
                shape[0] * groups,
                per_group * spatial,
                format!("(r % {groups}) * {per_group} + kk // {spatial}"),
            )
        }
        NormKind::Instance if *batch_stats && shape.len() >= 3 => (
            shape[0] * shape[1],
            shape[2..].iter().product(),
            format!("r % {} + kk * 0", shape[1]),
        ),
        NormKind::Lp { dim, .. } | NormKind::RmsAt { dim }
            if !matches!(kind, NormKind::Lp { p, .. } if *p != 1.0 && *p != 2.0)
                && *dim < shape.len() =>
        {
            inner = shape[dim + 1..].iter().product::<u64>();
            (
                shape[..*dim].iter().product::<u64>() * inner,
                shape[*dim],
                "kk".to_string(),
            )
        }
        other => {
            return Err(Refusal::new(format!(
                "no Triton norm kernel yet for {other:?}{}",
                if *batch_stats {
                    ""
                } else {
                    " with running statistics"
                }
            )));
        }
    };
    // Uncentred (RMS, Lp) or not; each element's term of the sum; the
    // factor `rstd` from the sum.
    let eps = lit(*eps)?;
    let (rms, term, rstd) = match kind {
        NormKind::Lp { p, .. } => (
            true,
            if *p == 1.0 { "tl.abs(d)" } else { "d * d" },
            if *p == 1.0 {
                format!("1.0 / tl.maximum(SUM, {eps})")
            } else {
                format!("1.0 / tl.maximum(tl.sqrt_rn(SUM), {eps})")
            },
        ),
        _ => (
            matches!(kind, NormKind::Rms { .. } | NormKind::RmsAt { .. }),
            "d * d",
            format!("1.0 / tl.sqrt_rn(SUM / K + {eps})"),
        ),
    };
    let whole = k <= WHOLE_ROW;
    let bk = if whole { pow2(k) } else { TILE };
    let (mut src, inputs) = norm_head(
        name,
        &format!("{kind:?} over {rows} rows of {k} (eps {eps}), tiles of {bk}"),
        &loader,
        &ins,
        (*affine, *bias),
    );
    let _ = writeln!(src, "    r = {}", program_id(wide));
    // The row's first element, and element kk's offset from it.
    let at = if inner == 1 {
        src.push_str("    base = r * K\n");
        "base + kk".to_string()
    } else {
        let _ = writeln!(
            src,
            "    base = (r // {inner}) * {} + r % {inner}",
            k * inner
        );
        format!("base + kk * {inner}")
    };
    let _ = writeln!(src, "    k = tl.arange(0, {bk})");
    let mut out = "d * rstd".to_string();
    if *affine {
        out += &format!(" * tl.load(w + {channel}, mask=m, other=0.0)");
    }
    if *bias {
        out += &format!(" + tl.load(b + {channel}, mask=m, other=0.0)");
    }
    let load = loader.load(&at, "m");
    if whole {
        src.push_str("    kk = k\n    m = kk < K\n");
        let _ = writeln!(src, "    v = tl.where(m, {load}, 0.0)");
        if rms {
            src.push_str("    mean = 0.0\n");
        } else {
            src.push_str("    mean = tl.sum(v, axis=0) / K\n");
        }
        src.push_str("    d = tl.where(m, v - mean, 0.0)\n");
        let _ = writeln!(src, "    ss = tl.sum({term}, axis=0)");
        let _ = writeln!(src, "    rstd = {}", rstd.replace("SUM", "ss"));
        let _ = writeln!(src, "    tl.store(y + {at}, {out}, mask=m)");
    } else {
        let pass = |src: &mut String| {
            let _ = writeln!(src, "    for k0 in range(0, {k}, {bk}):");
            src.push_str("        kk = k0 + k\n        m = kk < K\n");
            let _ = writeln!(src, "        v = tl.where(m, {load}, 0.0)");
        };
        if rms {
            src.push_str("    mean = 0.0\n");
        } else {
            let _ = writeln!(src, "    sv = tl.zeros([{bk}], tl.float32)");
            pass(&mut src);
            src.push_str("        sv += v\n");
            src.push_str("    mean = tl.sum(sv, axis=0) / K\n");
        }
        let _ = writeln!(src, "    qv = tl.zeros([{bk}], tl.float32)");
        pass(&mut src);
        let _ = writeln!(
            src,
            "        d = tl.where(m, v - mean, 0.0)\n        qv += {term}"
        );
        let _ = writeln!(
            src,
            "    rstd = {}",
            rstd.replace("SUM", "tl.sum(qv, axis=0)")
        );
        pass(&mut src);
        src.push_str("        d = v - mean\n");
        let _ = writeln!(src, "        tl.store(y + {at}, {out}, mask=m)");
    }
    node_fragment(
        name,
        node,
        src,
        inputs,
        grid(rows)?,
        vec![rows as i64, k as i64],
    )
}

/// A norm kernel's comment, its loader and its `def` line (the loader's
/// pointers, the scale `w` and shift `b` where the norm has them, `y`, `R`,
/// `K`), and the tensors its pointers point to.
fn norm_head(
    name: &str,
    what: &str,
    loader: &Loader,
    ins: &[TensorRef],
    (affine, bias): (bool, bool),
) -> (String, Vec<TensorRef>) {
    let mut params = loader.params.clone();
    let mut inputs = loader.inputs.clone();
    if affine {
        params.push("w".into());
        inputs.push(ins[1]);
    }
    if bias {
        params.push("b".into());
        inputs.push(ins[2]);
    }
    params.extend(["y".to_string(), "R".into(), "K".into()]);
    let mut src = format!("# {name}: {what}\n");
    src.push_str(&loader.source);
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    (src, inputs)
}

/// Batch norm with batch statistics over `[N, C, spatial…]`: a program per
/// channel, its `N × S` elements (`S` the spatial size) taken as one run
/// `j` at `(j / S) · C · S + c · S + j % S`, in tiles: the mean, then the
/// variance of the deviations, then the scaled and shifted output.
fn batch_norm(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    loader: Loader,
    wide: bool,
    (eps, affine, bias): (f64, bool, bool),
) -> Result<Fragment, Refusal> {
    let ins = g.inputs(node);
    let shape = g.tensor(ins[0]).shape.clone();
    let (n, c) = (shape[0], shape[1]);
    let spatial: u64 = shape[2..].iter().product();
    if spatial == 1 {
        return batch_norm_columns(
            node,
            name,
            (loader, &ins),
            wide,
            (n, c),
            (eps, affine, bias),
        );
    }
    let count = n * spatial;
    let bj = pow2(count).min(TILE);
    let (mut src, inputs) = norm_head(
        name,
        &format!("batch norm over {c} channels of {n} x {spatial} (eps {eps}), tiles of {bj}"),
        &loader,
        &ins,
        (affine, bias),
    );
    let _ = writeln!(
        src,
        "    c = {}\n    j = tl.arange(0, {bj})",
        program_id(wide)
    );
    let tile = format!(
        "    for j0 in range(0, {count}, {bj}):\n        jj = j0 + j\n        m = jj < {count}\n        at = (jj // {spatial}) * {} + c * {spatial} + jj % {spatial}\n        v = tl.where(m, {}, 0.0)\n",
        c * spatial,
        loader.load("at", "m")
    );
    batch_norm_passes(
        &mut src,
        &tile,
        (&format!("[{bj}]"), ""),
        count,
        eps,
        (
            affine.then_some("tl.load(w + c)"),
            bias.then_some("tl.load(b + c)"),
        ),
    )?;
    node_fragment(
        name,
        node,
        src,
        inputs,
        grid(c)?,
        vec![c as i64, count as i64],
    )
}

/// Batch norm with batch statistics over `[N, C]`: a program per `BC`
/// neighbouring channels, stepping down the rows in `[BJ, BC]` tiles (a
/// channel's elements lie `C` apart, so a program per channel would read a
/// float per line): the means, the variances of the deviations, then the
/// output. `BC` is the widest of 64, 32, 16, 8 that leaves 264 programs.
fn batch_norm_columns(
    node: NodeId,
    name: &str,
    (loader, ins): (Loader, &[TensorRef]),
    wide: bool,
    (n, c): (u64, u64),
    (eps, affine, bias): (f64, bool, bool),
) -> Result<Fragment, Refusal> {
    let mut bc = 64.min(pow2(c));
    while bc > 8 && c.div_ceil(bc) < SPLIT_BELOW {
        bc /= 2;
    }
    let bj = pow2(n).min(TILE / bc);
    let (mut src, inputs) = norm_head(
        name,
        &format!(
            "batch norm over {c} channels of {n} rows (eps {eps}), {bc} channels a program, tiles of [{bj}, {bc}]"
        ),
        &loader,
        ins,
        (affine, bias),
    );
    let _ = writeln!(
        src,
        "    c = {} * {bc} + tl.arange(0, {bc})\n    cm = c < {c}\n    j = tl.arange(0, {bj})",
        program_id(wide)
    );
    let tile = format!(
        "    for j0 in range(0, {n}, {bj}):\n        jj = j0 + j\n        m = (jj < {n})[:, None] & cm[None, :]\n        at = jj[:, None] * {c} + c[None, :]\n        v = tl.where(m, {}, 0.0)\n",
        loader.load("at", "m")
    );
    batch_norm_passes(
        &mut src,
        &tile,
        (&format!("[{bj}, {bc}]"), "[None, :]"),
        n,
        eps,
        (
            affine.then_some("tl.load(w + c, mask=cm, other=0.0)"),
            bias.then_some("tl.load(b + c, mask=cm, other=0.0)"),
        ),
    )?;
    node_fragment(
        name,
        node,
        src,
        inputs,
        grid(c.div_ceil(bc))?,
        vec![c as i64, n as i64],
    )
}

/// The three passes of a batch norm over `count` elements a channel, each
/// looping over `tile` (lines ending with the masked tile `v`, its mask
/// `m` and offsets `at`): the sum into a `shape` accumulator for the mean,
/// the squared deviations for the variance, then the output, scaled by
/// `w` and shifted by `b` where given. `per` broadcasts a program's
/// per-channel values over its tile.
fn batch_norm_passes(
    src: &mut String,
    tile: &str,
    (shape, per): (&str, &str),
    count: u64,
    eps: f64,
    (w, b): (Option<&str>, Option<&str>),
) -> Result<(), Refusal> {
    let _ = writeln!(src, "    sv = tl.zeros({shape}, tl.float32)");
    src.push_str(tile);
    src.push_str("        sv += v\n");
    let _ = writeln!(src, "    mean = tl.sum(sv, axis=0) / {count}.0");
    let _ = writeln!(src, "    qv = tl.zeros({shape}, tl.float32)");
    src.push_str(tile);
    let _ = writeln!(
        src,
        "        d = tl.where(m, v - mean{per}, 0.0)\n        qv += d * d"
    );
    let _ = writeln!(
        src,
        "    rstd = 1.0 / tl.sqrt_rn(tl.sum(qv, axis=0) / {count}.0 + {})",
        lit(eps)?
    );
    let _ = writeln!(
        src,
        "    sc = rstd{}",
        w.map_or(String::new(), |w| format!(" * {w}"))
    );
    src.push_str(tile);
    let _ = writeln!(
        src,
        "        tl.store(y + at, (v - mean{per}) * sc{per}{}, mask=m)",
        b.map_or(String::new(), |b| format!(" + {b}{per}"))
    );
    Ok(())
}

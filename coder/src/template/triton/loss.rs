//! Losses reduced to their mean or sum: a pass zeroing the result, then
//! programs adding their partials atomically.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph};
use mtmc_actions::op::{LossKind, Reduction};

use crate::program::{Fragment, Launch, Pass};
use crate::template::Refusal;
use crate::template::loss::LossView;

use super::expr::lit;
use super::{WHOLE_ROW, grid, node_fragment, pow2, program_id, vector_width};

/// Programs a loss kernel spreads its items over (each adds its partial
/// to the result once, atomically).
const LOSS_PROGRAMS: u64 = 132 * 4;

/// Losses reduced to their mean or sum: a pass that zeroes the result,
/// then `G` programs, each taking every `G`-th block of elements
/// (elementwise losses: mse, huber, smooth L1) or row (cross-entropy over
/// class logits with int64 targets, triplet margin with p = 2) and adding
/// its partial to the result with one atomic add.
pub(super) fn loss(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    warps: u32,
    vector: u32,
) -> Result<Fragment, Refusal> {
    vector_width(vector)?;
    let LossView {
        kind,
        reduction,
        ins,
        shape,
        numel,
        same,
    } = LossView::of(g, node, "the Triton loss kernels")?;
    let batch = shape.first().copied().unwrap_or(1);
    let wide = numel >= 1 << 31;
    let rows = |what: &str| -> Result<(u64, u64), Refusal> {
        if shape.len() != 2 || shape[1] > WHOLE_ROW {
            return Err(Refusal::new(format!(
                "the Triton {what} kernel takes [N, D] rows of at most {WHOLE_ROW}"
            )));
        }
        Ok((shape[0], shape[1]))
    };
    // (parameters, items, what the sum is divided by, per-item lines
    // leaving the masked term in `term`, lanes of a block)
    let elementwise = |term: String| -> Result<_, Refusal> {
        if !same {
            return Err(Refusal::new(
                "elementwise losses need their inputs float32 at one shape",
            ));
        }
        let block = u64::from(warps * 32 * vector);
        Ok((
            "a, b",
            numel,
            numel,
            format!(
                "        i = (it * G + pid) * {block} + tl.arange(0, {block})\n        m = i < {numel}\n        av = tl.load(a + i, mask=m, other=0.0)\n        bv = tl.load(b + i, mask=m, other=0.0)\n        d = av - bv\n        term = tl.sum(tl.where(m, {term}, 0.0), axis=0)\n"
            ),
            block,
        ))
    };
    let (params, items, count, body, per) = match kind {
        LossKind::Mse => elementwise("d * d".into())?,
        LossKind::Huber { delta } => {
            let delta = lit(*delta)?;
            elementwise(format!(
                "tl.where(tl.abs(d) < {delta}, 0.5 * d * d, {delta} * (tl.abs(d) - 0.5 * {delta}))"
            ))?
        }
        LossKind::SmoothL1 { beta } if *beta <= 0.0 => elementwise("tl.abs(d)".into())?,
        LossKind::SmoothL1 { beta } => {
            let beta = lit(*beta)?;
            elementwise(format!(
                "tl.where(tl.abs(d) < {beta}, 0.5 * d * d / {beta}, tl.abs(d) - 0.5 * {beta})"
            ))?
        }
        // torch's xlogy(b, b) - b·a: 0 where b is 0.
        LossKind::KlDiv { log_target: false } => {
            elementwise("tl.where(bv == 0.0, 0.0, bv * tl.log(bv)) - bv * av".into())?
        }
        LossKind::KlDiv { log_target: true } => elementwise("tl.exp(bv) * (bv - av)".into())?,
        LossKind::CrossEntropy => {
            let (n_rows, d) = rows("cross-entropy")?;
            let t = g.tensor(ins[1]);
            if t.dtype != DType::I64 || t.shape != [n_rows] {
                return Err(Refusal::new(
                    "cross-entropy needs [N, C] float32 logits and [N] int64 class targets",
                ));
            }
            let bd = pow2(d);
            (
                "x, t",
                n_rows,
                n_rows,
                format!(
                    "        r = it * G + pid\n        live = r < {n_rows}\n        k = tl.arange(0, {bd})\n        mk = (k < {d}) & live\n        v = tl.load(x + r * {d} + k, mask=mk, other=float(\"-inf\"))\n        mx = tl.max(v, axis=0)\n        s = tl.sum(tl.where(mk, tl.exp(v - mx), 0.0), axis=0)\n        xt = tl.load(x + r * {d} + tl.load(t + r, mask=live, other=0), mask=live, other=0.0)\n        term = tl.where(live, mx + tl.log(s) - xt, 0.0)\n"
                ),
                1,
            )
        }
        LossKind::TripletMargin { margin, p } => {
            let (n_rows, d) = rows("triplet")?;
            if *p != 2.0 || !same {
                return Err(Refusal::new(
                    "the Triton triplet kernel takes p = 2 and three float32 [N, D] inputs",
                ));
            }
            let bd = pow2(d);
            // torch's pairwise distance adds eps = 1e-6 to the difference.
            (
                "a, p, q",
                n_rows,
                n_rows,
                format!(
                    "        r = it * G + pid\n        live = r < {n_rows}\n        k = tl.arange(0, {bd})\n        mk = (k < {d}) & live\n        va = tl.load(a + r * {d} + k, mask=mk, other=0.0)\n        u = va - tl.load(p + r * {d} + k, mask=mk, other=0.0) + 1e-6\n        w = va - tl.load(q + r * {d} + k, mask=mk, other=0.0) + 1e-6\n        dp = tl.sum(tl.where(mk, u * u, 0.0), axis=0)\n        dn = tl.sum(tl.where(mk, w * w, 0.0), axis=0)\n        term = tl.where(live, tl.maximum(tl.sqrt(dp) - tl.sqrt(dn) + {}, 0.0), 0.0)\n",
                    lit(*margin)?
                ),
                1,
            )
        }
        other => {
            return Err(Refusal::new(format!(
                "no Triton loss kernel yet for {other:?}"
            )));
        }
    };
    let blocks = items.div_ceil(per);
    let programs = blocks.clamp(1, LOSS_PROGRAMS);
    let iters = blocks.div_ceil(programs);
    let scale = match reduction {
        Reduction::Mean => format!(" / {count}.0"),
        Reduction::BatchMean => format!(" / {batch}.0"),
        Reduction::Sum | Reduction::None => String::new(),
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {kind:?} loss ({reduction:?}) over {items} item(s), {programs} programs of {iters} step(s)"
    );
    let _ = writeln!(
        src,
        "@triton.jit\ndef {name}_zero({params}, y, n):\n    tl.store(y, 0.0)"
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}({params}, y, n):");
    let _ = writeln!(
        src,
        "    G = {programs}\n    pid = {}\n    acc = tl.zeros([1], tl.float32)\n    for it in range({iters}):",
        program_id(wide)
    );
    src.push_str(&body);
    src.push_str("        acc += term\n");
    let _ = writeln!(src, "    tl.atomic_add(y, tl.sum(acc, axis=0){scale})");
    let mut f = node_fragment(name, node, src, ins, grid(programs)?, vec![items as i64])?;
    f.before = vec![Pass {
        kernel: format!("{name}_zero"),
        launch: Launch {
            shared: 0,
            grid: 1,
            block: 32,
            sizes: vec![items as i64],
        },
    }];
    Ok(f)
}

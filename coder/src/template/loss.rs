//! Losses reduced to one number (mean or sum), in one launch: every block
//! accumulates the terms of its share (compensated sums), and the last
//! block to finish combines the blocks' partials.
//!
//! - Elementwise losses (mse, huber, smooth L1): a thread per element.
//! - Row losses (cross-entropy over class logits with int64 targets,
//!   triplet margin with p = 2): a warp per row, its lanes striding over
//!   the row and combining by shuffles.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{Loss, LossKind, Op, Reduction};

use super::rows::{block_reduce, combine_partials, declare_partials, step};
use super::{Refusal, WAVES, f32_input, lit, one_node, one_per_thread};
use crate::action::Action;
use crate::program::{Fragment, Launch};

/// A loss node as its kernels see it.
pub(super) struct LossView<'a> {
    pub kind: &'a LossKind,
    pub reduction: Reduction,
    pub ins: Vec<TensorRef>,
    /// The first input's shape and elements.
    pub shape: Vec<u64>,
    pub numel: u64,
    /// Whether every input is float32 at the first one's shape.
    pub same: bool,
}

impl<'a> LossView<'a> {
    /// Loss `node`, when it reduces to a mean, a sum or a batch mean (the
    /// sum over the first dim's extent) over a float32 first input into a
    /// float32 result (`who` names the kernels in the refusal).
    pub(super) fn of(g: &'a OpGraph, node: NodeId, who: &str) -> Result<LossView<'a>, Refusal> {
        let n = g.node(node);
        let Op::Loss(Loss { kind, reduction }) = &n.op else {
            return Err(Refusal::new(format!("`{}` is not a loss", n.name)));
        };
        if *reduction == Reduction::None {
            return Err(Refusal::new(format!(
                "`{}` reduces by {reduction:?}; {who} write a mean, a sum or a batch mean",
                n.name
            )));
        }
        let shape = g.tensor(f32_input(g, node)?).shape.clone();
        let ins = g.inputs(node).to_vec();
        let same = ins
            .iter()
            .all(|&t| g.tensor(t).shape == shape && g.tensor(t).dtype == DType::F32);
        Ok(LossView {
            kind,
            reduction: *reduction,
            ins,
            numel: shape.iter().product(),
            shape,
            same,
        })
    }
}

/// Generates the kernel for a single loss node.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a loss kernel covers one op"));
    };
    let block = one_per_thread(action, "loss")?;
    let LossView {
        kind,
        reduction,
        ins,
        shape,
        numel,
        same: same_shapes,
    } = LossView::of(g, node, "the loss kernels")?;
    let batch = shape.first().copied().unwrap_or(1);
    // (kernel parameters, per-item code leaving the term in `term`, items,
    // whether an item is a row taken by a warp, what the sum is divided by)
    let elementwise = |term: String| -> Result<_, Refusal> {
        if !same_shapes {
            return Err(Refusal::new(
                "elementwise losses need both inputs float32 at one shape",
            ));
        }
        Ok((
            "const float* __restrict__ a, const float* __restrict__ b",
            format!(
                "const float av = a[i], bv = b[i]; const float d = av - bv; float term = {term};"
            ),
            numel,
            false,
            numel,
        ))
    };
    let (params, body, items, rows, count) = match kind {
        LossKind::Mse => elementwise("d * d".into())?,
        // torch's xlogy(b, b) - b·a: 0 where b is 0.
        LossKind::KlDiv { log_target: false } => {
            elementwise("(bv == 0.0f ? 0.0f : bv * logf(bv)) - bv * av".into())?
        }
        LossKind::KlDiv { log_target: true } => elementwise("expf(bv) * (bv - av)".into())?,
        LossKind::Huber { delta } => {
            let delta = lit(*delta)?;
            elementwise(format!(
                "fabsf(d) < {delta} ? 0.5f * d * d : {delta} * (fabsf(d) - 0.5f * {delta})"
            ))?
        }
        LossKind::SmoothL1 { beta } => {
            if *beta <= 0.0 {
                elementwise("fabsf(d)".into())?
            } else {
                let beta = lit(*beta)?;
                elementwise(format!(
                    "fabsf(d) < {beta} ? 0.5f * d * d / {beta} : fabsf(d) - 0.5f * {beta}"
                ))?
            }
        }
        LossKind::CrossEntropy => {
            let t = g.tensor(ins[1]);
            if shape.len() != 2 || t.dtype != DType::I64 || t.shape != [shape[0]] {
                return Err(Refusal::new(
                    "cross-entropy needs [N, C] float32 logits and [N] int64 class targets",
                ));
            }
            let mut body = String::from("const float* xr = x + i * D;\n");
            body.push_str("            float m = __int_as_float(0xff800000);\n");
            body.push_str(
                "            for (long long k = lane; k < D; k += 32) m = fmaxf(m, xr[k]);\n",
            );
            body.push_str("            for (int off = 16; off > 0; off >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, off));\n");
            body.push_str("            float s = 0.0f;\n");
            body.push_str(
                "            for (long long k = lane; k < D; k += 32) s += expf(xr[k] - m);\n",
            );
            body.push_str("            for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);\n");
            body.push_str("            float term = m + logf(s) - xr[target[i]];");
            (
                "const float* __restrict__ x, const long long* __restrict__ target",
                body,
                shape[0],
                true,
                shape[0],
            )
        }
        LossKind::TripletMargin { margin, p } => {
            if *p != 2.0 || !same_shapes || shape.len() != 2 {
                return Err(Refusal::new(
                    "the triplet kernel takes p = 2 and three float32 [N, D] inputs",
                ));
            }
            // torch's pairwise distance adds eps = 1e-6 to the difference.
            let mut body = String::from(
                "const float* ar = a + i * D; const float* pr = p + i * D; const float* nr = q + i * D;\n",
            );
            body.push_str("            float dp = 0.0f, dn = 0.0f;\n");
            body.push_str("            for (long long k = lane; k < D; k += 32) { float u = ar[k] - pr[k] + 1e-6f; float w = ar[k] - nr[k] + 1e-6f; dp += u * u; dn += w * w; }\n");
            body.push_str("            for (int off = 16; off > 0; off >>= 1) { dp += __shfl_xor_sync(0xffffffffu, dp, off); dn += __shfl_xor_sync(0xffffffffu, dn, off); }\n");
            let _ = write!(
                body,
                "            float term = fmaxf(sqrtf(dp) - sqrtf(dn) + {}, 0.0f);",
                lit(*margin)?
            );
            (
                "const float* __restrict__ a, const float* __restrict__ p, const float* __restrict__ q",
                body,
                shape[0],
                true,
                shape[0],
            )
        }
        other => {
            return Err(Refusal::new(format!("no loss kernel yet for {other:?}")));
        }
    };
    let per_block = if rows {
        u64::from(block / 32)
    } else {
        u64::from(block)
    };
    let splits = items.div_ceil(per_block).clamp(1, WAVES);
    let finish = match reduction {
        Reduction::Mean => format!("acc / {}", lit(count as f64)?),
        Reduction::BatchMean => format!("acc / {}", lit(batch as f64)?),
        Reduction::Sum | Reduction::None => "acc".into(),
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {kind:?} loss ({reduction:?}) over {items} {}, {splits} blocks",
        if rows { "rows" } else { "elements" }
    );
    declare_partials(&mut src, name, 1, splits);
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({params}, float* __restrict__ y, long long items, long long D, long long splits) {{"
    );
    src.push_str("    __shared__ float shared[32];\n    __shared__ bool last;\n    {\n");
    src.push_str("        float acc = 0.0f, c = 0.0f;\n");
    if rows {
        src.push_str("        const int lane = threadIdx.x & 31;\n");
        src.push_str("        const long long warps = (long long)gridDim.x * (blockDim.x >> 5);\n");
        src.push_str("        for (long long i = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); i < items; i += warps) {\n");
        let _ = writeln!(src, "            {body}");
        // Lane 0 holds the row's term (every lane does; one counts it).
        let _ = writeln!(
            src,
            "            if (lane == 0) {{ {} }}",
            step("term", "a + b")
        );
    } else {
        src.push_str("        for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < items; i += (long long)gridDim.x * blockDim.x) {\n");
        let _ = writeln!(src, "            {body}");
        let _ = writeln!(src, "            {{ {} }}", step("term", "a + b"));
    }
    src.push_str("        }\n");
    block_reduce(&mut src, "acc", "a + b", "0.0f");
    combine_partials(&mut src, name, "0", ("0.0f", "a + b"), &finish);
    src.push_str("}\n");
    let d = if shape.len() > 1 {
        shape[1..].iter().product::<u64>()
    } else {
        1
    };
    let launch = Launch {
        shared: 0,
        grid: splits as u32,
        block,
        sizes: vec![items as i64, d as i64, splits as i64],
    };
    Ok(one_node(name, action, src, ins, node, launch))
}

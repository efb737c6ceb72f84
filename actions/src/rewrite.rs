//! Graph rewrites: actions that change what is computed into something
//! cheaper with the same result. Unlike [`crate::normalize`], a rewrite
//! changes the values in floating point (a sum taken in another order),
//! so each rewritten program is judged numerically like any other step.
//!
//! - [`reduce_before_gemm`]: a sum or mean over a GEMM's output features,
//!   through per-feature affine steps, becomes a GEMV against the reduced
//!   weights (`Σ_j (x Wᵀ)_ij = x · Σ_j W_j`). The reduced weights are
//!   computed from the parameter in every forward, never assumed frozen.
//! - [`fold_into_weights`]: the per-channel scales (`* s`, `/ s`), shifts
//!   (`+ t`, `- t`) and eval-mode batch norms right after a linear layer
//!   (`x Wᵀ + b`) or a convolution, their operands parameters or
//!   constants, become part of its weights and bias: `W' = W · s` channel
//!   by channel, `b' = chain(b)` (from zeros where it had no bias). The
//!   folded weights are ops on the parameters, so the export keeps them
//!   until a parameter changes (its storage or version counter) and
//!   recomputes them then; they are never assumed frozen.
//! - [`drop_size_one_reductions`]: a reduction over dims that all have
//!   extent 1 leaves its input unchanged; it becomes a view.
//! - [`drop_nested_clamps`]: of two clamps in a row (clamp, hardtanh,
//!   relu, relu6), one whose interval holds the other's changes nothing:
//!   the inner one when it is the wider (and nothing else reads it), the
//!   outer one when it is; so does a clamp after an op whose values lie in
//!   its interval already (tanh in [-1, 1], sigmoid in [0, 1]). The op
//!   that changes nothing becomes a view.
//! - [`conv_bias_in_epilogue`]: a convolution's bias becomes an add after
//!   it, where the kernel that reads the convolution adds it for free
//!   (torch adds it in a pass of its own over the whole result).
//! - [`channels_last`]: a 2-d or 3-d convolution's result is read
//!   channels-last (`N, spatial…, C`), which cuDNN computes faster from
//!   channels-last operands, and the ops after it work in that layout
//!   (see [`sink_layout`]) until one cannot; the NCHW result is a
//!   permuted view again where it is needed.
//! - [`attention_in_one_call`]: attention written out op by op (scores
//!   `q @ kᵀ`, a constant scale on them or on `q`, a mask filled with
//!   `-inf`, softmax over the keys, inactive dropout, `@ v`) becomes one
//!   `scaled_dot_product_attention` call with that scale and the mask's
//!   complement as its boolean mask: torch's fused kernels never write the
//!   `L × S` scores to memory, which the ops one by one write and read
//!   four times.

use std::collections::HashMap;

use crate::dtype::TensorType;
use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{
    Attention, BinaryOp, Conv, Layout, MatMul, Norm, NormKind, Op, OpClass, Pool, Reduce, ReduceOp,
    UnaryOp,
};

/// A rewrite: its name, and the graph it makes (`None` where it finds
/// nothing to rewrite).
pub type Rewrite = (&'static str, fn(&OpGraph) -> Option<OpGraph>);

/// Every rewrite, in the order they are tried.
pub const REWRITES: [Rewrite; 7] = [
    ("reduce_before_gemm", reduce_before_gemm),
    ("fold_into_weights", fold_into_weights),
    ("drop_size_one_reductions", drop_size_one_reductions),
    ("drop_nested_clamps", drop_nested_clamps),
    ("conv_bias_in_epilogue", conv_bias_in_epilogue),
    ("channels_last", channels_last),
    ("attention_in_one_call", attention_in_one_call),
];

/// The graph with every rewrite that applies, and their names.
pub fn rewrite_all(g: &OpGraph) -> Option<(OpGraph, Vec<&'static str>)> {
    rewrite_all_but(g, &[])
}

/// The graph with every rewrite that applies except those named in
/// `skip`, and their names.
pub fn rewrite_all_but(g: &OpGraph, skip: &[&str]) -> Option<(OpGraph, Vec<&'static str>)> {
    let mut current = g.clone();
    let mut applied = Vec::new();
    for (name, rewrite) in REWRITES.into_iter().filter(|(n, _)| !skip.contains(n)) {
        if let Some(next) = rewrite(&current) {
            current = next;
            applied.push(name);
        }
    }
    (!applied.is_empty()).then_some((current, applied))
}

/// Makes every reader of `from` (and the graph's outputs) read `to`.
pub(crate) fn redirect(g: &mut OpGraph, from: NodeId, to: TensorRef) {
    for reader in g.consumers(from) {
        let slots: Vec<usize> = g
            .inputs(reader)
            .iter()
            .enumerate()
            .filter(|(_, t)| t.node == from)
            .map(|(k, _)| k)
            .collect();
        for k in slots {
            g.replace_input(reader, k, to);
        }
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|t| if t.node == from { to } else { *t })
        .collect();
    g.set_outputs(outputs);
}

/// Adds a node of the rewritten graph: name, op, inputs, output shape.
type AddNode<'a> = dyn FnMut(&mut OpGraph, String, Op, &[TensorRef], Vec<u64>) -> TensorRef + 'a;

/// Adds nodes of `dtype` one after another in the graph's order, the first
/// right after `anchor`; each returns its result.
fn adder(
    dtype: crate::DType,
    mut anchor: NodeId,
) -> impl FnMut(&mut OpGraph, String, Op, &[TensorRef], Vec<u64>) -> TensorRef {
    move |g, name, op, inputs, shape| {
        let id = g
            .add(name, op, inputs, vec![TensorType::new(shape, dtype)])
            .expect("inputs exist");
        g.place_after(id, anchor);
        anchor = id;
        TensorRef::first(id)
    }
}

/// One step between the GEMM and the reduction, affine per feature.
enum Step {
    /// `x op c` or `c op x` with a constant.
    Scalar(NodeId),
    /// `x ± v` with `v` a vector over the features.
    Vector(NodeId, TensorRef, BinaryOp),
}

/// See the module's documentation.
pub fn reduce_before_gemm(g: &OpGraph) -> Option<OpGraph> {
    for (id, node) in g.nodes() {
        let Op::MatMul(MatMul {
            trans_a: false,
            trans_b,
            bias,
        }) = node.op
        else {
            continue;
        };
        let ins = g.inputs(id);
        let (x, w) = (ins[0], ins[1]);
        let out = &node.outputs[0].shape;
        if g.tensor(x).shape.len() != 2 || g.tensor(w).shape.len() != 2 || out.len() != 2 {
            continue;
        }
        let features = out[1];
        // Walk the single-reader chain of affine steps to the reduction.
        let mut steps = Vec::new();
        let mut at = id;
        let reduce = loop {
            let readers = g.consumers(at);
            let [next] = readers[..] else { break None };
            if g.outputs().iter().any(|t| t.node == at) {
                break None;
            }
            let n = g.node(next);
            match &n.op {
                Op::Reduce(Reduce {
                    op: op @ (ReduceOp::Sum | ReduceOp::Mean),
                    dims,
                    keepdim,
                }) if dims[..] == [1] => break Some((next, op.clone(), *keepdim)),
                Op::Scalar {
                    op, scalar_first, ..
                } => {
                    let affine = match op {
                        BinaryOp::Mul | BinaryOp::Add | BinaryOp::Sub => true,
                        BinaryOp::Div => !scalar_first,
                        _ => false,
                    };
                    if !affine {
                        break None;
                    }
                    steps.push(Step::Scalar(next));
                }
                Op::Binary(op @ (BinaryOp::Add | BinaryOp::Sub)) => {
                    let operands = g.inputs(next);
                    if operands[0].node != at || operands[1].node == at {
                        break None;
                    }
                    let v = operands[1];
                    let shape = &g.tensor(v).shape;
                    let per_feature = shape.iter().product::<u64>() == features
                        && shape.last() == Some(&features);
                    if !per_feature || !g.node(v.node).op.is_source() {
                        break None;
                    }
                    steps.push(Step::Vector(next, v, *op));
                }
                _ => break None,
            }
            at = next;
        };
        let Some((reduce, op, keepdim)) = reduce else {
            continue;
        };
        return Some(build_gemv(
            g, id, x, w, trans_b, bias, &steps, reduce, op, keepdim,
        ));
    }
    None
}

/// One step after a linear layer or convolution that [`fold_into_weights`]
/// folds.
enum FoldStep {
    /// A constant step (`x * 2`, `x - 1`, `2 * x`), applied as it is.
    Constant(NodeId),
    /// `x op v`, `v` a parameter with one value per output channel (or one
    /// in all); `Mul` and `Add` with `v` on either side.
    Operand(NodeId, BinaryOp, TensorRef),
    /// A batch norm with running statistics (eval mode):
    /// `(x - mean) · w / sqrt(var + eps) + b`.
    EvalNorm(NodeId),
}

impl FoldStep {
    fn node(&self) -> NodeId {
        match *self {
            FoldStep::Constant(n) | FoldStep::Operand(n, ..) | FoldStep::EvalNorm(n) => n,
        }
    }
}

/// A primitive of a folded step: the op of a constant step, or `x op v`.
enum Primitive {
    Constant(Op),
    Operand(BinaryOp, TensorRef),
}

impl Primitive {
    fn scales(&self) -> bool {
        match self {
            Primitive::Constant(Op::Scalar { op, .. }) | Primitive::Operand(op, _) => {
                matches!(op, BinaryOp::Mul | BinaryOp::Div)
            }
            _ => false,
        }
    }
}

/// The producer a fold starts from: a linear layer (`x Wᵀ + b`, output
/// channels last) or a convolution (not transposed, channels at dim 1),
/// its weight (and bias) parameters.
fn foldable(g: &OpGraph, id: NodeId) -> Option<usize> {
    let node = g.node(id);
    let ins = g.inputs(id);
    let parameter = |t: TensorRef| matches!(g.node(t.node).op, Op::Param { .. });
    let (channel_dim, bias) = match &node.op {
        Op::MatMul(MatMul {
            trans_a: false,
            trans_b: true,
            bias,
        }) if g.tensor(ins[1]).shape.len() == 2 => (node.outputs[0].shape.len() - 1, *bias),
        Op::Conv(Conv {
            transposed: false,
            bias,
            ..
        }) => (1, *bias),
        _ => return None,
    };
    let out = &node.outputs[0].shape;
    (parameter(ins[1])
        && (!bias || parameter(ins[2]))
        && out.get(channel_dim) == g.tensor(ins[1]).shape.first())
    .then_some(channel_dim)
}

/// Whether `v` holds one value per channel of `out` (its dims aligned to
/// the right, the one at `channel_dim` the channels, the others 1) or one
/// value in all.
fn per_channel(v: &[u64], out: &[u64], channel_dim: usize) -> bool {
    let numel: u64 = v.iter().product();
    if numel == 1 {
        return true;
    }
    v.len() <= out.len()
        && v.iter().enumerate().all(|(i, &d)| {
            let at = out.len() - v.len() + i;
            d == if at == channel_dim { out[at] } else { 1 }
        })
}

/// See the module's documentation.
pub fn fold_into_weights(g: &OpGraph) -> Option<OpGraph> {
    let parameter = |t: TensorRef| matches!(g.node(t.node).op, Op::Param { .. });
    for (id, node) in g.nodes() {
        let Some(channel_dim) = foldable(g, id) else {
            continue;
        };
        let out = node.outputs[0].shape.clone();
        let mut steps = Vec::new();
        let mut at = id;
        loop {
            let readers = g.consumers(at);
            let [next] = readers[..] else { break };
            if g.outputs().iter().any(|t| t.node == at) || g.node(next).outputs[0].shape != out {
                break;
            }
            let step = match &g.node(next).op {
                Op::Scalar {
                    op: op @ (BinaryOp::Mul | BinaryOp::Add | BinaryOp::Sub | BinaryOp::Div),
                    scalar_first,
                    ..
                } if !*scalar_first || matches!(op, BinaryOp::Mul | BinaryOp::Add) => {
                    FoldStep::Constant(next)
                }
                Op::Binary(
                    op @ (BinaryOp::Mul | BinaryOp::Add | BinaryOp::Sub | BinaryOp::Div),
                ) => {
                    let operands = g.inputs(next);
                    let v = if operands[0].node == at && operands[1].node != at {
                        operands[1]
                    } else if operands[1].node == at
                        && operands[0].node != at
                        && matches!(op, BinaryOp::Mul | BinaryOp::Add)
                    {
                        operands[0]
                    } else {
                        break;
                    };
                    if !parameter(v) || !per_channel(&g.tensor(v).shape, &out, channel_dim) {
                        break;
                    }
                    FoldStep::Operand(next, *op, v)
                }
                Op::Norm(Norm {
                    kind: NormKind::Batch,
                    batch_stats: false,
                    ..
                }) if channel_dim == 1
                    && g.inputs(next)[0].node == at
                    && g.inputs(next)[1..].iter().all(|&t| parameter(t)) =>
                {
                    FoldStep::EvalNorm(next)
                }
                _ => break,
            };
            steps.push(step);
            at = next;
        }
        if steps.is_empty() {
            continue;
        }
        return Some(build_fold(g, id, &steps));
    }
    None
}

/// The rewritten graph for [`fold_into_weights`]: the weights scaled
/// channel by channel, the bias (zeros where the producer had none) taken
/// through every step, and the producer computed from them.
fn build_fold(g: &OpGraph, producer: NodeId, steps: &[FoldStep]) -> OpGraph {
    let mut g = g.clone();
    let ins = g.inputs(producer);
    let (w, dtype) = (ins[1], g.tensor(ins[1]).dtype);
    let w_shape = g.tensor(w).shape.clone();
    let channels = w_shape[0];
    let last = steps.last().expect("a step to fold").node();
    let out = g.node(last).outputs[0].shape.clone();
    let base = g.node(producer).name.clone();
    let mut add = adder(dtype, last);
    // Each step as primitives; a batch norm's scale `w / sqrt(var + eps)`
    // is computed from its parameters.
    let mut primitives = Vec::new();
    for step in steps {
        match *step {
            FoldStep::Constant(n) => primitives.push(Primitive::Constant(g.node(n).op.clone())),
            FoldStep::Operand(_, op, v) => primitives.push(Primitive::Operand(op, v)),
            FoldStep::EvalNorm(n) => {
                let Op::Norm(Norm {
                    eps, affine, bias, ..
                }) = g.node(n).op.clone()
                else {
                    unreachable!("a batch norm")
                };
                let ni = g.inputs(n);
                let (weight, shift) = (
                    affine.then(|| ni[1]),
                    bias.then(|| ni[1 + usize::from(affine)]),
                );
                let stats = 1 + usize::from(affine) + usize::from(bias);
                let (mean, var) = (ni[stats], ni[stats + 1]);
                let name = g.node(n).name.clone();
                let spread = add(
                    &mut g,
                    format!("{name}_var_eps"),
                    Op::Scalar {
                        op: BinaryOp::Add,
                        value: eps,
                        scalar_first: false,
                    },
                    &[var],
                    vec![channels],
                );
                let root = add(
                    &mut g,
                    format!("{name}_std"),
                    Op::Unary(UnaryOp::Sqrt),
                    &[spread],
                    vec![channels],
                );
                let scale = match weight {
                    Some(wt) => add(
                        &mut g,
                        format!("{name}_scale"),
                        Op::Binary(BinaryOp::Div),
                        &[wt, root],
                        vec![channels],
                    ),
                    None => add(
                        &mut g,
                        format!("{name}_scale"),
                        Op::Scalar {
                            op: BinaryOp::Div,
                            value: 1.0,
                            scalar_first: true,
                        },
                        &[root],
                        vec![channels],
                    ),
                };
                primitives.push(Primitive::Operand(BinaryOp::Sub, mean));
                primitives.push(Primitive::Operand(BinaryOp::Mul, scale));
                if let Some(b) = shift {
                    primitives.push(Primitive::Operand(BinaryOp::Add, b));
                }
            }
        }
    }
    // `value op step` over a tensor of `shape`, an operand viewed as `view`
    // (a column of the weights, or the bias's vector).
    let apply = |g: &mut OpGraph,
                 add: &mut AddNode<'_>,
                 value: TensorRef,
                 p: &Primitive,
                 (shape, view): (&[u64], &[u64]),
                 name: String| {
        match p {
            Primitive::Constant(op) => add(g, name, op.clone(), &[value], shape.to_vec()),
            Primitive::Operand(op, v) => {
                let one: u64 = g.tensor(*v).shape.iter().product();
                let view = if one == 1 {
                    vec![1; view.len()]
                } else {
                    view.to_vec()
                };
                let v = add(
                    g,
                    format!("{name}_operand"),
                    Op::Layout(Layout::Reshape),
                    &[*v],
                    view,
                );
                add(g, name, Op::Binary(*op), &[value, v], shape.to_vec())
            }
        }
    };
    let mut column = vec![1; w_shape.len()];
    column[0] = channels;
    let mut weights = w;
    for (k, p) in primitives.iter().enumerate().filter(|(_, p)| p.scales()) {
        weights = apply(
            &mut g,
            &mut add,
            weights,
            p,
            (&w_shape, &column),
            format!("{base}_weights_{k}"),
        );
    }
    let had_bias = ins.len() > 2;
    let mut b = if had_bias {
        ins[2]
    } else {
        add(
            &mut g,
            format!("{base}_zero_bias"),
            Op::Constant {
                fill: crate::op::Fill::Full(0.0),
            },
            &[],
            vec![channels],
        )
    };
    for (k, p) in primitives.iter().enumerate() {
        b = apply(
            &mut g,
            &mut add,
            b,
            p,
            (&[channels], &[channels]),
            format!("{base}_bias_{k}"),
        );
    }
    let op = match g.node(producer).op.clone() {
        Op::MatMul(m) => Op::MatMul(MatMul { bias: true, ..m }),
        Op::Conv(c) => Op::Conv(Conv { bias: true, ..c }),
        _ => unreachable!("a linear layer or a convolution"),
    };
    let folded = add(
        &mut g,
        format!("{base}_folded"),
        op,
        &[ins[0], weights, b],
        out,
    );
    redirect(&mut g, last, folded);
    for step in steps.iter().rev() {
        g.remove_unread(step.node());
    }
    g.remove_unread(producer);
    g
}

/// The rewritten graph for [`reduce_before_gemm`].
#[allow(clippy::too_many_arguments)]
fn build_gemv(
    g: &OpGraph,
    gemm: NodeId,
    x: TensorRef,
    w: TensorRef,
    trans_b: bool,
    bias: bool,
    steps: &[Step],
    reduce: NodeId,
    op: ReduceOp,
    keepdim: bool,
) -> OpGraph {
    let mut g = g.clone();
    let dtype = g.tensor(x).dtype;
    let rows = g.tensor(x).shape[0];
    let inner = g.tensor(x).shape[1];
    let features = g.node(gemm).outputs[0].shape[1];
    let base = g.node(reduce).name.clone();
    let mean = op == ReduceOp::Mean;
    // New nodes go right after the reduction; everything they read comes
    // before it.
    let mut add = adder(dtype, reduce);
    let reduce_all = |dims: Vec<usize>| {
        Op::Reduce(Reduce {
            op: op.clone(),
            dims,
            keepdim: false,
        })
    };
    let wred = add(
        &mut g,
        format!("{base}_weights"),
        reduce_all(vec![if trans_b { 0 } else { 1 }]),
        &[w],
        vec![inner],
    );
    let column = add(
        &mut g,
        format!("{base}_column"),
        Op::Layout(Layout::Reshape),
        &[wred],
        vec![inner, 1],
    );
    let mut value = add(
        &mut g,
        format!("{base}_gemv"),
        Op::MatMul(MatMul {
            trans_a: false,
            trans_b: false,
            bias: false,
        }),
        &[x, column],
        vec![rows, 1],
    );
    let vector_term = |g: &mut OpGraph,
                       add: &mut AddNode<'_>,
                       value: TensorRef,
                       v: TensorRef,
                       bop: BinaryOp,
                       name: String| {
        let rank = g.tensor(v).shape.len();
        let r = add(
            g,
            format!("{name}_reduced"),
            reduce_all((0..rank).collect()),
            &[v],
            vec![],
        );
        add(g, name, Op::Binary(bop), &[value, r], vec![rows, 1])
    };
    if bias {
        let b = g.inputs(gemm)[2];
        value = vector_term(
            &mut g,
            &mut add,
            value,
            b,
            BinaryOp::Add,
            format!("{base}_bias"),
        );
    }
    for step in steps {
        match *step {
            Step::Scalar(n) => {
                let Op::Scalar {
                    op: sop,
                    value: c,
                    scalar_first,
                } = g.node(n).op
                else {
                    unreachable!("a scalar step")
                };
                // A constant added to every feature adds `features` times
                // itself to their sum (itself to their mean).
                let c = if matches!(sop, BinaryOp::Add | BinaryOp::Sub) && !mean {
                    c * features as f64
                } else {
                    c
                };
                let name = format!("{}_reduced", g.node(n).name);
                value = add(
                    &mut g,
                    name,
                    Op::Scalar {
                        op: sop,
                        value: c,
                        scalar_first,
                    },
                    &[value],
                    vec![rows, 1],
                );
            }
            Step::Vector(n, v, bop) => {
                let name = format!("{}_reduced", g.node(n).name);
                value = vector_term(&mut g, &mut add, value, v, bop, name);
            }
        }
    }
    if !keepdim {
        value = add(
            &mut g,
            format!("{base}_flat"),
            Op::Layout(Layout::Reshape),
            &[value],
            vec![rows],
        );
    }
    redirect(&mut g, reduce, value);
    // The old chain, last first, now that nothing reads it.
    g.remove_unread(reduce);
    for step in steps.iter().rev() {
        let (Step::Scalar(n) | Step::Vector(n, ..)) = *step;
        g.remove_unread(n);
    }
    g.remove_unread(gemm);
    g
}

/// See the module's documentation.
pub fn drop_size_one_reductions(g: &OpGraph) -> Option<OpGraph> {
    let found: Vec<NodeId> = g
        .nodes()
        .filter(|(id, n)| {
            let Op::Reduce(Reduce { op, dims, .. }) = &n.op else {
                return false;
            };
            let keeps_values = matches!(
                op,
                ReduceOp::Sum
                    | ReduceOp::Mean
                    | ReduceOp::Max { .. }
                    | ReduceOp::Min { .. }
                    | ReduceOp::LogSumExp
            );
            let input = g.tensor(g.inputs(*id)[0]);
            keeps_values
                && n.outputs.len() == 1
                && !dims.is_empty()
                && dims.iter().all(|&d| input.shape.get(d) == Some(&1))
        })
        .map(|(id, _)| id)
        .collect();
    if found.is_empty() {
        return None;
    }
    let mut g = g.clone();
    for id in found {
        *g.op_mut(id) = Op::Layout(Layout::Reshape);
    }
    Some(g)
}

/// The interval an op clamps its input to (`None` bounds are infinite),
/// for the ops that are clamps.
fn clamp_interval(op: &Op) -> Option<(f64, f64)> {
    let (lo, hi) = match op {
        Op::Unary(UnaryOp::Clamp { min, max }) => (*min, *max),
        Op::Unary(UnaryOp::Hardtanh { min, max }) => (Some(*min), Some(*max)),
        Op::Unary(UnaryOp::Relu) => (Some(0.0), None),
        Op::Unary(UnaryOp::Relu6) => (Some(0.0), Some(6.0)),
        _ => return None,
    };
    let lo = lo.unwrap_or(f64::NEG_INFINITY);
    let hi = hi.unwrap_or(f64::INFINITY);
    // An empty interval clamps everything to one bound, in an order of
    // its own: not a case for this rewrite.
    (lo <= hi).then_some((lo, hi))
}

/// The interval an op's values lie in, for ops whose values are bounded
/// whatever their input: clamps, and tanh, sigmoid, hard sigmoid.
fn value_range(op: &Op) -> Option<(f64, f64)> {
    match op {
        Op::Unary(UnaryOp::Tanh) => Some((-1.0, 1.0)),
        Op::Unary(UnaryOp::Sigmoid | UnaryOp::Hardsigmoid) => Some((0.0, 1.0)),
        other => clamp_interval(other),
    }
}

/// See the module's documentation.
pub fn drop_nested_clamps(g: &OpGraph) -> Option<OpGraph> {
    let mut views = Vec::new();
    for (outer, n) in g.nodes() {
        let Some((lo2, hi2)) = clamp_interval(&n.op) else {
            continue;
        };
        let [input] = g.inputs(outer)[..] else {
            continue;
        };
        let inner = input.node;
        if views.contains(&inner) {
            continue;
        }
        let inner_op = &g.node(inner).op;
        let Some((lo1, hi1)) = value_range(inner_op) else {
            continue;
        };
        if g.tensor(input).dtype != n.outputs[0].dtype {
            continue;
        }
        let only_reader =
            g.consumers(inner).len() == 1 && !g.outputs().iter().any(|t| t.node == inner);
        if clamp_interval(inner_op).is_some() && lo1 <= lo2 && hi1 >= hi2 && only_reader {
            // The outer clamp alone gives the same values.
            views.push(inner);
        } else if lo1 >= lo2 && hi1 <= hi2 {
            // Already inside the outer interval: the outer one is a no-op.
            views.push(outer);
        }
    }
    if views.is_empty() {
        return None;
    }
    let mut g = g.clone();
    for id in views {
        *g.op_mut(id) = Op::Layout(Layout::Reshape);
    }
    Some(g)
}

/// See the module's documentation. It applies to a convolution with a
/// bias whose one reader is computed by a kernel (an elementwise op, a
/// reduction, softmax, a norm or pooling), or whose readers are all
/// elementwise (one fused chain then reads the add).
pub fn conv_bias_in_epilogue(g: &OpGraph) -> Option<OpGraph> {
    let split: Vec<NodeId> = g
        .nodes()
        .filter(|(id, n)| {
            let Op::Conv(c) = &n.op else { return false };
            let readers = g.consumers(*id);
            let pointwise = |r: &NodeId| g.node(*r).op.class() == OpClass::Pointwise;
            c.bias
                && n.outputs.len() == 1
                && !g.outputs().iter().any(|t| t.node == *id)
                && ((readers.len() == 1
                    && matches!(
                        g.node(readers[0]).op.class(),
                        OpClass::Pointwise
                            | OpClass::Reduction
                            | OpClass::Softmax
                            | OpClass::Norm
                            | OpClass::Pool
                    ))
                    || (!readers.is_empty() && readers.iter().all(pointwise)))
        })
        .map(|(id, _)| id)
        .collect();
    if split.is_empty() {
        return None;
    }
    Some(rebuilt(g, |out, id, map| {
        if !split.contains(&id) {
            return Rebuilt::Copied;
        }
        let node = g.node(id);
        let ins: Vec<TensorRef> = g.inputs(id).iter().map(|t| map[t]).collect();
        let Op::Conv(c) = &node.op else {
            unreachable!("a convolution")
        };
        let conv = out
            .add(
                node.name.clone(),
                Op::Conv(Conv {
                    bias: false,
                    ..c.clone()
                }),
                &ins[..2],
                node.outputs.clone(),
            )
            .expect("inputs exist");
        let ty = &node.outputs[0];
        let mut shape = vec![1; ty.shape.len() - 1];
        shape[0] = ty.shape[1];
        let bias = out
            .add(
                format!("{}_bias_view", node.name),
                Op::Layout(Layout::Reshape),
                &ins[2..3],
                vec![TensorType::new(shape, ty.dtype)],
            )
            .expect("inputs exist");
        Rebuilt::As(
            out.add(
                format!("{}_bias", node.name),
                Op::Binary(BinaryOp::Add),
                &[TensorRef::first(conv), TensorRef::first(bias)],
                node.outputs.clone(),
            )
            .expect("inputs exist"),
        )
    }))
}

/// What stands in the rebuilt graph for a node of the old one.
enum Rebuilt {
    /// The node as it was.
    Copied,
    /// Nothing: no node kept reads it.
    Dropped,
    /// This node, with the old one's outputs.
    As(NodeId),
}

/// `g` rebuilt node by node in order: `each(out, id, map)` says what
/// stands for node `id`, `map` holding each tensor of `g` computed so far
/// as it is in `out` (a dropped node's tensors are not there).
fn rebuilt(
    g: &OpGraph,
    mut each: impl FnMut(&mut OpGraph, NodeId, &HashMap<TensorRef, TensorRef>) -> Rebuilt,
) -> OpGraph {
    let mut out = OpGraph::new();
    let mut map: HashMap<TensorRef, TensorRef> = HashMap::new();
    for &id in g.order() {
        let node = g.node(id);
        let result = match each(&mut out, id, &map) {
            Rebuilt::Dropped => continue,
            Rebuilt::As(new) => new,
            Rebuilt::Copied => {
                let ins: Vec<TensorRef> = g.inputs(id).iter().map(|t| map[t]).collect();
                out.add(
                    node.name.clone(),
                    node.op.clone(),
                    &ins,
                    node.outputs.clone(),
                )
                .expect("inputs exist")
            }
        };
        map.extend(output_pairs(id, result, node.outputs.len()));
    }
    out.set_outputs(g.outputs().iter().map(|t| map[t]).collect());
    out
}

/// One match of [`attention_in_one_call`]: the nodes it replaces and what
/// the call reads.
struct AttentionMatch {
    /// The product with `v`, whose result the call computes.
    product: NodeId,
    /// The nodes from the scores to the product, and a scale on `q` that
    /// only the scores read: no other node reads them.
    dropped: Vec<NodeId>,
    q: TensorRef,
    k: TensorRef,
    v: TensorRef,
    scale: f64,
    /// The mask filled with `-inf` (true where a score is dropped).
    mask: Option<TensorRef>,
}

/// A constant scale `x * c` or `x / c` with `c > 0` (`None` for other
/// ops): it keeps `-inf` where it is, so it may come before or after the
/// mask.
fn scale_of(op: &Op) -> Option<f64> {
    let c = match op {
        Op::Scalar {
            op: BinaryOp::Mul,
            value,
            ..
        } => Some(*value),
        Op::Scalar {
            op: BinaryOp::Div,
            value,
            scalar_first: false,
        } if *value != 0.0 => Some(1.0 / value),
        _ => None,
    }?;
    (c > 0.0 && c.is_finite()).then_some(c)
}

/// The attention written out op by op that ends at softmax `s`, if any.
fn attention_at(g: &OpGraph, s: NodeId) -> Option<AttentionMatch> {
    let only_read_by_one = |id: NodeId| {
        let readers = g.consumers(id);
        (readers.len() == 1 && !g.outputs().iter().any(|t| t.node == id)).then(|| readers[0])
    };
    let node = g.node(s);
    let rank = node.outputs[0].shape.len();
    if !matches!(node.op, Op::Softmax { dim, log: false } if dim + 1 == rank)
        || rank < 3
        || !node.outputs[0].dtype.is_float()
    {
        return None;
    }
    let mut dropped = vec![s];
    // Forward to the product with v, through inactive dropout.
    let mut at = s;
    let product = loop {
        let next = only_read_by_one(at)?;
        match &g.node(next).op {
            Op::Dropout { active: false, .. } => {
                dropped.push(next);
                at = next;
            }
            Op::MatMul(MatMul {
                trans_a: false,
                trans_b: false,
                bias: false,
            }) if g.inputs(next)[0].node == at => break next,
            _ => return None,
        }
    };
    let v = g.inputs(product)[1];
    // Back to the scores, through a mask filled with -inf and a scale.
    let mut scale = None;
    let mut mask = None;
    let mut at = g.inputs(s)[0].node;
    loop {
        only_read_by_one(at)?;
        let op = &g.node(at).op;
        let scaled = scale_of(op).filter(|_| scale.is_none());
        match op {
            Op::Where { fill: Some(f) } if *f == f64::NEG_INFINITY && mask.is_none() => {
                let ins = g.inputs(at);
                if g.tensor(ins[1]).dtype != crate::DType::Bool {
                    return None;
                }
                mask = Some(ins[1]);
            }
            _ if scaled.is_some() => scale = scaled,
            Op::MatMul(MatMul {
                trans_a: false,
                trans_b: true,
                bias: false,
            }) => break,
            _ => return None,
        }
        dropped.push(at);
        at = g.inputs(at)[0].node;
    }
    let scores = at;
    dropped.push(scores);
    let (mut q, k) = (g.inputs(scores)[0], g.inputs(scores)[1]);
    // A scale on q that only the scores read.
    if scale.is_none()
        && let Some(c) = scale_of(&g.node(q.node).op)
        && only_read_by_one(q.node).is_some()
    {
        dropped.push(q.node);
        scale = Some(c);
        q = g.inputs(q.node)[0];
    }
    let (tq, tk, tv) = (g.tensor(q), g.tensor(k), g.tensor(v));
    let batch = |t: &TensorType| t.shape[..t.shape.len() - 2].to_vec();
    let same = tq.shape.len() == rank
        && tk.shape.len() == rank
        && tv.shape.len() == rank
        && batch(tq) == batch(tk)
        && batch(tq) == batch(tv)
        && tq.dtype == node.outputs[0].dtype
        && tk.dtype == tq.dtype
        && tv.dtype == tq.dtype;
    same.then_some(AttentionMatch {
        product,
        dropped,
        q,
        k,
        v,
        scale: scale.unwrap_or(1.0),
        mask,
    })
}

/// See the module's documentation. The mask (true where a score is
/// dropped) is complemented by `== 0` for the call, whose boolean mask is
/// true where a score takes part; a row with every score dropped, all
/// `-inf` before softmax, is not a case this rewrite keeps the values of
/// (the judge's trials catch it).
pub fn attention_in_one_call(g: &OpGraph) -> Option<OpGraph> {
    let found: Vec<AttentionMatch> = g
        .nodes()
        .filter_map(|(id, _)| attention_at(g, id))
        .collect();
    if found.is_empty() {
        return None;
    }
    let dropped: Vec<NodeId> = found.iter().flat_map(|m| m.dropped.clone()).collect();
    Some(rebuilt(g, |out, id, map| {
        if dropped.contains(&id) {
            return Rebuilt::Dropped;
        }
        let Some(m) = found.iter().find(|m| m.product == id) else {
            return Rebuilt::Copied;
        };
        let node = g.node(id);
        let mut ins = vec![map[&m.q], map[&m.k], map[&m.v]];
        if let Some(mask) = m.mask {
            let complement = out
                .add(
                    format!("{}_kept", node.name),
                    Op::Scalar {
                        op: BinaryOp::Eq,
                        value: 0.0,
                        scalar_first: false,
                    },
                    &[map[&mask]],
                    vec![g.tensor(mask).clone()],
                )
                .expect("inputs exist");
            ins.push(TensorRef::first(complement));
        }
        Rebuilt::As(
            out.add(
                node.name.clone(),
                Op::Attention(Attention {
                    causal: false,
                    scale: Some(m.scale),
                    mask: m.mask.is_some(),
                }),
                &ins,
                node.outputs.clone(),
            )
            .expect("inputs exist"),
        )
    }))
}

/// Each of the `n` outputs of `old` paired with the same output of `new`.
fn output_pairs(
    old: NodeId,
    new: NodeId,
    n: usize,
) -> impl Iterator<Item = (TensorRef, TensorRef)> {
    (0..n).map(move |output| {
        (
            TensorRef { node: old, output },
            TensorRef { node: new, output },
        )
    })
}

/// The permutation that reads a rank-`rank` NC… tensor channels-last
/// (`[0, 2, …, rank-1, 1]`).
pub fn channels_last_perm(rank: usize) -> Vec<usize> {
    let mut p = vec![0];
    p.extend(2..rank);
    p.push(1);
    p
}

/// The permutation that undoes `perm`.
pub fn inverse(perm: &[usize]) -> Vec<usize> {
    let mut inv = vec![0; perm.len()];
    for (i, &p) in perm.iter().enumerate() {
        inv[p] = i;
    }
    inv
}

fn permuted(shape: &[u64], perm: &[usize]) -> Vec<u64> {
    perm.iter().map(|&p| shape[p]).collect()
}

/// See the module's documentation. It applies when every full-size
/// tensor in the new layout either reaches a graph output (a free view
/// there) or feeds ops that work in it: no full-size copy back to NCHW
/// is read by another op.
pub fn channels_last(g: &OpGraph) -> Option<OpGraph> {
    let convs: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| {
            matches!(&n.op, Op::Conv(c) if c.spatial >= 2)
                && n.outputs.len() == 1
                && n.outputs[0].shape.len() >= 4
        })
        .map(|(id, _)| id)
        .collect();
    if convs.is_empty() {
        return None;
    }
    let r = sink_layout(g, &convs);
    let smallest = convs
        .iter()
        .map(|&c| g.node(c).outputs[0].numel())
        .min()
        .unwrap_or(0);
    let costly_copy = r.nodes().any(|(id, n)| {
        n.name.ends_with(BACK) && n.outputs[0].numel() * 4 >= smallest && !reads_as_view(&r, id)
    });
    (!costly_copy).then_some(r)
}

/// Whether permute `id` stays a strided view: only graph outputs and
/// convolutions (which take channels-last operands as they are) read it.
pub fn reads_as_view(g: &OpGraph, id: NodeId) -> bool {
    g.consumers(id).iter().all(|&c| {
        matches!(g.node(c).op, Op::Conv(_))
            && g.inputs(c)
                .iter()
                .enumerate()
                .all(|(slot, t)| t.node != id || slot == 0)
    })
}

/// Name suffix of the permutes [`sink_layout`] adds back to NC… order.
const BACK: &str = "_nc_order";

/// The graph where each of `starts` (single-output nodes of rank ≥ 3) is
/// followed by a permute to channels-last, and the ops after it are
/// computed in that layout while they can be: elementwise ops (operands
/// of other layouts must be broadcasts that a reshape reorders),
/// reductions and softmax (their dims renumbered), pooling over the
/// spatial dims of channels-last tensors, global pooling (a reduction),
/// batch norm with batch statistics (reductions and elementwise ops). A reader that cannot
/// work in the new layout, and each graph output, reads a permute back.
pub fn sink_layout(g: &OpGraph, starts: &[NodeId]) -> OpGraph {
    let mut out = OpGraph::new();
    // Each tensor of `g` as computed in `out`: in its own layout, and
    // (where it moved) permuted, with `new = old.permute(perm)`.
    let mut plain: HashMap<TensorRef, TensorRef> = HashMap::new();
    let mut moved: HashMap<TensorRef, (TensorRef, Vec<usize>)> = HashMap::new();
    let add =
        |out: &mut OpGraph, name: String, op: Op, ins: &[TensorRef], outputs: Vec<TensorType>| {
            out.add(name, op, ins, outputs).expect("inputs exist")
        };
    // The tensor of `g` in its own layout, permuted back when it moved.
    let plain_of = |out: &mut OpGraph,
                    plain: &mut HashMap<TensorRef, TensorRef>,
                    moved: &HashMap<TensorRef, (TensorRef, Vec<usize>)>,
                    t: TensorRef| {
        if let Some(&p) = plain.get(&t) {
            return p;
        }
        let (m, perm) = moved[&t].clone();
        let ty = g.tensor(t).clone();
        let name = match t.output {
            0 => format!("{}{BACK}", g.node(t.node).name),
            k => format!("{}_{k}{BACK}", g.node(t.node).name),
        };
        // Where only size-1 dims move, the permute is a reshape (a view).
        let inv = inverse(&perm);
        let moved_shape = &out.tensor(m).shape;
        let kept: Vec<usize> = inv
            .iter()
            .copied()
            .filter(|&p| moved_shape[p] != 1)
            .collect();
        let op = if kept.windows(2).all(|w| w[0] < w[1]) {
            Op::Layout(Layout::Reshape)
        } else {
            Op::Layout(Layout::Permute { perm: inv })
        };
        let back = TensorRef::first(add(out, name, op, &[m], vec![ty]));
        plain.insert(t, back);
        back
    };
    for &id in g.order() {
        let node = g.node(id);
        let ins = g.inputs(id);
        let one =
            |t: &TensorType, perm: &[usize]| TensorType::new(permuted(&t.shape, perm), t.dtype);
        if let Some((y, perm)) = batch_norm_in_new_layout(g, id, &ins, &moved, &mut out, &mut plain)
        {
            moved.insert(TensorRef::first(id), (y, perm));
            continue;
        }
        if let Some((op, new_ins, perm)) = in_new_layout(g, id, &ins, &moved) {
            // Operands: moved tensors as they are, broadcasts reshaped.
            let mut mapped = Vec::new();
            for (slot, t) in ins.iter().enumerate() {
                match new_ins[slot] {
                    Operand::Moved => mapped.push(moved[t].0),
                    Operand::Reshaped(ref shape) => {
                        let p = plain_of(&mut out, &mut plain, &moved, *t);
                        let r = add(
                            &mut out,
                            format!("{}_{}_operand{slot}", g.node(t.node).name, node.name),
                            Op::Layout(Layout::Reshape),
                            &[p],
                            vec![TensorType::new(shape.clone(), g.tensor(*t).dtype)],
                        );
                        mapped.push(TensorRef::first(r));
                    }
                }
            }
            // Every output (values and indices) is permuted alike.
            let types = node.outputs.iter().map(|t| one(t, &perm)).collect();
            let new = add(&mut out, node.name.clone(), op, &mapped, types);
            for (old, new) in output_pairs(id, new, node.outputs.len()) {
                if perm.iter().enumerate().all(|(i, &p)| i == p) {
                    plain.insert(old, new);
                } else {
                    moved.insert(old, (new, perm.clone()));
                }
            }
            continue;
        }
        let mapped: Vec<TensorRef> = ins
            .iter()
            .map(|&t| plain_of(&mut out, &mut plain, &moved, t))
            .collect();
        let new = add(
            &mut out,
            node.name.clone(),
            node.op.clone(),
            &mapped,
            node.outputs.clone(),
        );
        plain.extend(output_pairs(id, new, node.outputs.len()));
        if starts.contains(&id) && node.outputs.len() == 1 {
            let rank = node.outputs[0].shape.len();
            let perm = channels_last_perm(rank);
            let cl = add(
                &mut out,
                format!("{}_channels_last", node.name),
                Op::Layout(Layout::Permute { perm: perm.clone() }),
                &[TensorRef::first(new)],
                vec![one(&node.outputs[0], &perm)],
            );
            // Every reader goes through the channels-last view.
            plain.remove(&TensorRef::first(id));
            moved.insert(TensorRef::first(id), (TensorRef::first(cl), perm));
        }
    }
    let outputs = g
        .outputs()
        .iter()
        .map(|&t| plain_of(&mut out, &mut plain, &moved, t))
        .collect();
    out.set_outputs(outputs);
    out
}

/// Batch norm with batch statistics of a moved tensor, written out in its
/// layout: the mean and the variance (of the deviations, two passes) per
/// channel are reductions over every other dim, then `(x - mean) *
/// rsqrt(var + eps)`, scaled and shifted per channel. The result and its
/// permutation, or `None` where node `id` is no such norm.
fn batch_norm_in_new_layout(
    g: &OpGraph,
    id: NodeId,
    ins: &[TensorRef],
    moved: &HashMap<TensorRef, (TensorRef, Vec<usize>)>,
    out: &mut OpGraph,
    plain: &mut HashMap<TensorRef, TensorRef>,
) -> Option<(TensorRef, Vec<usize>)> {
    let node = g.node(id);
    let Op::Norm(Norm {
        kind: NormKind::Batch,
        eps,
        affine,
        bias,
        batch_stats: true,
    }) = &node.op
    else {
        return None;
    };
    let (x, perm) = moved.get(ins.first()?)?.clone();
    let shape = out.tensor(x).shape.clone();
    let dtype = out.tensor(x).dtype;
    let channel = perm.iter().position(|&p| p == 1)?;
    let mut stat = vec![1; shape.len()];
    stat[channel] = shape[channel];
    let dims: Vec<usize> = (0..shape.len()).filter(|&d| d != channel).collect();
    let name = &node.name;
    let mut add = |step: &str, op: Op, inputs: &[TensorRef], shape: &[u64]| {
        TensorRef::first(
            out.add(
                format!("{name}_{step}"),
                op,
                inputs,
                vec![TensorType::new(shape.to_vec(), dtype)],
            )
            .expect("inputs exist"),
        )
    };
    let mean = |dims: &[usize]| {
        Op::Reduce(Reduce {
            op: ReduceOp::Mean,
            dims: dims.to_vec(),
            keepdim: true,
        })
    };
    let m = add("mean", mean(&dims), &[x], &stat);
    // The deviations squared feed only the variance, so that they fuse in
    // front of it; the output computes its own.
    let d = add("deviation", Op::Binary(BinaryOp::Sub), &[x, m], &shape);
    let d2 = add("squared", Op::Binary(BinaryOp::Mul), &[d, d], &shape);
    let v = add("variance", mean(&dims), &[d2], &stat);
    let ve = add(
        "variance_eps",
        Op::Scalar {
            op: BinaryOp::Add,
            value: *eps,
            scalar_first: false,
        },
        &[v],
        &stat,
    );
    let r = add("rstd", Op::Unary(UnaryOp::Rsqrt), &[ve], &stat);
    let centered = add("centered", Op::Binary(BinaryOp::Sub), &[x, m], &shape);
    let mut y = add(
        "normalized",
        Op::Binary(BinaryOp::Mul),
        &[centered, r],
        &shape,
    );
    for (slot, (used, step, op)) in [
        (*affine, "scaled", BinaryOp::Mul),
        (*affine && *bias, "shifted", BinaryOp::Add),
    ]
    .into_iter()
    .enumerate()
    {
        if !used {
            continue;
        }
        let param = *plain.get(ins.get(slot + 1)?)?;
        let view = add(
            &format!("{step}_view"),
            Op::Layout(Layout::Reshape),
            &[param],
            &stat,
        );
        y = add(step, Op::Binary(op), &[y, view], &shape);
    }
    Some((y, perm))
}

/// How an operand reaches an op computed in the new layout.
enum Operand {
    /// It is in the new layout already.
    Moved,
    /// A broadcast operand in NC… order, reshaped (a view) to this shape.
    Reshaped(Vec<u64>),
}

/// Node `id` of `g` computed in the layout of its moved inputs: the op,
/// how each operand gets there, and the permutation of its result.
fn in_new_layout(
    g: &OpGraph,
    id: NodeId,
    ins: &[TensorRef],
    moved: &HashMap<TensorRef, (TensorRef, Vec<usize>)>,
) -> Option<(Op, Vec<Operand>, Vec<usize>)> {
    let node = g.node(id);
    // Only a max or min with indices has two outputs.
    if node.outputs.len() != 1 && !matches!(node.op, Op::Reduce(_)) {
        return None;
    }
    let perm = ins.iter().find_map(|t| moved.get(t).map(|m| m.1.clone()))?;
    let rank = perm.len();
    let one_moved = |ops: Op| -> Option<(Op, Vec<Operand>, Vec<usize>)> {
        let [t] = ins else { return None };
        (moved.get(t)?.1 == perm).then(|| (ops, vec![Operand::Moved], perm.clone()))
    };
    match &node.op {
        Op::Unary(_)
        | Op::Scalar { .. }
        | Op::Layout(Layout::Copy)
        | Op::Dropout { active: false, .. } => one_moved(node.op.clone()),
        Op::Binary(_) | Op::Where { .. } => {
            if node.outputs[0].shape.len() != rank {
                return None;
            }
            let mut operands = Vec::new();
            for t in ins {
                if let Some((_, p)) = moved.get(t) {
                    if *p != perm || g.tensor(*t).shape.len() != rank {
                        return None;
                    }
                    operands.push(Operand::Moved);
                    continue;
                }
                // A broadcast operand: aligned to the right, its dims of
                // extent > 1 must keep their order under the permutation.
                let shape = &g.tensor(*t).shape;
                if shape.len() > rank {
                    return None;
                }
                let mut full = vec![1; rank - shape.len()];
                full.extend(shape);
                let order: Vec<usize> = perm.iter().copied().filter(|&p| full[p] != 1).collect();
                if order.windows(2).any(|w| w[0] > w[1]) {
                    return None;
                }
                operands.push(Operand::Reshaped(permuted(&full, &perm)));
            }
            Some((node.op.clone(), operands, perm))
        }
        Op::Reduce(Reduce { op, dims, keepdim }) => {
            let mut new_dims: Vec<usize> = (0..rank).filter(|&i| dims.contains(&perm[i])).collect();
            new_dims.sort_unstable();
            let out_perm = if *keepdim {
                perm.clone()
            } else {
                let kept: Vec<usize> = (0..rank)
                    .filter(|i| !new_dims.contains(i))
                    .map(|i| perm[i] - dims.iter().filter(|&&d| d < perm[i]).count())
                    .collect();
                kept
            };
            let op = Op::Reduce(Reduce {
                op: op.clone(),
                dims: new_dims,
                keepdim: *keepdim,
            });
            one_moved(op).map(|(op, o, _)| (op, o, out_perm))
        }
        // A pool over the spatial dims of a channels-last tensor.
        Op::Pool(p) if perm == channels_last_perm(rank) && rank == p.spatial + 2 => {
            one_moved(Op::Pool(Pool {
                channels_last: true,
                ..p.clone()
            }))
        }
        // Global pooling is a reduction over the spatial dims.
        Op::AdaptivePool(a) if a.is_global() && rank == a.output.len() + 2 => {
            let dims: Vec<usize> = (0..rank).filter(|&i| perm[i] >= 2).collect();
            let op = if a.max {
                ReduceOp::Max { indices: false }
            } else {
                ReduceOp::Mean
            };
            one_moved(Op::Reduce(Reduce {
                op,
                dims,
                keepdim: true,
            }))
        }
        Op::Softmax { dim, log } => {
            let new = perm.iter().position(|p| p == dim)?;
            one_moved(Op::Softmax {
                dim: new,
                log: *log,
            })
        }
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::intent::{Bindings, compile, parse_shapes};

    fn graph(src: &str, shapes: &str) -> OpGraph {
        let b = Bindings {
            shapes: parse_shapes(shapes).unwrap(),
            dtype: Some(crate::DType::F32),
        };
        compile(src, &b).unwrap()
    }

    #[test]
    fn a_sum_over_gemm_features_becomes_a_gemv_against_reduced_weights() {
        let g = graph(
            "y = sum((x @ w + b) * 0.5 - 2, dim=1)",
            "x=64x128,w=128x256,b=256",
        );
        let r = reduce_before_gemm(&g).unwrap();
        let ops: Vec<String> = r.nodes().map(|(_, n)| n.op.to_string()).collect();
        // No 64x256 product any more: the weights are summed over the
        // features, and x meets them in a GEMV.
        assert!(
            r.nodes()
                .all(|(_, n)| n.outputs.iter().all(|t| t.shape != [64, 256])),
            "{ops:?}"
        );
        assert!(ops.iter().any(|o| o == "matmul"), "{ops:?}");
        // The constant added to each of 256 features adds 512 to the sum.
        assert!(ops.iter().any(|o| o.contains("512")), "{ops:?}");
        assert_eq!(r.tensor(r.outputs()[0]).shape, [64]);
    }

    #[test]
    fn nonlinear_steps_and_other_dims_are_left_alone() {
        for src in [
            "y = sum(sigmoid(x @ w), dim=1)",
            "y = sum(x @ w, dim=0)",
            "y = max(x @ w, dim=1)",
        ] {
            let g = graph(src, "x=64x128,w=128x256");
            assert!(reduce_before_gemm(&g).is_none(), "{src}");
        }
    }

    /// The ops of `g` in order, as displayed.
    fn ops(g: &OpGraph) -> Vec<String> {
        g.order()
            .iter()
            .map(|&n| g.node(n).op.to_string())
            .collect()
    }

    #[test]
    fn ops_after_a_channels_last_tensor_work_in_its_layout() {
        let g = graph(
            "y = softmax(sum(x * 2, dim=2, keepdim=true) + b, dim=1)",
            "x=2x3x4x5,b=3x1x1",
        );
        let x = g.nodes().find(|(_, n)| n.name == "x").unwrap().0;
        let r = sink_layout(&g, &[x]);
        let ops = ops(&r);
        let shapes: Vec<Vec<u64>> = r
            .order()
            .iter()
            .map(|&n| r.node(n).outputs[0].shape.clone())
            .collect();
        // x is read as [2, 4, 5, 3]; the sum over dim 2 (H) is over dim 1
        // there; the bias is reshaped to [1, 1, 1, 3]; the softmax over the
        // channels is over the last dim; one permute back at the output.
        assert!(ops.contains(&"permute [0, 2, 3, 1]".to_string()), "{ops:?}");
        assert!(shapes.contains(&vec![2, 4, 5, 3]), "{shapes:?}");
        assert!(
            ops.iter().any(|o| o.contains("sum") && o.contains("[1]")),
            "{ops:?}"
        );
        assert!(shapes.contains(&vec![1, 1, 1, 3]), "{shapes:?}");
        assert!(
            ops.iter().any(|o| o.contains("softmax") && o.contains('3')),
            "{ops:?}"
        );
        assert_eq!(ops.last().unwrap(), "permute [0, 3, 1, 2]", "{ops:?}");
        assert_eq!(r.tensor(r.outputs()[0]).shape, [2, 3, 1, 5]);
        assert_eq!(
            ops.iter().filter(|o| o.starts_with("permute")).count(),
            2,
            "{ops:?}"
        );
    }

    #[test]
    fn a_full_size_operand_in_the_old_layout_stops_the_new_one() {
        // `x + z` would need z transposed: it reads x permuted back.
        let g = graph("y = relu(x) + z", "x=2x3x4x5,z=2x3x4x5");
        let x = g.nodes().find(|(_, n)| n.name == "x").unwrap().0;
        let r = sink_layout(&g, &[x]);
        let ops = ops(&r);
        let back = r
            .order()
            .iter()
            .position(|&n| r.node(n).name.ends_with(BACK))
            .unwrap();
        let add = ops.iter().position(|o| o == "+").unwrap();
        assert!(back < add, "{ops:?}");
        assert_eq!(r.tensor(r.outputs()[0]).shape, [2, 3, 4, 5]);
    }

    /// `g` with the inputs named in `names` made parameters.
    fn with_parameters(mut g: OpGraph, names: &[&str]) -> OpGraph {
        let ids: Vec<NodeId> = g
            .nodes()
            .filter(|(_, n)| names.contains(&n.name.as_str()))
            .map(|(id, _)| id)
            .collect();
        for id in ids {
            let name = g.node(id).name.clone();
            *g.op_mut(id) = Op::Param {
                name,
                trainable: true,
            };
        }
        g
    }

    #[test]
    fn scales_and_shifts_after_a_linear_layer_fold_into_its_weights() {
        let g = with_parameters(
            graph(
                "y = relu((2 * linear(x, w, b) / s + t) * 0.5)",
                "x=64x128,w=256x128,b=256,s=256,t=256",
            ),
            &["w", "b", "s", "t"],
        );
        let r = fold_into_weights(&g).unwrap();
        // One product, then the relu: every step went into the weights
        // (three scales: `* 2`, `/ s`, `* 0.5`) and the bias (all four).
        let after = |r: &OpGraph| -> Vec<String> {
            r.order()
                .iter()
                .skip_while(|&&n| !matches!(r.node(n).op, Op::MatMul(_)))
                .filter(|&&n| !r.node(n).op.is_source())
                .map(|&n| r.node(n).op.to_string())
                .collect()
        };
        assert_eq!(after(&r), ["matmul Bᵀ +bias", "relu"], "{:?}", computed(&r));
        let weights = r.nodes().filter(|(_, n)| n.outputs[0].shape == [256, 128]);
        assert_eq!(
            weights.filter(|(_, n)| !n.op.is_source()).count(),
            3,
            "{:?}",
            computed(&r)
        );
        let product = r
            .nodes()
            .find(|(_, n)| matches!(n.op, Op::MatMul(_)))
            .unwrap()
            .0;
        assert!(
            r.inputs(product)[1..]
                .iter()
                .all(|t| !matches!(r.node(t.node).op, Op::Param { .. })),
            "the product reads the folded weights and bias"
        );
        assert_eq!(r.tensor(r.outputs()[0]).shape, [64, 256]);
        // Without a bias the shift stays after the product.
        let g = with_parameters(
            graph("y = linear(x, w) * s + t", "x=64x128,w=256x128,s=256,t=256"),
            &["w", "s", "t"],
        );
        let r = fold_into_weights(&g).unwrap();
        assert_eq!(after(&r), ["matmul Bᵀ +bias"], "{:?}", computed(&r));
        assert!(
            r.nodes().any(|(_, n)| matches!(n.op, Op::Constant { .. })),
            "a zero bias to shift: {:?}",
            computed(&r)
        );
    }

    #[test]
    fn an_eval_mode_batch_norm_after_a_convolution_folds_into_it() {
        let mut g = OpGraph::new();
        let f = |s: &[u64]| vec![TensorType::new(s.to_vec(), crate::DType::F32)];
        let x = g
            .add("x", Op::Input { name: "x".into() }, &[], f(&[2, 3, 8, 8]))
            .unwrap();
        let param = |g: &mut OpGraph, name: &str, s: &[u64]| {
            let id = g
                .add(
                    name,
                    Op::Param {
                        name: name.into(),
                        trainable: true,
                    },
                    &[],
                    f(s),
                )
                .unwrap();
            TensorRef::first(id)
        };
        let w = param(&mut g, "w", &[4, 3, 3, 3]);
        let stats: Vec<TensorRef> = ["gamma", "beta", "mean", "var"]
            .iter()
            .map(|n| param(&mut g, n, &[4]))
            .collect();
        let conv = g
            .add(
                "conv",
                Op::Conv(Conv {
                    spatial: 2,
                    transposed: false,
                    kernel: vec![3, 3],
                    stride: vec![1, 1],
                    padding: vec![0, 0],
                    dilation: vec![1, 1],
                    output_padding: vec![0, 0],
                    groups: 1,
                    bias: false,
                }),
                &[TensorRef::first(x), w],
                f(&[2, 4, 6, 6]),
            )
            .unwrap();
        let scaled = g
            .add(
                "scaled",
                Op::Scalar {
                    op: BinaryOp::Mul,
                    value: 2.0,
                    scalar_first: false,
                },
                &[TensorRef::first(conv)],
                f(&[2, 4, 6, 6]),
            )
            .unwrap();
        let mut ins = vec![TensorRef::first(scaled)];
        ins.extend(stats);
        let bn = g
            .add(
                "bn",
                Op::Norm(Norm {
                    kind: NormKind::Batch,
                    eps: 1e-5,
                    affine: true,
                    bias: true,
                    batch_stats: false,
                }),
                &ins,
                f(&[2, 4, 6, 6]),
            )
            .unwrap();
        let y = g
            .add(
                "y",
                Op::Unary(UnaryOp::Relu),
                &[TensorRef::first(bn)],
                f(&[2, 4, 6, 6]),
            )
            .unwrap();
        g.set_outputs(vec![TensorRef::first(y)]);
        let r = fold_into_weights(&g).unwrap();
        // The convolution with a bias, then the relu; the norm's scale is
        // computed from its parameters (`gamma / sqrt(var + eps)`).
        let ops = computed(&r);
        let conv_at = ops.iter().position(|o| o.starts_with("conv")).unwrap();
        assert_eq!(ops[conv_at + 1..], ["relu"], "{ops:?}");
        assert!(!ops.iter().any(|o| o.contains("norm")), "{ops:?}");
        assert!(ops.iter().any(|o| o == "sqrt"), "{ops:?}");
        let folded = r
            .nodes()
            .find(|(_, n)| matches!(n.op, Op::Conv(_)))
            .unwrap();
        assert!(matches!(folded.1.op, Op::Conv(Conv { bias: true, .. })));
        assert_eq!(r.inputs(folded.0).len(), 3);
        // With batch statistics (training mode) it does not fold.
        let Op::Norm(n) = g.op_mut(bn) else {
            unreachable!()
        };
        n.batch_stats = true;
        assert!(
            fold_into_weights(&g)
                .unwrap()
                .nodes()
                .any(|(_, n)| matches!(n.op, Op::Norm(_)))
        );
    }

    #[test]
    fn weights_that_are_inputs_and_nonlinear_steps_do_not_fold() {
        // Weights read from the forward's inputs are no parameters.
        let g = graph("y = linear(x, w, b) * 2", "x=64x128,w=256x128,b=256");
        assert!(fold_into_weights(&g).is_none());
        // A nonlinear step, a constant divided by the product, a full-size
        // operand, an operand read from the inputs.
        for (src, operand) in [
            ("y = relu(linear(x, w, b)) * 2", ""),
            ("y = 2 / linear(x, w, b)", ""),
            ("y = linear(x, w, b) * v", ",v=64x256"),
            ("y = linear(x, w, b) * u", ",u=256"),
        ] {
            let g = with_parameters(
                graph(src, &format!("x=64x128,w=256x128,b=256{operand}")),
                &["w", "b", "v"],
            );
            assert!(fold_into_weights(&g).is_none(), "{src}");
        }
    }

    #[test]
    fn reductions_over_size_one_dims_become_views() {
        let g = graph(
            "y = logsumexp(sum(x, dim=1, keepdim=true), dim=1)",
            "x=8x16",
        );
        let r = drop_size_one_reductions(&g).unwrap();
        let last = r.outputs()[0].node;
        assert!(r.node(last).op.is_view());
        assert!(drop_size_one_reductions(&graph("y = sum(x, dim=1)", "x=8x16")).is_none());
    }

    /// The ops of `g` that are not views, as shown.
    fn computed(g: &OpGraph) -> Vec<String> {
        g.nodes()
            .filter(|(_, n)| !n.op.is_source() && !n.op.is_view())
            .map(|(_, n)| n.op.to_string())
            .collect()
    }

    #[test]
    fn a_clamp_inside_a_wider_clamp_becomes_a_view() {
        // The inner clamp is the wider: the outer alone gives the values.
        let g = graph("y = clamp(clamp(x, min=-2, max=2), min=-1, max=1)", "x=64");
        assert_eq!(computed(&drop_nested_clamps(&g).unwrap()), ["clamp(-1, 1)"]);
        // A relu after a clamp into [0.5, 3] changes nothing.
        let g = graph("y = relu(clamp(x, min=0.5, max=3))", "x=64");
        assert_eq!(
            computed(&drop_nested_clamps(&g).unwrap()),
            ["clamp(0.5, 3)"]
        );
        // relu then relu6: relu is the wider (no upper bound) inner one.
        let g = graph("y = relu6(relu(x))", "x=64");
        assert_eq!(computed(&drop_nested_clamps(&g).unwrap()), ["relu6"]);
        // Overlapping intervals: both are needed.
        let g = graph(
            "y = clamp(clamp(x, min=-1, max=1), min=-2, max=0.5)",
            "x=64",
        );
        assert!(drop_nested_clamps(&g).is_none());
        // A clamp to [-1, 1] after tanh changes nothing; to [0, 0.5] it does.
        let g = graph("y = clamp(tanh(x), min=-1, max=1)", "x=64");
        assert_eq!(computed(&drop_nested_clamps(&g).unwrap()), ["tanh"]);
        assert!(
            drop_nested_clamps(&graph("y = clamp(sigmoid(x), min=0, max=0.5)", "x=64")).is_none()
        );
        // An inner clamp read elsewhere stays.
        let g = graph(
            "c = clamp(x, min=-2, max=2); y = clamp(c, min=-1, max=1) + c",
            "x=64",
        );
        assert!(drop_nested_clamps(&g).is_none());
    }

    /// A shared problem's traced graph.
    fn traced(level: u64, name: &str) -> OpGraph {
        crate::import::shared_graph(level, name).unwrap()
    }

    #[test]
    fn attention_written_op_by_op_becomes_one_call() {
        // L3/44: scores scaled after the product, a causal mask filled
        // with -inf, inactive dropout. L3/31 (torch's multi-head
        // attention, written out): the scale on q.
        for (level, name, scale, masked) in [
            (3, "44_MiniGPTBlock", 0.10206207261596575, true),
            (3, "31_VisionAttention", 0.17677669529663687, false),
        ] {
            let g = traced(level, name);
            let r = attention_in_one_call(&g).unwrap_or_else(|| panic!("{name}"));
            let calls: Vec<_> = r
                .nodes()
                .filter(|(_, n)| matches!(n.op, Op::Attention(_)))
                .collect();
            assert_eq!(calls.len(), 1, "{name}: {:?}", ops(&r));
            let (call, node) = calls[0];
            let Op::Attention(a) = &node.op else {
                unreachable!()
            };
            assert_eq!((a.causal, a.scale, a.mask), (false, Some(scale), masked));
            // No softmax, and no tensor of the scores' shape, left.
            let scores = g
                .nodes()
                .find(|(_, n)| matches!(n.op, Op::Softmax { .. }))
                .map(|(_, n)| n.outputs[0].shape.clone())
                .unwrap();
            for (_, n) in r.nodes() {
                assert!(!matches!(n.op, Op::Softmax { .. }), "{name}");
                assert!(
                    n.outputs.iter().all(|t| t.shape != scores),
                    "{name}: {} {:?}",
                    n.op,
                    n.outputs[0].shape
                );
            }
            let ins = r.inputs(call);
            assert_eq!(ins.len(), 3 + usize::from(masked));
            // The call's shapes and what reads its result are the product's.
            let old = g
                .nodes()
                .find(|(_, n)| n.name == node.name)
                .map(|(id, _)| id)
                .unwrap();
            assert_eq!(g.node(old).outputs, node.outputs);
            let readers = |g: &OpGraph, id| -> Vec<String> {
                g.consumers(id)
                    .iter()
                    .map(|&c| g.node(c).name.clone())
                    .collect()
            };
            assert_eq!(readers(&g, old), readers(&r, call));
            if masked {
                // The call's mask is the -inf mask's complement.
                let kept = r.node(ins[3].node);
                assert_eq!(kept.op.to_string(), "x == 0", "{name}");
                let dropped_where = r.node(r.inputs(ins[3].node)[0].node);
                assert_eq!(dropped_where.name, "__eq__", "{name}");
            } else {
                // q comes unscaled: the scale is the call's.
                assert!(!ops(&r).iter().any(|o| o.starts_with("x * 0.17")), "{name}");
            }
            assert!(
                rewrite_all(&g)
                    .unwrap()
                    .1
                    .contains(&"attention_in_one_call")
            );
        }
    }

    #[test]
    fn attention_whose_scores_are_read_elsewhere_or_not_filled_with_minus_infinity_stays() {
        let g = traced(3, "44_MiniGPTBlock");
        let node = |g: &OpGraph, name: &str| {
            g.nodes()
                .find(|(_, n)| n.name == name)
                .map(|(id, _)| id)
                .unwrap()
        };
        // The softmax also returned.
        let mut returned = g.clone();
        let mut outs = returned.outputs().to_vec();
        outs.push(TensorRef::first(node(&g, "softmax")));
        returned.set_outputs(outs);
        assert!(attention_in_one_call(&returned).is_none());
        // A large finite fill instead of -inf, or a negative scale.
        for op in [
            Op::Where { fill: Some(-1e9) },
            Op::Scalar {
                op: BinaryOp::Mul,
                value: -0.5,
                scalar_first: false,
            },
        ] {
            let mut other = g.clone();
            let at = node(
                &g,
                if matches!(op, Op::Where { .. }) {
                    "masked_fill"
                } else {
                    "mul"
                },
            );
            *other.op_mut(at) = op;
            assert!(attention_in_one_call(&other).is_none());
        }
        // Log-softmax.
        let mut log = g.clone();
        *log.op_mut(node(&g, "softmax")) = Op::Softmax { dim: 3, log: true };
        assert!(attention_in_one_call(&log).is_none());
    }
}

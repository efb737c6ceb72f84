//! [`fold_into_weights`]: per-channel scales, shifts and eval-mode batch
//! norms after a linear layer or convolution folded into its weights.

use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Conv, Layout, MatMul, Norm, NormKind, Op, UnaryOp};

use super::{AddNode, adder, redirect};

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

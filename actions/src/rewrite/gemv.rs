//! [`reduce_before_gemm`]: a sum or mean over a GEMM's output features
//! becomes a GEMV against the reduced weights.

use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Layout, MatMul, Op, Reduce, ReduceOp};

use super::{AddNode, adder, redirect};

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

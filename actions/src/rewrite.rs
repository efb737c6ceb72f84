//! Graph rewrites: actions that change what is computed into something
//! cheaper with the same result. Unlike [`crate::normalize`], a rewrite
//! changes the values in floating point (a sum taken in another order),
//! so each rewritten program is judged numerically like any other step.
//!
//! - [`reduce_before_gemm`]: a sum or mean over a GEMM's output features,
//!   through per-feature affine steps, becomes a GEMV against the reduced
//!   weights (`Σ_j (x Wᵀ)_ij = x · Σ_j W_j`). The reduced weights are
//!   computed from the parameter in every forward, never assumed frozen.
//! - [`drop_size_one_reductions`]: a reduction over dims that all have
//!   extent 1 leaves its input unchanged; it becomes a view.

use crate::dtype::TensorType;
use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Layout, MatMul, Op, Reduce, ReduceOp};

/// A rewrite: its name, and the graph it makes (`None` where it finds
/// nothing to rewrite).
pub type Rewrite = (&'static str, fn(&OpGraph) -> Option<OpGraph>);

/// Every rewrite, in the order they are tried.
pub const REWRITES: [Rewrite; 2] = [
    ("reduce_before_gemm", reduce_before_gemm),
    ("drop_size_one_reductions", drop_size_one_reductions),
];

/// The graph with every rewrite that applies, and their names.
pub fn rewrite_all(g: &OpGraph) -> Option<(OpGraph, Vec<&'static str>)> {
    let mut current = g.clone();
    let mut applied = Vec::new();
    for (name, rewrite) in REWRITES {
        if let Some(next) = rewrite(&current) {
            current = next;
            applied.push(name);
        }
    }
    (!applied.is_empty()).then_some((current, applied))
}

/// Makes every reader of `from` (and the graph's outputs) read `to`.
fn redirect(g: &mut OpGraph, from: NodeId, to: TensorRef) {
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
    let mut anchor = reduce;
    let mut add = |g: &mut OpGraph, name: String, op: Op, inputs: &[TensorRef], shape: Vec<u64>| {
        let id = g
            .add(name, op, inputs, vec![TensorType::new(shape, dtype)])
            .expect("inputs exist");
        g.place_after(id, anchor);
        anchor = id;
        TensorRef::first(id)
    };
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
}

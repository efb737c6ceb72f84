//! Norms written out op by op become the norm op (see
//! [`fold_written_norms`]).

use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Norm, NormKind, Op, Reduce, ReduceOp, UnaryOp};

/// A norm a model writes out op by op becomes the one norm op that
/// computes it, so that one kernel reads the tensor once and writes it
/// once (the ops one by one read it twice and write it once, besides
/// their small intermediates), and so that the planner sees the same
/// program whichever way a model spells it:
///
/// - `x / sqrt(mean(x², dims, keepdim) + ε)` and `x * rsqrt(mean(x², dims,
///   keepdim) + ε)` (the square as `x ** 2` or `x * x`): an RMS norm over
///   the trailing `dims` ([`NormKind::Rms`]), or along one dim with others
///   after it ([`NormKind::RmsAt`]);
/// - `x / norm(x, p=2, dim, keepdim)`: `F.normalize` with p = 2 and ε = 0
///   ([`NormKind::Lp`]: `x / max(‖x‖₂, 0)` is `x / ‖x‖₂`).
///
/// Each op between `x` and the division must be read by the next alone
/// (nothing else reads the mean of squares, say), and the result has the
/// shape of `x`. The ops the norm stands for are removed.
pub fn fold_written_norms(g: &mut OpGraph) {
    let candidates: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::Binary(BinaryOp::Div | BinaryOp::Mul)))
        .map(|(id, _)| id)
        .collect();
    for at in candidates {
        let Some(found) = written_norm(g, at) else {
            continue;
        };
        let node = g.node(at).clone();
        let norm = Op::Norm(Norm {
            kind: found.kind,
            eps: found.eps,
            affine: false,
            bias: false,
            batch_stats: true,
        });
        let id = g
            .add(
                format!("{}_norm", node.name),
                norm,
                &[found.x],
                node.outputs.clone(),
            )
            .expect("x is in the graph");
        g.place_after(id, at);
        crate::rewrite::redirect(g, at, TensorRef::first(id));
        g.remove_unread(at);
        for n in found.chain.into_iter().rev() {
            g.remove_unread(n);
        }
        g.set_name(id, node.name);
    }
}

/// A norm found at a division (or product) node.
struct Found {
    /// What is normalized.
    x: TensorRef,
    kind: NormKind,
    eps: f64,
    /// The nodes between `x` and the division, from `x` on.
    chain: Vec<NodeId>,
}

/// The one reader of `id`'s result, when it has one and is no graph
/// output.
fn only_reader(g: &OpGraph, id: NodeId) -> bool {
    g.consumers(id).len() == 1 && !g.outputs().iter().any(|t| t.node == id)
}

/// The single input of `id`, when `id` computes `op`-like things (the
/// caller matched its op) and is read by its one reader alone.
fn single_input(g: &OpGraph, id: NodeId) -> Option<TensorRef> {
    let [input] = g.inputs(id)[..] else {
        return None;
    };
    only_reader(g, id).then_some(input)
}

/// The norm that node `at` (`x / s` or `x * r`, either order for the
/// product) computes, if it is one of [`fold_written_norms`]'s.
fn written_norm(g: &OpGraph, at: NodeId) -> Option<Found> {
    let [a, b] = g.inputs(at)[..] else {
        return None;
    };
    let div = matches!(g.node(at).op, Op::Binary(BinaryOp::Div));
    let orders: &[(TensorRef, TensorRef)] = if div { &[(a, b)] } else { &[(a, b), (b, a)] };
    orders.iter().find_map(|&(x, s)| norm_of(g, at, x, s, div))
}

/// The norm `x / s` (`div`) or `x * s` computes, if `s` is the matching
/// statistic of `x`.
fn norm_of(g: &OpGraph, at: NodeId, x: TensorRef, s: TensorRef, div: bool) -> Option<Found> {
    let x_type = g.tensor(x);
    let out = &g.node(at).outputs[0];
    if out.shape != x_type.shape || x_type.dtype != crate::DType::F32 || s.output != 0 {
        return None;
    }
    let rank = x_type.shape.len();
    let op = &g.node(s.node).op;
    // x / norm(x, p=2, dim, keepdim)
    if let (
        true,
        Op::Reduce(Reduce {
            op: ReduceOp::Norm { p },
            dims,
            keepdim: true,
        }),
    ) = (div, op)
        && *p == 2.0
        && let [dim] = dims[..]
        && single_input(g, s.node) == Some(x)
    {
        return Some(Found {
            x,
            kind: NormKind::Lp { p: 2.0, dim },
            eps: 0.0,
            chain: vec![s.node],
        });
    }
    // x / sqrt(m + ε) or x * rsqrt(m + ε)
    let root = match op {
        Op::Unary(UnaryOp::Sqrt) if div => true,
        Op::Unary(UnaryOp::Rsqrt) if !div => true,
        _ => false,
    };
    if !root {
        return None;
    }
    let plus = single_input(g, s.node)?;
    let Op::Scalar {
        op: BinaryOp::Add,
        value: eps,
        ..
    } = g.node(plus.node).op
    else {
        return None;
    };
    if eps.is_nan() || eps < 0.0 || plus.output != 0 {
        return None;
    }
    let mean = single_input(g, plus.node)?;
    let Op::Reduce(Reduce {
        op: ReduceOp::Mean,
        dims,
        keepdim: true,
    }) = &g.node(mean.node).op
    else {
        return None;
    };
    let square = single_input(g, mean.node)?;
    if square.output != 0 || !only_reader(g, square.node) || !squares(g, square.node, x) {
        return None;
    }
    let mut sorted = dims.clone();
    sorted.sort_unstable();
    let trailing = !sorted.is_empty()
        && sorted
            .iter()
            .enumerate()
            .all(|(k, &d)| d == rank - sorted.len() + k);
    let kind = if trailing {
        NormKind::Rms { dims: sorted.len() }
    } else if let [dim] = sorted[..] {
        NormKind::RmsAt { dim }
    } else {
        return None;
    };
    Some(Found {
        x,
        kind,
        eps,
        chain: vec![square.node, mean.node, plus.node, s.node],
    })
}

/// Whether node `id` computes `x²` (`x ** 2`, `x * x`).
fn squares(g: &OpGraph, id: NodeId, x: TensorRef) -> bool {
    let ins = g.inputs(id);
    match g.node(id).op {
        Op::Scalar {
            op: BinaryOp::Pow,
            value,
            scalar_first: false,
        } => value == 2.0 && ins[..] == [x],
        Op::Binary(BinaryOp::Mul) => ins[..] == [x, x],
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use crate::DType;
    use crate::intent::{Bindings, compile, parse_shapes};
    use crate::op::{NormKind, Op};

    /// The non-source ops of intent `src` over `shapes`, as compiled
    /// (normalized).
    fn ops(src: &str, shapes: &str) -> Vec<Op> {
        let b = Bindings {
            shapes: parse_shapes(shapes).unwrap(),
            dtype: Some(DType::F32),
        };
        let g = compile(src, &b).unwrap();
        g.nodes()
            .filter(|(_, n)| !n.op.is_source())
            .map(|(_, n)| n.op.clone())
            .collect()
    }

    fn kind(op: &Op) -> Option<(NormKind, f64)> {
        match op {
            Op::Norm(n) if !n.affine && !n.bias => Some((n.kind.clone(), n.eps)),
            _ => None,
        }
    }

    #[test]
    fn rms_norms_written_out_become_the_norm_whichever_way_they_are_spelt() {
        for (src, want) in [
            (
                "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) + 1e-5)",
                NormKind::RmsAt { dim: 1 },
            ),
            (
                "y = x * rsqrt(mean(x * x, dim=1, keepdim=true) + 1e-5)",
                NormKind::RmsAt { dim: 1 },
            ),
            (
                "y = rsqrt(1e-5 + mean(x * x, dim=-1, keepdim=true)) * x",
                NormKind::Rms { dims: 1 },
            ),
        ] {
            let got = ops(src, "x=4x6x5");
            assert_eq!(got.len(), 1, "{src}: {got:?}");
            assert_eq!(kind(&got[0]), Some((want, 1e-5)), "{src}");
        }
        let got = ops("y = x / norm(x, dim=1, keepdim=true)", "x=4x6x5");
        assert_eq!(got.len(), 1, "{got:?}");
        assert_eq!(kind(&got[0]), Some((NormKind::Lp { p: 2.0, dim: 1 }, 0.0)));
    }

    #[test]
    fn what_is_not_exactly_a_norm_stays_as_written() {
        for (src, why) in [
            (
                "m = mean(x ** 2, dim=1, keepdim=true); y = x / sqrt(m + 1e-5) + m",
                "the mean of squares is read elsewhere",
            ),
            (
                "y = x / sqrt(mean(x ** 3, dim=1, keepdim=true) + 1e-5)",
                "not a square",
            ),
            (
                "y = x / sqrt(mean(z ** 2, dim=1, keepdim=true) + 1e-5)",
                "the squares are of another tensor",
            ),
            (
                "y = x / sqrt(sum(x ** 2, dim=1, keepdim=true) + 1e-5)",
                "a sum, not a mean",
            ),
            (
                "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) - 1e-5)",
                "ε subtracted",
            ),
            (
                "y = x * sqrt(mean(x ** 2, dim=1, keepdim=true) + 1e-5)",
                "a product with the root",
            ),
            (
                "y = x / norm(x, p=1, dim=1, keepdim=true)",
                "not the Euclidean length",
            ),
        ] {
            let shapes = if src.contains('z') {
                "x=4x6x5,z=4x6x5"
            } else {
                "x=4x6x5"
            };
            let got = ops(src, shapes);
            assert!(got.iter().all(|o| kind(o).is_none()), "{why}: {got:?}");
        }
    }
}

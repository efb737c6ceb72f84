//! Rewrites that drop an op that changes nothing:
//! [`drop_size_one_reductions`] and [`drop_nested_clamps`].

use crate::graph::{NodeId, OpGraph};
use crate::op::{Layout, Op, Reduce, ReduceOp, UnaryOp};

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

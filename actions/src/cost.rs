//! Work and traffic of each node: FLOPs and minimum bytes moved.
//!
//! Conventions (also in ARCHITECTURE.md):
//! - a multiply-add counts 2 FLOPs; every other arithmetic step, comparison or
//!   transcendental function counts 1 (so `sigmoid` = neg, exp, add, div = 4);
//! - a node's minimum bytes are its inputs read once plus its outputs written
//!   once; views (reshape, permute, expand, slice) and sources move nothing by
//!   themselves, and an input reached through an `expand` view costs the bytes
//!   of the tensor under the view;
//! - an opaque node's FLOPs are unknown: its cost is marked inexact and counts
//!   only its bytes.

use crate::dtype::TensorType;
use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Layout, LossKind, NormKind, Op, Reduce, ReduceOp, Rnn, UnaryOp};

/// Work and traffic of one node or one graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Cost {
    /// Floating-point operations.
    pub flops: u64,
    /// Minimum bytes read and written.
    pub bytes: u64,
    /// False when some FLOPs could not be counted (opaque nodes).
    pub exact: bool,
}

impl Cost {
    /// FLOPs per byte.
    pub fn intensity(&self) -> f64 {
        if self.bytes == 0 {
            0.0
        } else {
            self.flops as f64 / self.bytes as f64
        }
    }
}

/// FLOPs per output element of an elementwise function.
pub fn unary_flops_per_element(op: &UnaryOp) -> u64 {
    match op {
        UnaryOp::Relu | UnaryOp::Abs | UnaryOp::Neg | UnaryOp::Sign | UnaryOp::Not => 1,
        UnaryOp::Relu6 | UnaryOp::Hardtanh { .. } | UnaryOp::LeakyRelu { .. } => 2,
        UnaryOp::Clamp { min, max } => u64::from(min.is_some()) + u64::from(max.is_some()),
        UnaryOp::Exp
        | UnaryOp::Log
        | UnaryOp::Sqrt
        | UnaryOp::Rsqrt
        | UnaryOp::Reciprocal
        | UnaryOp::Erf
        | UnaryOp::Sin
        | UnaryOp::Cos
        | UnaryOp::Tanh => 1,
        UnaryOp::Softsign => 3,
        UnaryOp::Hardsigmoid => 4,
        UnaryOp::Sigmoid | UnaryOp::Elu { .. } => 4,
        UnaryOp::Hardswish | UnaryOp::Selu => 5,
        UnaryOp::Silu | UnaryOp::Softplus { .. } => 5,
        UnaryOp::Gelu { tanh: false } => 5,
        UnaryOp::Gelu { tanh: true } => 9,
        UnaryOp::Mish => 7,
    }
}

/// The bytes that reading `t` costs: a view of an expanded (broadcast)
/// tensor costs only the tensor under the view.
fn read_bytes(g: &OpGraph, t: TensorRef) -> u64 {
    let node = g.node(t.node);
    match &node.op {
        Op::Layout(Layout::Expand | Layout::Reshape | Layout::Permute { .. }) => {
            let inputs = g.inputs(t.node);
            match inputs.first() {
                Some(&src) => read_bytes(g, src).min(g.tensor(t).bytes()),
                None => g.tensor(t).bytes(),
            }
        }
        _ => g.tensor(t).bytes(),
    }
}

fn numel(t: &TensorType) -> u64 {
    t.numel()
}

/// The contracted extent of a matmul's first operand.
fn contracted(a: &TensorType, trans_a: bool) -> u64 {
    match a.rank() {
        0 => 1,
        1 => a.shape[0],
        r if trans_a => a.shape[r - 2],
        r => a.shape[r - 1],
    }
}

fn reduce_flops(r: &Reduce, input: u64, output: u64) -> u64 {
    match r.op {
        ReduceOp::Sum
        | ReduceOp::Max { .. }
        | ReduceOp::Min { .. }
        | ReduceOp::Prod
        | ReduceOp::ArgMax
        | ReduceOp::ArgMin => input,
        ReduceOp::Mean => input + output,
        ReduceOp::LogSumExp => 4 * input + output,
        ReduceOp::Norm { p } if p == 1.0 || p.is_infinite() => 2 * input,
        ReduceOp::Norm { .. } => 2 * input + output,
        ReduceOp::Var { .. } => 4 * input + 2 * output,
        ReduceOp::Std { .. } => 4 * input + 3 * output,
    }
}

fn rnn_flops(r: &Rnn, input: &TensorType) -> u64 {
    // Input is (seq, batch, feature) or (batch, seq, feature); unbatched is (seq, feature).
    let (steps, batch) = match (input.rank(), r.batch_first) {
        (3, true) => (input.shape[1], input.shape[0]),
        (3, false) => (input.shape[0], input.shape[1]),
        (2, _) => (input.shape[0], 1),
        _ => (1, 1),
    };
    let dirs = if r.bidirectional { 2 } else { 1 };
    let g = r.cell.gates();
    let h = r.hidden_size;
    let mut per_step = 0;
    for layer in 0..r.layers {
        let fan_in = if layer == 0 { r.input_size } else { h * dirs };
        // Gate matmuls (multiply-add) plus the cell's elementwise update.
        per_step += dirs * (2 * g * h * (fan_in + h) + 6 * g * h);
    }
    steps * batch * per_step
}

fn einsum_flops(equation: &str, inputs: &[&TensorType]) -> Option<u64> {
    let (lhs, rhs) = equation.split_once("->")?;
    let mut sizes = std::collections::BTreeMap::new();
    for (spec, t) in lhs.split(',').zip(inputs) {
        let letters: Vec<char> = spec.trim().chars().filter(|c| c.is_alphabetic()).collect();
        if letters.len() != t.rank() {
            return None;
        }
        for (c, &d) in letters.iter().zip(&t.shape) {
            sizes.insert(*c, d);
        }
    }
    let total: u64 = sizes.values().product();
    let contracts = sizes.keys().any(|c| !rhs.contains(*c));
    Some(if contracts && inputs.len() > 1 {
        2 * total
    } else {
        total
    })
}

/// FLOPs and minimum bytes of one node.
pub fn node_cost(g: &OpGraph, id: NodeId) -> Cost {
    let node = g.node(id);
    let inputs = g.inputs(id);
    let in_types: Vec<&TensorType> = inputs.iter().map(|&t| g.tensor(t)).collect();
    let out_elems: u64 = node.outputs.iter().map(numel).sum();
    let out_bytes: u64 = node.outputs.iter().map(TensorType::bytes).sum();
    let in_bytes: u64 = inputs.iter().map(|&t| read_bytes(g, t)).sum();
    let first_in = in_types.first().map_or(0, |t| t.numel());
    let moved = in_bytes + out_bytes;
    let exact = |flops| Cost {
        flops,
        bytes: moved,
        exact: true,
    };
    match &node.op {
        Op::Input { .. } | Op::Param { .. } => Cost {
            exact: true,
            ..Cost::default()
        },
        Op::Constant { .. } => Cost {
            flops: 0,
            bytes: out_bytes,
            exact: true,
        },
        Op::MatMul(m) => {
            let k = in_types.first().map_or(1, |a| contracted(a, m.trans_a));
            exact(2 * out_elems * k + if m.bias { out_elems } else { 0 })
        }
        Op::Einsum { equation } => match einsum_flops(equation, &in_types) {
            Some(f) => exact(f),
            None => Cost {
                flops: 0,
                bytes: moved,
                exact: false,
            },
        },
        Op::Conv(c) => {
            let kernel: u64 = c.kernel.iter().product();
            let bias = if c.bias { out_elems } else { 0 };
            let macs = if c.transposed {
                let out_channels = node.outputs[0].shape.get(1).copied().unwrap_or(1);
                first_in * (out_channels / c.groups.max(1)) * kernel
            } else {
                let in_channels = in_types.first().and_then(|t| t.shape.get(1)).copied();
                out_elems * (in_channels.unwrap_or(1) / c.groups.max(1)) * kernel
            };
            exact(2 * macs + bias)
        }
        Op::Unary(u) => exact(out_elems * unary_flops_per_element(u)),
        Op::Binary(b) | Op::Scalar { op: b, .. } => {
            let per = if *b == BinaryOp::Pow { 2 } else { 1 };
            exact(out_elems * per)
        }
        Op::Where { .. } => exact(out_elems),
        Op::Triangular { .. } => exact(0),
        Op::Reduce(r) => exact(reduce_flops(r, first_in, out_elems)),
        Op::Scan(_) => exact(first_in),
        Op::Softmax { .. } => exact(5 * out_elems),
        Op::Norm(n) => {
            let stats = match n.kind {
                NormKind::Batch | NormKind::Instance if !n.batch_stats => 0,
                NormKind::Rms { .. } | NormKind::RmsAt { .. } | NormKind::Lp { .. } => 2,
                _ => 4,
            };
            let affine = 2 * u64::from(n.affine);
            exact(out_elems * (stats + 2 + affine))
        }
        Op::Pool(p) => exact(out_elems * p.kernel.iter().product::<u64>()),
        Op::AdaptivePool(_) => exact(first_in + out_elems),
        Op::Dropout { active: false, .. } => Cost {
            exact: true,
            ..Cost::default()
        },
        Op::Dropout { active: true, .. } => exact(2 * out_elems),
        Op::Loss(l) => {
            let per = match l.kind {
                LossKind::Mse => 3,
                LossKind::Huber { .. } | LossKind::SmoothL1 { .. } => 5,
                LossKind::CrossEntropy => 6,
                LossKind::Hinge { .. } => 3,
                LossKind::TripletMargin { .. } => 8,
                LossKind::Cosine { .. } => 7,
                LossKind::KlDiv { .. } => 4,
            };
            exact(per * first_in)
        }
        Op::Attention(_) => {
            let (q, k, v) = match in_types.as_slice() {
                [q, k, v, ..] => (*q, *k, *v),
                _ => return exact(0),
            };
            let e = q.shape.last().copied().unwrap_or(1);
            let ev = v.shape.last().copied().unwrap_or(1);
            let lq = q.shape.iter().rev().nth(1).copied().unwrap_or(1);
            let lk = k.shape.iter().rev().nth(1).copied().unwrap_or(1);
            let batch = q.numel() / (lq * e).max(1);
            exact(batch * lq * lk * (2 * e + 2 * ev + 5))
        }
        Op::Rnn(r) => match in_types.first() {
            Some(x) => exact(rnn_flops(r, x)),
            None => exact(0),
        },
        Op::Layout(l) if l.is_view() => Cost {
            exact: true,
            ..Cost::default()
        },
        Op::Layout(_) => exact(0),
        Op::Opaque { .. } => Cost {
            flops: 0,
            bytes: moved,
            exact: false,
        },
    }
}

/// Totals over a graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct GraphCost {
    /// Sum of the nodes' costs: each op as its own kernel (unfused).
    pub unfused: Cost,
    /// Compulsory traffic if the whole graph ran as one fused kernel: each
    /// input, parameter and constant read once, each output written once.
    pub fused_bytes: u64,
}

/// Totals over a graph.
pub fn graph_cost(g: &OpGraph) -> GraphCost {
    let mut total = Cost {
        exact: true,
        ..Cost::default()
    };
    let mut fused_bytes = 0;
    for (id, node) in g.nodes() {
        let c = node_cost(g, id);
        total.flops += c.flops;
        total.bytes += c.bytes;
        total.exact &= c.exact;
        if node.op.is_source() && !g.consumers(id).is_empty() {
            fused_bytes += node.outputs.iter().map(TensorType::bytes).sum::<u64>();
        }
    }
    let mut written: Vec<TensorRef> = g.outputs().to_vec();
    written.sort_by_key(|t| (t.node, t.output));
    written.dedup();
    for t in written {
        if !g.node(t.node).op.is_source() {
            fused_bytes += g.tensor(t).bytes();
        }
    }
    GraphCost {
        unfused: total,
        fused_bytes,
    }
}

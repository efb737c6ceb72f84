//! [`channels_last`]: convolutions read channels-last, and the ops after
//! them in that layout ([`sink_layout`]).

use std::collections::HashMap;

use crate::dtype::TensorType;
use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Layout, Norm, NormKind, Op, Pool, Reduce, ReduceOp, UnaryOp};

use super::output_pairs;

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
pub(super) const BACK: &str = "_nc_order";

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

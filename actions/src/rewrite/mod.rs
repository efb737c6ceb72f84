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
use crate::op::Op;

mod attention;
mod conv_bias;
mod fold;
mod gemv;
mod layout;
mod simplify;
#[cfg(test)]
mod tests;

pub use attention::attention_in_one_call;
pub use conv_bias::conv_bias_in_epilogue;
pub use fold::fold_into_weights;
pub use gemv::reduce_before_gemm;
pub use layout::{channels_last, channels_last_perm, inverse, reads_as_view, sink_layout};
pub use simplify::{drop_nested_clamps, drop_size_one_reductions};

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

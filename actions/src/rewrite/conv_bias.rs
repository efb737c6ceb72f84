//! [`conv_bias_in_epilogue`]: a convolution's bias moved into the kernel
//! that reads the convolution.

use crate::dtype::TensorType;
use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{BinaryOp, Conv, Layout, Op, OpClass};

use super::{Rebuilt, rebuilt};

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

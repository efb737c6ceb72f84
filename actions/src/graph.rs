//! The op graph: operators as nodes, tensors as edges.

use petgraph::Direction;
use petgraph::stable_graph::{NodeIndex, StableDiGraph};
use petgraph::visit::EdgeRef;

use crate::dtype::TensorType;
use crate::op::{Op, OpClass};

/// Identifies a node of an [`OpGraph`].
pub type NodeId = NodeIndex<u32>;

/// One output tensor of one node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct TensorRef {
    /// The producing node.
    pub node: NodeId,
    /// Which of its outputs.
    pub output: usize,
}

impl TensorRef {
    /// The first (often only) output of a node.
    pub fn first(node: NodeId) -> TensorRef {
        TensorRef { node, output: 0 }
    }
}

/// A node: an operator and the types of the tensors it produces.
#[derive(Clone, Debug)]
pub struct Node {
    /// Unique, human-readable name (from the source program where it has one).
    pub name: String,
    /// The operation.
    pub op: Op,
    /// Types of its outputs, in order.
    pub outputs: Vec<TensorType>,
}

/// An edge carries output `output` of its source into input `slot` of its target.
#[derive(Clone, Copy, Debug)]
pub struct Edge {
    /// Output index at the producer.
    pub output: usize,
    /// Input position at the consumer.
    pub slot: usize,
}

/// A dataflow graph of tensor operations.
///
/// Architecture invariant: nodes are only added after their inputs, so
/// insertion order is a topological order, and every input reference names an
/// existing output of an existing node.
#[derive(Clone, Debug, Default)]
pub struct OpGraph {
    graph: StableDiGraph<Node, Edge>,
    order: Vec<NodeId>,
    outputs: Vec<TensorRef>,
}

/// A reference to a tensor that does not exist.
#[derive(Debug, thiserror::Error)]
#[error("node `{consumer}` reads output {output} of `{producer}`, which has {available} outputs")]
pub struct DanglingInput {
    /// The node being added.
    pub consumer: String,
    /// The producer named.
    pub producer: String,
    /// Output index asked for.
    pub output: usize,
    /// Outputs the producer has.
    pub available: usize,
}

impl OpGraph {
    /// An empty graph.
    pub fn new() -> OpGraph {
        OpGraph::default()
    }

    /// Adds a node reading `inputs` (in slot order) and producing `outputs`.
    pub fn add(
        &mut self,
        name: impl Into<String>,
        op: Op,
        inputs: &[TensorRef],
        outputs: Vec<TensorType>,
    ) -> Result<NodeId, DanglingInput> {
        let name = name.into();
        for input in inputs {
            let available = self
                .graph
                .node_weight(input.node)
                .map_or(0, |n| n.outputs.len());
            if input.output >= available {
                return Err(DanglingInput {
                    consumer: name,
                    producer: self
                        .graph
                        .node_weight(input.node)
                        .map_or_else(|| format!("{:?}", input.node), |n| n.name.clone()),
                    output: input.output,
                    available,
                });
            }
        }
        let id = self.graph.add_node(Node { name, op, outputs });
        for (slot, input) in inputs.iter().enumerate() {
            self.graph.add_edge(
                input.node,
                id,
                Edge {
                    output: input.output,
                    slot,
                },
            );
        }
        self.order.push(id);
        Ok(id)
    }

    /// Adds a graph input called `name`.
    pub fn add_input(&mut self, name: &str, ty: TensorType) -> TensorRef {
        let op = Op::Input { name: name.into() };
        TensorRef::first(self.add(name, op, &[], vec![ty]).expect("reads nothing"))
    }

    /// Adds a trainable parameter called `name`.
    pub fn add_param(&mut self, name: &str, ty: TensorType) -> TensorRef {
        let op = Op::Param {
            name: name.into(),
            trainable: true,
        };
        TensorRef::first(self.add(name, op, &[], vec![ty]).expect("reads nothing"))
    }

    /// Moves `id` in the execution order to just after `anchor`. Everything
    /// `id` reads must come before `anchor` or be `anchor`.
    pub fn place_after(&mut self, id: NodeId, anchor: NodeId) {
        self.order.retain(|&n| n != id);
        let at = self
            .position(anchor)
            .min(self.order.len().saturating_sub(1));
        self.order.insert(at + 1, id);
    }

    /// Renames a node.
    pub fn set_name(&mut self, id: NodeId, name: impl Into<String>) {
        self.graph[id].name = name.into();
    }

    /// The operation of a node, for rewrites.
    pub fn op_mut(&mut self, id: NodeId) -> &mut Op {
        &mut self.graph[id].op
    }

    /// Makes input `slot` of `consumer` read `from` instead. Both must be in
    /// the graph and `from` must come before `consumer` (it keeps the order
    /// topological).
    pub fn replace_input(&mut self, consumer: NodeId, slot: usize, from: TensorRef) {
        debug_assert!(
            self.position(from.node) < self.position(consumer),
            "a rewired input must come before its consumer"
        );
        let old = self
            .graph
            .edges_directed(consumer, Direction::Incoming)
            .find(|e| e.weight().slot == slot)
            .map(|e| e.id());
        if let Some(edge) = old {
            self.graph.remove_edge(edge);
        }
        self.graph.add_edge(
            from.node,
            consumer,
            Edge {
                output: from.output,
                slot,
            },
        );
    }

    /// Removes a node that nothing reads and that is no graph output.
    /// Returns whether it was removed.
    pub fn remove_unread(&mut self, id: NodeId) -> bool {
        let read =
            self.consumers(id).iter().any(|_| true) || self.outputs.iter().any(|t| t.node == id);
        if read {
            return false;
        }
        self.graph.remove_node(id);
        self.order.retain(|&n| n != id);
        true
    }

    fn position(&self, id: NodeId) -> usize {
        self.order
            .iter()
            .position(|&n| n == id)
            .unwrap_or(usize::MAX)
    }

    /// Declares the graph's results, in order.
    pub fn set_outputs(&mut self, outputs: Vec<TensorRef>) {
        self.outputs = outputs;
    }

    /// The graph's results.
    pub fn outputs(&self) -> &[TensorRef] {
        &self.outputs
    }

    /// A node by id.
    ///
    /// # Panics
    /// If `id` is not a node of this graph (ids come only from this graph).
    pub fn node(&self, id: NodeId) -> &Node {
        &self.graph[id]
    }

    /// The type of one tensor.
    pub fn tensor(&self, t: TensorRef) -> &TensorType {
        &self.graph[t.node].outputs[t.output]
    }

    /// Node ids in topological order.
    pub fn order(&self) -> &[NodeId] {
        &self.order
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.order.len()
    }

    /// Whether the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.order.is_empty()
    }

    /// The tensors a node reads, in slot order.
    pub fn inputs(&self, id: NodeId) -> Vec<TensorRef> {
        let mut edges: Vec<(usize, TensorRef)> = self
            .graph
            .edges_directed(id, Direction::Incoming)
            .map(|e| {
                (
                    e.weight().slot,
                    TensorRef {
                        node: e.source(),
                        output: e.weight().output,
                    },
                )
            })
            .collect();
        edges.sort_by_key(|(slot, _)| *slot);
        edges.into_iter().map(|(_, t)| t).collect()
    }

    /// Nodes that read any output of `id`.
    pub fn consumers(&self, id: NodeId) -> Vec<NodeId> {
        let mut out: Vec<NodeId> = self
            .graph
            .neighbors_directed(id, Direction::Outgoing)
            .collect();
        out.sort();
        out.dedup();
        out
    }

    /// Nodes with their ids, in topological order.
    pub fn nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.order.iter().map(|&id| (id, &self.graph[id]))
    }

    /// Distinct operator classes present, excluding sources, sorted.
    pub fn op_classes(&self) -> Vec<OpClass> {
        let mut classes: Vec<OpClass> = self
            .nodes()
            .map(|(_, n)| n.op.class())
            .filter(|c| *c != OpClass::Source)
            .collect();
        classes.sort();
        classes.dedup();
        classes
    }

    /// Nodes that are opaque library calls.
    pub fn opaque_nodes(&self) -> impl Iterator<Item = (NodeId, &Node)> {
        self.nodes()
            .filter(|(_, n)| matches!(n.op, Op::Opaque { .. }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;
    use crate::op::UnaryOp;

    #[test]
    fn inputs_come_back_in_slot_order_and_dangling_refs_are_refused() {
        let t = TensorType::new(vec![4], DType::F32);
        let mut g = OpGraph::new();
        let a = g
            .add("a", Op::Input { name: "a".into() }, &[], vec![t.clone()])
            .unwrap();
        let b = g
            .add("b", Op::Input { name: "b".into() }, &[], vec![t.clone()])
            .unwrap();
        let sub = g
            .add(
                "sub",
                Op::Binary(crate::op::BinaryOp::Sub),
                &[TensorRef::first(b), TensorRef::first(a)],
                vec![t.clone()],
            )
            .unwrap();
        assert_eq!(
            g.inputs(sub),
            vec![TensorRef::first(b), TensorRef::first(a)]
        );
        assert_eq!(g.consumers(a), vec![sub]);
        let err = g
            .add(
                "bad",
                Op::Unary(UnaryOp::Relu),
                &[TensorRef { node: a, output: 1 }],
                vec![t],
            )
            .unwrap_err();
        assert_eq!(
            err.to_string(),
            "node `bad` reads output 1 of `a`, which has 1 outputs"
        );
        assert_eq!(g.len(), 3);
    }
}

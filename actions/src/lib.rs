//! The problem side of mtmc: what is to be computed, and what it costs.
//!
//! - [`dtype`]: element and tensor types;
//! - [`op`]: the operator vocabulary;
//! - [`graph`]: the op graph (petgraph) with multi-output nodes;
//! - [`cost`]: FLOPs and minimum bytes per node and per graph;
//! - [`device`]: device specs as data and the roofline bound;
//! - [`import`]: torch traces (JSON from the Python tracer) into op graphs;
//! - [`problem`]: KernelBench problems and their names;
//! - [`intent`]: the intent language (`y = gelu(x @ w + b)`);
//! - [`normalize`]: normal forms (transposes folded into matmuls).
//!
//! This crate does no I/O: callers hand it text and get values or errors back.

pub mod cost;
pub mod device;
pub mod dtype;
pub mod graph;
pub mod import;
pub mod intent;
pub mod normalize;
pub mod op;
pub mod problem;
pub mod rewrite;

pub use cost::{Cost, GraphCost, graph_cost, node_cost};
pub use device::{DeviceSpec, MathMode, Roofline, builtin_devices, find_device, roofline};
pub use dtype::{DType, TensorType};
pub use graph::{Node, NodeId, OpGraph, TensorRef};
pub use op::{Op, OpClass};

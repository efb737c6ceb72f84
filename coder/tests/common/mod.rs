//! Helpers shared by the coder's tests.

use mtmc_actions::DType;
use mtmc_actions::dtype::TensorType;
use mtmc_actions::graph::{OpGraph, TensorRef};
use mtmc_actions::op::Op;
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::program::{Fragment, Program};
use mtmc_coder::template::{Refusal, TemplateCoder};

/// The graph of a built-in KernelBench trace.
#[allow(dead_code)]
pub fn traced(level: u64, name: &str) -> OpGraph {
    mtmc_actions::import::shared_graph(level, name).unwrap()
}

/// Every computing node of the graph, as one fused region.
#[allow(dead_code)]
pub fn fuse_all(g: &OpGraph, params: Params) -> Action {
    Action {
        kind: ActionKind::Fuse,
        region: g
            .nodes()
            .filter(|(_, n)| !n.op.is_source())
            .map(|(id, _)| id.index() as u32)
            .collect(),
        params,
    }
}

/// The template coder's kernel for the first node whose op `is`, as a
/// custom kernel at the default launch parameters.
#[allow(dead_code)]
pub fn realize_first(g: &OpGraph, is: impl Fn(&Op) -> bool) -> Result<Fragment, Refusal> {
    let node = g
        .nodes()
        .find(|(_, n)| is(&n.op))
        .expect("the graph has such a node")
        .0;
    let action = Action {
        kind: ActionKind::CustomKernel,
        region: vec![node.index() as u32],
        params: Params::default(),
    };
    TemplateCoder.realize(&Program::default(), g, &action)
}

/// The first node whose op `is`, and every non-source op after it, as
/// one region (a custom kernel when that is the node alone).
#[allow(dead_code)]
pub fn realize_with_rest(g: &OpGraph, is: impl Fn(&Op) -> bool) -> Result<Fragment, Refusal> {
    let first = g
        .nodes()
        .find(|(_, n)| is(&n.op))
        .map(|(id, _)| id)
        .expect("the graph has such a node");
    let mut region = vec![first.index() as u32];
    region.extend(
        g.nodes()
            .filter(|(id, n)| id.index() > first.index() && !n.op.is_source())
            .map(|(id, _)| id.index() as u32),
    );
    let action = Action::kernel_for(region, Params::default());
    TemplateCoder.realize(&Program::default(), g, &action)
}

/// Asserts that the fragment compiles with NVRTC for sm_90.
#[allow(dead_code)]
#[track_caller]
pub fn compiles(f: &Fragment, what: &str) {
    let r = mtmc_env::nvrtc::compile(
        &mtmc_env::nvrtc::CompileUnit {
            name: "k.cu".into(),
            source: f.source.clone(),
        },
        mtmc_env::nvrtc::Arch::SM90,
    )
    .unwrap_or_else(|e| panic!("{e}: these tests need NVRTC 13 (run scripts/test)"));
    assert!(r.ok, "{what}: {}\n{}", r.log, f.source);
}

/// Adds node `name`, `op` of `ins` with one output of `shape` and
/// `dtype`; that output.
#[allow(dead_code)]
pub fn node(
    g: &mut OpGraph,
    name: &str,
    op: Op,
    ins: &[TensorRef],
    shape: &[u64],
    dtype: DType,
) -> TensorRef {
    let t = TensorType::new(shape.to_vec(), dtype);
    TensorRef::first(g.add(name, op, ins, vec![t]).unwrap())
}

/// Adds the graph input `name` of `shape` and `dtype`.
#[allow(dead_code)]
pub fn input(g: &mut OpGraph, name: &str, shape: &[u64], dtype: DType) -> TensorRef {
    let op = Op::Input { name: name.into() };
    node(g, name, op, &[], shape, dtype)
}

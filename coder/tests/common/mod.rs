//! Helpers shared by the coder's tests.

use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::Op;
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::program::{Fragment, Program};
use mtmc_coder::template::{Refusal, TemplateCoder};

/// The graph of a built-in KernelBench trace.
pub fn traced(level: u64, name: &str) -> OpGraph {
    let traces = include_str!("../../../traces/kernelbench.jsonl");
    let line = traces
        .lines()
        .find(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["level"] == level && v["name"] == name
        })
        .unwrap();
    let t = mtmc_actions::import::parse_trace(line).unwrap();
    mtmc_actions::import::import_trace(&t).unwrap().graph
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

//! Helpers shared by the coder's tests.

use mtmc_actions::graph::OpGraph;

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

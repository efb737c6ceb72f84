//! `mtmc show`: one problem's graph with per-node FLOPs and bytes, and its
//! roofline time on the built-in devices.

use anyhow::{Context, Result, bail};
use mtmc_actions::device::{MathMode, builtin_devices, find_device, roofline};
use mtmc_actions::{OpGraph, node_cost};

use mtmc_search::fmt::{seconds, si, table};
use mtmc_search::subject::Subject;

/// Prints the graph and its roofline.
pub fn run(out: &mut dyn std::io::Write, subject: Subject<'_>, device: Option<&str>) -> Result<()> {
    let specs = builtin_devices();
    let devices = match device {
        None => specs.clone(),
        Some(name) => vec![
            find_device(&specs, name)
                .with_context(|| {
                    let known: Vec<&str> = specs.iter().map(|s| s.name.as_str()).collect();
                    format!("unknown device `{name}`; built in: {}", known.join(", "))
                })?
                .clone(),
        ],
    };
    let (title, graph) = match subject {
        Subject::Problem { kernelbench, name } => {
            let problems = mtmc_search::source::Problems::load(kernelbench)?;
            let p = problems.find(name)?;
            let traced = problems.graphs(&[p])?.remove(0);
            let graph = match traced.graph {
                Ok(g) => g,
                Err(why) => bail!("{p} has no graph: {why}"),
            };
            let how = match &traced.trace {
                Some(t) => format!(
                    "traced with {} on {}, torch {}",
                    t.method.as_deref().unwrap_or("?"),
                    t.device.as_deref().unwrap_or("?"),
                    t.torch
                ),
                None => String::new(),
            };
            (format!("{} ({how})", p.full_name()), graph)
        }
        Subject::Intent {
            text,
            origin,
            bindings,
        } => {
            let graph = mtmc_actions::intent::compile(&text, &bindings)
                .map_err(|e| anyhow::anyhow!("{origin}, {e}"))?;
            ("intent".to_string(), graph)
        }
    };
    writeln!(out, "{title}\n")?;
    write!(out, "{}", node_table(&graph))?;
    let first = roofline(&graph, &devices[0], MathMode::default());
    let cost = first.cost;
    writeln!(out)?;
    writeln!(
        out,
        "total: {}{} in {} nodes; minimum bytes {} fused (inputs, weights, outputs once), {} one kernel per op",
        if cost.unfused.exact { "" } else { "≥" },
        si(cost.unfused.flops as f64, "FLOP"),
        graph.len(),
        si(cost.fused_bytes as f64, "B"),
        si(cost.unfused.bytes as f64, "B"),
    )?;
    if !cost.unfused.exact {
        writeln!(
            out,
            "note: opaque nodes have unknown FLOPs; FLOP totals and compute bounds are lower bounds"
        )?;
    }
    writeln!(
        out,
        "roofline (fp32 matmuls on CUDA cores: KernelBench's 1e-4 tolerance rules out TF32):"
    )?;
    for spec in &devices {
        let r = roofline(&graph, spec, MathMode::default());
        writeln!(
            out,
            "  {:5} {:>9}  {} (compute {}, memory {}); one kernel per op: {}",
            spec.name,
            seconds(r.time_s),
            r.bound,
            seconds(r.compute_s),
            seconds(r.memory_s),
            seconds(r.unfused_s),
        )?;
    }
    Ok(())
}

fn node_table(g: &OpGraph) -> String {
    let outputs: Vec<_> = g.outputs().iter().map(|t| t.node).collect();
    let mut rows = Vec::new();
    for (id, node) in g.nodes() {
        let c = node_cost(g, id);
        let inputs: Vec<String> = g
            .inputs(id)
            .iter()
            .map(|t| {
                let n = &g.node(t.node).name;
                if g.node(t.node).outputs.len() > 1 {
                    format!("{n}.{}", t.output)
                } else {
                    n.clone()
                }
            })
            .collect();
        let types: Vec<String> = node.outputs.iter().map(|t| t.to_string()).collect();
        rows.push(vec![
            format!(
                "{}{}",
                node.name,
                if outputs.contains(&id) { " →" } else { "" }
            ),
            node.op.to_string(),
            abbreviate(&inputs),
            types.join(", "),
            if c.exact {
                si(c.flops as f64, "")
            } else {
                "?".into()
            },
            si(c.bytes as f64, "B"),
        ]);
    }
    table(
        &["NODE", "OP", "INPUTS", "OUTPUT", "FLOP", "BYTES"],
        &rows,
        &[4, 5],
    )
}

/// At most three input names, then a count of the rest.
fn abbreviate(names: &[String]) -> String {
    if names.len() <= 3 {
        names.join(", ")
    } else {
        format!("{}, +{} more", names[..2].join(", "), names.len() - 2)
    }
}

//! `mtmc problems`: the problem list with op classes, FLOPs and bytes.

use std::path::Path;

use anyhow::Result;
use mtmc_actions::{OpClass, graph_cost};

use mtmc_search::fmt::{si, table};
use mtmc_search::source::{Origin, Problems};

/// Lists problems (optionally one level) with their graphs' figures.
pub fn run(
    out: &mut dyn std::io::Write,
    kernelbench: Option<&Path>,
    level: Option<u32>,
) -> Result<()> {
    let problems = Problems::load(kernelbench)?;
    problems.check_levels(level.as_slice())?;
    let chosen: Vec<_> = problems
        .list
        .iter()
        .filter(|p| level.is_none_or(|l| p.level == l))
        .collect();
    let graphs = problems.graphs(&chosen)?;
    let mut rows = Vec::new();
    // Per level: (problems, traced with no opaque node).
    let mut full = std::collections::BTreeMap::<u32, (usize, usize)>::new();
    let mut opaque_targets = std::collections::BTreeMap::<String, usize>::new();
    for (p, t) in chosen.iter().zip(&graphs) {
        let entry = full.entry(p.level).or_default();
        entry.0 += 1;
        match &t.graph {
            Ok(g) => {
                let cost = graph_cost(g);
                let classes: Vec<&str> = g
                    .op_classes()
                    .into_iter()
                    .filter(|c| *c != OpClass::Layout)
                    .map(OpClass::name)
                    .collect();
                let opaque: Vec<String> = g
                    .opaque_nodes()
                    .map(|(_, n)| match &n.op {
                        mtmc_actions::Op::Opaque { target, .. } => target.clone(),
                        _ => unreachable!("opaque_nodes yields opaque nodes"),
                    })
                    .collect();
                if opaque.is_empty() {
                    entry.1 += 1;
                }
                for o in &opaque {
                    *opaque_targets.entry(o.clone()).or_default() += 1;
                }
                let flops = if cost.unfused.exact {
                    si(cost.unfused.flops as f64, "")
                } else {
                    format!("≥{}", si(cost.unfused.flops as f64, ""))
                };
                rows.push(vec![
                    p.id(),
                    p.name.clone(),
                    classes.join(","),
                    flops,
                    si(cost.fused_bytes as f64, "B"),
                    if opaque.is_empty() {
                        String::new()
                    } else {
                        format!("{} opaque", opaque.len())
                    },
                ]);
            }
            Err(why) => rows.push(vec![
                p.id(),
                p.name.clone(),
                "-".into(),
                "-".into(),
                "-".into(),
                format!("no graph: {why}"),
            ]),
        }
    }
    write!(
        out,
        "{}",
        table(
            &["ID", "NAME", "OPS", "FLOP", "MIN BYTES", "NOTE"],
            &rows,
            &[3, 4]
        )
    )?;
    let source = match &problems.origin {
        Origin::Jsonl(p) | Origin::Checkout(p) => p.display().to_string(),
        Origin::Builtin => {
            "the traces built into mtmc (the 200 shared problems; pass --kernelbench PATH for others)"
                .to_string()
        }
    };
    writeln!(out, "\n{} problems from {source}", chosen.len())?;
    let per_level: Vec<String> = full
        .iter()
        .map(|(l, (n, f))| format!("L{l} {f}/{n}"))
        .collect();
    writeln!(out, "traced with no opaque node: {}", per_level.join(", "))?;
    if !opaque_targets.is_empty() {
        let list: Vec<String> = opaque_targets
            .iter()
            .map(|(t, n)| format!("{t} ×{n}"))
            .collect();
        writeln!(out, "opaque ops: {}", list.join(", "))?;
    }
    Ok(())
}

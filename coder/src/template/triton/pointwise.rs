//! Pointwise chains with broadcasting: a program per `BLOCK = block ×
//! vector` elements.

use std::fmt::Write as _;

use mtmc_actions::graph::OpGraph;

use crate::action::Action;
use crate::program::{Fragment, Lang, Launch};
use crate::template::Refusal;
use crate::template::pointwise::one_shape_boundary;

use super::expr::{chain_body, check_pointwise};
use super::{grid, program_id, vector_width};

/// A fused pointwise chain.
pub(super) fn pointwise(
    g: &OpGraph,
    action: &Action,
    name: &str,
    warps: u32,
) -> Result<Fragment, Refusal> {
    let region = action.nodes();
    let (inputs, outputs, full) = one_shape_boundary(g, &region)?;
    check_pointwise(g, &region, &full)?;
    let vector = action.params.vector;
    vector_width(vector)?;
    let numel: u64 = full.iter().product();
    let block = u64::from(warps * 32 * vector);
    let ptrs: Vec<String> = (0..inputs.len()).map(|k| format!("in{k}")).collect();
    let (body, names) = chain_body(g, &region, &inputs, &ptrs, &full, "    ")?;
    let params: Vec<String> = ptrs
        .iter()
        .cloned()
        .chain((0..outputs.len()).map(|k| format!("out{k}")))
        .chain(["n".to_string()])
        .collect();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {} fused pointwise op(s) over {numel} elements, {block} per program",
        region.len()
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    let wide = numel + block >= 1 << 31;
    let _ = writeln!(
        src,
        "    i = {} * {block} + tl.arange(0, {block})",
        program_id(wide)
    );
    src.push_str("    m = i < n\n");
    src.push_str(&body);
    for (k, t) in outputs.iter().enumerate() {
        let _ = writeln!(src, "    tl.store(out{k} + i, {}, mask=m)", names[t]);
    }
    Ok(Fragment {
        name: name.to_string(),
        action: action.clone(),
        lang: Lang::Triton,
        source: src,
        inputs,
        outputs,
        region,
        launch: Launch {
            shared: 0,
            grid: grid(numel.div_ceil(block))?,
            block: warps * 32,
            sizes: vec![numel as i64],
        },
        before: Vec::new(),
    })
}

//! Max and average pooling over 1–3 spatial dims, channels first or
//! last.

use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph};
use mtmc_actions::op::Op;

use crate::program::Fragment;
use crate::template::pool::Window;
use crate::template::{Refusal, f32_input};

use super::{grid, node_fragment, program_id, vector_width};

/// Max and average pooling over 1–3 spatial dims, channels first or last:
/// a program per `BLOCK = block × vector` outputs, each walking its window
/// (taps outside the input masked off), dividing as torch does with and
/// without `count_include_pad`.
pub(super) fn pool(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    warps: u32,
    vector: u32,
) -> Result<Fragment, Refusal> {
    let n = g.node(node);
    let Op::Pool(p) = &n.op else {
        return Err(Refusal::new(format!("`{}` is not a pooling op", n.name)));
    };
    let input = f32_input(g, node)?;
    let in_shape = g.tensor(input).shape.clone();
    let out_shape = n.outputs[0].shape.clone();
    let Window {
        kernel,
        stride,
        padding,
        dilation,
    } = Window::of(p, in_shape.len(), out_shape.len())?;
    vector_width(vector)?;
    let (max, count_include_pad, channels_last, dims) =
        (&p.max, &p.count_include_pad, &p.channels_last, p.spatial);
    let first = if *channels_last { 1 } else { 2 };
    let channels = if *channels_last {
        in_shape[dims + 1]
    } else {
        1
    };
    let in_sp = &in_shape[first..first + dims];
    let out_sp = &out_shape[first..first + dims];
    let numel: u64 = out_shape.iter().product();
    let block = u64::from(warps * 32 * vector);
    let wide = numel + block >= 1 << 31 || g.tensor(input).numel() >= 1 << 31;
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {} pool {in_sp:?}{} (kernel {kernel:?}, stride {stride:?}, padding {padding:?}, dilation {dilation:?}), {block} outputs a program",
        if *max { "max" } else { "average" },
        if *channels_last { " channels-last" } else { "" },
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}(x, y, n):");
    let _ = writeln!(
        src,
        "    i = {} * {block} + tl.arange(0, {block})\n    m = i < n\n    rest = i",
        program_id(wide)
    );
    if *channels_last {
        let _ = writeln!(
            src,
            "    c = rest % {channels}\n    rest = rest // {channels}"
        );
    }
    for d in (0..dims).rev() {
        let _ = writeln!(
            src,
            "    s{d} = (rest % {}) * {} - {}\n    rest = rest // {}",
            out_sp[d], stride[d], padding[d], out_sp[d]
        );
    }
    let plane: u64 = in_sp.iter().product::<u64>() * channels;
    let _ = writeln!(
        src,
        "    base = rest * {plane}{}",
        if *channels_last { " + c" } else { "" }
    );
    let pad = if *max { "float(\"-inf\")" } else { "0.0" };
    let _ = writeln!(src, "    acc = tl.full([{block}], {pad}, tl.float32)");
    if !*max && !*count_include_pad {
        let _ = writeln!(src, "    inside = tl.zeros([{block}], tl.int32)");
    }
    let mut indent = "    ".to_string();
    let mut ok = vec!["m".to_string()];
    for d in 0..dims {
        let _ = writeln!(src, "{indent}for k{d} in range({}):", kernel[d]);
        indent.push_str("    ");
        let _ = writeln!(
            src,
            "{indent}p{d} = s{d} + k{d} * {}\n{indent}ok{d} = (p{d} >= 0) & (p{d} < {})",
            dilation[d], in_sp[d]
        );
        ok.push(format!("ok{d}"));
    }
    let mut offset = "p0".to_string();
    for (d, &extent) in in_sp.iter().enumerate().skip(1) {
        offset = format!("({offset}) * {extent} + p{d}");
    }
    if *channels_last {
        offset = format!("({offset}) * {channels}");
    }
    let _ = writeln!(
        src,
        "{indent}ok = {}\n{indent}v = tl.load(x + base + {offset}, mask=ok, other={pad})",
        ok.join(" & ")
    );
    if *max {
        let _ = writeln!(src, "{indent}acc = tl.maximum(acc, v)");
    } else {
        let _ = writeln!(src, "{indent}acc += v");
        if !*count_include_pad {
            let _ = writeln!(src, "{indent}inside += ok.to(tl.int32)");
        }
    }
    let value = if *max {
        "acc".to_string()
    } else if *count_include_pad {
        // The window clipped to the padded input.
        let mut terms = Vec::new();
        for d in 0..dims {
            let _ = writeln!(
                src,
                "    e{d} = tl.minimum(s{d} + {}, {})",
                kernel[d],
                in_sp[d] + padding[d]
            );
            terms.push(format!("(e{d} - s{d})"));
        }
        format!("acc / ({}).to(tl.float32)", terms.join(" * "))
    } else {
        "acc / tl.maximum(inside, 1).to(tl.float32)".to_string()
    };
    let _ = writeln!(src, "    tl.store(y + i, {value}, mask=m)");
    node_fragment(
        name,
        node,
        src,
        vec![input],
        grid(numel.div_ceil(block))?,
        vec![numel as i64],
    )
}

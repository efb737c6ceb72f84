//! Pooling (max and average, 1–3 spatial dims, and global adaptive
//! pooling), each output looping over its window. A thread takes as many
//! outputs as the action's vector width (1, 2 or 4), a block apart, and
//! walks their windows together, so that each step of the walk has that
//! many independent loads in flight (a window's loads are mostly L1 hits,
//! and one output a thread can leave too few misses in flight to keep
//! memory busy; more outputs take more registers). A window's taps outside
//! the input are predicated off.
//!
//! Output extents are the traced ones (so `ceil_mode` needs no rule here).
//! Average pooling divides as torch does: by the window clipped to the
//! padded input when `count_include_pad`, else by the elements inside the
//! input.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{AdaptivePool, Op, Pool};

use super::{ROW_BLOCKS, Refusal, WAVES, one_node};
use crate::action::{Action, Params};
use crate::program::{Fragment, Launch};

/// One pooling window per spatial dim: kernel, stride, padding, dilation.
struct Window {
    kernel: Vec<u64>,
    stride: Vec<u64>,
    padding: Vec<u64>,
    dilation: Vec<u64>,
}

/// Generates the kernel for one pooling node.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a pooling kernel covers one op"));
    };
    let n = g.node(node);
    let input = g.inputs(node)[0];
    let in_shape = g.tensor(input).shape.clone();
    let out_shape = n.outputs[0].shape.clone();
    if g.tensor(input).dtype != DType::F32 || n.outputs[0].dtype != DType::F32 {
        return Err(Refusal::new(format!("`{}` is not float32", n.name)));
    }
    let (max, window, include_pad, last) = match &n.op {
        Op::Pool(Pool {
            max,
            spatial,
            kernel,
            stride,
            padding,
            dilation,
            count_include_pad,
            channels_last,
            ..
        }) => {
            if in_shape.len() != spatial + 2 {
                return Err(Refusal::new("pooling needs [N, C, spatial...] input"));
            }
            let ones = vec![1; *spatial];
            let window = Window {
                kernel: kernel.clone(),
                stride: stride.clone(),
                padding: padding.clone(),
                dilation: if dilation.is_empty() {
                    ones
                } else {
                    dilation.clone()
                },
            };
            (*max, window, *count_include_pad, *channels_last)
        }
        Op::AdaptivePool(a @ AdaptivePool { max, .. }) if a.is_global() => {
            let spatial = &in_shape[2..];
            let window = Window {
                kernel: spatial.to_vec(),
                stride: spatial.to_vec(),
                padding: vec![0; spatial.len()],
                dilation: vec![1; spatial.len()],
            };
            (*max, window, false, false)
        }
        other => return Err(Refusal::new(format!("no pooling kernel yet for {other}"))),
    };
    let dims = in_shape.len() - 2;
    // Spatial dims start after the channels, or right after N when the
    // channels are last.
    let first = if last { 1 } else { 2 };
    let channels = if last {
        in_shape[dims + 1]
    } else {
        in_shape[1]
    };
    let in_sp = &in_shape[first..first + dims];
    let out_sp = &out_shape[first..first + dims];
    if [
        &window.kernel,
        &window.stride,
        &window.padding,
        &window.dilation,
    ]
    .iter()
    .any(|v| v.len() != dims)
        || out_shape.len() != in_shape.len()
    {
        return Err(Refusal::new(
            "the window's rank does not match the input's spatial dims",
        ));
    }
    let Params { block, vector } = action.params;
    if !ROW_BLOCKS.contains(&block) || ![1, 2, 4].contains(&vector) {
        return Err(Refusal::new(
            "pooling kernels take a block of 64 to 1024 threads (a power of two) and walk 1, 2 or 4 outputs a thread together (the vector width)",
        ));
    }
    let u = u64::from(vector);
    let numel: u64 = out_shape.iter().product();
    let in_spatial: u64 = in_sp.iter().product();
    // 32-bit index arithmetic (its divisions by constants are a multiply
    // and a shift; 64-bit ones are calls) when the output's indices and
    // the offsets within a plane fit, with room for the grid stride's last
    // step; a plane's start is 64-bit.
    let plane = in_spatial * if last { channels } else { 1 };
    let wide = numel.max(plane) > 1 << 30;
    let (ty, ll) = if wide {
        ("long long", "LL")
    } else {
        ("int", "")
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} pool {:?}{} (kernel {:?}, stride {:?}, padding {:?}, dilation {:?}), {u} output(s) a thread",
        if max { "max" } else { "average" },
        in_sp,
        if last { " channels-last" } else { "" },
        window.kernel,
        window.stride,
        window.padding,
        window.dilation
    );
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, long long n) {{\n    const {ty} count = ({ty})n;"
    );
    let _ = writeln!(
        src,
        "    const {ty} stride = ({ty})gridDim.x * blockDim.x * {u};\n    for ({ty} first = blockIdx.x * ({ty})blockDim.x * {u} + threadIdx.x; first < count; first += stride) {{"
    );
    // Per output `u`: whether it exists, the start of its (n, c) plane
    // (channels last: the channel is innermost and neighbouring threads
    // read neighbouring channels, `channels` apart per spatial step), and
    // its window's first input per spatial dim.
    let _ = writeln!(
        src,
        "        bool live[{u}]; const float* plane[{u}]; {ty} s[{u}][{dims}];"
    );
    let _ = writeln!(
        src,
        "        #pragma unroll\n        for (int u = 0; u < {u}; ++u) {{\n            const {ty} i = first + u * ({ty})blockDim.x;\n            live[u] = i < count;\n            {ty} rest = live[u] ? i : 0;"
    );
    if last {
        let _ = writeln!(
            src,
            "            const {ty} c = rest % {channels}{ll}; rest /= {channels}{ll};"
        );
    }
    for d in (0..dims).rev() {
        let _ = writeln!(
            src,
            "            s[u][{d}] = rest % {}{ll} * {}{ll} - {}{ll}; rest /= {}{ll};",
            out_sp[d], window.stride[d], window.padding[d], out_sp[d]
        );
    }
    if last {
        let _ = writeln!(
            src,
            "            plane[u] = x + (long long)rest * {}LL + c;",
            in_spatial * channels
        );
    } else {
        let _ = writeln!(
            src,
            "            plane[u] = x + (long long)rest * {in_spatial}LL;"
        );
    }
    src.push_str("        }\n");
    if max {
        let _ = writeln!(
            src,
            "        float acc[{u}];\n        #pragma unroll\n        for (int u = 0; u < {u}; ++u) acc[u] = __int_as_float(0xff800000);"
        );
    } else {
        let _ = writeln!(
            src,
            "        float acc[{u}] = {{}}; {ty} inside[{u}] = {{}};"
        );
    }
    for d in 0..dims {
        let _ = writeln!(
            src,
            "        #pragma unroll\n        for ({ty} k{d} = 0; k{d} < {}{ll}; ++k{d}) {{",
            window.kernel[d]
        );
    }
    let _ = writeln!(
        src,
        "        #pragma unroll\n        for (int u = 0; u < {u}; ++u) {{"
    );
    let mut inside = vec!["live[u]".to_string()];
    for (d, &extent) in in_sp.iter().enumerate() {
        let _ = writeln!(
            src,
            "            const {ty} p{d} = s[u][{d}] + k{d} * {}{ll};",
            window.dilation[d]
        );
        inside.push(format!("p{d} >= 0 && p{d} < {extent}{ll}"));
    }
    let mut offset = String::from("0");
    for (d, &extent) in in_sp.iter().enumerate() {
        offset = format!("({offset}) * {extent}{ll} + p{d}");
    }
    if last {
        offset = format!("({offset}) * {channels}{ll}");
    }
    let _ = writeln!(src, "            const bool in = {};", inside.join(" && "));
    if max {
        let _ = writeln!(
            src,
            "            acc[u] = fmaxf(acc[u], in ? plane[u][{offset}] : __int_as_float(0xff800000));"
        );
    } else {
        let _ = writeln!(
            src,
            "            acc[u] += in ? plane[u][{offset}] : 0.0f; inside[u] += in;"
        );
    }
    src.push_str("        }\n");
    for _ in 0..dims {
        src.push_str("        }\n");
    }
    let _ = writeln!(
        src,
        "        #pragma unroll\n        for (int u = 0; u < {u}; ++u) {{\n            if (!live[u]) continue;\n            const {ty} i = first + u * ({ty})blockDim.x;"
    );
    if max {
        src.push_str("            y[i] = acc[u];\n");
    } else if include_pad {
        // The divisor with padding counted: the window clipped to the
        // padded input.
        let mut terms = Vec::new();
        for (d, &extent) in in_sp.iter().enumerate() {
            let _ = writeln!(
                src,
                "            const {ty} e{d} = min(s[u][{d}] + {}{ll}, {}{ll});",
                window.kernel[d],
                extent + window.padding[d],
            );
            terms.push(format!("(e{d} - s[u][{d}])"));
        }
        let _ = writeln!(
            src,
            "            y[i] = acc[u] / (float)({});",
            terms.join(" * ")
        );
    } else {
        src.push_str("            y[i] = acc[u] / (float)inside[u];\n");
    }
    src.push_str("        }\n    }\n}\n");
    let launch = Launch {
        shared: 0,
        grid: numel.div_ceil(u64::from(block) * u).clamp(1, WAVES) as u32,
        block,
        sizes: vec![numel as i64],
    };
    Ok(one_node(name, action, src, vec![input], node, launch))
}

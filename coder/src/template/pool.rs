//! Pooling (max and average, 1–3 spatial dims, and global adaptive
//! pooling): one thread per output element, looping over its window.
//!
//! Output extents are the traced ones (so `ceil_mode` needs no rule here).
//! Average pooling divides as torch does: by the window clipped to the
//! padded input when `count_include_pad`, else by the elements inside the
//! input.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{AdaptivePool, Op, Pool};

use super::{Refusal, WAVES, one_node, one_per_thread};
use crate::action::Action;
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
    let block = one_per_thread(action, "pooling")?;
    let numel: u64 = out_shape.iter().product();
    let in_spatial: u64 = in_sp.iter().product();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} pool {:?}{} (kernel {:?}, stride {:?}, padding {:?}, dilation {:?})",
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
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, long long n) {{"
    );
    src.push_str("    long long stride = (long long)gridDim.x * blockDim.x;\n");
    src.push_str("    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += stride) {\n");
    // Output coordinates, innermost last; `plane` starts the (n, c) plane
    // (channels last: the channel is innermost and neighbouring threads
    // read neighbouring channels, `channels` apart per spatial step).
    src.push_str("        long long rest = i;\n");
    if last {
        let _ = writeln!(
            src,
            "        const long long c = rest % {channels}LL; rest /= {channels}LL;"
        );
    }
    for d in (0..dims).rev() {
        let _ = writeln!(
            src,
            "        long long o{d} = rest % {}LL; rest /= {}LL;",
            out_sp[d], out_sp[d]
        );
    }
    if last {
        let _ = writeln!(
            src,
            "        const float* plane = x + rest * {}LL + c;",
            in_spatial * channels
        );
    } else {
        let _ = writeln!(
            src,
            "        const float* plane = x + rest * {in_spatial}LL;"
        );
    }
    for d in 0..dims {
        let _ = writeln!(
            src,
            "        long long s{d} = o{d} * {}LL - {}LL;",
            window.stride[d], window.padding[d]
        );
    }
    if max {
        src.push_str("        float acc = __int_as_float(0xff800000);\n");
    } else {
        src.push_str("        float acc = 0.0f; long long inside = 0;\n");
        // The divisor with padding counted: the window clipped to the
        // padded input.
        let mut terms = Vec::new();
        for (d, &extent) in in_sp.iter().enumerate() {
            let _ = writeln!(
                src,
                "        long long e{d} = s{d} + {}LL; if (e{d} > {}LL) e{d} = {}LL;",
                window.kernel[d],
                extent + window.padding[d],
                extent + window.padding[d]
            );
            terms.push(format!("(e{d} - s{d})"));
        }
        let _ = writeln!(src, "        long long padded = {};", terms.join(" * "));
    }
    for (d, &extent) in in_sp.iter().enumerate() {
        let _ = writeln!(
            src,
            "        for (long long k{d} = 0; k{d} < {}LL; ++k{d}) {{ long long p{d} = s{d} + k{d} * {}LL; if (p{d} < 0 || p{d} >= {extent}LL) continue;",
            window.kernel[d], window.dilation[d]
        );
    }
    let mut offset = String::from("0");
    for (d, &extent) in in_sp.iter().enumerate() {
        offset = format!("({offset}) * {extent}LL + p{d}");
    }
    if last {
        offset = format!("({offset}) * {channels}LL");
    }
    if max {
        let _ = writeln!(src, "        acc = fmaxf(acc, plane[{offset}]);");
    } else {
        let _ = writeln!(src, "        acc += plane[{offset}]; ++inside;");
    }
    for _ in 0..dims {
        src.push_str("        }\n");
    }
    if max {
        src.push_str("        y[i] = acc;\n");
    } else if include_pad {
        src.push_str("        y[i] = acc / (float)padded;\n");
    } else {
        src.push_str("        y[i] = acc / (float)inside;\n");
    }
    src.push_str("    }\n}\n");
    let launch = Launch {
        shared: 0,
        grid: numel.div_ceil(u64::from(block)).clamp(1, WAVES) as u32,
        block,
        sizes: vec![numel as i64],
    };
    Ok(one_node(name, action, src, vec![input], node, launch))
}

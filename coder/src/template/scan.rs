//! Scans (cumsum, cumprod, forward or reverse) along one dim, the input
//! seen as `[outer, K, inner]`.
//!
//! - `inner == 1` (the scanned dim is the last): a block per row walks it
//!   in tiles of one element per thread; each tile is scanned by warp
//!   shuffles, then across warps through shared memory, and the running
//!   total of the tiles before it is carried into it.
//! - `inner > 1`: a thread per `(outer, inner)` line, sequential along
//!   `K`, neighbouring threads on neighbouring addresses.

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{Op, Scan};

use super::rows::{per_line, per_line_launch, per_row};
use super::{Refusal, WAVES, one_node, one_per_thread};
use crate::action::Action;
use crate::program::{Fragment, Launch};

/// Generates the kernel for a single scan node.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a scan kernel covers one op"));
    };
    let n = g.node(node);
    let Op::Scan(Scan {
        prod,
        dim,
        reverse,
        exclusive,
    }) = n.op
    else {
        return Err(Refusal::new(format!("`{}` is not a scan", n.name)));
    };
    if exclusive {
        return Err(Refusal::new("exclusive scans are not written yet"));
    }
    let input = g.inputs(node)[0];
    if g.tensor(input).dtype != DType::F32 || n.outputs[0].dtype != DType::F32 {
        return Err(Refusal::new(format!("`{}` is not float32", n.name)));
    }
    let shape = &g.tensor(input).shape;
    let outer: u64 = shape[..dim].iter().product();
    let k = shape[dim];
    let inner: u64 = shape[dim + 1..].iter().product();
    let block = one_per_thread(action, "scan")?;
    let (identity, op) = if prod { ("1.0f", "*") } else { ("0.0f", "+") };
    // Position `j` of the walk is element `at(j)` of the line.
    let at = |j: &str| {
        if reverse {
            format!("(K - 1 - {j})")
        } else {
            j.to_string()
        }
    };
    let what = if prod { "cumprod" } else { "cumsum" };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {what}{} over [{outer}, {k}, {inner}] (outer, scanned, inner)",
        if reverse { " (reverse)" } else { "" }
    );
    let (grid, sizes) = if inner == 1 {
        per_row(
            &mut src,
            name,
            "float",
            "    __shared__ float warp_total[32];\n    __shared__ float carry_in;\n    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n",
        );
        src.push_str("        float* yr = y + r * K;\n");
        let _ = writeln!(
            src,
            "        if (threadIdx.x == 0) carry_in = {identity};\n        __syncthreads();"
        );
        src.push_str("        for (long long base = 0; base < K; base += blockDim.x) {\n");
        src.push_str("            const long long j = base + threadIdx.x;\n");
        let _ = writeln!(
            src,
            "            float v = j < K ? LOAD_X(xr + {}) : {identity};",
            at("j")
        );
        let _ = writeln!(
            src,
            "            for (int off = 1; off < 32; off <<= 1) {{ float u = __shfl_up_sync(0xffffffffu, v, off); if (lane >= off) v = u {op} v; }}"
        );
        src.push_str(
            "            if (lane == 31) warp_total[warp] = v;\n            __syncthreads();\n",
        );
        // The first warp scans the warp totals in place.
        let _ = writeln!(
            src,
            "            if (warp == 0) {{ float t = lane < (blockDim.x >> 5) ? warp_total[lane] : {identity}; for (int off = 1; off < 32; off <<= 1) {{ float u = __shfl_up_sync(0xffffffffu, t, off); if (lane >= off) t = u {op} t; }} warp_total[lane] = t; }}"
        );
        src.push_str("            __syncthreads();\n");
        let _ = writeln!(
            src,
            "            float before = warp > 0 ? warp_total[warp - 1] : {identity};"
        );
        let _ = writeln!(src, "            v = (carry_in {op} before) {op} v;");
        let _ = writeln!(src, "            if (j < K) yr[{}] = v;", at("j"));
        src.push_str("            __syncthreads();\n");
        src.push_str("            if (threadIdx.x == blockDim.x - 1) carry_in = v;\n");
        src.push_str("            __syncthreads();\n        }\n    }\n}\n");
        (outer.clamp(1, WAVES * 2), vec![outer as i64, k as i64])
    } else {
        per_line(&mut src, name, "float");
        let _ = writeln!(src, "        float acc = {identity};");
        let _ = writeln!(
            src,
            "        for (long long j = 0; j < K; ++j) {{ long long at = base + {} * inner; acc = acc {op} LOAD_X(at); y[at] = acc; }}",
            at("j")
        );
        src.push_str("    }\n}\n");
        per_line_launch(outer, k, inner, block)
    };
    let launch = Launch {
        shared: 0,
        grid: grid as u32,
        block,
        sizes,
    };
    Ok(one_node(name, action, src, vec![input], node, launch))
}

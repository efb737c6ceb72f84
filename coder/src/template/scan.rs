//! Scans (cumsum, cumprod, forward or reverse, inclusive or exclusive)
//! along one dim, the input seen as `[outer, K, inner]`. An exclusive scan
//! is the inclusive scan of the input shifted one place along the walk
//! (the identity first); a warp per row then reads element by element.
//!
//! - `inner == 1` (the scanned dim is the last), with rows enough to fill
//!   the GPU a warp each: a warp per row walks it in tiles of
//!   [`LANE_ELEMENTS`] neighbouring elements a lane (two 16-byte loads when
//!   nothing is fused in front and the rows are 16-byte aligned). A lane
//!   scans its elements in registers, the warp scans the lanes' totals by
//!   shuffles, and the running total of the tiles before is carried in: no
//!   barrier, and two loads in flight a lane.
//! - `inner == 1` with fewer rows: a block per row walks it in tiles of one
//!   element per thread; each tile is scanned by warp shuffles, then across
//!   warps through shared memory, and the running total of the tiles before
//!   it is carried into it.
//! - `inner > 1`: a thread per `(outer, inner)` line, sequential along
//!   `K`, neighbouring threads on neighbouring addresses.

use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{Op, Scan};

use super::rows::{per_line, per_line_launch, per_row};
use super::{Refusal, WAVES, f32_input, one_node, one_per_thread};
use crate::action::Action;
use crate::program::{Fragment, Launch};

/// Scan `node` (float32 in and out): the op, its input, and the input
/// seen as `[outer, K, inner]` along the scanned dim.
pub(super) fn view(g: &OpGraph, node: NodeId) -> Result<(Scan, TensorRef, [u64; 3]), Refusal> {
    let n = g.node(node);
    let Op::Scan(scan) = &n.op else {
        return Err(Refusal::new(format!("`{}` is not a scan", n.name)));
    };
    let input = f32_input(g, node)?;
    let shape = &g.tensor(input).shape;
    let dim = scan.dim;
    let scan = scan.clone();
    let lines = [
        shape[..dim].iter().product(),
        shape[dim],
        shape[dim + 1..].iter().product(),
    ];
    Ok((scan, input, lines))
}

/// Generates the kernel for a single scan node.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a scan kernel covers one op"));
    };
    let (
        Scan {
            prod,
            reverse,
            exclusive,
            ..
        },
        input,
        [outer, k, inner],
    ) = view(g, node)?;
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
        "// {name}: {what}{}{} over [{outer}, {k}, {inner}] (outer, scanned, inner)",
        if reverse { " (reverse)" } else { "" },
        if exclusive { " (exclusive)" } else { "" }
    );
    // Walk position `j` reads element `at(j)`, or, exclusive, `at(j - 1)`
    // (the identity at position 0): the inclusive scan of the input
    // shifted one place.
    let (live, read) = if exclusive {
        ("j >= 1 && j < K", at("(j - 1)"))
    } else {
        ("j < K", at("j"))
    };
    let (grid, sizes) = if inner == 1 && outer >= WARP_ROWS {
        warp_per_row(&mut src, name, k, (reverse, exclusive), identity, op);
        let warps = u64::from(block / 32);
        (
            outer.div_ceil(warps).clamp(1, WAVES * 2),
            vec![outer as i64, k as i64],
        )
    } else if inner == 1 {
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
            "            float v = {live} ? LOAD_X(xr + {read}) : {identity};"
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
        // Exclusive: each element is written before it joins the total.
        let step = if exclusive {
            format!("y[at] = acc; acc = acc {op} LOAD_X(at);")
        } else {
            format!("acc = acc {op} LOAD_X(at); y[at] = acc;")
        };
        let _ = writeln!(
            src,
            "        for (long long j = 0; j < K; ++j) {{ long long at = base + {} * inner; {step} }}",
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

/// Rows from which a last-dim scan takes a warp per row: 8 warps an SM.
const WARP_ROWS: u64 = 132 * 8;

/// Elements of a row each lane of a [`warp_per_row`] scan holds per tile.
const LANE_ELEMENTS: u64 = 8;

/// The kernel of a last-dim scan with a warp per row (see the module's
/// comment). Position `j` of the walk is element `j` of the row, or
/// element `K - 1 - j` when `reverse`; a lane's elements are neighbours in
/// memory either way, so its loads are 16-byte loads of the row read
/// forward, their lanes reversed for a reverse walk.
fn warp_per_row(
    src: &mut String,
    name: &str,
    k: u64,
    (reverse, exclusive): (bool, bool),
    identity: &str,
    op: &str,
) {
    let per = LANE_ELEMENTS;
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}(const float* __restrict__ x, float* __restrict__ y, long long rows, long long K) {{"
    );
    src.push_str(
        "    const int lane = threadIdx.x & 31;
    const long long warps = (long long)gridDim.x * (blockDim.x >> 5);
",
    );
    src.push_str("    for (long long r = blockIdx.x * (long long)(blockDim.x >> 5) + (threadIdx.x >> 5); r < rows; r += warps) {
");
    src.push_str(
        "        const long long xr = r * K;
        float* yr = y + xr;
",
    );
    let _ = writeln!(src, "        float carry = {identity};");
    let _ = writeln!(
        src,
        "        for (long long base = 0; base < K; base += {}) {{",
        32 * per
    );
    let _ = writeln!(
        src,
        "            const long long j0 = base + lane * {per}LL;
            float v[{per}];"
    );
    // Memory index of walk position `j`.
    let at = |j: &str| {
        if reverse {
            format!("K - 1 - ({j})")
        } else {
            j.to_string()
        }
    };
    // Exclusive: position j reads position j - 1 (the identity at 0), so
    // a lane's reads are not 16-byte aligned: element by element.
    let scalar_load = if exclusive {
        format!(
            "            #pragma unroll\n            for (int e = 0; e < {per}; ++e) v[e] = j0 + e >= 1 && j0 + e < K ? LOAD_X(xr + {}) : {identity};",
            at("j0 + e - 1")
        )
    } else {
        format!(
            "            #pragma unroll\n            for (int e = 0; e < {per}; ++e) v[e] = j0 + e < K ? LOAD_X(xr + {}) : {identity};",
            at("j0 + e")
        )
    };
    let vector = k.is_multiple_of(4) && !exclusive;
    if vector {
        // Quad `q` of the lane holds walk positions j0 + 4q .. j0 + 4q + 3:
        // memory j0 + 4q on, or K - 4 - j0 - 4q on, read backwards.
        src.push_str("#ifdef MTMC_PROLOGUE\n");
        src.push_str(&scalar_load);
        src.push_str("\n#else\n");
        let _ = writeln!(
            src,
            "            #pragma unroll\n            for (int q = 0; q < {}; ++q) {{",
            per / 4
        );
        let _ = writeln!(
            src,
            "                const long long j = j0 + 4 * q;\n                float4 u = make_float4({identity}, {identity}, {identity}, {identity});"
        );
        let from = if reverse { "K - 4 - j" } else { "j" };
        let _ = writeln!(
            src,
            "                if (j < K) u = *reinterpret_cast<const float4*>(x + xr + {from});"
        );
        if reverse {
            src.push_str("                v[4 * q] = u.w; v[4 * q + 1] = u.z; v[4 * q + 2] = u.y; v[4 * q + 3] = u.x;\n");
        } else {
            src.push_str("                v[4 * q] = u.x; v[4 * q + 1] = u.y; v[4 * q + 2] = u.z; v[4 * q + 3] = u.w;\n");
        }
        src.push_str("            }\n#endif\n");
    } else {
        src.push_str(&scalar_load);
        src.push('\n');
    }
    let _ = writeln!(
        src,
        "            #pragma unroll\n            for (int e = 1; e < {per}; ++e) v[e] = v[e - 1] {op} v[e];"
    );
    let _ = writeln!(src, "            float t = v[{}];", per - 1);
    let _ = writeln!(
        src,
        "            #pragma unroll\n            for (int off = 1; off < 32; off <<= 1) {{ float u = __shfl_up_sync(0xffffffffu, t, off); if (lane >= off) t = u {op} t; }}"
    );
    let _ = writeln!(
        src,
        "            float before = __shfl_up_sync(0xffffffffu, t, 1);\n            if (lane == 0) before = {identity};\n            const float pre = carry {op} before;"
    );
    let _ = writeln!(
        src,
        "            #pragma unroll\n            for (int e = 0; e < {per}; ++e) v[e] = pre {op} v[e];"
    );
    let _ = writeln!(
        src,
        "            carry = __shfl_sync(0xffffffffu, v[{}], 31);",
        per - 1
    );
    if vector {
        let _ = writeln!(
            src,
            "            #pragma unroll\n            for (int q = 0; q < {}; ++q) {{",
            per / 4
        );
        src.push_str(
            "                const long long j = j0 + 4 * q;\n                if (j >= K) break;\n",
        );
        if reverse {
            src.push_str("                *reinterpret_cast<float4*>(yr + K - 4 - j) = make_float4(v[4 * q + 3], v[4 * q + 2], v[4 * q + 1], v[4 * q]);\n");
        } else {
            src.push_str("                *reinterpret_cast<float4*>(yr + j) = make_float4(v[4 * q], v[4 * q + 1], v[4 * q + 2], v[4 * q + 3]);\n");
        }
        src.push_str("            }\n");
    } else {
        let _ = writeln!(
            src,
            "            #pragma unroll\n            for (int e = 0; e < {per}; ++e) if (j0 + e < K) yr[{}] = v[e];",
            at("j0 + e")
        );
    }
    src.push_str("        }\n    }\n}\n");
}

//! Pooling (max and average, 1–3 spatial dims, and global adaptive
//! pooling). Two kernels:
//!
//! - **Staged** (channels first, where the tile fits): a block takes a
//!   tile of outputs (`rd` planes × `g·rh` rows × `ct·u` columns) and
//!   copies the inputs of their windows into shared memory, 16 bytes at a
//!   time from a 16-byte boundary; each thread then takes `u` columns
//!   (the action's vector width, `ct` apart) of `rd × rh` outputs and
//!   reads each staged input once for all of its outputs whose windows
//!   hold it. Read straight from global memory, neighbouring windows
//!   overlap, so each input passes through L1 many times, in unaligned
//!   128-byte requests; staged, it is read from memory once and from
//!   shared memory by conflict-free rows.
//! - **Walk** (channels last, global pooling, tiles too large for shared
//!   memory or mostly empty): each output loops over its window. A thread
//!   takes as many outputs as the vector width, a block apart, and walks
//!   their windows together, so that each step of the walk has that many
//!   independent loads in flight.
//!
//! A window's taps outside the input are predicated off (staged: the
//! padding value is staged in their place). Output extents are the traced
//! ones (so `ceil_mode` needs no rule here). Average pooling divides as
//! torch does: by the window clipped to the padded input when
//! `count_include_pad`, else by the elements inside the input.

use std::fmt::Write as _;

use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{AdaptivePool, Op, Pool};

use super::{ROW_BLOCKS, Refusal, WAVES, f32_input, one_node};
use crate::action::{Action, Params};
use crate::program::{Fragment, Launch};

/// One pooling window per spatial dim: kernel, stride, padding, dilation.
pub(super) struct Window {
    pub kernel: Vec<u64>,
    pub stride: Vec<u64>,
    pub padding: Vec<u64>,
    pub dilation: Vec<u64>,
}

impl Window {
    /// `p`'s window (dilation 1 where none is given), when its rank fits
    /// an `[N, C, spatial…]` input (or `[N, spatial…, C]`) and output of
    /// ranks `rank` and `out_rank`.
    pub(super) fn of(p: &Pool, rank: usize, out_rank: usize) -> Result<Window, Refusal> {
        let dims = p.spatial;
        let window = Window {
            kernel: p.kernel.clone(),
            stride: p.stride.clone(),
            padding: p.padding.clone(),
            dilation: if p.dilation.is_empty() {
                vec![1; dims]
            } else {
                p.dilation.clone()
            },
        };
        let sizes = [
            &window.kernel,
            &window.stride,
            &window.padding,
            &window.dilation,
        ];
        if rank != dims + 2 || out_rank != rank || sizes.iter().any(|v| v.len() != dims) {
            return Err(Refusal::new(
                "the window's rank does not match the input's spatial dims",
            ));
        }
        Ok(window)
    }
}

/// Generates the kernel for one pooling node.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let [node] = action.nodes()[..] else {
        return Err(Refusal::new("a pooling kernel covers one op"));
    };
    let n = g.node(node);
    let input = f32_input(g, node)?;
    let in_shape = g.tensor(input).shape.clone();
    let out_shape = n.outputs[0].shape.clone();
    let (max, window, include_pad, last) = match &n.op {
        Op::Pool(p) => (
            p.max,
            Window::of(p, in_shape.len(), out_shape.len())?,
            p.count_include_pad,
            p.channels_last,
        ),
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
    let Params { block, vector } = action.params;
    if !ROW_BLOCKS.contains(&block) || ![1, 2, 4].contains(&vector) {
        return Err(Refusal::new(
            "pooling kernels take a block of 64 to 1024 threads (a power of two) and walk 1, 2 or 4 outputs a thread together (the vector width)",
        ));
    }
    if !last && matches!(n.op, Op::Pool(_)) {
        let planes: u64 = in_shape[..2].iter().product();
        let shape = Staged::new(in_sp, out_sp, &window, planes, block, vector);
        if let Some(staged) = shape {
            let src = staged.source(name, max, include_pad, &window, in_sp);
            let launch = Launch {
                shared: 0,
                grid: staged.grid as u32,
                block,
                sizes: vec![out_shape.iter().product::<u64>() as i64],
            };
            return Ok(one_node(name, action, src, vec![input], node, launch));
        }
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

/// Static shared memory a staged block may take.
const STAGE_BYTES: u64 = 48 * 1024;
/// Accumulators a staged thread may hold (columns × planes × rows).
const STAGE_ACCUMULATORS: u64 = 16;
/// Shared-memory reads a staged thread may unroll.
const STAGE_READS: u64 = 512;
/// Outputs a staged thread takes along the outer spatial dims (planes,
/// rows), most shared taps first.
const STAGE_ROWS: [(u64, u64); 6] = [(2, 4), (2, 2), (1, 4), (1, 2), (2, 1), (1, 1)];

/// The staged kernel's tile, with the spatial dims taken as three (depth,
/// height, width; a missing one has extent, kernel, stride and dilation 1
/// and no padding).
#[derive(Debug)]
struct Staged {
    /// Input and output extents, kernel, stride, padding, dilation.
    input: [u64; 3],
    output: [u64; 3],
    kernel: [u64; 3],
    stride: [u64; 3],
    padding: [u64; 3],
    dilation: [u64; 3],
    /// Threads along the width, and groups of rows a block.
    ct: u64,
    g: u64,
    /// Columns, planes and rows a thread.
    u: u64,
    rd: u64,
    rh: u64,
    /// Staged planes, rows of the block and of a group, and floats a
    /// staged row (a multiple of 4).
    spd: u64,
    sph: u64,
    sph_group: u64,
    segment: u64,
    /// Tiles along each dim, and the grid (a block a tile).
    tiles: [u64; 3],
    grid: u64,
}

/// `v`'s spatial values as three dims, the missing leading ones `fill`.
fn three(v: &[u64], fill: u64) -> [u64; 3] {
    let mut out = [fill; 3];
    out[3 - v.len()..].copy_from_slice(v);
    out
}

impl Staged {
    /// The tile for a block of `block` threads taking `u` columns each,
    /// or `None` when none fits shared memory, the registers and the
    /// unroll budget, when at least half the tile would lie outside the
    /// output, or when the grid would exceed 2^31 - 1 blocks.
    fn new(
        in_sp: &[u64],
        out_sp: &[u64],
        w: &Window,
        planes: u64,
        block: u32,
        u: u32,
    ) -> Option<Staged> {
        let (block, u) = (u64::from(block), u64::from(u));
        let input = three(in_sp, 1);
        let output = three(out_sp, 1);
        let kernel = three(&w.kernel, 1);
        let stride = three(&w.stride, 1);
        let padding = three(&w.padding, 0);
        let dilation = three(&w.dilation, 1);
        let ct = output[2].div_ceil(u).next_power_of_two().min(block);
        let g = block / ct;
        let span =
            |d: usize, outputs: u64| (outputs - 1) * stride[d] + (kernel[d] - 1) * dilation[d] + 1;
        STAGE_ROWS.iter().find_map(|&(rd, rh)| {
            if (rd > 1 && rd > output[0]) || (rh > 1 && rh > output[1]) {
                return None;
            }
            let (spd, sph, sph_group) = (span(0, rd), span(1, g * rh), span(1, rh));
            // The window's first input may sit up to 3 floats past the
            // 16-byte boundary the row's copy starts from.
            let segment = (span(2, ct * u) + 3).div_ceil(4) * 4;
            let tiles = [
                output[0].div_ceil(rd),
                output[1].div_ceil(g * rh),
                output[2].div_ceil(ct * u),
            ];
            let covered = tiles[0] * rd * tiles[1] * g * rh * tiles[2] * ct * u;
            let grid = planes * tiles.iter().product::<u64>();
            let fits = spd * sph * segment * 4 <= STAGE_BYTES
                && u * rd * rh <= STAGE_ACCUMULATORS
                && spd * sph_group * kernel[2] * u <= STAGE_READS
                && 2 * output.iter().product::<u64>() >= covered
                && grid <= i32::MAX as u64;
            fits.then_some(Staged {
                input,
                output,
                kernel,
                stride,
                padding,
                dilation,
                ct,
                g,
                u,
                rd,
                rh,
                spd,
                sph,
                sph_group,
                segment,
                tiles,
                grid,
            })
        })
    }

    /// The kernel's source. `in_sp` are the real spatial dims (for the
    /// comment and the divisor).
    fn source(
        &self,
        name: &str,
        max: bool,
        include_pad: bool,
        window: &Window,
        in_sp: &[u64],
    ) -> String {
        let ([id, ih, iw], [od, oh, ow]) = (self.input, self.output);
        let ([kd, kh, kw], [sd, sh, sw]) = (self.kernel, self.stride);
        let ([pd, ph, pw], [dd, dh, dw]) = (self.padding, self.dilation);
        let (ct, g, u, rd, rh) = (self.ct, self.g, self.u, self.rd, self.rh);
        let (spd, sph, sph_group, segment) = (self.spd, self.sph, self.sph_group, self.segment);
        let [tdn, thn, twn] = self.tiles;
        let block = ct * g;
        let (rows, width) = (g * rh, ct * u);
        let pad = if max {
            "__int_as_float(0xff800000)"
        } else {
            "0.0f"
        };
        let mut src = String::new();
        let _ = writeln!(
            src,
            "// {name}: {} pool {in_sp:?} (kernel {:?}, stride {:?}, padding {:?}, dilation {:?}), staged: a block stages the inputs of {rd} plane(s) x {rows} row(s) x {width} outputs in shared memory; a thread takes {u} column(s) {ct} apart of {rd} x {rh} outputs",
            if max { "max" } else { "average" },
            window.kernel,
            window.stride,
            window.padding,
            window.dilation,
        );
        let _ = writeln!(
            src,
            "extern \"C\" __global__ void __launch_bounds__({block}) {name}(const float* __restrict__ x, float* __restrict__ y, long long n) {{"
        );
        let _ = writeln!(
            src,
            "    __shared__ __align__(16) float tile[{}];",
            spd * sph * segment
        );
        let _ = writeln!(
            src,
            "    long long r = blockIdx.x;\n    const int tw = (int)(r % {twn}); r /= {twn};\n    const int th = (int)(r % {thn}); r /= {thn};\n    const int td = (int)(r % {tdn}); const long long plane = r / {tdn};"
        );
        let _ = writeln!(
            src,
            "    const int sd = td * {} - {pd}, sh = th * {} - {ph}, start = tw * {} - {pw};",
            rd * sd,
            rows * sh,
            width * sw
        );
        // A row's copy starts at the 16-byte boundary at or before the
        // first window's first input (two's complement: `& ~3` floors).
        let _ = writeln!(
            src,
            "    const int wa = start & ~3, off = start - wa;\n    const float* p = x + plane * {}LL;",
            id * ih * iw
        );
        let quads = segment / 4;
        let _ = writeln!(
            src,
            "    for (int q = threadIdx.x; q < {}; q += {block}) {{\n        const int w4 = q % {quads}, b = q / {quads} % {sph}, a = q / {};\n        const int d = sd + a, h = sh + b, w = wa + 4 * w4;\n        const bool row = d >= 0 && d < {id} && h >= 0 && h < {ih};\n        const float* src = p + (row ? ((long long)d * {ih} + h) * {iw} : 0LL);\n        float4 v;",
            spd * sph * quads,
            sph * quads
        );
        let lane = |i: u32, c: &str| {
            format!("v.{c} = row && w + {i} >= 0 && w + {i} < {iw} ? src[w + {i}] : {pad};")
        };
        let scalar = format!(
            "{} {} {} {}",
            lane(0, "x"),
            lane(1, "y"),
            lane(2, "z"),
            lane(3, "w")
        );
        if iw % 4 == 0 {
            // Rows start on 16 bytes: whole quads inside the row are one
            // load.
            let _ = writeln!(
                src,
                "        if (row && w >= 0 && w + 3 < {iw}) v = *reinterpret_cast<const float4*>(src + w);\n        else {{ {scalar} }}"
            );
        } else {
            let _ = writeln!(src, "        {scalar}");
        }
        src.push_str(
            "        reinterpret_cast<float4*>(tile)[q] = v;\n    }\n    __syncthreads();\n",
        );
        let _ = writeln!(
            src,
            "    const int g = threadIdx.x / {ct}, c = threadIdx.x % {ct};"
        );
        let init = if max { pad } else { "0.0f" };
        let _ = writeln!(
            src,
            "    float acc[{u}][{rd}][{rh}];\n    #pragma unroll\n    for (int u = 0; u < {u}; ++u)\n    #pragma unroll\n    for (int jd = 0; jd < {rd}; ++jd)\n    #pragma unroll\n    for (int jh = 0; jh < {rh}; ++jh) acc[u][jd][jh] = {init};"
        );
        // Every staged input of the thread's rows, once, into each of its
        // outputs whose window holds it (the conditions are constants
        // once unrolled; inputs no window holds are never read).
        let op = if max {
            "fmaxf(acc[u][jd][jh], v)"
        } else {
            "acc[u][jd][jh] + v"
        };
        let _ = writeln!(
            src,
            "    #pragma unroll\n    for (int a = 0; a < {spd}; ++a)\n    #pragma unroll\n    for (int b = 0; b < {sph_group}; ++b)\n    #pragma unroll\n    for (int k = 0; k < {kw}; ++k)\n    #pragma unroll\n    for (int u = 0; u < {u}; ++u) {{\n        const float v = tile[(a * {sph} + g * {} + b) * {segment} + off + (c + u * {ct}) * {sw} + k * {dw}];\n        #pragma unroll\n        for (int jd = 0; jd < {rd}; ++jd)\n        #pragma unroll\n        for (int jh = 0; jh < {rh}; ++jh) {{\n            const int kd = a - jd * {sd}, kh = b - jh * {sh};\n            if (kd >= 0 && kd % {dd} == 0 && kd / {dd} < {kd} && kh >= 0 && kh % {dh} == 0 && kh / {dh} < {kh}) acc[u][jd][jh] = {op};\n        }}\n    }}",
            rh * sh
        );
        let _ = writeln!(
            src,
            "    #pragma unroll\n    for (int u = 0; u < {u}; ++u)\n    #pragma unroll\n    for (int jd = 0; jd < {rd}; ++jd)\n    #pragma unroll\n    for (int jh = 0; jh < {rh}; ++jh) {{\n        const int od = td * {rd} + jd, oh = th * {rows} + g * {rh} + jh, ow = tw * {width} + c + u * {ct};\n        if (od >= {od} || oh >= {oh} || ow >= {ow}) continue;"
        );
        // The real dims' output coordinates, innermost last.
        let coords = ["od", "oh", "ow"];
        let first = 3 - in_sp.len();
        let divisor = if max {
            None
        } else {
            let mut terms = Vec::new();
            for (d, &extent) in in_sp.iter().enumerate() {
                let o = coords[first + d];
                let _ = writeln!(
                    src,
                    "        const int s{d} = {o} * {} - {};",
                    window.stride[d], window.padding[d]
                );
                if include_pad {
                    let _ = writeln!(
                        src,
                        "        const int e{d} = min(s{d} + {}, {});",
                        window.kernel[d],
                        extent + window.padding[d]
                    );
                    terms.push(format!("(e{d} - s{d})"));
                } else {
                    let _ = writeln!(
                        src,
                        "        int n{d} = 0;\n        #pragma unroll\n        for (int k = 0; k < {}; ++k) n{d} += s{d} + k * {} >= 0 && s{d} + k * {} < {extent};",
                        window.kernel[d], window.dilation[d], window.dilation[d]
                    );
                    terms.push(format!("n{d}"));
                }
            }
            Some(terms.join(" * "))
        };
        let value = match divisor {
            None => "acc[u][jd][jh]".to_string(),
            Some(d) => format!("acc[u][jd][jh] / (float)({d})"),
        };
        let _ = writeln!(
            src,
            "        y[((plane * {od} + od) * {oh} + oh) * {ow} + ow] = {value};\n    }}\n}}"
        );
        src
    }
}

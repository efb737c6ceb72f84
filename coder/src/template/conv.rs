//! Convolutions (1–3-d, one channel group) as implicit GEMMs on the
//! tensor cores, with a pointwise chain fused after them: the alternative
//! to the cuDNN call.
//!
//! Output pixels are the GEMM's rows (`M = batch · output positions`),
//! output channels its columns (`N`), and the reduction runs over input
//! channels and kernel taps (`K = C · taps`, the weight's own row-major
//! order, so the weights are B stored K-contiguous). A is never formed:
//! each 32-deep slice of it is gathered from the input with 4-byte
//! `cp.async` copies that zero-fill the padding, into the M-contiguous
//! staged layout of the GEMM kernel, whose `mma.sync` 3xTF32 main loop
//! (fp32 accuracy) then runs unchanged. A lane gathers the same rows of
//! every slice (their positions are worked out once per block) and a warp
//! the same taps of a slice, so consecutive lanes read consecutive output
//! positions: with stride 1, consecutive input elements. The block's
//! columns are sized to the output channels (16 to 128), and the results
//! are written to the NC… output, eight consecutive positions of a channel
//! per sector.

use std::fmt::Write as _;

use mtmc_actions::graph::{OpGraph, TensorRef};
use mtmc_actions::op::{Conv, Op};

use super::Refusal;
use super::gemm::{
    BK, Fused, Operand, Pair, STAGES, WHOLE, Warps, body, copy16, float32_only, helpers, mma_store,
};
use super::pointwise::shape;
use crate::action::Action;
use crate::program::Fragment;

/// Threads per block: four warps.
const THREADS: u32 = 128;

/// Whether the convolution family computes `op`: a convolution that is
/// not transposed, over one channel group.
pub fn computes(op: &Op) -> bool {
    matches!(op, Op::Conv(c) if !c.transposed && c.groups == 1)
}

/// The warp layout for `n` output channels: the narrowest block that
/// holds them (16, 32, 64 or 128 columns).
fn warps_for(n: u64) -> Warps {
    match n {
        0..=16 => Warps::new(1, 2, THREADS),
        17..=32 => Warps::new(2, 2, THREADS),
        33..=64 => Warps::new(2, 4, THREADS),
        _ => Warps::new(2, 8, THREADS),
    }
}

/// The implicit-GEMM kernel for `action`'s region: a convolution (its
/// first node), then a pointwise chain fused after it.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let region = action.nodes();
    let node = region[0];
    let Op::Conv(conv) = &g.node(node).op else {
        return Err(Refusal::new(
            "a convolution region starts with a convolution",
        ));
    };
    if conv.transposed {
        return Err(Refusal::new(
            "a transposed convolution has no implicit-GEMM template yet",
        ));
    }
    if conv.groups != 1 {
        return Err(Refusal::new(format!(
            "a convolution over {} channel groups has no implicit-GEMM template yet (one group only)",
            conv.groups
        )));
    }
    let ins = g.inputs(node);
    let out = TensorRef::first(node);
    float32_only(g, node, "convolution")?;
    let (sx, sw, so) = (shape(g, ins[0]), shape(g, ins[1]), shape(g, out));
    let dims = conv.spatial;
    if sx.len() != dims + 2 || sw.len() != dims + 2 || so.len() != dims + 2 {
        return Err(Refusal::new(
            "the convolution's input, weight and output must be batched NC… tensors",
        ));
    }
    let geometry = Geometry::new(conv, &sx, &sw, &so)?;
    let (m, n, k) = (geometry.m(), so[1], geometry.k());
    if m >= 1 << 31 || k >= 1 << 31 {
        return Err(Refusal::new(
            "the convolution has 2^31 output positions or reduction steps or more",
        ));
    }
    // Output channels are the GEMM's columns.
    let fused = Fused::new(g, &region, conv.bias, n, name)?;

    let warps = warps_for(n);
    let (bm, bn) = (warps.bm(), warps.bn());
    let a = Operand {
        k_contiguous: false,
        batch_stride: 0,
    };
    let b = Operand {
        k_contiguous: true,
        batch_stride: 0,
    };
    let blocks = m.div_ceil(bm) * n.div_ceil(bn);
    if blocks > u64::from(u32::MAX / 2) {
        return Err(Refusal::new("the convolution is too large for one launch"));
    }
    let shared = 4 * STAGES * (a.tile(bm) + b.tile(bn));

    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: fp32 {dims}-d convolution as an implicit GEMM {m}x{n}x{k} on the tensor cores (3xTF32){}",
        fused.chained()
    );
    src.push_str(fused.epilogue_source());
    src.push_str(&helpers(name));
    let _ = writeln!(
        src,
        r#"__device__ __forceinline__ void {name}_cp4(float* dst, const float* src, bool ok) {{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;\n" :: "r"(d), "l"(src), "r"(ok ? 4 : 0));
}}"#
    );
    src.push_str(&fused.signature(name, THREADS));
    let _ = writeln!(
        src,
        "    const long long M = {m}LL, N = {n}LL, K = {k}LL;\n    const long long A_BATCH = 0LL, B_BATCH = 0LL;"
    );
    let _ = writeln!(
        src,
        "    const int TILES_M = {}, TILES_N = {}, KTILES = {};",
        m.div_ceil(bm),
        n.div_ceil(bn),
        k.div_ceil(BK)
    );
    let store = fused.store(name);
    let load_b = if k.is_multiple_of(4) {
        copy16(name, &b, "b", "N", bn, "n0", THREADS)
    } else {
        // Weight rows not on 16 bytes: element by element.
        format!(
            r#"        for (int e = tid; e < {elements}; e += {THREADS}) {{
            int r = e / {BK}, kc = e % {BK};
            bool ok = n0 + r < N && k0 + kc < K;
            {name}_cp4(&bs[r * {pad} + kc], ok ? b + (n0 + r) * K + k0 + kc : b, ok);
        }}
"#,
            elements = bn * BK,
            pad = BK + 4,
        )
    };
    let (setup, load_a) = geometry.gather(name, bm);
    src.push_str(&body(
        name,
        &a,
        &b,
        warps,
        &setup,
        (&load_a, &load_b),
        WHOLE,
    ));
    let offset = format!(
        "(row / {positions} * N + col + q) * {positions} + row % {positions}",
        positions = geometry.positions()
    );
    // Adjacent columns are output channels: `positions` apart.
    src.push_str(&mma_store(&store, warps, &offset, Pair::Scalar));
    src.push_str("}\n");
    Ok(fused.fragment(name, action, src, blocks, THREADS, shared))
}

/// The sizes of one convolution, per spatial dim.
struct Geometry {
    batch: u64,
    channels: u64,
    input: Vec<u64>,
    output: Vec<u64>,
    kernel: Vec<u64>,
    stride: Vec<u64>,
    padding: Vec<u64>,
    dilation: Vec<u64>,
}

impl Geometry {
    fn new(conv: &Conv, sx: &[u64], sw: &[u64], so: &[u64]) -> Result<Geometry, Refusal> {
        let dims = conv.spatial;
        let per_dim = |v: &[u64], what: &str| -> Result<Vec<u64>, Refusal> {
            if v.len() == dims {
                Ok(v.to_vec())
            } else {
                Err(Refusal::new(format!(
                    "the convolution's {what} has {} values for {dims} spatial dims",
                    v.len()
                )))
            }
        };
        let geometry = Geometry {
            batch: sx[0],
            channels: sx[1],
            input: sx[2..].to_vec(),
            output: so[2..].to_vec(),
            kernel: per_dim(&conv.kernel, "kernel")?,
            stride: per_dim(&conv.stride, "stride")?,
            padding: per_dim(&conv.padding, "padding")?,
            dilation: per_dim(&conv.dilation, "dilation")?,
        };
        if sw[1] != geometry.channels || sw[2..] != geometry.kernel[..] || so[0] != sx[0] {
            return Err(Refusal::new(
                "the weight's shape does not match the input's channels and the kernel",
            ));
        }
        for d in 0..dims {
            let span = geometry.dilation[d] * (geometry.kernel[d] - 1) + 1;
            let expected = (geometry.input[d] + 2 * geometry.padding[d])
                .checked_sub(span)
                .map(|r| r / geometry.stride[d] + 1);
            if expected != Some(geometry.output[d]) {
                return Err(Refusal::new(format!(
                    "the output's spatial dim {d} ({}) is not what the kernel, stride, padding and dilation give",
                    geometry.output[d]
                )));
            }
        }
        Ok(geometry)
    }

    /// Output positions per image.
    fn positions(&self) -> u64 {
        self.output.iter().product()
    }

    /// Rows of the implicit GEMM.
    fn m(&self) -> u64 {
        self.batch * self.positions()
    }

    /// Depth of the implicit GEMM: input channels times kernel taps.
    fn k(&self) -> u64 {
        self.channels * self.kernel.iter().product::<u64>()
    }

    /// The gather of A's slices for a block of `bm` rows: the per-block
    /// setup (each lane's rows: where their window starts in the input,
    /// per dim, and the offset of that start) and the per-slice load (each
    /// warp's taps: channel and tap offsets; each element checked against
    /// the input's bounds, zero-filled outside).
    fn gather(&self, name: &str, bm: u64) -> (String, String) {
        let dims = self.input.len();
        // Offsets into the input: 32-bit where they fit.
        let elements = self.batch * self.channels * self.input.iter().product::<u64>();
        let index = if elements < 1 << 31 {
            "int"
        } else {
            "long long"
        };
        let per_lane = bm / 32;
        let image: u64 = self.input.iter().product();
        // Elements between consecutive steps along input dim d.
        let pitch: Vec<u64> = (0..dims)
            .map(|d| self.input[d + 1..].iter().product())
            .collect();
        let mut setup = String::new();
        let _ = writeln!(setup, "    {index} base_[{per_lane}];");
        for d in 0..dims {
            let _ = writeln!(setup, "    int at{d}_[{per_lane}];");
        }
        let _ = writeln!(
            setup,
            "#pragma unroll\n    for (int j = 0; j < {per_lane}; ++j) {{\n        long long m = m0 + lane + 32 * j;"
        );
        let _ = writeln!(
            setup,
            "        int img = (int)(m / {positions});\n        int rest = (int)(m % {positions});",
            positions = self.positions()
        );
        let mut offset = format!("({index})img * {}", self.channels * image);
        for d in (0..dims).rev() {
            let _ = writeln!(
                setup,
                "        int o{d} = rest % {out}; rest /= {out};\n        at{d}_[j] = m < M ? o{d} * {s} - {p} : -(1 << 30);",
                out = self.output[d],
                s = self.stride[d],
                p = self.padding[d],
            );
        }
        for (d, step) in pitch.iter().enumerate() {
            let _ = write!(offset, " + at{d}_[j] * {step}");
        }
        let _ = writeln!(setup, "        base_[j] = m < M ? {offset} : 0;\n    }}");

        let taps: u64 = self.kernel.iter().product();
        let mut load = String::new();
        let _ = writeln!(
            load,
            "#pragma unroll\n        for (int i = 0; i < {per_warp}; ++i) {{",
            per_warp = BK / 4
        );
        let _ = writeln!(
            load,
            "            const int kq = warp + 4 * i;\n            const int kk = (int)k0 + kq;\n            const int c = kk / {taps}, tap = kk % {taps};"
        );
        let mut koff = format!("({index})c * {image}");
        let mut rest = "tap".to_string();
        for d in (0..dims).rev() {
            let inner: u64 = self.kernel[d + 1..].iter().product();
            let _ = writeln!(
                load,
                "            const int t{d} = ({rest} / {inner}) % {kd} * {dil};",
                kd = self.kernel[d],
                dil = self.dilation[d],
            );
            let _ = write!(koff, " + t{d} * {}", pitch[d]);
            rest = "tap".to_string();
        }
        let _ = writeln!(load, "            const {index} koff = {koff};");
        let mut ok = "kk < K".to_string();
        for d in 0..dims {
            let _ = write!(ok, " && (unsigned)(at{d}_[j] + t{d}) < {}u", self.input[d]);
        }
        let _ = writeln!(
            load,
            r#"#pragma unroll
            for (int j = 0; j < {per_lane}; ++j) {{
                bool ok = {ok};
                {name}_cp4(&as[kq * {pad} + lane + 32 * j], ok ? a + base_[j] + koff : a, ok);
            }}
        }}"#,
            pad = bm + 8,
        );
        (setup, load)
    }
}

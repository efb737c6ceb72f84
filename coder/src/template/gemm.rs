//! Matrix products as fp32 GEMM kernels with a fused epilogue: the
//! alternative to the library call.
//!
//! Tensor cores with fp32 accuracy: each operand is split into a TF32
//! value and a TF32 remainder (`x = big + small`), and each product is
//! `big·big + big·small + small·big` (the `small·small` term is below
//! fp32's precision). Each 8-deep step's three products are summed by
//! `mma.sync` into a fresh accumulator, which is then added to the running
//! sum in fp32 with round-to-nearest: the tensor cores' own accumulation
//! truncates, and over thousands of steps that bias would leave fp32's
//! accuracy. Measured on the H100 against a float64 product, the error is
//! below cuBLAS's fp32 SGEMM.
//!
//! Compiled for Hopper's arch-specific target (`sm_90a`), the products
//! are `wgmma` instructions of a warpgroup each: a block of two
//! warpgroups computes a 128×128 tile, 64 rows each. TF32 `wgmma` reads
//! both operands K-major from shared memory, in the 128-byte swizzled
//! layout; the tensor cores read a raw fp32 value as its TF32 truncation
//! (the `big` part). Each thread loads its part of the next slice but one
//! into registers, and writes the next slice to shared memory twice, raw
//! and as remainders (`x - big`, rounded to TF32), while this slice's
//! products run; an operand stored the other way (`x.T`, or a B stored
//! `[K, N]`) is transposed on the way, in registers. Staged so, the
//! remainders cost no pass over shared memory of their own: on the H100 a
//! 4096³ `x @ w.T` took 1.49 ms against 2.07 ms when the slices came in
//! with `cp.async` and a second pass wrote the remainders. Each slice's
//! twelve products go to a fresh accumulator, added to the running sum in
//! fp32.
//!
//! Compiled for any other target, the same kernel runs `mma.sync`: eight
//! warps of 64×32 each (`m16n8k8` fragments) compute the 128×128 tile;
//! 32-deep slices of both operands are staged through shared memory in
//! three stages with `cp.async`, so loads of the next slices overlap the
//! products of this one. Either operand may be K-contiguous or
//! M/N-contiguous (transposed); each layout has its own shared-memory
//! padding that keeps the fragment reads free of bank
//! conflicts. Blocks walk the tiles in groups of eight tile rows, so that
//! neighbouring blocks share operand tiles in L2.

use std::fmt::Write as _;

use mtmc_actions::dtype::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::Op;

use super::pointwise::{Epilogue, epilogue, shape};
use super::{Refusal, WAVES};
use crate::action::Action;
use crate::program::{Fragment, Lang, Launch};

/// Output rows per block.
const BM: u64 = 128;
/// Output columns per block.
const BN: u64 = 128;
/// Depth of one staged slice.
pub(super) const BK: u64 = 32;
/// Slices in flight.
pub(super) const STAGES: u64 = 3;
/// The `mma.sync` body's warp layout: each warp computes 64 rows and
/// `frags` 8-column fragments of the block's tile.
#[derive(Clone, Copy)]
pub(super) struct Warps {
    /// Warps across the tile's columns (rows: the rest).
    across: u32,
    /// 8-column fragments per warp.
    frags: u32,
    /// Threads per block.
    pub(super) threads: u32,
}

impl Warps {
    /// A layout of `across` warps over the columns with `frags` fragments
    /// each, `threads` threads in all.
    pub(super) const fn new(across: u32, frags: u32, threads: u32) -> Warps {
        Warps {
            across,
            frags,
            threads,
        }
    }

    /// Output rows per block.
    pub(super) fn bm(self) -> u64 {
        u64::from(self.threads / 32 / self.across) * 64
    }

    /// Output columns per block.
    pub(super) fn bn(self) -> u64 {
        u64::from(self.across * self.frags) * 8
    }
}

/// Eight warps of 64×32: the `mma.sync` path, for targets without
/// `wgmma`.
const EIGHT: Warps = Warps::new(4, 4, 256);
/// Bytes of one slice in the `wgmma` path (A and B, 128 rows of 128
/// bytes each).
const WG_STAGE: u64 = (BM + BN) * BK * 4;
/// Shared memory of the `wgmma` path: two slices of raw values and two of
/// their remainders, and 1 KiB to align the swizzled tiles.
const WG_SHARED: u64 = 4 * WG_STAGE + 1024;
/// 16-byte chunks of one operand's slice each of the `wgmma` path's 256
/// threads moves.
const WG_PER: u64 = BM * BK / 4 / 256;
// Four chunks of K-contiguous rows a thread; an operand stored `[K,
// rows]` is one 4×4 block a thread, four chunks too.
const _: () = assert!(WG_PER == 4 && BM == BN && (BK / 4) * (BN / 4) == 256);

/// How one operand is laid out in memory.
pub(super) struct Operand {
    /// Contiguous along K (`[rows, K]`), else along its rows (`[K, rows]`).
    pub(super) k_contiguous: bool,
    /// Elements between consecutive batches (0: shared by every batch).
    pub(super) batch_stride: u64,
}

impl Operand {
    /// Floats of one staged slice of `rows` rows, padded.
    pub(super) fn tile(&self, rows: u64) -> u64 {
        if self.k_contiguous {
            rows * (BK + 4)
        } else {
            BK * (rows + 8)
        }
    }
}

/// The GEMM kernel for `action`'s region: a matrix product (its first
/// node), then a pointwise chain fused after it.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let region = action.nodes();
    let mm = region[0];
    let Op::MatMul(m) = &g.node(mm).op else {
        return Err(Refusal::new("a GEMM region starts with a matrix product"));
    };
    let ins = g.inputs(mm);
    let out = TensorRef::first(mm);
    float32_only(g, mm, "GEMM")?;
    let (sa, sb, so) = (shape(g, ins[0]), shape(g, ins[1]), shape(g, out));
    if sa.len() < 2 || sb.len() < 2 || so.len() < 2 {
        return Err(Refusal::new(
            "a matrix-vector product has no GEMM template (operands of rank 1)",
        ));
    }
    let (ra, rb, ro) = (sa.len(), sb.len(), so.len());
    let n = so[ro - 1];
    let k = if m.trans_a { sa[ra - 2] } else { sa[ra - 1] };
    let batch_dims = &so[..ro - 2];
    // A batch of row-major A times one B is one taller product.
    let (batch, rows) = if rb == 2 && !m.trans_a {
        (1, so[..ro - 1].iter().product::<u64>())
    } else {
        (batch_dims.iter().product::<u64>(), so[ro - 2])
    };
    let stride = |s: &[u64], elements: u64| -> Result<u64, Refusal> {
        if batch == 1 || s.len() == 2 {
            Ok(0)
        } else if s[..s.len() - 2] == *batch_dims {
            Ok(elements)
        } else {
            Err(Refusal::new(
                "operands whose batch dims broadcast have no GEMM template",
            ))
        }
    };
    let a = Operand {
        k_contiguous: !m.trans_a,
        batch_stride: stride(&sa, rows * k)?,
    };
    let b = Operand {
        k_contiguous: m.trans_b,
        batch_stride: stride(&sb, n * k)?,
    };
    // 16-byte copies: each operand's rows start on 16 bytes.
    for (what, op, extent) in [("A", &a, rows), ("B", &b, n)] {
        let row = if op.k_contiguous { k } else { extent };
        if !row.is_multiple_of(4) {
            return Err(Refusal::new(format!(
                "{what}'s rows ({row} floats) are not a multiple of 4: the 16-byte copies need aligned rows"
            )));
        }
    }
    let tiles = rows.div_ceil(BM) * n.div_ceil(BN);
    let blocks = batch * tiles;
    if blocks > u64::from(u32::MAX / 2) || rows * n * batch > i64::MAX as u64 / 2 {
        return Err(Refusal::new("the product is too large for one launch"));
    }
    // A long product with few tiles would leave most SMs idle for its
    // whole length, one tile a block: it is split over K instead.
    let parts = parts_over_k(blocks, k);
    let macs = batch * rows * n * k;
    if parts > 1 && macs < SPLIT_MACS {
        return Err(Refusal::new(format!(
            "{blocks} output tiles of {BM}x{BN} over K = {k} leave most SMs idle, and {macs} multiply-adds are too few to split over K (its extra launches cost more than they save)"
        )));
    }
    let fused = Fused::new(g, &region, m.bias, n, name)?;

    // `wgmma` where the target has it (every layout), else `mma.sync`.
    let warps = EIGHT;
    let shared = (4 * STAGES * (a.tile(BM) + b.tile(BN))).max(WG_SHARED);
    let threads = warps.threads;
    let mut src = String::new();
    let split = if parts > 1 {
        format!(", split over K in {parts} parts")
    } else {
        String::new()
    };
    let _ = writeln!(
        src,
        "// {name}: fp32 GEMM ({batch}x) {rows}x{n}x{k} on the tensor cores (3xTF32; wgmma on sm_90a){split}{}",
        fused.chained()
    );
    src.push_str(fused.epilogue_source());
    src.push_str(&helpers(name));
    src.push_str("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n");
    src.push_str(&wgmma_helpers(name));
    src.push_str("#endif\n");
    // Split over K, the product's kernel adds its part to the output
    // (zeroed first); the bias and the chain are applied after, by a
    // kernel of their own where there are any (the stored value is more
    // than the accumulator).
    let stored = fused.store(name);
    let after = parts > 1 && stored != "ACC";
    let product = if after {
        format!("{name}_part")
    } else {
        name.to_string()
    };
    src.push_str(&fused.signature(&product, threads));
    let _ = writeln!(
        src,
        "    const long long M = {rows}LL, N = {n}LL, K = {k}LL;"
    );
    let _ = writeln!(
        src,
        "    const long long A_BATCH = {}LL, B_BATCH = {}LL;",
        a.batch_stride, b.batch_stride
    );
    let ktiles = k.div_ceil(BK);
    let _ = writeln!(
        src,
        "    const int TILES_M = {}, TILES_N = {}, KTILES = {ktiles};",
        rows.div_ceil(BM),
        n.div_ceil(BN),
    );
    let (store, pair, range) = if parts > 1 {
        // Block b multiplies tile b % blocks over part b / blocks: the
        // blocks of one part, which read the same slices of K, run side by
        // side, so that tiles sharing an operand's slice read it from L2.
        let per = ktiles.div_ceil(parts);
        let _ = writeln!(
            src,
            "    const int TILE = blockIdx.x % {blocks}, KT0 = (blockIdx.x / {blocks}) * {per}, KT1 = min(KTILES, KT0 + {per});"
        );
        ("ACC", Pair::Atomic, PART)
    } else {
        (stored.as_str(), Pair::row_major(n), WHOLE)
    };
    let (bm, bn) = (warps.bm(), warps.bn());
    let loads = (
        copy16(name, &a, "a", "M", bm, "m0", threads),
        copy16(name, &b, "b", "N", bn, "n0", threads),
    );
    let mut mma = body(name, &a, &b, warps, "", (&loads.0, &loads.1), range);
    mma.push_str(&mma_store(store, warps, ROW_MAJOR, pair));
    src.push_str("#if defined(__CUDA_ARCH_FEAT_SM90_ALL)\n");
    src.push_str(&wgmma_body(
        name,
        store,
        (a.k_contiguous, b.k_contiguous),
        pair,
        range,
    ));
    src.push_str("#else\n");
    src.push_str(&mma);
    src.push_str("#endif\n");
    src.push_str("}\n");
    if parts == 1 {
        return Ok(fused.fragment(name, action, src, blocks, threads, shared));
    }
    let total = batch * rows * n;
    let pass = |kernel: &str, grid: u64, shared: u64| crate::program::Pass {
        kernel: kernel.to_string(),
        launch: Launch {
            grid: u32::try_from(grid).expect("checked above"),
            block: threads,
            sizes: Vec::new(),
            shared: u32::try_from(shared).expect("a few hundred kB"),
        },
    };
    // The passes over every output element (zeroing it, the bias and
    // chain) are grid-stride loops.
    let spread = total.div_ceil(u64::from(threads)).min(WAVES);
    let each = format!(
        "    for (long long o = blockIdx.x * (long long){threads} + threadIdx.x; o < {total}LL; o += (long long)gridDim.x * {threads})"
    );
    let _ = write!(
        src,
        "{}{each} out[o] = 0.0f;\n}}\n",
        fused.signature(&format!("{name}_zero"), threads)
    );
    let mut before = vec![pass(&format!("{name}_zero"), spread, 0)];
    if after {
        let value = stored.replace("ACC", "out[o]");
        let _ = write!(
            src,
            "{}{each} {{\n        const long long col = o % {n}LL;\n        const int q = 0;\n        out[o] = {value};\n    }}\n}}\n",
            fused.signature(name, threads)
        );
        before.push(pass(&product, blocks * parts, shared));
    }
    let mut f = fused.fragment(name, action, src, blocks * parts, threads, shared);
    if after {
        f.launch = pass(name, spread, 0).launch;
    }
    f.before = before;
    Ok(f)
}

/// The multiply-adds below which a product with few tiles is not split
/// over K: on the H100, a 10x128 product over K = 8192 replayed from a
/// CUDA graph (KernelBench L3/32's head) ran slower split, with its zeroing
/// and epilogue launches, than as the library call (the network's best
/// program, 4.11x eager, at 3.43x), where 256x256 over K = 524288 (L1/6)
/// and 128x8192 over K = 16384 (L3/1's first layer) ran faster (1.00x to
/// 1.36x, and 1.55x to 1.99x for the MLP's best program).
const SPLIT_MACS: u64 = 1 << 28;

/// The parts a product of `blocks` output tiles over depth `k` is split
/// into over K: 1 (no split) unless it has fewer tiles than half the
/// H100's 132 SMs and K is 8192 or more; then enough parts for about one
/// block an SM, each at least 16 slices (512) deep.
fn parts_over_k(blocks: u64, k: u64) -> u64 {
    if blocks >= 66 || k < 8192 {
        return 1;
    }
    let most = (k.div_ceil(BK) / 16).max(2);
    (132 / blocks).clamp(2, most)
}

/// What a product kernel (a GEMM, an implicit-GEMM convolution) computes
/// besides the product: its bias and the pointwise chain fused after it.
pub(super) struct Fused {
    /// The product's node and its operands (A, B).
    node: NodeId,
    operands: [TensorRef; 2],
    bias: Option<TensorRef>,
    /// The chain after the product, in graph order, and its epilogue.
    chain: Vec<NodeId>,
    epi: Option<Epilogue>,
    /// The product's own result.
    out: TensorRef,
}

/// Refuses a product whose operands or result are not float32.
pub(super) fn float32_only(g: &OpGraph, node: NodeId, family: &str) -> Result<(), Refusal> {
    for t in g.inputs(node).into_iter().chain([TensorRef::first(node)]) {
        if g.tensor(t).dtype != DType::F32 {
            return Err(Refusal::new(format!(
                "`{}` is not float32; the {family} template is fp32 only",
                g.node(t.node).name
            )));
        }
    }
    Ok(())
}

impl Fused {
    /// The product `region[0]` (with its bias, its third input, when
    /// `bias`: one value per each of the `columns` output columns) and the
    /// chain of the rest of `region` fused after it.
    pub(super) fn new(
        g: &OpGraph,
        region: &[NodeId],
        bias: bool,
        columns: u64,
        name: &str,
    ) -> Result<Fused, Refusal> {
        let node = region[0];
        let ins = g.inputs(node);
        let out = TensorRef::first(node);
        let bias = bias.then(|| ins[2]);
        if let Some(t) = bias
            && shape(g, t) != [columns]
        {
            return Err(Refusal::new("the bias is not one value per output column"));
        }
        let mut chain: Vec<NodeId> = region[1..].to_vec();
        let position = |n: &NodeId| g.order().iter().position(|o| o == n);
        chain.sort_by_key(position);
        let epi = if chain.is_empty() {
            None
        } else {
            Some(epilogue(g, &chain, out, None, name)?)
        };
        Ok(Fused {
            node,
            operands: [ins[0], ins[1]],
            bias,
            chain,
            epi,
            out,
        })
    }

    /// ", N pointwise op(s) fused after it" for the kernel's comment.
    pub(super) fn chained(&self) -> String {
        if self.chain.is_empty() {
            String::new()
        } else {
            format!(", {} pointwise op(s) fused after it", self.chain.len())
        }
    }

    /// The epilogue's device function, if any.
    pub(super) fn epilogue_source(&self) -> &str {
        self.epi.as_ref().map_or("", |e| &e.source)
    }

    fn epi_inputs(&self) -> &[TensorRef] {
        self.epi.as_ref().map_or(&[][..], |e| &e.inputs[..])
    }

    /// The kernel's signature line: `a`, `b`, the bias, the chain's other
    /// inputs (`pe0`, …) and `out`.
    pub(super) fn signature(&self, name: &str, threads: u32) -> String {
        let mut params = vec![
            "const float* __restrict__ a".to_string(),
            "const float* __restrict__ b".to_string(),
        ];
        if self.bias.is_some() {
            params.push("const float* __restrict__ bias".into());
        }
        if let Some(e) = &self.epi {
            params.extend(e.params.iter().cloned());
        }
        params.push("float* __restrict__ out".into());
        format!(
            "extern \"C\" __global__ void __launch_bounds__({threads}, 1) {name}({}) {{\n",
            params.join(", ")
        )
    }

    /// The value stored at output offset `o` from the accumulator `ACC`
    /// of column `col + q`: the bias, then the fused chain.
    pub(super) fn store(&self, name: &str) -> String {
        let mut value = "ACC".to_string();
        if self.bias.is_some() {
            value = format!("({value} + bias[col + q])");
        }
        match &self.epi {
            Some(e) => {
                let mut call = vec!["o".to_string(), value];
                call.extend((0..e.inputs.len()).map(|k| format!("pe{k}")));
                format!("{name}_e({})", call.join(", "))
            }
            None => value,
        }
    }

    /// The fragment of kernel `name` with source `src`, launched on
    /// `blocks` blocks of `threads` threads with `shared` bytes.
    pub(super) fn fragment(
        self,
        name: &str,
        action: &Action,
        source: String,
        blocks: u64,
        threads: u32,
        shared: u64,
    ) -> Fragment {
        let mut inputs = self.operands.to_vec();
        inputs.extend(self.bias);
        inputs.extend(self.epi_inputs());
        let output = self.epi.as_ref().map_or(self.out, |e| e.output);
        let mut region = vec![self.node];
        region.extend(&self.chain);
        Fragment {
            name: name.to_string(),
            action: action.clone(),
            lang: Lang::Cuda,
            source,
            inputs,
            outputs: vec![output],
            region,
            launch: Launch {
                grid: u32::try_from(blocks).expect("checked by the caller"),
                block: threads,
                sizes: Vec::new(),
                shared: u32::try_from(shared).expect("a few hundred kB"),
            },
            before: Vec::new(),
        }
    }
}

/// Device helpers, named after the kernel: shared-memory address,
/// asynchronous 16-byte copy (zero-filled where `ok` is false), the TF32
/// split, and one `m16n8k8` product.
pub(super) fn helpers(name: &str) -> String {
    format!(
        r#"__device__ __forceinline__ void {name}_cp16(float* dst, const float* src, bool ok) {{
    unsigned d = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(d), "l"(src), "r"(ok ? 16 : 0));
}}
__device__ __forceinline__ void {name}_split(float x, unsigned& big, unsigned& small) {{
    unsigned h;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(h) : "f"(x));
    h &= 0xffffe000u;
    float r = x - __uint_as_float(h);
    unsigned l;
    asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(r));
    big = h;
    small = l;
}}
__device__ __forceinline__ void {name}_mma(float* d, const unsigned* a, const unsigned* b) {{
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {{%0,%1,%2,%3}}, {{%4,%5,%6,%7}}, {{%8,%9}}, {{%0,%1,%2,%3}};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}}
"#
    )
}

/// The 16-byte copies of one operand's slice (`rows` rows of the tile
/// starting at `base`, of `extent`) into its staged buffer `{p}s`, at
/// `threads` threads: the A or B load of [`body`].
pub(super) fn copy16(
    name: &str,
    operand: &Operand,
    p: &str,
    extent: &str,
    rows: u64,
    base: &str,
    threads: u32,
) -> String {
    if operand.k_contiguous {
        format!(
            r#"        for (int c = tid; c < {chunks}; c += {threads}) {{
            int r = c / {per}, kc = (c % {per}) * 4;
            bool ok = {base} + r < {extent} && k0 + kc < K;
            {name}_cp16(&{p}s[r * {pad} + kc], ok ? {p} + {p}_off + ({base} + r) * K + k0 + kc : {p}, ok);
        }}
"#,
            chunks = rows * BK / 4,
            per = BK / 4,
            pad = BK + 4,
        )
    } else {
        format!(
            r#"        for (int c = tid; c < {chunks}; c += {threads}) {{
            int r = c / {per}, mc = (c % {per}) * 4;
            bool ok = k0 + r < K && {base} + mc < {extent};
            {name}_cp16(&{p}s[r * {pad} + mc], ok ? {p} + {p}_off + (k0 + r) * {extent} + {base} + mc : {p}, ok);
        }}
"#,
            chunks = rows * BK / 4,
            per = rows / 4,
            pad = rows + 8,
        )
    }
}

/// The staged `mma.sync` main loop, leaving `acc[4][frags][4]` (this
/// thread's part of the warp's 64-row tile), `m0`, `n0`, `bz`, `wm`, `wn`,
/// `g` and `t` in scope. `loads` fill the staged slices `as` and `bs` of
/// A and B at depth `k0` (see [`copy16`]); `setup` runs once before the
/// first load.
pub(super) fn body(
    name: &str,
    a: &Operand,
    b: &Operand,
    warps: Warps,
    setup: &str,
    loads: (&str, &str),
    range: KRange,
) -> String {
    let Warps {
        across,
        frags: nj,
        threads: _,
    } = warps;
    let (bm, bn) = (warps.bm(), warps.bn());
    let wide = nj * 8;
    let mut s = String::new();
    let (a_tile, b_tile) = (a.tile(bm), b.tile(bn));
    // Fragment reads: (row, k) of A's slice and (column, k) of B's.
    let a_at = if a.k_contiguous {
        format!("as[(r) * {} + (kq)]", BK + 4)
    } else {
        format!("as[(kq) * {} + (r)]", bm + 8)
    };
    let b_at = if b.k_contiguous {
        format!("bs[(c) * {} + (kq)]", BK + 4)
    } else {
        format!("bs[(kq) * {} + (c)]", bn + 8)
    };
    let _ = write!(
        s,
        r#"    extern __shared__ __align__(16) float smem[];
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wm = warp / {across}, wn = warp % {across};
{order}    const long long a_off = bz * A_BATCH, b_off = bz * B_BATCH;
{setup}    auto load = [&](int kt) {{
        if (kt < {end}) {{
        const long long k0 = (long long)kt * {BK};
        float* as = smem + (kt % {STAGES}) * {a_tile};
        float* bs = smem + {STAGES} * {a_tile} + (kt % {STAGES}) * {b_tile};
{load_a}{load_b}        }}
        asm volatile("cp.async.commit_group;\n");
    }};
    float acc[4][{nj}][4];
#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < {nj}; ++j)
#pragma unroll
            for (int l = 0; l < 4; ++l) acc[i][j][l] = 0.0f;
#pragma unroll
    for (int s = 0; s < {STAGES} - 1; ++s) load({ahead});
    for (int kt = {first}; kt < {end}; ++kt) {{
        asm volatile("cp.async.wait_group %0;\n" :: "n"({STAGES} - 2));
        __syncthreads();
        load(kt + {STAGES} - 1);
        const float* as = smem + (kt % {STAGES}) * {a_tile};
        const float* bs = smem + {STAGES} * {a_tile} + (kt % {STAGES}) * {b_tile};
#pragma unroll
        for (int kk = 0; kk < {BK}; kk += 8) {{
            // The last slice of a K that is not a multiple of 32.
            if (kt * {BK} + kk >= K) break;
            unsigned ah[4][4], al[4][4], bh[{nj}][2], bl[{nj}][2];
#pragma unroll
            for (int i = 0; i < 4; ++i) {{
#pragma unroll
                for (int q = 0; q < 4; ++q) {{
                    int r = wm * 64 + i * 16 + g + (q & 1) * 8;
                    int kq = kk + t + (q >> 1) * 4;
                    {name}_split({a_at}, ah[i][q], al[i][q]);
                }}
            }}
#pragma unroll
            for (int j = 0; j < {nj}; ++j) {{
#pragma unroll
                for (int q = 0; q < 2; ++q) {{
                    int c = wn * {wide} + j * 8 + g;
                    int kq = kk + t + q * 4;
                    {name}_split({b_at}, bh[j][q], bl[j][q]);
                }}
            }}
#pragma unroll
            for (int i = 0; i < 4; ++i)
#pragma unroll
                for (int j = 0; j < {nj}; ++j) {{
                    float p[4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
                    {name}_mma(p, al[i], bh[j]);
                    {name}_mma(p, ah[i], bl[j]);
                    {name}_mma(p, ah[i], bh[j]);
#pragma unroll
                    for (int l = 0; l < 4; ++l) acc[i][j][l] += p[l];
                }}
        }}
    }}
    asm volatile("cp.async.wait_group 0;\n");
"#,
        order = tile_order(bm, bn, range.tile),
        load_a = loads.0,
        load_b = loads.1,
        first = range.first,
        end = range.end,
        ahead = range.after("s"),
    );
    s
}

/// Which output tile a block computes (`bz`, `m0`, `n0`) from its tile
/// number `tile` (an expression: `blockIdx.x`, or a split product's
/// `TILE`): blocks walk the tiles of each batch in groups of eight tile
/// rows, column by column, so that neighbouring blocks share operand
/// tiles in L2.
fn tile_order(bm: u64, bn: u64, tile: &str) -> String {
    format!(
        r#"    const int per_batch = TILES_M * TILES_N;
    const long long bz = {tile} / per_batch;
    const int local = {tile} % per_batch;
    const int per_group = 8 * TILES_N;
    const int first_m = (local / per_group) * 8;
    const int rows_in_group = min(TILES_M - first_m, 8);
    const long long m0 = (long long)(first_m + (local % per_group) % rows_in_group) * {bm};
    const long long n0 = (long long)((local % per_group) / rows_in_group) * {bn};
"#
    )
}

/// The slices of K a block multiplies, as names in the kernel's text:
/// every slice of its tile ([`WHOLE`]), or one part of a product split
/// over K ([`PART`]).
#[derive(Clone, Copy)]
pub(super) struct KRange {
    /// Its first slice.
    first: &'static str,
    /// One past its last slice.
    end: &'static str,
    /// The number of the block's output tile.
    tile: &'static str,
}

impl KRange {
    /// Slice `k` of the range (`k` counted from its first).
    fn after(self, k: &str) -> String {
        if self.first == "0" {
            k.to_string()
        } else {
            format!("{} + {k}", self.first)
        }
    }
}

/// Every slice of K, one tile a block.
pub(super) const WHOLE: KRange = KRange {
    first: "0",
    end: "KTILES",
    tile: "blockIdx.x",
};

/// One part of a product split over K: the kernel defines `TILE`, `KT0`
/// and `KT1` ([`generate`] writes them).
const PART: KRange = KRange {
    first: "KT0",
    end: "KT1",
    tile: "TILE",
};

/// The row-major output offset of element (`row`, `col + q`) of batch
/// `bz`.
pub(super) const ROW_MAJOR: &str = "(bz * M + row) * N + col + q";

/// How a thread writes the two adjacent output columns it holds.
#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Pair {
    /// One 8-byte store: row-major offsets with an even N, so the pair
    /// (`col` is even) is adjacent, 8-byte aligned and inside the output
    /// or outside it whole. Half the store instructions: on the H100 a
    /// product whose time goes to its stores (KernelBench L1/9, K = 32)
    /// ran 2.6 times as fast.
    Vector,
    /// Two 4-byte stores: an odd N, or offsets that are not adjacent.
    Scalar,
    /// Two 4-byte atomic adds: one part of a product split over K adds
    /// its sum to the output the other parts add to.
    Atomic,
}

impl Pair {
    /// The pairing of a row-major output of `n` columns.
    pub(super) fn row_major(n: u64) -> Pair {
        if n.is_multiple_of(2) {
            Pair::Vector
        } else {
            Pair::Scalar
        }
    }
}

/// The `mma.sync` path's stores: each element of `acc`, through `store`
/// (`ACC` is the accumulator; `o`, `col` and `q` are in scope) at output
/// offset `offset` (of `row`, `col` and `q`), paired as `pair` says.
pub(super) fn mma_store(store: &str, warps: Warps, offset: &str, pair: Pair) -> String {
    let nj = warps.frags;
    let wide = nj * 8;
    let pair = store_pair(&store.replace("ACC", "acc[i][j][2 * h + q]"), offset, pair);
    format!(
        r#"#pragma unroll
    for (int i = 0; i < 4; ++i)
#pragma unroll
        for (int j = 0; j < {nj}; ++j)
#pragma unroll
            for (int h = 0; h < 2; ++h) {{
                long long row = m0 + wm * 64 + i * 16 + g + h * 8;
                long long col = n0 + wn * {wide} + j * 8 + 2 * t;
{pair}            }}
"#
    )
}

/// The two adjacent columns (`col`, `col + 1`) of output row `row` that
/// a thread holds, through `store` (`q` picks the column), each written
/// where it lies inside the output, at offset `offset`: as one 8-byte
/// store where `pair` allows and both lie inside (the text of the
/// kernels the shipped tree judged; with an even N the last branch is
/// never taken).
fn store_pair(store: &str, offset: &str, pair: Pair) -> String {
    if pair == Pair::Vector {
        return format!(
            r#"            if (row >= M) continue;
            if (col + 1 < N) {{
                float2 v;
#pragma unroll
                for (int q = 0; q < 2; ++q) {{
                    long long o = {offset};
                    (&v.x)[q] = {store};
                }}
                const int q = 0;
                *(float2*)(out + {offset}) = v;
            }} else if (col < N) {{
                const int q = 0;
                long long o = {offset};
                out[o] = {store};
            }}
"#
        );
    }
    let write = if pair == Pair::Atomic {
        format!("atomicAdd(out + o, {store})")
    } else {
        format!("out[o] = {store}")
    };
    format!(
        r#"            if (row >= M) continue;
#pragma unroll
            for (int q = 0; q < 2; ++q) {{
                if (col + q >= N) continue;
                long long o = {offset};
                {write};
            }}
"#
    )
}

/// Accumulator registers of one `m64n128k8` product per thread.
const WG_ACC: u64 = BN / 2;

/// `wgmma` helpers, named after the kernel: the shared-memory matrix
/// descriptor (128-byte swizzle, 1 KiB between 8-row groups), one
/// `m64n128k8` TF32 product into 64 registers (`scale` 0 starts the
/// accumulator afresh), a compiler fence on those registers, and the
/// TF32 remainders (`x - big`, rounded to TF32) of four values.
fn wgmma_helpers(name: &str) -> String {
    let regs: Vec<String> = (0..WG_ACC).map(|i| format!("%{i}")).collect();
    let outs: Vec<String> = (0..WG_ACC).map(|i| format!("\"+f\"(d[{i}])")).collect();
    let (da, db, sc) = (WG_ACC, WG_ACC + 1, WG_ACC + 2);
    format!(
        r#"__device__ __forceinline__ unsigned long long {name}_desc(unsigned addr) {{
    return (unsigned long long)((addr & 0x3FFFF) >> 4) | (1ull << 16) | ((unsigned long long)(1024 >> 4) << 32) | (1ull << 62);
}}
__device__ __forceinline__ void {name}_wg(float* d, unsigned long long a, unsigned long long b, int scale) {{
    asm volatile("{{\n.reg .pred p;\nsetp.ne.b32 p, %{sc}, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n{BN}k8.f32.tf32.tf32 {{{regs}}}, %{da}, %{db}, p, 1, 1;\n}}\n"
        : {outs}
        : "l"(a), "l"(b), "r"(scale));
}}
__device__ __forceinline__ void {name}_fence(float* d) {{
#pragma unroll
    for (int i = 0; i < {WG_ACC}; ++i) asm volatile("" : "+f"(d[i]) :: "memory");
}}
__device__ __forceinline__ float4 {name}_rem(float4 v) {{
    float* e = (float*)&v;
#pragma unroll
    for (int q = 0; q < 4; ++q) {{
        float r = e[q] - __uint_as_float(__float_as_uint(e[q]) & 0xffffe000u);
        unsigned l;
        asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(l) : "f"(r));
        e[q] = __uint_as_float(l);
    }}
    return v;
}}
"#,
        regs = regs.join(", "),
        outs = outs.join(", "),
    )
}

/// The `wgmma` path, stores included. Each thread loads its part of a
/// slice (A's 128 rows and B's 128 columns, 32 deep) from global memory
/// into registers one slice ahead, then writes it to shared memory twice,
/// raw and as remainders, in the 128-byte swizzle the descriptors name:
/// 16-byte chunk `c` of row `r` at chunk `c ^ (r % 8)`, 128 bytes a row
/// ([`wg_operand`]; `a_k`, `b_k`: whether each operand is K-contiguous).
/// Two slices live in shared memory: per slice, each warpgroup issues
/// four 8-deep steps of three products (small·big, big·small, big·big)
/// into a fresh accumulator, the next slice is written and the one after
/// it loaded while they run, then the products are waited for and added
/// to the running sum.
fn wgmma_body(
    name: &str,
    store: &str,
    (a_k, b_k): (bool, bool),
    pair: Pair,
    range: KRange,
) -> String {
    let store = store.replace("ACC", "acc[4 * j + 2 * h + q]");
    let stage = WG_STAGE;
    let a_bytes = BM * BK * 4;
    let row = BK * 4;
    let per = WG_PER;
    let (fetch_a, put_a) = wg_operand(name, a_k, ["ra", "ab", "M", "m0"], 0);
    let (fetch_b, put_b) = wg_operand(name, b_k, ["rb", "bb", "N", "n0"], a_bytes);
    format!(
        r#"    extern __shared__ __align__(16) unsigned char smem_bytes[];
    const unsigned raw_base = (unsigned)__cvta_generic_to_shared(smem_bytes);
    const unsigned base = (raw_base + 1023u) & ~1023u;
    unsigned char* gbase = smem_bytes + (base - raw_base);
    const unsigned REM = base + 2 * {stage};
    const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31, g = lane >> 2, t = lane & 3;
    const int wgi = warp >> 2;
{order}    const float* ab = a + bz * A_BATCH;
    const float* bb = b + bz * B_BATCH;
    const float4 zero = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
    // Slice `kt`, global memory to registers.
    float4 ra[{per}], rb[{per}];
    auto fetch = [&](int kt) {{
        if (kt < {end}) {{
            const long long k0 = (long long)kt * {BK};
{fetch_a}{fetch_b}        }}
    }};
    // The slice in registers to shared memory, raw and as remainders.
    auto put = [&](int kt) {{
        unsigned char* raw = gbase + (kt & 1) * {stage};
        unsigned char* rem = raw + 2 * {stage};
{put_a}{put_b}        asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }};
    float acc[{WG_ACC}], p[{WG_ACC}];
#pragma unroll
    for (int i = 0; i < {WG_ACC}; ++i) {{
        acc[i] = 0.0f;
        p[i] = 0.0f;
    }}
    fetch({first});
    put({first});
    fetch({second});
    __syncthreads();
    for (int kt = {first}; kt < {end}; ++kt) {{
        const unsigned ar = base + (kt & 1) * {stage} + wgi * 64 * {row}, br = base + (kt & 1) * {stage} + {a_bytes};
        const unsigned al = REM + (kt & 1) * {stage} + wgi * 64 * {row}, bl = REM + (kt & 1) * {stage} + {a_bytes};
        {name}_fence(p);
        asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#pragma unroll
        for (int k = 0; k < {BK} / 8; ++k) {{
            {name}_wg(p, {name}_desc(al + k * 32), {name}_desc(br + k * 32), k > 0);
            {name}_wg(p, {name}_desc(ar + k * 32), {name}_desc(bl + k * 32), 1);
            {name}_wg(p, {name}_desc(ar + k * 32), {name}_desc(br + k * 32), 1);
        }}
        asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
        {name}_fence(p);
        if (kt + 1 < {end}) put(kt + 1);
        fetch(kt + 2);
        asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
        {name}_fence(p);
#pragma unroll
        for (int i = 0; i < {WG_ACC}; ++i) acc[i] += p[i];
        __syncthreads();
    }}
    const long long row0 = m0 + wgi * 64 + (warp & 3) * 16 + g;
#pragma unroll
    for (int j = 0; j < {frags}; ++j)
#pragma unroll
        for (int h = 0; h < 2; ++h) {{
            long long row = row0 + h * 8;
            long long col = n0 + j * 8 + 2 * t;
{pair}        }}
"#,
        pair = store_pair(&store, ROW_MAJOR, pair),
        order = tile_order(BM, BN, range.tile),
        frags = BN / 8,
        first = range.first,
        second = range.after("1"),
        end = range.end,
    )
}

/// One operand's part of the `wgmma` path's staging: the code that loads
/// its slice into the registers `regs` (`names`: the registers, the
/// operand's pointer, its extent and the block's first row of it) and the
/// code that writes them at byte `offset` of a slice in shared memory,
/// raw (`raw`) and as remainders (`rem`). A K-contiguous operand's thread
/// holds four 16-byte chunks of rows. One stored `[K, rows]` is loaded as
/// a 4×4 block a thread (K rows `4 * (tid % 8)` to `+ 3` of rows `4 *
/// (tid / 8)` to `+ 3`) and transposed in registers into four K-major
/// chunks: eight threads in a row write the eight chunks of one swizzled
/// row, free of bank conflicts.
fn wg_operand(name: &str, k_contiguous: bool, names: [&str; 4], offset: u64) -> (String, String) {
    let [regs, ptr, extent, origin] = names;
    let chunks = BK / 4;
    let row = BK * 4;
    let per = WG_PER;
    if k_contiguous {
        (
            format!(
                r#"#pragma unroll
            for (int i = 0; i < {per}; ++i) {{
                int c = tid + i * 256, r = c / {chunks}, ch = c % {chunks};
                bool ok = {origin} + r < {extent} && k0 + ch * 4 < K;
                {regs}[i] = ok ? __ldg((const float4*)({ptr} + ({origin} + r) * K + k0 + ch * 4)) : zero;
            }}
"#
            ),
            format!(
                r#"#pragma unroll
        for (int i = 0; i < {per}; ++i) {{
            int c = tid + i * 256, r = c / {chunks}, ch = c % {chunks};
            int at = {offset} + r * {row} + ((ch ^ (r & 7)) << 4);
            *(float4*)(raw + at) = {regs}[i];
            *(float4*)(rem + at) = {name}_rem({regs}[i]);
        }}
"#
            ),
        )
    } else {
        (
            format!(
                r#"            {{
                const int kq = tid % {chunks}, rc = tid / {chunks};
#pragma unroll
                for (int j = 0; j < 4; ++j) {{
                    bool ok = k0 + kq * 4 + j < K && {origin} + rc * 4 < {extent};
                    {regs}[j] = ok ? __ldg((const float4*)({ptr} + (k0 + kq * 4 + j) * {extent} + {origin} + rc * 4)) : zero;
                }}
            }}
"#
            ),
            format!(
                r#"        {{
            const int kq = tid % {chunks}, rc = tid / {chunks};
#pragma unroll
            for (int q = 0; q < 4; ++q) {{
                int r = rc * 4 + q;
                float4 v = make_float4(((float*)&{regs}[0])[q], ((float*)&{regs}[1])[q], ((float*)&{regs}[2])[q], ((float*)&{regs}[3])[q]);
                int at = {offset} + r * {row} + ((kq ^ (r & 7)) << 4);
                *(float4*)(raw + at) = v;
                *(float4*)(rem + at) = {name}_rem(v);
            }}
        }}
"#
            ),
        )
    }
}

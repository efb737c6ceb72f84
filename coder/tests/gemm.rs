//! The GEMM family, compiled with real NVRTC: both operand layouts each,
//! batches, a bias and a pointwise chain fused after the product, and the
//! products it refuses.

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_actions::op::Op;
use mtmc_coder::program::Fragment;
use mtmc_coder::template::Refusal;

mod common;
use common::realize_with_rest;

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    };
    compile(src, &b).unwrap()
}

/// The product and every pointwise op after it, as one fused region.
fn realize(g: &OpGraph) -> Result<Fragment, Refusal> {
    realize_with_rest(g, |op| matches!(op, Op::MatMul(_)))
}

/// `f` compiled for Hopper's `sm_90a` (`wgmma`: true) and for Ampere:
/// each build compiles, and the Hopper one does not spill. Staging a
/// slice in registers leaves the `wgmma` body near the 255 registers a
/// thread may have: it must not spill, with any epilogue. (Ampere's build
/// of the eight-warp `mma.sync` body may.)
fn both_targets(
    f: &Fragment,
    src: &str,
) -> Vec<(mtmc_env::nvrtc::Arch, bool, mtmc_env::nvrtc::CompileReport)> {
    [
        (mtmc_env::nvrtc::Arch::SM90, true),
        (mtmc_env::nvrtc::Arch { major: 8, minor: 0 }, false),
    ]
    .into_iter()
    .map(|(arch, wgmma)| {
        let unit = mtmc_env::nvrtc::CompileUnit {
            name: "k.cu".into(),
            source: f.source.clone(),
        };
        let r = mtmc_env::nvrtc::compile(&unit, arch)
            .unwrap_or_else(|e| panic!("{e}: these tests need NVRTC 13 (run scripts/test)"));
        assert!(r.ok, "{src} for {}: {}", arch.target(), r.log);
        assert!(
            !wgmma || r.kernels.iter().all(|k| !k.spills()),
            "{src} for {}: {}",
            arch.target(),
            r.log
        );
        (arch, wgmma, r)
    })
    .collect()
}

#[test]
fn every_layout_and_batches_compile_with_the_epilogue_fused() {
    for (src, shapes, inputs) in [
        ("y = x @ w", "x=256x512,w=512x384", 2),
        ("y = x @ w.T", "x=256x512,w=384x512", 2),
        ("y = relu(x @ w.T + b)", "x=200x96,w=300x96,b=300", 3),
        ("y = x.T @ w", "x=512x256,w=512x384", 2),
        ("y = x.T @ w.T", "x=512x256,w=384x512", 2),
        ("y = a @ b", "a=4x128x64,b=4x64x96", 2),
        ("y = a @ w", "a=4x128x64,w=64x96", 2),
        ("y = relu(x @ w + b)", "x=256x512,w=512x384,b=384", 3),
        ("y = tanh(x @ w.T) * s - 0.5", "x=100x64,w=200x64,s=200", 3),
        ("y = x @ w.T", "x=96x64,w=301x64", 2),
    ] {
        let g = graph(src, shapes);
        let f = realize(&g).unwrap_or_else(|r| panic!("{src}: refused: {r}"));
        assert_eq!(f.inputs.len(), inputs, "{src}");
        assert_eq!(f.outputs, g.outputs(), "{src}: writes the chain's result");
        assert!(f.source.contains("mma.sync.aligned.m16n8k8"), "{src}");
        // Each thread's two adjacent output columns go out in one 8-byte
        // store where N is even (every pair then starts 8-byte aligned).
        let n = g.tensor(g.outputs()[0]).shape.last().copied().unwrap_or(1);
        assert_eq!(f.source.contains("*(float2*)(out + "), n % 2 == 0, "{src}");
        // Every layout: the kernel has a `wgmma` path for sm_90a (two
        // warpgroups) and the `mma.sync` path for any other target, with
        // the same launch. The `wgmma` path keeps two slices in shared
        // memory, raw and as remainders (4 × 32 KiB and 1 KiB to align);
        // an operand stored the other way (`x.T`, a B stored `[K, N]`) is
        // transposed in registers on the way.
        assert!(f.source.contains("wgmma.mma_async"), "{src}");
        assert_eq!(f.launch.block, 256, "{src}");
        assert_eq!(f.launch.shared, 129 * 1024, "{src}");
        let (a_t, b_k) = (src.contains("x.T"), src.contains("w.T"));
        assert_eq!(f.source.contains("((float*)&ra[1])[q]"), a_t, "{src}");
        assert_eq!(f.source.contains("((float*)&rb[1])[q]"), !b_k, "{src}");
        // Hopper's build issues `wgmma`; Ampere's builds the other path.
        for (arch, wgmma, r) in both_targets(&f, src) {
            let ptx = r.ptx.clone().unwrap_or_default();
            assert_eq!(
                ptx.contains("wgmma.mma_async"),
                wgmma,
                "{src} for {}",
                arch.target()
            );
            assert_eq!(
                ptx.contains("mma.sync"),
                !wgmma,
                "{src} for {}",
                arch.target()
            );
        }
    }
    // A batch of row-major A times one B is one taller product: tiles of
    // 128 rows over all 4 * 128 rows.
    let g = graph("y = a @ w", "a=4x128x64,w=64x256");
    assert_eq!(realize(&g).unwrap().launch.grid, 4 * 2);
    // A batched product: one set of tiles per batch.
    let g = graph("y = a @ b", "a=3x128x64,b=3x64x256");
    assert_eq!(realize(&g).unwrap().launch.grid, 3 * 2);
}

/// A long product with few output tiles is split over K: a pass zeroes
/// the output, each block adds its part of one tile's sum to it, and the
/// bias and chain (when there are any) follow in a pass of their own.
#[test]
fn long_products_with_few_tiles_are_split_over_k() {
    for (src, shapes, parts, after) in [
        // 4 tiles over K = 524288: 33 parts, one block an SM.
        ("y = x @ w", "x=256x524288,w=524288x256", 33, false),
        // 8 tiles over K = 32768: 16 parts.
        (
            "y = relu(x @ w.T + b)",
            "x=10x32768,w=1024x32768,b=1024",
            16,
            true,
        ),
        // 1 tile over K = 524288 (16384 slices): 132 parts.
        ("y = x @ w", "x=64x524288,w=524288x128", 132, false),
        // A batch of 4 products of one tile each: 33 parts.
        ("y = a @ b", "a=4x64x65536,b=4x65536x64", 33, false),
        // 32 tiles over K = 25088: 4 parts; x.T and a bias alone.
        ("y = x.T @ w + b", "x=25088x12,w=25088x4096,b=4096", 4, true),
    ] {
        let g = graph(src, shapes);
        let f = realize(&g).unwrap_or_else(|r| panic!("{src}: refused: {r}"));
        assert!(
            f.source.contains(&format!("split over K in {parts} parts")),
            "{src}"
        );
        let o = &g.tensor(g.outputs()[0]).shape;
        let r = o.len();
        let batch: u64 = o[..r - 2].iter().product();
        let tiles = batch * o[r - 2].div_ceil(128) * o[r - 1].div_ceil(128);
        let kernels: Vec<(&str, u32)> = f.launches().map(|(k, l)| (k, l.grid)).collect();
        let zero = format!("{}_zero", f.name);
        let part = format!("{}_part", f.name);
        if after {
            assert_eq!(kernels.len(), 3, "{src}: {kernels:?}");
            assert_eq!(kernels[0].0, zero, "{src}");
            assert_eq!(kernels[1], (part.as_str(), (tiles * parts) as u32), "{src}");
            assert_eq!(kernels[2].0, f.name, "{src}");
            assert_eq!(f.launch.shared, 0, "{src}: the chain's pass");
            assert!(f.source.contains(&format!("{}_e(", f.name)) || !src.contains("relu"));
        } else {
            assert_eq!(kernels.len(), 2, "{src}: {kernels:?}");
            assert_eq!(kernels[0].0, zero, "{src}");
            assert_eq!(
                kernels[1],
                (f.name.as_str(), (tiles * parts) as u32),
                "{src}"
            );
        }
        // Each part adds its sums: no plain stores of the product.
        assert!(f.source.contains("atomicAdd(out + o, acc["), "{src}");
        assert!(!f.source.contains("*(float2*)(out + "), "{src}");
        for (_, _, r) in both_targets(&f, src) {
            let names: Vec<&str> = r.kernels.iter().map(|k| k.name.as_str()).collect();
            for (k, _) in &kernels {
                assert!(names.contains(k), "{src}: {k} not in {names:?}");
            }
        }
    }
    // Enough tiles (66, half the SMs) or a short K: one tile a block.
    for (src, shapes) in [
        ("y = x @ w", "x=1024x8192,w=8192x1056"),
        ("y = x @ w", "x=256x8188,w=8188x256"),
    ] {
        let f = realize(&graph(src, shapes)).unwrap();
        assert!(!f.source.contains("split over K"), "{src}");
        assert!(f.before.is_empty(), "{src}");
    }
}

#[test]
fn products_it_cannot_write_are_refused_with_the_reason() {
    for (src, shapes, why) in [
        ("y = x @ w", "x=64x30,w=30x64", "not a multiple of 4"),
        ("y = a @ b", "a=2x3x64x32,b=3x32x64", "broadcast"),
        // Few tiles over a long K, but too little work to split.
        (
            "y = x @ w.T",
            "x=10x8192,w=128x8192",
            "too few to split over K",
        ),
    ] {
        let g = graph(src, shapes);
        let r = realize(&g).expect_err(src);
        assert!(r.to_string().contains(why), "{src}: {r}");
    }
    // A chain whose intermediate is read elsewhere has two results.
    let g = graph(
        "h = x @ w; y = relu(h + 1.0); z = h + 1.0",
        "x=64x64,w=64x64",
    );
    let r = realize(&g).expect_err("two results");
    assert!(
        r.to_string().contains("read outside") || r.to_string().contains("one result"),
        "{r}"
    );
}

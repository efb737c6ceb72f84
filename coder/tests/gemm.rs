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
use common::{compiles, realize_with_rest};

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
        compiles(&f, src);
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
        for (arch, wgmma) in [
            (mtmc_env::nvrtc::Arch::SM90, true),
            (mtmc_env::nvrtc::Arch { major: 8, minor: 0 }, false),
        ] {
            let unit = mtmc_env::nvrtc::CompileUnit {
                name: "k.cu".into(),
                source: f.source.clone(),
            };
            let r = mtmc_env::nvrtc::compile(&unit, arch).expect("NVRTC");
            assert!(r.ok, "{src} for {}: {}", arch.target(), r.log);
            // Staging a slice in registers leaves the `wgmma` body
            // near the 255 registers a thread may have: it must not
            // spill, with any of these epilogues. (Ampere's build of
            // the eight-warp `mma.sync` body may.)
            assert!(
                !wgmma || r.kernels.iter().all(|k| !k.spills()),
                "{src} for {}: {}",
                arch.target(),
                r.log
            );
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

#[test]
fn products_it_cannot_write_are_refused_with_the_reason() {
    for (src, shapes, why) in [
        ("y = x @ w", "x=64x30,w=30x64", "not a multiple of 4"),
        ("y = x @ w", "x=256x524288,w=524288x256", "split over K"),
        ("y = a @ b", "a=2x3x64x32,b=3x32x64", "broadcast"),
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

//! The row family and pooling, compiled with real NVRTC: reductions and
//! softmax in both layouts (reduced dims trailing: a block per row, a warp
//! per short row; else a thread per output, or blocks of warps over few
//! outputs), layer/group/instance/RMS norm, max and average
//! pooling.

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::program::Program;
use mtmc_coder::template::TemplateCoder;

mod common;
use common::{compiles, fuse_all, traced};

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    };
    compile(src, &b).unwrap()
}

fn last_node(g: &OpGraph) -> Action {
    Action {
        kind: ActionKind::CustomKernel,
        region: vec![g.outputs()[0].node.index() as u32],
        params: Params::default(),
    }
}

#[test]
fn every_reduction_and_softmax_compiles_in_both_layouts() {
    for op in [
        "sum",
        "mean",
        "max",
        "min",
        "logsumexp",
        "norm",
        "softmax",
        "log_softmax",
    ] {
        for (dim, layout, sizes) in [
            (2, "rows", vec![64 * 32, 128]),
            (1, "columns", vec![64, 32, 128]),
        ] {
            let g = graph(&format!("y = {op}(x, dim={dim})"), "x=64x32x128");
            let f = TemplateCoder
                .realize(&Program::default(), &g, &last_node(&g))
                .unwrap();
            compiles(&f, &format!("{op} over {layout}"));
            // (a chunk count follows where blocks share the lines' steps)
            assert_eq!(
                f.launch.sizes[..sizes.len()],
                sizes[..],
                "{op} over {layout}"
            );
            assert!(f.name.ends_with("_rows"));
        }
    }
}

#[test]
fn reductions_it_cannot_write_are_refused() {
    let g = graph(
        "x: [a=4, b=8, c=16]; y = sum(x, dim=a); z = sum(y, dim=1)",
        "",
    );
    let action = Action {
        kind: ActionKind::CustomKernel,
        region: vec![g.outputs()[0].node.index() as u32],
        params: Params {
            block: 256,
            vector: 4,
        },
    };
    let e = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap_err();
    assert!(e.0.contains("one element per thread"), "{e}");
}

#[test]
fn every_warp_gets_the_block_result_that_softmax_uses() {
    // Softmax scales every element by the row's maximum and sum, so every
    // warp (not only warp 0) must read the whole block's result.
    let g = graph("y = softmax(x, dim=1)", "x=64x4000");
    let f = TemplateCoder
        .realize(&Program::default(), &g, &last_node(&g))
        .unwrap();
    assert!(
        f.source
            .contains("(threadIdx.x & 31) < (blockDim.x >> 5) ? shared[threadIdx.x & 31]"),
        "{}",
        f.source
    );
    assert!(!f.source.contains("shared[threadIdx.x]"), "{}", f.source);
}

#[test]
fn short_rows_take_a_warp_each_and_few_columns_a_block_each() {
    // Rows of 128: a warp per row, combined by shuffles alone.
    for op in ["sum", "softmax", "logsumexp"] {
        let g = graph(&format!("y = {op}(x, dim=1)"), "x=65536x128");
        let f = TemplateCoder
            .realize(&Program::default(), &g, &last_node(&g))
            .unwrap();
        compiles(&f, op);
        assert!(f.source.contains("k += 32)"), "{op}: {}", f.source);
        assert!(!f.source.contains("__syncthreads"), "{op}: {}", f.source);
    }
    // 8 x 64 lines over 4096 steps: blocks of warps share each line's
    // steps; 512 x 4096 lines stay a thread each.
    for (shape, shared) in [("x=8x4096x64", true), ("x=512x16x4096", false)] {
        let g = graph("y = sum(x, dim=1)", shape);
        let f = TemplateCoder
            .realize(&Program::default(), &g, &last_node(&g))
            .unwrap();
        compiles(&f, shape);
        assert_eq!(
            f.source.contains("part[slice][lane]"),
            shared,
            "{shape}: {}",
            f.source
        );
        if shared {
            // 16 column tiles: the 4096 steps are cut into chunks, one
            // block each, so that the grid fills the GPU.
            assert!(f.launch.sizes[3] > 1, "{:?}", f.launch.sizes);
            assert_eq!(u64::from(f.launch.grid), 16 * f.launch.sizes[3] as u64);
        }
    }
}

#[test]
fn layer_group_and_instance_norm_compile_with_their_scale_and_shift() {
    let cases = [
        // nn.InstanceNorm2d has no scale or shift by default; its rows of
        // 512x512 take a team of blocks each, the row in registers.
        (
            traced(1, "34_InstanceNorm"),
            "{ return (val - mean) * rstd; }",
        ),
        // Short rows are read once into registers: 32 lanes of 8 here,
        // a block of 256 threads of 16 for rows of 4000, and 2 lanes of 7
        // for rows of 10.
        (
            graph("y = layer_norm(x, w, b, dim=-1)", "x=16x256,w=256,b=256"),
            "32 thread(s) per row holding 8 elements each in registers",
        ),
        (
            graph(
                "y = layer_norm(x, w, b, dim=-1)",
                "x=300x4000,w=4000,b=4000",
            ),
            "STORE_YX(xr + k, (v_[j] - mean) * rstd * w[k] + b[k], v_[j]);",
        ),
        (
            graph("y = layer_norm(x, w, b, dim=-1)", "x=1000x10,w=10,b=10"),
            "2 thread(s) per row holding 5 elements each in registers",
        ),
        (
            graph("y = rms_norm(x, g, dim=-1)", "x=16x65536,g=65536"),
            // No centering: each chunk's own mean is taken as 0.
            "const float mine = 0.0f;",
        ),
        (traced(1, "35_GroupNorm_"), "(unsigned)r % 8u"),
        (traced(1, "40_LayerNorm"), "w[k]"),
        (
            graph("y = rms_norm(x, g, dim=-1)", "x=16x256,g=256"),
            "w[k]",
        ),
    ];
    for (g, channel) in cases {
        let f =
            common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::Norm(_))).unwrap();
        compiles(&f, "norm");
        assert!(
            f.source.contains(channel),
            "{channel} missing:\n{}",
            f.source
        );
        // Rows of at most 16384 are held in registers by a block or less;
        // longer rows by a team of blocks, 16 bytes a load and a store, up
        // to 176 blocks of 256 (rows of 2 M).
        let k = f.launch.sizes[1];
        assert_eq!(
            f.source.contains("thread(s) per row holding"),
            k <= 16384,
            "K = {k}:\n{}",
            f.source
        );
        assert_eq!(
            f.source.contains("a team of") && f.source.contains("__stcs(reinterpret_cast<float4*>"),
            k > 16384 && k <= 1 << 21,
            "K = {k}:\n{}",
            f.source
        );
        assert!(!f.source.contains("__cluster_dims__"), "{}", f.source);
    }
}

/// `F.normalize` with p = 2 over the last dim is a norm kernel that takes
/// the mean as 0 and divides by the row's length (`1 / max(‖x‖₂, ε)`):
/// short rows in registers, long ones (or few) by a team of blocks each,
/// or by chunks whose squares the last block of each row combines, as the
/// other norms; over another dim, or with another p, it is refused with
/// what is written.
#[test]
fn normalize_over_the_last_dim_divides_rows_by_their_length() {
    let lp = |op: &mtmc_actions::op::Op| matches!(op, mtmc_actions::op::Op::Norm(_));
    for (shape, how) in [
        (
            "x=4096x32",
            "4 thread(s) per row holding 8 elements each in registers",
        ),
        ("x=64x16384", "each cut into 4 chunks"),
        ("x=16x65536", "a team of 4 blocks per group"),
    ] {
        let g = graph("y = normalize(x, dim=-1)", shape);
        let f = common::realize_first(&g, lp).unwrap();
        compiles(&f, shape);
        // Registers: the row's squares; a team or split: the chunks'
        // combined (m2), around no mean.
        let (zero, squares) = if how.contains("registers") {
            ("const float mean = 0.0f;", "squares")
        } else if how.contains("team") {
            ("const float mine = 0.0f;", "m2")
        } else {
            ("const float mean = 0.0f;", "m2")
        };
        for part in [
            how,
            zero,
            &format!("1.0f / fmaxf(sqrtf({squares}), 1e-12f)"),
        ] {
            assert!(
                f.source.contains(part),
                "{shape}: {part} missing:\n{}",
                f.source
            );
        }
        assert!(!f.source.contains("rsqrtf"), "{}", f.source);
    }
    // Over a dim with others after it: a thread per line.
    let g = graph("y = normalize(x, dim=0)", "x=64x256");
    let f = common::realize_first(&g, lp).unwrap();
    compiles(&f, "normalize over dim 0");
    assert!(f.source.contains("a thread per line"), "{}", f.source);
    for (src, why) in [
        ("y = normalize(x, dim=0, p=1.0)", "p = 1 over dim 0 of 2"),
        ("y = normalize(x, dim=1, p=1.0)", "p = 1 over dim 1 of 2"),
    ] {
        let g = graph(src, "x=64x256");
        let e = common::realize_first(&g, lp).unwrap_err();
        assert!(
            e.to_string().contains(why) && e.to_string().contains("(only p = 2)"),
            "{src}: {e}"
        );
    }
}

#[test]
fn norms_and_softmax_take_a_chain_in_front_and_one_after_in_one_kernel() {
    // Rows of 64 in registers, of 4000 a block each, of 65536 a team of
    // blocks each, and few groups of a million a team of 64 each;
    // softmax over short rows (a warp each), long rows (a block each) and
    // a leading dim (a thread per line): every kernel writes through the
    // chain fused after it.
    for (intent, shapes) in [
        (
            "y = gelu(softmax(x + c, dim=-1)) * s",
            "x=512x64,c=64,s=512x1",
        ),
        (
            "y = gelu(log_softmax(x + c, dim=-1)) * s",
            "x=64x4096,c=4096,s=64x1",
        ),
        (
            "y = gelu(softmax(x + c, dim=0)) * s",
            "x=64x512,c=512,s=64x1",
        ),
        (
            "y = gelu(layer_norm(x + c, w, b, dim=-1)) * s",
            "x=512x64,c=64,w=64,b=64,s=512x1",
        ),
        (
            "y = gelu(layer_norm(x + c, w, b, dim=-1)) * s",
            "x=300x4000,c=4000,w=4000,b=4000,s=300x1",
        ),
        (
            "y = gelu(rms_norm(x + c, w, dim=-1)) * s",
            "x=64x65536,c=65536,w=65536,s=64x1",
        ),
        (
            "y = gelu(layer_norm(x + c, w, b, dim=-1)) * s",
            "x=8x1048576,c=1048576,w=1048576,b=1048576,s=8x1",
        ),
    ] {
        let g = graph(intent, shapes);
        let action = fuse_all(&g, Params::default());
        let region = action.region.clone();
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f, intent);
        assert!(f.source.contains("#define MTMC_PROLOGUE"), "{}", f.source);
        // Kernels that store 16 bytes at a time store element by element
        // through the chain.
        assert!(f.source.contains("#define MTMC_EPILOGUE"), "{}", f.source);
        assert!(
            f.source
                .contains("#define EPI_Y(i, v, xv) k0_rows_e((i), (v), pe0)\n#define STORE_Y(i, v) (y[(i)] = EPI_Y(i, v, 0.0f))"),
            "{}",
            f.source
        );
        // x, c, the scale (and shift), then the chain's s, then y.
        assert_eq!(f.inputs.last(), Some(&g.inputs(g.outputs()[0].node)[1]));
        assert_eq!(f.outputs, g.outputs());
        assert_eq!(f.region.len(), region.len());
    }
    // A chain that does not alone read the norm is refused, with why.
    let g = graph(
        "n = layer_norm(x, w, b, dim=-1); y = relu(n) + n",
        "x=512x64,w=64,b=64",
    );
    let norm = g
        .nodes()
        .find(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Norm(_)))
        .unwrap()
        .0;
    let relu = g.consumers(norm)[0];
    let action = Action {
        kind: ActionKind::Fuse,
        region: vec![norm.index() as u32, relu.index() as u32],
        params: Params::default(),
    };
    let r = TemplateCoder.realize(&Program::default(), &g, &action);
    assert!(
        r.as_ref()
            .is_err_and(|e| e.0.contains("read outside the chain")),
        "{r:?}"
    );
}

#[test]
fn a_residual_after_a_norm_takes_the_input_the_norm_holds() {
    // `x + tanh(norm(x))`: the chain after the norm reads the norm's own
    // input at the element it writes. Kernels holding it in registers
    // pass it (`STORE_YX`, `EPI_Y`); the others' `STORE_Y` reads it
    // through `LOAD_X`, next to their own read; no pointer to it is passed
    // to the chain.
    for (shapes, holds) in [
        // A warp's part per row, in registers.
        ("x=4096x64,w=64,b=64", Some("STORE_YX(")),
        // A block per row, in registers.
        ("x=300x4000,w=4000,b=4000", Some("STORE_YX(")),
        // A team of blocks per row, 16 bytes at a time.
        ("x=64x65536,w=65536,b=65536", Some("EPI_Y(at + 3, ")),
        // Two launches: the normalizing one reads x again.
        ("x=2x16777216,w=16777216,b=16777216", None),
    ] {
        let g = graph("y = x + tanh(layer_norm(x, w, b, dim=-1))", shapes);
        let action = fuse_all(&g, Params::default());
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f, shapes);
        for item in [
            "__device__ __forceinline__ float k0_rows_e(long long i, float v, float xv) {",
            "#define EPI_Y(i, v, xv) k0_rows_e((i), (v), (xv))",
            "#define STORE_Y(i, v) STORE_YX(i, v, LOAD_X(i))",
        ] {
            assert!(f.source.contains(item), "{shapes}: {item}\n{}", f.source);
        }
        assert!(!f.source.contains("pe0"), "{shapes}:\n{}", f.source);
        if let Some(call) = holds {
            assert!(f.source.contains(call), "{shapes}: {call}\n{}", f.source);
        }
        // x, the scale and the shift; nothing for the chain.
        assert_eq!(f.inputs.len(), 3, "{shapes}");
    }
}
#[test]
fn norms_along_a_middle_dim_take_a_thread_per_line() {
    // What a model writes out over the channels: an RMS norm (64 channels
    // in registers, 100 read twice) and a division by the length, with a
    // chain in front and a residual after, which takes the element the
    // thread holds.
    for (intent, shapes, held) in [
        (
            "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) + 1e-5)",
            "x=4x64x1024",
            true,
        ),
        (
            "z = relu(x) - 0.5; y = z * rsqrt(mean(z * z, dim=1, keepdim=true) + 1e-5)",
            "x=4x64x33x31",
            true,
        ),
        (
            "y = tanh(x * rsqrt(mean(x * x, dim=1, keepdim=true) + 1e-5)) + x",
            "x=4x64x33x31",
            true,
        ),
        (
            "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) + 1e-5)",
            "x=4x100x1000",
            false,
        ),
        ("y = x / norm(x, dim=1, keepdim=true)", "x=8x48x4096", true),
    ] {
        let g = graph(intent, shapes);
        let action = fuse_all(&g, Params::default());
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f, intent);
        assert!(
            f.source.contains("a thread per line"),
            "{intent}: {}",
            f.source
        );
        assert_eq!(
            f.source.contains("float v_["),
            held,
            "{intent}: {}",
            f.source
        );
        assert_eq!(f.outputs, g.outputs(), "{intent}");
    }
}

#[test]
fn max_and_average_pooling_compile_with_torchs_divisor() {
    // Where the tile fits, a block stages its outputs' inputs in shared
    // memory and a thread takes the vector width's columns of 1–2 planes x
    // 1–4 rows; otherwise (L1/45's windows of 11 x 11, 11 apart; L1/46 at 4
    // columns a thread) a thread walks that many outputs' windows
    // together, taps outside the input predicated off, 32-bit indices.
    const WALK: &str = "1, 2 or 4 outputs";
    // Each problem's divisor, staged and walked, and its path at each
    // vector width.
    type Paths = [(u32, &'static str); 3];
    let cases: [(&str, &str, &str, Paths); 5] = [
        (
            "41_Max_Pooling_1D",
            "= acc[u][jd][jh];",
            "",
            [
                (1, "1 x 1 outputs"),
                (2, "1 x 1 outputs"),
                (4, "1 x 1 outputs"),
            ],
        ),
        // 4 rows a thread: each staged input read once for up to 4 windows.
        (
            "42_Max_Pooling_2D",
            "= acc[u][jd][jh];",
            "",
            [
                (1, "1 x 4 outputs"),
                (2, "1 x 4 outputs"),
                (4, "1 x 4 outputs"),
            ],
        ),
        // count_include_pad: the window clipped to the padded input.
        (
            "44_Average_Pooling_1D",
            "acc[u][jd][jh] / (float)((e0 - s0));",
            "",
            [
                (1, "1 x 1 outputs"),
                (2, "1 x 1 outputs"),
                (4, "1 x 1 outputs"),
            ],
        ),
        (
            "45_Average_Pooling_2D",
            "",
            "y[i] = acc[u] / (float)((e0 - s[u][0]) * (e1 - s[u][1]));",
            [(1, WALK), (2, WALK), (4, WALK)],
        ),
        (
            "46_Average_Pooling_3D",
            "acc[u][jd][jh] / (float)((e0 - s0) * (e1 - s1) * (e2 - s2));",
            "y[i] = acc[u] / (float)((e0 - s[u][0]) * (e1 - s[u][1]) * (e2 - s[u][2]));",
            [(1, "2 x 2 outputs"), (2, "2 x 1 outputs"), (4, WALK)],
        ),
    ];
    for (name, staged, walked, paths) in cases {
        let g = traced(1, name);
        let node = g
            .nodes()
            .find(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Pool(_)))
            .unwrap()
            .0;
        let realize = |vector| {
            let action = Action {
                kind: ActionKind::CustomKernel,
                region: vec![node.index() as u32],
                params: Params { block: 256, vector },
            };
            TemplateCoder.realize(&Program::default(), &g, &action)
        };
        let refusal = realize(3).unwrap_err().to_string();
        assert!(refusal.contains(WALK), "{refusal}");
        for (vector, path) in paths {
            let what = format!("{name} x{vector}");
            let f = realize(vector).unwrap();
            assert!(f.name.ends_with("_pool"));
            compiles(&f, &what);
            let outputs = f.launch.sizes[0] as u64;
            if path == WALK {
                let live = format!("bool live[{vector}];");
                for item in [walked, "int rest = live[u] ? i : 0;", &live] {
                    assert!(f.source.contains(item), "{what}: {item}\n{}", f.source);
                }
                // A block's threads take the first output of each of
                // their groups of `vector`, a block apart.
                assert_eq!(
                    u64::from(f.launch.grid),
                    outputs.div_ceil(256 * u64::from(vector)).clamp(1, 132 * 8),
                    "{what}"
                );
                continue;
            }
            let columns = format!("a thread takes {vector} column(s)");
            for item in [
                staged,
                "staged:",
                &columns,
                path,
                "__shared__ __align__(16) float tile[",
                "v = *reinterpret_cast<const float4*>(src + w);",
            ] {
                assert!(f.source.contains(item), "{what}: {item}\n{}", f.source);
            }
            // A block a tile: at least as many outputs as the blocks'
            // threads' columns cover, at most twice as many.
            let covered = u64::from(f.launch.grid) * 256 * u64::from(vector);
            let taken = match path {
                "1 x 4 outputs" => 4,
                "2 x 2 outputs" => 4,
                "2 x 1 outputs" => 2,
                _ => 1,
            };
            assert!(
                covered * taken >= outputs && covered * taken <= 2 * outputs,
                "{what}: {} blocks for {outputs} outputs",
                f.launch.grid
            );
        }
    }
    // L1/41's dilated taps: 3 apart in the staged row.
    let g = traced(1, "41_Max_Pooling_1D");
    let f = common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::Pool(_))).unwrap();
    assert!(f.source.contains("* 1 + k * 3];"), "{}", f.source);
}

/// A graph of one pooling node over `shape` (its output `out`).
fn pool_graph(shape: Vec<u64>, out: Vec<u64>, pool: mtmc_actions::op::Pool) -> OpGraph {
    use mtmc_actions::TensorType;
    use mtmc_actions::graph::TensorRef;
    use mtmc_actions::op::Op;
    let mut g = OpGraph::new();
    let x = g
        .add(
            "x",
            Op::Input { name: "x".into() },
            &[],
            vec![TensorType::new(shape, DType::F32)],
        )
        .unwrap();
    let y = g
        .add(
            "pool",
            Op::Pool(pool),
            &[TensorRef::first(x)],
            vec![TensorType::new(out, DType::F32)],
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(y)]);
    g
}

/// A 2-d pooling op, channels first: square kernel, stride, padding.
fn pool_2d(
    max: bool,
    kernel: u64,
    stride: u64,
    padding: u64,
    include_pad: bool,
) -> mtmc_actions::op::Pool {
    mtmc_actions::op::Pool {
        max,
        spatial: 2,
        kernel: vec![kernel; 2],
        stride: vec![stride; 2],
        padding: vec![padding; 2],
        dilation: vec![1, 1],
        ceil_mode: false,
        count_include_pad: include_pad,
        channels_last: false,
    }
}

/// The kernel for one pooling op over `shape` (its output `out`), which
/// must compile and hold each of `items`.
fn pooled(shape: Vec<u64>, out: Vec<u64>, pool: mtmc_actions::op::Pool, items: &[&str]) -> String {
    let g = pool_graph(shape, out, pool);
    let f = TemplateCoder
        .realize(&Program::default(), &g, &last_node(&g))
        .unwrap();
    compiles(&f, &format!("{:?}", f.source.lines().next()));
    for item in items {
        assert!(f.source.contains(item), "{item}:\n{}", f.source);
    }
    f.source
}

#[test]
fn pooling_with_more_than_2_pow_30_outputs_indexes_in_64_bits() {
    use mtmc_actions::op::Pool;
    // A 3x3 max pool, stride 1, padding 1, over 16 x 64 x 1024 x 1100:
    // 1.15 G outputs. Staged: a plane's start and each output's index are
    // 64-bit, coordinates within a plane 32-bit.
    let pool = pool_2d(true, 3, 1, 1, true);
    let shape = vec![16, 64, 1024, 1100];
    pooled(
        shape.clone(),
        shape,
        pool.clone(),
        &[
            "const long long plane = r / 1;",
            "const float* p = x + plane * 1126400LL;",
            "y[((plane * 1 + od) * 1024 + oh) * 1100 + ow]",
        ],
    );
    // Channels last, the walk: every index 64-bit.
    let shape = vec![16, 1024, 1100, 64];
    let last = Pool {
        channels_last: true,
        ..pool
    };
    pooled(
        shape.clone(),
        shape,
        last,
        &[
            "long long rest = live[u] ? i : 0;",
            "const long long count = (long long)n;",
        ],
    );
}

#[test]
fn staged_average_pooling_without_the_padding_counts_the_taps_inside() {
    // A 3x3 average pool, stride 2, padding 1, count_include_pad off, over
    // rows of 30 (not a multiple of 4: the staging copies element by
    // element).
    let source = pooled(
        vec![8, 16, 30, 30],
        vec![8, 16, 15, 15],
        pool_2d(false, 3, 2, 1, false),
        &[
            "staged:",
            "n0 += s0 + k * 1 >= 0 && s0 + k * 1 < 30;",
            "acc[u][jd][jh] / (float)(n0 * n1);",
        ],
    );
    assert!(
        !source.contains("reinterpret_cast<const float4*>"),
        "{source}"
    );
}

#[test]
fn pooling_moved_to_channels_last_compiles_with_the_channel_innermost() {
    for name in [
        "35_Conv2d_Subtract_HardSwish_MaxPool_Mish",
        "46_Conv2d_Subtract_Tanh_Subtract_AvgPool",
    ] {
        let g = traced(2, name);
        let (r, applied) = mtmc_actions::rewrite::rewrite_all(&g).unwrap();
        assert!(applied.contains(&"channels_last"), "{name}: {applied:?}");
        let f =
            common::realize_first(&r, |op| matches!(op, mtmc_actions::op::Op::Pool(_))).unwrap();
        compiles(&f, name);
        // Neighbouring threads take neighbouring channels; every index
        // fits 32 bits.
        assert!(f.source.contains("channels-last"), "{name}:\n{}", f.source);
        assert!(
            f.source.contains("const int c = rest % 128;"),
            "{name}:\n{}",
            f.source
        );
    }
}

#[test]
fn batch_norm_with_batch_statistics_compiles_with_and_without_spatial_dims() {
    for (name, layout) in [
        // BatchNorm2d after a convolution, 128 channels of 1 M elements:
        // a team of blocks per channel; 32-bit indices.
        ("52_Conv2d_Activation_BatchNorm", "(unsigned)k % 15876u)"),
        // BatchNorm1d after a GEMM: 32 channels a block, warps along rows.
        ("39_Gemm_Scale_BatchNorm", "LOAD_X(r * C + ch)"),
    ] {
        let g = traced(2, name);
        let f =
            common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::Norm(_))).unwrap();
        compiles(&f, name);
        assert!(f.source.contains(layout), "{name}:\n{}", f.source);
        assert!(
            (f.source.contains("* w[ch]") && f.source.contains("+ b[ch]"))
                || (f.source.contains("* w[r]") && f.source.contains("+ b[r]")),
            "{}",
            f.source
        );
    }
}

#[test]
fn few_long_rows_split_across_blocks_and_the_last_block_combines() {
    for op in ["sum", "mean", "max", "min", "norm"] {
        let g = graph(&format!("y = {op}(x, dim=1)"), "x=4x1048576");
        let f = TemplateCoder
            .realize(&Program::default(), &g, &last_node(&g))
            .unwrap();
        compiles(&f, op);
        assert!(
            f.source.contains("__device__ float k0_rows_part["),
            "{}",
            f.source
        );
        // The count is reset for the next launch.
        assert!(f.source.contains("k0_rows_done[r] = 0u;"), "{}", f.source);
        let splits = f.launch.sizes[2];
        assert!(splits > 1, "{op}: {:?}", f.launch);
        assert_eq!(i64::from(f.launch.grid), 4 * splits, "{op}");
    }
    let g = graph("y = softmax(x, dim=1)", "x=4x1048576");
    let e = TemplateCoder
        .realize(&Program::default(), &g, &last_node(&g))
        .unwrap_err();
    assert!(e.0.contains("two-stage online kernel"), "{e}");
}

/// Softmax over long rows: a cluster of eight blocks per row, each holding
/// its eighth in shared memory; with a chain fused in front, the loads go
/// through the chain element by element.
#[test]
fn softmax_over_long_rows_keeps_each_row_in_a_clusters_shared_memory() {
    for op in ["softmax", "log_softmax"] {
        let g = graph(&format!("y = {op}(x, dim=1)"), "x=16x65536");
        let f = TemplateCoder
            .realize(&Program::default(), &g, &last_node(&g))
            .unwrap();
        compiles(&f, op);
        assert!(
            f.source.contains("__cluster_dims__(8, 1, 1)"),
            "{}",
            f.source
        );
        assert!(
            f.source.contains("ld.shared::cluster.v2.f32"),
            "{}",
            f.source
        );
        assert_eq!(
            (f.launch.grid, f.launch.block, f.launch.shared),
            (16 * 8, 1024, 65536 / 8 * 4),
            "{op}"
        );
    }
    let g = graph("y = softmax(relu(x) * 2.0, dim=1)", "x=16x65536");
    let action = fuse_all(&g, Params::default());
    let f = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap();
    compiles(&f, "softmax with a prologue");
    assert!(f.source.contains("#define MTMC_PROLOGUE"), "{}", f.source);
    assert_eq!(f.region.len(), 3);
    // Rows too short for a cluster, or too long for its shared memory, are
    // not given one.
    for shape in ["x=16x4096", "x=16x1048576", "x=16x65540"] {
        let g = graph("y = softmax(x, dim=1)", shape);
        let f = TemplateCoder.realize(&Program::default(), &g, &last_node(&g));
        assert!(
            f.as_ref()
                .map_or(true, |f| !f.source.contains("__cluster_dims__")),
            "{shape}"
        );
    }
}

#[test]
fn argmax_and_argmin_write_int64_indices_in_both_layouts() {
    for op in ["argmax", "argmin"] {
        for (dim, layout) in [(2, "rows"), (1, "columns")] {
            let g = graph(&format!("y = {op}(x, dim={dim})"), "x=64x32x128");
            let f = TemplateCoder
                .realize(&Program::default(), &g, &last_node(&g))
                .unwrap();
            compiles(&f, &format!("{op} over {layout}"));
            assert!(
                f.source.contains("long long* __restrict__ y"),
                "{}",
                f.source
            );
            // Ties go to the lower index.
            assert!(f.source.contains("== best && k < at"), "{}", f.source);
        }
    }
}

#[test]
fn scans_compile_forward_reverse_and_exclusive_in_both_layouts() {
    for op in ["cumsum", "cumprod"] {
        // 512 rows: a block per row; 2048 rows: a warp per row, with
        // 16-byte loads when a row is a whole number of them.
        for (dim, layout, shape, warp) in [
            (2, "rows", "16x32x128", None),
            (1, "columns", "16x32x128", None),
            (2, "rows", "64x32x128", Some(true)),
            (2, "rows", "64x32x130", Some(false)),
        ] {
            let g = graph(&format!("y = {op}(x, dim={dim})"), &format!("x={shape}"));
            let f = TemplateCoder
                .realize(&Program::default(), &g, &last_node(&g))
                .unwrap();
            assert!(f.name.ends_with("_scan"));
            compiles(&f, &format!("{op} over {layout} of {shape}"));
            let lanes = f.source.contains("float v[8];");
            assert_eq!(lanes, warp.is_some(), "{shape}:\n{}", f.source);
            let quads = f
                .source
                .contains("reinterpret_cast<const float4*>(x + xr + j)");
            assert_eq!(quads, warp == Some(true), "{shape}:\n{}", f.source);
        }
    }
    // Exclusive scans read one place back along the walk (the identity
    // first): a block per row, a warp per row (element by element, even
    // where the rows are whole quads), a thread per line (each element
    // written before it joins the total); reverse ones one place forward.
    for (intent, shape, read) in [
        (
            "cumsum(x, dim=2, exclusive=true)",
            "16x32x128",
            "float v = j >= 1 && j < K ? LOAD_X(xr + (j - 1)) : 0.0f;",
        ),
        (
            "cumsum(x, dim=2, exclusive=true)",
            "64x32x128",
            "v[e] = j0 + e >= 1 && j0 + e < K ? LOAD_X(xr + j0 + e - 1) : 0.0f;",
        ),
        (
            "cumprod(x, dim=2, reverse=true, exclusive=true)",
            "64x32x128",
            "LOAD_X(xr + K - 1 - (j0 + e - 1)) : 1.0f;",
        ),
        (
            "cumsum(x, dim=1, exclusive=true)",
            "16x32x128",
            "y[at] = acc; acc = acc + LOAD_X(at);",
        ),
    ] {
        let g = graph(&format!("y = {intent}"), &format!("x={shape}"));
        let f = TemplateCoder
            .realize(&Program::default(), &g, &last_node(&g))
            .unwrap();
        compiles(&f, intent);
        assert!(f.source.contains("(exclusive)"), "{intent}:\n{}", f.source);
        assert!(f.source.contains(read), "{intent}: {read}\n{}", f.source);
        assert!(!f.source.contains("float4"), "{intent}:\n{}", f.source);
    }
    // KernelBench's reverse cumsum is flip, cumsum, flip: normalized into
    // one reverse scan, written as one kernel walking from the end.
    let g = traced(1, "91_cumsum_reverse");
    let scan = g
        .nodes()
        .find(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Scan(_)))
        .unwrap()
        .0;
    assert_eq!(g.nodes().count(), 2, "the flips are gone");
    let action = Action {
        kind: ActionKind::CustomKernel,
        region: vec![scan.index() as u32],
        params: Params::default(),
    };
    let f = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap();
    compiles(&f, "reverse cumsum");
    // 32768 rows of 32768: a warp per row, each lane's quads read forward
    // and walked backwards (or through LOAD_X when a chain is fused in).
    for walk in [
        "reinterpret_cast<const float4*>(x + xr + K - 4 - j)",
        "v[4 * q] = u.w;",
        "LOAD_X(xr + K - 1 - (j0 + e))",
        "reinterpret_cast<float4*>(yr + K - 4 - j)",
    ] {
        assert!(f.source.contains(walk), "{walk}:\n{}", f.source);
    }
}

#[test]
fn losses_compile_elementwise_and_by_rows_with_one_combining_block() {
    for (name, item) in [
        ("95_CrossEntropyLoss", "xr[target[i]]"),
        ("96_HuberLoss", "fabsf(d) < 1e0f ? 0.5f * d * d / 1e0f"),
        ("99_TripletMarginLoss", "+ 1e-6f"),
    ] {
        let g = traced(1, name);
        let f =
            common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::Loss(_))).unwrap();
        assert!(f.name.ends_with("_loss"));
        compiles(&f, name);
        assert!(f.source.contains(item), "{name}:\n{}", f.source);
        // The mean divides by the number of terms; the count is reset.
        assert!(f.source.contains("y[0] = acc / "), "{name}:\n{}", f.source);
        assert!(f.source.contains("_done[0] = 0u;"), "{name}:\n{}", f.source);
    }
}

#[test]
fn kl_divergence_compiles_with_its_batch_mean() {
    use mtmc_actions::dtype::TensorType;
    use mtmc_actions::graph::TensorRef;
    use mtmc_actions::op::{Loss, LossKind, Op, Reduction};
    for (log_target, reduction, term, finish) in [
        (
            false,
            Reduction::BatchMean,
            "(bv == 0.0f ? 0.0f : bv * logf(bv)) - bv * av",
            "y[0] = acc / 4e1f",
        ),
        (true, Reduction::Sum, "expf(bv) * (bv - av)", "y[0] = acc;"),
    ] {
        let mut g = OpGraph::new();
        let ins: Vec<TensorRef> = ["p", "q"]
            .iter()
            .map(|&name| {
                let t = TensorType::new(vec![40, 100], DType::F32);
                let id = g
                    .add(name, Op::Input { name: name.into() }, &[], vec![t])
                    .unwrap();
                TensorRef::first(id)
            })
            .collect();
        let kl = Op::Loss(Loss {
            kind: LossKind::KlDiv { log_target },
            reduction,
        });
        let y = g
            .add("kl", kl, &ins, vec![TensorType::new(vec![], DType::F32)])
            .unwrap();
        g.set_outputs(vec![TensorRef::first(y)]);
        let f = TemplateCoder
            .realize(&Program::default(), &g, &last_node(&g))
            .unwrap();
        compiles(&f, "kl_div");
        for piece in [term, finish] {
            assert!(f.source.contains(piece), "{piece}:\n{}", f.source);
        }
    }
}

#[test]
fn norms_of_long_groups_take_a_team_of_blocks_that_meet_in_one_launch() {
    // InstanceNorm2d of [112, 64, 512, 512]: 7168 rows of 256 K;
    // GroupNorm of [112, 64, 512, 512] in 8 groups: 896 groups of 2 M;
    // BatchNorm2d after a convolution: 128 channels of about 1 M, strided
    // in runs of 126 x 126.
    for (level, name, groups, count) in [
        (1, "34_InstanceNorm", 7168, 1 << 18),
        (1, "35_GroupNorm_", 896, 8 << 18),
        (2, "52_Conv2d_Activation_BatchNorm", 128, 64 * 15876),
    ] {
        let g = traced(level, name);
        let f =
            common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::Norm(_))).unwrap();
        compiles(&f, name);
        let kernels: Vec<&str> = f.launches().map(|(k, _)| k).collect();
        assert_eq!(kernels, ["k0_rows"], "{name}");
        let block = i64::from(f.launch.block);
        assert_eq!(block, 256, "{name}");
        let splits = f.launch.sizes[2];
        assert_eq!(f.launch.sizes[..2], [groups, count], "{name}");
        // 64 elements a thread; at most two thirds of the 2 blocks of 256
        // an SM is sure to hold, on 132 SMs.
        assert_eq!(splits, (count + 64 * block - 1) / (64 * block), "{name}");
        assert!(3 * splits <= 2 * 132 * 2, "{name}: {splits}");
        // 3 blocks an SM with nothing fused in (20 spare registers a
        // thread), 2 with a chain (64).
        assert!(
            f.source.contains("__launch_bounds__(256, k0_rows_MIN)")
                && f.source
                    .contains("#define k0_rows_MIN 2\n#else\n#define k0_rows_MIN 3"),
            "{}",
            f.source
        );
        assert_eq!(i64::from(f.launch.grid), groups * splits, "{name}");
        // A ticket per block; the team waits for all its blocks; Chan's
        // combination of the chunks' statistics by every block; the counts
        // and the tickets reset for the next launch.
        for piece in [
            "ticket_ = atomicAdd(&k0_rows_ticket[0], 1u);",
            "< (unsigned int)splits) __nanosleep(",
            "m2 += stats[p].y +",
            "k0_rows_in[r] = 0u; k0_rows_out[r] = 0u;",
            "k0_rows_ticket[0] = 0u; k0_rows_ticket[1] = 0u;",
        ] {
            assert!(f.source.contains(piece), "{piece}:\n{}", f.source);
        }
        // 16 bytes a load and a store: the batch norm's runs are a
        // multiple of 4 long.
        assert!(f.source.contains("float4 v_[16];"), "{}", f.source);
    }
}

#[test]
fn groups_too_long_for_a_team_take_a_statistics_launch_then_a_normalizing_one() {
    // LayerNorm over [64, 256, 256] of 16 rows: groups of 4 M, for which
    // a team would need 256 blocks of 256.
    let g = traced(1, "40_LayerNorm");
    let f = common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::Norm(_))).unwrap();
    compiles(&f, "layer norm");
    let kernels: Vec<&str> = f.launches().map(|(k, _)| k).collect();
    assert_eq!(kernels, ["k0_rows_stats", "k0_rows"]);
    let block = i64::from(f.launch.block);
    let splits = f.launch.sizes[2];
    assert_eq!(f.launch.sizes[..2], [16, 64 << 16]);
    assert_eq!(splits, ((64 << 16) + 16 * block - 1) / (16 * block));
    // The chunk in registers, read once by each launch (the third LOAD_X
    // is its definition); the last block combines by Chan's formula.
    assert!(f.source.contains("float v_[k0_rows_PER];"), "{}", f.source);
    assert_eq!(f.source.matches("LOAD_X(").count(), 3, "{}", f.source);
    assert!(
        f.source.contains("m2 += stats[2 * p + 1] +"),
        "{}",
        f.source
    );
    assert!(f.source.contains("k0_rows_done[r] = 0u;"), "{}", f.source);
}

#[test]
fn global_pooling_is_a_row_reduction_read_by_whole_blocks() {
    let g = traced(2, "67_Conv2d_GELU_GlobalAvgPool");
    let f = common::realize_first(&g, |op| matches!(op, mtmc_actions::op::Op::AdaptivePool(_)))
        .unwrap();
    assert!(f.name.ends_with("_rows"), "{}", f.name);
    compiles(&f, "global average pool");
    assert!(f.source.contains("y[r] = acc / (float)K;"), "{}", f.source);
}

#[test]
fn a_pointwise_chain_read_only_by_a_row_kernel_is_fused_in_front_of_it() {
    // MSE written out: (a - b) ** 2, then a mean over everything.
    let g = traced(1, "94_MSELoss");
    let action = fuse_all(&g, Params::default());
    let f = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap();
    compiles(&f, "mse with a fused prologue");
    assert_eq!(f.inputs.len(), 2, "both operands, no intermediate");
    assert!(
        f.source
            .contains("#define LOAD_X(i) k0_rows_x((i), px0, px1)"),
        "{}",
        f.source
    );
    assert!(f.source.contains("(t2 * t2)"), "{}", f.source);
    // A chain whose result is read elsewhere too cannot be fused.
    let g = graph("h = relu(x); y = sum(h, dim=1); z = h * 2", "x=64x128");
    let region = g
        .nodes()
        .filter(|(_, n)| n.name == "h" || n.name == "y")
        .map(|(id, _)| id.index() as u32)
        .collect();
    let action = Action {
        kind: ActionKind::Fuse,
        region,
        params: Params::default(),
    };
    let e = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap_err();
    assert!(e.0.contains("one result"), "{e}");
}

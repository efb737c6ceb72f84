//! The pointwise family: every op it knows compiles with real NVRTC for
//! sm_90 (scripts/test installs NVRTC), fused chains with broadcasting
//! become one kernel, a fragment that does not compile is rolled back, and
//! a program renders to a launch plan that fits its graph.

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph};
use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::program::{Fragment, Program};
use mtmc_coder::render::to_cuda_program;
use mtmc_coder::session::{Session, Stage};
use mtmc_coder::template::{Refusal, TemplateCoder};
use mtmc_env::nvrtc::{Arch, CompileUnit};

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    };
    compile(src, &b).unwrap()
}

#[track_caller]
fn compiles(f: &Fragment) {
    let r = mtmc_env::nvrtc::compile(
        &CompileUnit {
            name: format!("{}.cu", f.name),
            source: f.source.clone(),
        },
        Arch::SM90,
    )
    .unwrap_or_else(|e| panic!("{e}: these tests need NVRTC 13 (run scripts/test)"));
    assert!(r.ok, "{}\n{}", r.log, f.source);
    assert_eq!(r.kernels.len(), 1);
    assert_eq!(r.kernels[0].name, f.name);
}

mod common;
use common::fuse_all;

#[test]
fn every_pointwise_function_compiles() {
    let functions = [
        "relu",
        "relu6",
        "leaky_relu",
        "gelu",
        "gelu_tanh",
        "sigmoid",
        "tanh",
        "silu",
        "mish",
        "hardswish",
        "hardsigmoid",
        "hardtanh",
        "softplus",
        "softsign",
        "elu",
        "selu",
        "exp",
        "log",
        "abs",
        "neg",
        "sqrt",
        "rsqrt",
        "reciprocal",
        "erf",
        "sin",
        "cos",
    ];
    let chain: Vec<String> = functions.iter().map(|f| format!("{f}(")).collect();
    let src = format!("y = {}x{}", chain.concat(), ")".repeat(functions.len()));
    let g = graph(&src, "x=1000");
    let f = TemplateCoder
        .realize(&Program::default(), &g, &fuse_all(&g, Params::default()))
        .unwrap();
    compiles(&f);
    assert_eq!(f.region.len(), functions.len());
    assert_eq!(f.launch.sizes, [1000]);
}

#[test]
fn a_chain_with_broadcasting_is_one_kernel_reading_each_input_once() {
    let g = graph(
        "y = gelu(x * s + b) - c ** 2 + clamp(x, min=-0.5, max=0.5)",
        "x=64x128,s=128,b=1,c=64x1",
    );
    let f = TemplateCoder
        .realize(&Program::default(), &g, &fuse_all(&g, Params::default()))
        .unwrap();
    compiles(&f);
    assert_eq!(f.inputs.len(), 4, "x, s, b, c");
    assert_eq!(f.outputs.len(), 1);
    // s varies along the last dim, c along the first: both coordinates,
    // in 32-bit arithmetic (every index fits).
    assert!(
        f.source
            .contains("long long c0 = (long long)((unsigned)(i) / 128u % 64u);"),
        "{}",
        f.source
    );
    assert!(
        f.source
            .contains("long long c1 = (long long)((unsigned)(i) / 1u % 128u);"),
        "{}",
        f.source
    );
}

#[test]
fn coordinates_of_more_than_2_pow_32_elements_take_64_bit_arithmetic() {
    let g = graph("y = x + b", "x=70000x70000,b=70000");
    let f = TemplateCoder
        .realize(&Program::default(), &g, &fuse_all(&g, Params::default()))
        .unwrap();
    compiles(&f);
    assert!(
        f.source.contains("long long c1 = ((i) / 1LL) % 70000LL;"),
        "{}",
        f.source
    );
}

#[test]
fn float4_with_broadcast_inputs_read_per_lane_or_once() {
    // The fused region at block 128, vector width 4.
    let float4 = |src: &str, shapes: &str| {
        let g = graph(src, shapes);
        let params = Params {
            block: 128,
            vector: 4,
        };
        TemplateCoder.realize(&Program::default(), &g, &fuse_all(&g, params))
    };
    let f = float4("y = silu(a) * b", "a=4096,b=4096").unwrap();
    compiles(&f);
    assert!(f.source.contains("reinterpret_cast<const float4*>(in0)[i]"));
    assert_eq!((f.launch.block, f.launch.grid), (128, 8));
    // A per-channel bias over 8x8 planes: the same for four neighbours,
    // read once.
    let f = float4("y = x + b", "x=2x3x8x8,b=3x1x1").unwrap();
    compiles(&f);
    let s = &f.source;
    assert!(
        s.contains("long long c1 = (long long)((unsigned)(i * 4) / 64u % 3u);"),
        "{s}"
    );
    assert!(s.contains("float v1 = in1[c1];"), "{s}");
    // A bias over the last dim: one load per lane.
    let f = float4("y = x + b", "x=16x6,b=6").unwrap();
    compiles(&f);
    let s = &f.source;
    assert!(
        s.contains("long long c1_z = (long long)((unsigned)(i * 4 + 2) / 1u % 6u);"),
        "{s}"
    );
    assert!(s.contains("float v1_w = in1[c1_w];"), "{s}");
    let e = float4("y = a * 2", "a=4098").unwrap_err();
    assert!(e.0.contains("float4 needs a multiple of 4 elements"), "{e}");
}

#[test]
fn float2_reads_two_lanes_a_trip() {
    let float2 = |src: &str, shapes: &str| {
        let g = graph(src, shapes);
        let params = Params {
            block: 256,
            vector: 2,
        };
        TemplateCoder.realize(&Program::default(), &g, &fuse_all(&g, params))
    };
    let f = float2("y = silu(a) * b", "a=4098,b=4098").unwrap();
    compiles(&f);
    let s = &f.source;
    assert!(s.contains("i < n / 2;"), "{s}");
    assert!(s.contains("reinterpret_cast<const float2*>(in0)[i]"), "{s}");
    assert!(s.contains("make_float2(t"), "{s}");
    assert_eq!(f.launch.grid, 9, "2049 pairs in blocks of 256");
    // A bias over an odd last dim: one load per lane.
    let f = float2("y = x + b", "x=4x5,b=5").unwrap();
    compiles(&f);
    let s = &f.source;
    assert!(
        s.contains("long long c1_y = (long long)((unsigned)(i * 2 + 1) / 1u % 5u);"),
        "{s}"
    );
    assert!(!s.contains("c1_z"), "{s}");
    let e = float2("y = a * 2", "a=4097").unwrap_err();
    assert!(e.0.contains("float2 needs a multiple of 2 elements"), "{e}");
    let g = graph("y = relu(x)", "x=16");
    let params = Params {
        block: 256,
        vector: 3,
    };
    let e = TemplateCoder
        .realize(&Program::default(), &g, &fuse_all(&g, params))
        .unwrap_err();
    assert!(e.0.contains("vector width 3 is not 1, 2 or 4"), "{e}");
}

#[test]
fn what_the_family_cannot_write_is_refused_with_the_reason() {
    let g = graph("y = relu(transpose(x, dim0=0, dim1=1))", "x=4x8");
    let e = TemplateCoder
        .realize(&Program::default(), &g, &fuse_all(&g, Params::default()))
        .unwrap_err();
    assert!(
        e.0.contains("is not a pointwise op this template writes"),
        "{e}"
    );
    let g = graph("y = relu(x)", "x=16");
    let bad = Action {
        kind: ActionKind::Fuse,
        region: fuse_all(&g, Params::default()).region,
        params: Params {
            block: 100,
            vector: 1,
        },
    };
    assert!(
        TemplateCoder
            .realize(&Program::default(), &g, &bad)
            .unwrap_err()
            .0
            .contains("block 100")
    );
}

/// Writes a fragment that does not compile.
struct Broken;

impl MicroCoder for Broken {
    fn realize(&self, p: &Program, g: &OpGraph, a: &Action) -> Result<Fragment, Refusal> {
        let mut f = TemplateCoder.realize(p, g, a)?;
        f.source = f.source.replace("fmaxf", "fmaxx");
        Ok(f)
    }
}

#[test]
fn a_fragment_that_does_not_compile_is_rolled_back_with_its_log() {
    let g = graph("y = relu(x) * 2.0", "x=1024");
    let action = fuse_all(&g, Params::default());
    let mut s = Session::new(&g, Broken, Arch::SM90);
    let f = s.propose(&action).unwrap_err();
    assert_eq!(f.stage, Stage::Compile);
    assert!(
        f.log.contains("identifier \"fmaxx\" is undefined"),
        "{}",
        f.log
    );
    assert!(f.fragment.unwrap().contains("fmaxx"));
    assert!(
        s.good().fragments.is_empty(),
        "the good program is unchanged"
    );
    assert_eq!(s.failures.len(), 1);

    let mut s = Session::new(&g, TemplateCoder, Arch::SM90);
    let p = s.propose(&action).unwrap();
    s.accept(p.clone());
    // A step the evaluator finds wrong goes back to the last good program.
    let retile = Action {
        kind: ActionKind::Retile,
        params: Params {
            block: 512,
            vector: 4,
        },
        ..action.clone()
    };
    let worse = s.propose(&retile).unwrap();
    s.reject(&retile, &worse, "incorrect: values differ");
    assert_eq!(s.good(), &p);
    assert_eq!(s.failures[0].stage, Stage::Outcome);
    assert_eq!(
        worse.fragments.len(),
        1,
        "a retile replaces the kernel, it does not add one"
    );
    assert_eq!(worse.fragments[0].name, p.fragments[0].name);
}

#[test]
fn split_fragments_render_to_a_plan_that_fits_the_graph() {
    let g = graph("h = gelu(x + b)\ny = h * h", "x=256x64,b=64");
    let ids: Vec<u32> = g
        .nodes()
        .filter(|(_, n)| !n.op.is_source())
        .map(|(id, _)| id.index() as u32)
        .collect();
    let (first, second) = ids.split_at(2);
    let mut s = Session::new(&g, TemplateCoder, Arch::SM90);
    // Second half first: the program orders fragments by what they read.
    for region in [second, first] {
        let a = Action {
            kind: ActionKind::Fuse,
            region: region.to_vec(),
            params: Params::default(),
        };
        let p = s.propose(&a).unwrap();
        s.accept(p);
    }
    let program = s.good();
    assert_eq!(program.fragments.len(), 2);
    assert_eq!(
        program.fragments[0].region.len(),
        2,
        "gelu(x + b) runs first"
    );
    let cuda = to_cuda_program(&g, program).unwrap();
    cuda.check(&g).unwrap();
    assert_eq!(cuda.launches.len(), 2);
    assert!(
        cuda.buffers.iter().any(|b| b.bytes == Some(256 * 64 * 4)),
        "h is scratch"
    );
    assert!(
        to_cuda_program(&g, &Program::default())
            .unwrap_err()
            .starts_with("no fragment computes")
    );
}

#[test]
fn triu_and_tril_keep_elements_by_row_and_column() {
    for (name, keep) in [
        (
            "14_Matmul_for_upper_triangular_matrices",
            "(c1 - c0 >= 0LL)",
        ),
        (
            "15_Matmul_for_lower_triangular_matrices",
            "(c1 - c0 <= 0LL)",
        ),
    ] {
        let g = common::traced(1, name);
        let node = g
            .nodes()
            .find(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Triangular { .. }))
            .unwrap()
            .0;
        let mut action = Action {
            kind: ActionKind::CustomKernel,
            region: vec![node.index() as u32],
            params: Params::default(),
        };
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f);
        assert!(f.source.contains(keep), "{name}:\n{}", f.source);
        action.params.vector = 4;
        let e = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap_err();
        assert!(e.0.contains("one element per thread"), "{e}");
    }
}

/// MiniGPT's traced graph, its scaling of the attention scores and the
/// masked_fill after it.
fn minigpt_mask() -> (OpGraph, NodeId, NodeId) {
    let g = common::traced(3, "44_MiniGPTBlock");
    let fill = g
        .nodes()
        .find(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Where { fill: Some(_) }))
        .unwrap()
        .0;
    let scale = g.inputs(fill)[0].node;
    (g, scale, fill)
}

#[test]
fn masked_fill_reads_its_mask_as_bools_and_fills_with_an_infinity() {
    // MiniGPT's attention scores: `(q @ kᵀ) * scale` masked to -inf where
    // the causal mask (a boolean [1, 1, T, T] from torch) holds.
    let (g, scale, fill) = minigpt_mask();
    for vector in [1, 4] {
        let action = Action::kernel_for(
            vec![scale.index() as u32, fill.index() as u32],
            Params { block: 256, vector },
        );
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f);
        assert!(
            f.source.contains("const bool* __restrict__ in1")
                && f.source.contains("? __int_as_float(0xff800000) :"),
            "{}",
            f.source
        );
        if vector == 4 {
            // The mask broadcasts over the heads: each lane reads its own
            // byte, never a float4.
            assert!(f.source.contains("bool v1_w = in1["), "{}", f.source);
        }
    }
}

#[test]
fn a_boolean_input_is_refused_where_it_is_not_a_condition() {
    use common::{input, node};
    use mtmc_actions::op::{BinaryOp, Op};
    let mut g = OpGraph::new();
    let x = input(&mut g, "x", &[64], DType::F32);
    let m = input(&mut g, "m", &[64], DType::Bool);
    // where(m, x, m): the mask is also the value where it does not hold.
    let w = node(
        &mut g,
        "w",
        Op::Where { fill: None },
        &[m, x, m],
        &[64],
        DType::F32,
    );
    let add = Op::Binary(BinaryOp::Add);
    let y = node(&mut g, "y", add, &[w, x], &[64], DType::F32);
    g.set_outputs(vec![y]);
    let region = vec![w.node.index() as u32, y.node.index() as u32];
    let action = Action::kernel_for(region, Params::default());
    let e = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap_err();
    assert!(
        e.0.contains("the boolean `m` is read other than as a where's condition"),
        "{e}"
    );
}

#[test]
fn a_comparison_is_a_bool_that_only_a_where_reads() {
    use common::{input, node};
    use mtmc_actions::op::{BinaryOp, Op};
    let full = [4, 64];
    let mut g = OpGraph::new();
    let x = input(&mut g, "x", &full, DType::F32);
    let y = input(&mut g, "y", &full, DType::F32);
    let gt = Op::Scalar {
        op: BinaryOp::Gt,
        value: 0.5,
        scalar_first: false,
    };
    let gt = node(&mut g, "gt", gt, &[x], &full, DType::Bool);
    let w = node(
        &mut g,
        "w",
        Op::Where { fill: None },
        &[gt, x, y],
        &full,
        DType::F32,
    );
    g.set_outputs(vec![w]);
    let region = vec![gt.node.index() as u32, w.node.index() as u32];
    for vector in [1, 4] {
        let action = Action::kernel_for(region.clone(), Params { block: 256, vector });
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f);
        let decl = format!("bool t{}", gt.node.index());
        assert!(
            f.source.contains(&decl) && f.source.contains("> 5e-1f)"),
            "{}",
            f.source
        );
    }
    // The comparison alone would be a boolean result: left to torch.
    let action = Action::kernel_for(vec![gt.node.index() as u32], Params::default());
    let e = TemplateCoder
        .realize(&Program::default(), &g, &action)
        .unwrap_err();
    assert!(e.0.contains("`gt` is a boolean result"), "{e}");
}

#[test]
fn a_masked_fill_is_fused_in_front_of_the_softmax_reading_it() {
    // MiniGPT's scores scaled and masked to -inf, then softmax: one row
    // kernel whose loads compute the chain, reading the mask as bools.
    let (g, scale, fill) = minigpt_mask();
    let softmax = g.consumers(fill)[0];
    assert!(matches!(
        g.node(softmax).op,
        mtmc_actions::op::Op::Softmax { .. }
    ));
    let region: Vec<u32> = [scale, fill, softmax]
        .iter()
        .map(|n| n.index() as u32)
        .collect();
    for block in [128, 512] {
        let action = Action::kernel_for(region.clone(), Params { block, vector: 1 });
        let f = TemplateCoder
            .realize(&Program::default(), &g, &action)
            .unwrap();
        compiles(&f);
        assert_eq!(f.region.len(), 3, "{}", f.source);
        assert!(
            f.source.contains("const bool* __restrict__ px1")
                && f.source.contains("bool v1 = px1[")
                && f.source.contains("#define MTMC_PROLOGUE"),
            "{}",
            f.source
        );
    }
}

#[test]
fn a_gemm_epilogue_reads_a_mask_as_bools() {
    use common::{input, node};
    use mtmc_actions::op::{BinaryOp, MatMul, Op};
    // masked_fill(x @ wᵀ, m, 0) * 2, the mask broadcast over the rows.
    let mut g = OpGraph::new();
    let x = input(&mut g, "x", &[256, 512], DType::F32);
    let w = input(&mut g, "w", &[384, 512], DType::F32);
    let m = input(&mut g, "m", &[384], DType::Bool);
    let product = Op::MatMul(MatMul {
        trans_a: false,
        trans_b: true,
        bias: false,
    });
    let full = [256, 384];
    let xw = node(&mut g, "xw", product, &[x, w], &full, DType::F32);
    let fill = Op::Where { fill: Some(0.0) };
    let filled = node(&mut g, "filled", fill, &[xw, m], &full, DType::F32);
    let twice = Op::Scalar {
        op: BinaryOp::Mul,
        value: 2.0,
        scalar_first: false,
    };
    let y = node(&mut g, "y", twice, &[filled], &full, DType::F32);
    g.set_outputs(vec![y]);
    let f = common::realize_with_rest(&g, |op| matches!(op, Op::MatMul(_))).unwrap();
    compiles(&f);
    assert_eq!(f.inputs.len(), 3);
    assert!(
        f.source.contains("mma.sync.aligned.m16n8k8")
            && f.source.contains("const bool* __restrict__ pe0")
            && f.source.contains("bool v0 = pe0["),
        "{}",
        f.source
    );
}

//! The Triton coder, with real Triton: every family compiles for sm_90
//! (Triton lowers to PTX and its ptxas assembles it, no GPU needed), a
//! fragment that does not compile is rolled back with Triton's error, and
//! the exported `ModelNew` computes what the same graph computes with
//! torch, run on the CPU by Triton's interpreter.
//!
//! They need Python with torch and triton (`$MTMC_TEST_PYTHON`, which
//! `scripts/test` provides); without it they pass vacuously unless
//! `MTMC_EXPECT_TRITON` is set.

use mtmc_actions::DType;
use mtmc_actions::dtype::TensorType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_actions::op::{Loss, LossKind, Norm, NormKind, Op, OpClass, Pool, Reduction};
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::export::to_model_new;
use mtmc_coder::program::{Fragment, Lang, Program};
use mtmc_coder::session::{Session, Stage};
use mtmc_coder::template::Refusal;
use mtmc_coder::template::triton::TritonCoder;
use mtmc_env::nvrtc::Arch;

mod common;

/// The Python with torch and triton, when this machine has one.
fn python() -> Option<String> {
    let python = std::env::var("MTMC_TEST_PYTHON").ok();
    let has = python.as_ref().is_some_and(|p| {
        std::process::Command::new(p)
            .args(["-c", "import torch, triton"])
            .status()
            .is_ok_and(|s| s.success())
    });
    if !has && std::env::var_os("MTMC_EXPECT_TRITON").is_some() {
        panic!("MTMC_EXPECT_TRITON is set but $MTMC_TEST_PYTHON has no torch and triton");
    }
    python.filter(|_| has)
}

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    };
    compile(src, &b).unwrap()
}

/// `x` of `shape`, normalized by a group or instance norm with a scale and
/// shift (inputs `w` and `b`), batch statistics.
fn norm_graph(kind: NormKind, shape: &[u64]) -> OpGraph {
    let mut g = OpGraph::new();
    let t = |s: &[u64]| TensorType::new(s.to_vec(), DType::F32);
    let x = g
        .add("x", Op::Input { name: "x".into() }, &[], vec![t(shape)])
        .unwrap();
    let w = g
        .add(
            "w",
            Op::Input { name: "w".into() },
            &[],
            vec![t(&shape[1..2])],
        )
        .unwrap();
    let b = g
        .add(
            "b",
            Op::Input { name: "b".into() },
            &[],
            vec![t(&shape[1..2])],
        )
        .unwrap();
    let y = g
        .add(
            "y",
            Op::Norm(Norm {
                kind,
                eps: 1e-5,
                affine: true,
                bias: true,
                batch_stats: true,
            }),
            &[
                TensorRef::first(x),
                TensorRef::first(w),
                TensorRef::first(b),
            ],
            vec![t(shape)],
        )
        .unwrap();
    let s = g
        .add(
            "s",
            Op::Unary(mtmc_actions::op::UnaryOp::Tanh),
            &[TensorRef::first(y)],
            vec![t(shape)],
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(s)]);
    g
}

/// `y = F.normalize(x, p, dim)` over `x` of `shape`.
fn lp_graph(p: f64, shape: &[u64], dim: usize) -> OpGraph {
    let mut g = OpGraph::new();
    let t = TensorType::new(shape.to_vec(), DType::F32);
    let x = g
        .add("x", Op::Input { name: "x".into() }, &[], vec![t.clone()])
        .unwrap();
    let y = g
        .add(
            "y",
            Op::Norm(Norm {
                kind: NormKind::Lp { p, dim },
                eps: 1e-12,
                affine: false,
                bias: false,
                batch_stats: true,
            }),
            &[TensorRef::first(x)],
            vec![t],
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(y)]);
    g
}

/// `triu(x, diagonal=1)` of `x` of `shape`, then `exp`.
fn triu_graph(shape: &[u64]) -> OpGraph {
    let mut g = OpGraph::new();
    let t = TensorType::new(shape.to_vec(), DType::F32);
    let x = g
        .add("x", Op::Input { name: "x".into() }, &[], vec![t.clone()])
        .unwrap();
    let u = g
        .add(
            "u",
            Op::Triangular {
                upper: true,
                diagonal: 1,
            },
            &[TensorRef::first(x)],
            vec![t.clone()],
        )
        .unwrap();
    let e = g
        .add(
            "e",
            Op::Unary(mtmc_actions::op::UnaryOp::Exp),
            &[TensorRef::first(u)],
            vec![t],
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(e)]);
    g
}

/// `exp(masked_fill(x * 2, m, -inf))` with `fill`, else
/// `where(m, x * 2, b)`: `x` [6, 5, 33], the boolean `m` [5, 33]
/// broadcast over the first dim, `b` [33].
fn where_graph(fill: Option<f64>) -> OpGraph {
    use common::{input, node};
    let mut g = OpGraph::new();
    let full = [6, 5, 33];
    let x = input(&mut g, "x", &full, DType::F32);
    let m = input(&mut g, "m", &[5, 33], DType::Bool);
    let twice = node(&mut g, "twice", twice(), &[x], &full, DType::F32);
    let out = if let Some(v) = fill {
        let w = Op::Where { fill: Some(v) };
        let w = node(&mut g, "w", w, &[twice, m], &full, DType::F32);
        let exp = Op::Unary(mtmc_actions::op::UnaryOp::Exp);
        node(&mut g, "e", exp, &[w], &full, DType::F32)
    } else {
        let b = input(&mut g, "b", &[33], DType::F32);
        let w = Op::Where { fill: None };
        node(&mut g, "w", w, &[m, twice, b], &full, DType::F32)
    };
    g.set_outputs(vec![out]);
    g
}

/// `softmax(masked_fill(x * 2, m, -inf), dim=-1)`: the masked_fill a
/// prologue of the softmax, `x` [6, 5, 33], the boolean `m` [5, 33].
fn masked_softmax_graph() -> OpGraph {
    use common::{input, node};
    let mut g = OpGraph::new();
    let full = [6, 5, 33];
    let x = input(&mut g, "x", &full, DType::F32);
    let m = input(&mut g, "m", &[5, 33], DType::Bool);
    let twice = node(&mut g, "twice", twice(), &[x], &full, DType::F32);
    let fill = Op::Where {
        fill: Some(f64::NEG_INFINITY),
    };
    let w = node(&mut g, "w", fill, &[twice, m], &full, DType::F32);
    let softmax = Op::Softmax { dim: 2, log: false };
    let y = node(&mut g, "y", softmax, &[w], &full, DType::F32);
    g.set_outputs(vec![y]);
    g
}

/// `masked_fill(a @ b, m, -1) * 2`: `a` [3, 20, 40], `b` [3, 40, 30], the
/// boolean `m` [20, 30], read in the GEMM's epilogue.
fn masked_gemm_graph() -> OpGraph {
    use common::{input, node};
    let mut g = OpGraph::new();
    let a = input(&mut g, "a", &[3, 20, 40], DType::F32);
    let b = input(&mut g, "b", &[3, 40, 30], DType::F32);
    let m = input(&mut g, "m", &[20, 30], DType::Bool);
    let full = [3, 20, 30];
    let product = Op::MatMul(mtmc_actions::op::MatMul {
        trans_a: false,
        trans_b: false,
        bias: false,
    });
    let ab = node(&mut g, "ab", product, &[a, b], &full, DType::F32);
    let fill = Op::Where { fill: Some(-1.0) };
    let w = node(&mut g, "w", fill, &[ab, m], &full, DType::F32);
    let y = node(&mut g, "y", twice(), &[w], &full, DType::F32);
    g.set_outputs(vec![y]);
    g
}

/// `x * 2`.
fn twice() -> Op {
    Op::Scalar {
        op: mtmc_actions::op::BinaryOp::Mul,
        value: 2.0,
        scalar_first: false,
    }
}

/// `where(x * 2 > 2, x, b)`: `x` [7, 40], `b` [40].
fn compared_graph() -> OpGraph {
    use common::{input, node};
    let mut g = OpGraph::new();
    let full = [7, 40];
    let x = input(&mut g, "x", &full, DType::F32);
    let b = input(&mut g, "b", &[40], DType::F32);
    let twice = node(&mut g, "twice", twice(), &[x], &full, DType::F32);
    let gt = Op::Scalar {
        op: mtmc_actions::op::BinaryOp::Gt,
        value: 2.0,
        scalar_first: false,
    };
    let gt = node(&mut g, "gt", gt, &[twice], &full, DType::Bool);
    let w = Op::Where { fill: None };
    let w = node(&mut g, "w", w, &[gt, x, b], &full, DType::F32);
    g.set_outputs(vec![w]);
    g
}

/// `x` of `shape` pooled by `pool` to `out`.
fn pool_graph(shape: &[u64], out: &[u64], pool: Pool) -> OpGraph {
    let mut g = OpGraph::new();
    let t = |s: &[u64]| TensorType::new(s.to_vec(), DType::F32);
    let x = g
        .add("x", Op::Input { name: "x".into() }, &[], vec![t(shape)])
        .unwrap();
    let y = g
        .add("y", Op::Pool(pool), &[TensorRef::first(x)], vec![t(out)])
        .unwrap();
    g.set_outputs(vec![TensorRef::first(y)]);
    g
}

/// A pooling op over `spatial` dims with one kernel, stride, padding and
/// dilation for each.
fn pool(max: bool, spatial: usize, window: [u64; 4], include_pad: bool, last: bool) -> Pool {
    let [kernel, stride, padding, dilation] = window;
    Pool {
        max,
        spatial,
        kernel: vec![kernel; spatial],
        stride: vec![stride; spatial],
        padding: vec![padding; spatial],
        dilation: vec![dilation; spatial],
        ceil_mode: false,
        count_include_pad: include_pad,
        channels_last: last,
    }
}

/// A loss over inputs of `shapes` (the second int64 for cross-entropy).
fn loss_graph(kind: LossKind, reduction: Reduction, shapes: &[&[u64]]) -> OpGraph {
    let mut g = OpGraph::new();
    let ce = matches!(kind, LossKind::CrossEntropy);
    let ins: Vec<TensorRef> = shapes
        .iter()
        .enumerate()
        .map(|(k, s)| {
            let dtype = if ce && k == 1 { DType::I64 } else { DType::F32 };
            let name = format!("in{k}");
            let id = g
                .add(
                    &name,
                    Op::Input { name: name.clone() },
                    &[],
                    vec![TensorType::new(s.to_vec(), dtype)],
                )
                .unwrap();
            TensorRef::first(id)
        })
        .collect();
    let y = g
        .add(
            "loss",
            Op::Loss(Loss { kind, reduction }),
            &ins,
            vec![TensorType::new(vec![], DType::F32)],
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(y)]);
    g
}

/// The cases: a graph, and the shapes its inputs are drawn at.
fn cases() -> Vec<(&'static str, OpGraph)> {
    vec![
        (
            "broadcast chain",
            graph(
                "y = gelu(x * s + b) - tanh(x) / (1 + exp(-x)) + mish(b) + softplus(x) + x ** 3",
                "x=6x5x33,s=5x1,b=33",
            ),
        ),
        ("triu", triu_graph(&[3, 17, 19])),
        (
            "masked_fill with -inf",
            where_graph(Some(f64::NEG_INFINITY)),
        ),
        ("where", where_graph(None)),
        ("where of a comparison", compared_graph()),
        (
            "masked_fill fused in front of a softmax",
            masked_softmax_graph(),
        ),
        ("a GEMM's epilogue reading a mask", masked_gemm_graph()),
        ("sum of rows", graph("y = sum(x, dim=-1)", "x=37x300")),
        (
            "max over a middle dim",
            graph("y = max(relu(x) * 3, dim=1)", "x=4x70x90"),
        ),
        ("mean of all", graph("y = mean(x, dim=[0, 1])", "x=40x33")),
        (
            "mean of one long line, cut into runs",
            graph("y = mean((a - b) ** 2, dim=[0, 1])", "a=64x1000,b=64x1000"),
        ),
        (
            "max of long rows, cut into runs",
            graph("y = max(x, dim=-1)", "x=3x40000"),
        ),
        (
            "min over a long middle dim, cut into runs",
            graph("y = min(x * -1, dim=1)", "x=2x20000x3"),
        ),
        (
            "norm over a long row",
            graph("y = norm(x, dim=-1)", "x=3x20000"),
        ),
        ("argmax of rows", graph("y = argmax(x, dim=-1)", "x=9x1000")),
        (
            "argmin over a middle dim",
            graph("y = argmin(x, dim=1)", "x=5x300x7"),
        ),
        (
            "softmax of short rows",
            graph("y = softmax(x * 2, dim=-1)", "x=13x100"),
        ),
        (
            "softmax of long rows",
            graph("y = softmax(x, dim=-1)", "x=3x10000"),
        ),
        (
            "log_softmax over a middle dim",
            graph("y = log_softmax(x, dim=1)", "x=3x50x40"),
        ),
        ("logsumexp", graph("y = logsumexp(x, dim=-1)", "x=12x5000")),
        (
            "layer norm",
            graph("y = layer_norm(x, g, b, dim=-1)", "x=16x300,g=300,b=300"),
        ),
        (
            "rms norm of long rows",
            graph("y = rms_norm(x - 1, g, dim=-1)", "x=4x10000,g=10000"),
        ),
        (
            "group norm",
            norm_graph(NormKind::Group { groups: 4 }, &[2, 8, 6, 5]),
        ),
        (
            "instance norm",
            norm_graph(NormKind::Instance, &[2, 3, 7, 9]),
        ),
        ("batch norm", norm_graph(NormKind::Batch, &[6, 5, 9, 7])),
        ("L2 normalize of rows", lp_graph(2.0, &[7, 300], 1)),
        ("L1 normalize of long rows", lp_graph(1.0, &[3, 10000], 1)),
        (
            "L2 normalize over a middle dim",
            lp_graph(2.0, &[4, 37, 9], 1),
        ),
        (
            "RMS norm written out over a middle dim",
            graph(
                "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) + 1e-5)",
                "x=4x37x9",
            ),
        ),
        (
            "L1 normalize of long columns",
            lp_graph(1.0, &[10000, 3], 0),
        ),
        (
            "linear with its bias and a chain after it",
            graph("y = gelu(x @ w.T + b) * 0.5", "x=70x100,w=90x100,b=90"),
        ),
        (
            "batched matmul, a chain after it",
            graph("y = tanh(a @ b) - a2", "a=3x20x40,b=3x40x30,a2=20x30"),
        ),
        ("transposed A", graph("y = x.T @ w", "x=50x33,w=50x17")),
        (
            "one B for a batch of A",
            graph("y = relu(a @ b)", "a=2x3x19x21,b=21x40"),
        ),
        (
            "batch norm of many rows, tiles",
            norm_graph(NormKind::Batch, &[5000, 3]),
        ),
        (
            "batch norm of [N, C], channel tiles",
            norm_graph(NormKind::Batch, &[300, 70]),
        ),
        (
            "batch norm of [N, C], narrow channel tiles",
            norm_graph(NormKind::Batch, &[40, 600]),
        ),
        (
            "dilated max pool 2-d",
            pool_graph(
                &[2, 3, 17, 19],
                &[2, 3, 8, 9],
                pool(true, 2, [3, 2, 1, 2], true, false),
            ),
        ),
        (
            "average pool 1-d, padding not counted",
            pool_graph(
                &[2, 3, 50],
                &[2, 3, 17],
                pool(false, 1, [4, 3, 2, 1], false, false),
            ),
        ),
        (
            "average pool 3-d, padding counted",
            pool_graph(
                &[1, 2, 9, 8, 7],
                &[1, 2, 5, 4, 4],
                pool(false, 3, [3, 2, 1, 1], true, false),
            ),
        ),
        (
            "channels-last max pool 2-d",
            pool_graph(
                &[2, 9, 8, 5],
                &[2, 4, 4, 5],
                pool(true, 2, [2, 2, 0, 1], true, true),
            ),
        ),
        ("cumsum of rows", graph("y = cumsum(x, dim=-1)", "x=5x3000")),
        (
            "cumsum of long rows, tiles and a carry",
            graph("y = cumsum(x, dim=1)", "x=3x10000"),
        ),
        (
            "exclusive reverse cumsum",
            graph(
                "y = cumsum(x, dim=1, reverse=true, exclusive=true)",
                "x=6x5000",
            ),
        ),
        (
            "reverse cumprod over a middle dim",
            graph("y = cumprod(x, dim=1, reverse=true)", "x=4x30x7"),
        ),
        (
            "exclusive cumprod of rows",
            graph("y = cumprod(x, dim=-1, exclusive=true)", "x=3x100"),
        ),
        (
            "mse loss",
            loss_graph(LossKind::Mse, Reduction::Mean, &[&[64, 1000], &[64, 1000]]),
        ),
        (
            "huber loss, summed",
            loss_graph(
                LossKind::Huber { delta: 0.25 },
                Reduction::Sum,
                &[&[3000], &[3000]],
            ),
        ),
        (
            "smooth L1 loss",
            loss_graph(
                LossKind::SmoothL1 { beta: 0.5 },
                Reduction::Mean,
                &[&[5, 777], &[5, 777]],
            ),
        ),
        (
            "cross-entropy",
            loss_graph(
                LossKind::CrossEntropy,
                Reduction::Mean,
                &[&[600, 10], &[600]],
            ),
        ),
        (
            "kl divergence, batch mean",
            loss_graph(
                LossKind::KlDiv { log_target: false },
                Reduction::BatchMean,
                &[&[40, 100], &[40, 100]],
            ),
        ),
        (
            "kl divergence of log targets, summed",
            loss_graph(
                LossKind::KlDiv { log_target: true },
                Reduction::Sum,
                &[&[3, 700], &[3, 700]],
            ),
        ),
        (
            "triplet margin",
            loss_graph(
                LossKind::TripletMargin {
                    margin: 1.0,
                    p: 2.0,
                },
                Reduction::Mean,
                &[&[40, 100], &[40, 100], &[40, 100]],
            ),
        ),
    ]
}

fn is_row(g: &OpGraph, n: NodeId) -> bool {
    !matches!(g.node(n).op.class(), OpClass::Pointwise)
}

/// Regions as `mtmc optimize` cuts them for these graphs: the pointwise
/// ops before a row op fused in front of it, a matrix product with the
/// pointwise ops after it, the rest one chain.
fn plan(g: &OpGraph) -> Vec<Vec<u32>> {
    let mut regions = Vec::new();
    let mut pending: Vec<u32> = Vec::new();
    for (id, n) in g.nodes() {
        if n.op.is_source() || n.op.is_view() {
            continue;
        }
        if matches!(n.op, Op::MatMul(_)) {
            if !pending.is_empty() {
                regions.push(std::mem::take(&mut pending));
            }
            pending.push(id.index() as u32);
            continue;
        }
        pending.push(id.index() as u32);
        if is_row(g, id) {
            regions.push(std::mem::take(&mut pending));
        }
    }
    if !pending.is_empty() {
        regions.push(pending);
    }
    regions
}

/// Builds the Triton program for `g`, every fragment compiled with
/// Triton in `python`.
fn build(g: &OpGraph, python: &str, params: Params) -> Program {
    let mut s = Session::new(g, TritonCoder, Arch::SM90).with_python(python);
    for region in plan(g) {
        let action = Action::kernel_for(region, params);
        match s.propose(&action) {
            Ok(p) => s.accept(p),
            Err(f) => panic!("{:?} failed at {:?}: {}", action, f.stage, f.log),
        }
    }
    assert!(
        g.nodes()
            .all(|(id, n)| n.op.is_source() || n.op.is_view() || s.good().covered().contains(&id))
    );
    s.good().clone()
}

/// Problem code whose `Model` takes the graph's inputs by name.
fn problem_code(g: &OpGraph) -> String {
    let names: Vec<String> = g
        .nodes()
        .filter_map(|(_, n)| match &n.op {
            Op::Input { name } => Some(name.clone()),
            _ => None,
        })
        .collect();
    format!(
        "import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def forward(self, {}):\n        raise RuntimeError('the reference is the call-library export')\n",
        names.join(", ")
    )
}

#[test]
fn every_triton_family_compiles_for_sm90() {
    let Some(python) = python() else { return };
    for (what, g) in cases() {
        for params in [
            Params {
                block: 128,
                vector: 1,
            },
            Params {
                block: 256,
                vector: 4,
            },
        ] {
            let p = build(&g, &python, params);
            assert!(p.fragments.iter().all(|f| f.lang == Lang::Triton), "{what}");
        }
    }
}

#[test]
fn triton_programs_compute_what_torch_computes_in_the_interpreter() {
    let Some(python) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let mut checks = String::new();
    for (k, (what, g)) in cases().into_iter().enumerate() {
        let p = build(
            &g,
            &python,
            Params {
                block: 128,
                vector: 1,
            },
        );
        let code = problem_code(&g);
        let triton = to_model_new(&g, &p, &code).unwrap();
        let reference = to_model_new(&g, &Program::default(), &code).unwrap();
        assert!(triton.contains("@triton.jit") && !triton.contains("import cupy"));
        let (tf, rf) = (
            dir.path().join(format!("t{k}.py")),
            dir.path().join(format!("r{k}.py")),
        );
        std::fs::write(&tf, &triton).unwrap();
        std::fs::write(&rf, &reference).unwrap();
        // Float inputs in [0.5, 1.5); int64 ones (class targets) 0 or 1;
        // booleans (masks) true about half the time.
        let shapes: Vec<String> = g
            .nodes()
            .filter(|(_, n)| matches!(n.op, Op::Input { .. }))
            .map(|(_, n)| {
                let t = &n.outputs[0];
                let kind = match t.dtype {
                    DType::I64 => 'i',
                    DType::Bool => 'b',
                    _ => 'f',
                };
                format!("('{kind}', {:?})", t.shape)
            })
            .collect();
        checks += &format!(
            "check({what:?}, {:?}, {:?}, [{}])\n",
            tf.display().to_string(),
            rf.display().to_string(),
            shapes.join(", ")
        );
    }
    let script = format!(
        "import os\nos.environ['TRITON_INTERPRET'] = '1'\nimport runpy, torch\nbad = []\ndef check(what, tf, rf, shapes):\n    torch.manual_seed(0)\n    args = [torch.randint(0, 2, s) if k == 'i' else torch.rand(*s) > 0.5 if k == 'b' else torch.rand(*s) + 0.5 for k, s in shapes]\n    got = runpy.run_path(tf)['ModelNew']()(*args)\n    want = runpy.run_path(rf)['ModelNew']()(*args)\n    if got.shape != want.shape or got.dtype != want.dtype:\n        bad.append(f'{{what}}: {{got.shape}} {{got.dtype}} vs {{want.shape}} {{want.dtype}}')\n    elif got.dtype == torch.int64:\n        if not torch.equal(got, want): bad.append(f'{{what}}: indices differ')\n    elif not torch.allclose(got, want, atol=1e-4, rtol=1e-4):\n        bad.append(f'{{what}}: max error {{(got - want).abs().max().item()}}')\n{checks}print('bad:', bad)\nassert not bad\n"
    );
    let out = std::process::Command::new(&python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A coder whose Triton fragment calls a function `tl` does not have.
struct Broken;

impl MicroCoder for Broken {
    fn realize(&self, _: &Program, g: &OpGraph, action: &Action) -> Result<Fragment, Refusal> {
        let mut f = TritonCoder.realize(&Program::default(), g, action)?;
        f.source = f.source.replace("tl.maximum", "tl.no_such_function");
        Ok(f)
    }
}

#[test]
fn a_triton_fragment_that_does_not_compile_is_rolled_back_with_tritons_error() {
    let Some(python) = python() else { return };
    let g = graph("y = relu(x)", "x=1024");
    let action = Action {
        kind: ActionKind::CustomKernel,
        region: plan(&g).remove(0),
        params: Params::default(),
    };
    let mut s = Session::new(&g, Broken, Arch::SM90).with_python(&python);
    let failure = s.propose(&action).unwrap_err();
    assert_eq!(failure.stage, Stage::Compile);
    assert!(failure.log.contains("no_such_function"), "{}", failure.log);
    assert!(s.good().fragments.is_empty());
    assert_eq!(s.failures.len(), 1);
    // The same step from the real coder compiles.
    let mut s = Session::new(&g, TritonCoder, Arch::SM90).with_python(&python);
    let p = s.propose(&action).unwrap();
    assert_eq!(p.fragments.len(), 1);
}

#[test]
fn what_the_triton_coder_cannot_write_is_refused_with_the_reason() {
    let g = graph("y = a @ b", "a=2x3x8x16,b=3x16x4");
    let node = plan(&g).remove(0);
    let r = TritonCoder
        .realize(
            &Program::default(),
            &g,
            &Action {
                kind: ActionKind::CustomKernel,
                region: node,
                params: Params::default(),
            },
        )
        .unwrap_err();
    assert!(r.0.contains("batch dims broadcast"), "{r}");
    let g = graph("y = relu(x)", "x=64");
    let r = TritonCoder
        .realize(
            &Program::default(),
            &g,
            &Action {
                kind: ActionKind::CustomKernel,
                region: plan(&g).remove(0),
                params: Params {
                    block: 96,
                    vector: 1,
                },
            },
        )
        .unwrap_err();
    assert!(r.0.contains("power of two"), "{r}");
}

#[test]
fn few_long_lines_are_cut_into_runs_combined_atomically() {
    let Some(python) = python() else { return };
    let params = Params {
        block: 128,
        vector: 1,
    };
    for (what, expr, shapes, atomic) in [
        (
            "mean",
            "y = mean(x, dim=[0, 1])",
            "x=64x1000",
            "tl.atomic_add",
        ),
        ("max", "y = max(x, dim=-1)", "x=3x40000", "tl.atomic_max"),
        ("min", "y = min(x, dim=1)", "x=2x20000x3", "tl.atomic_min"),
    ] {
        let p = build(&graph(expr, shapes), &python, params);
        let f = &p.fragments[0];
        assert!(f.source.contains(atomic), "{what}: {}", f.source);
        assert_eq!(f.before.len(), 1, "{what}: the pass setting the identity");
        assert!(f.launch.grid > 8, "{what}: {} programs", f.launch.grid);
    }
    // Many rows are not cut: a program per row, stored.
    let p = build(
        &graph("y = sum(x, dim=-1)", "x=4096x40000"),
        &python,
        params,
    );
    assert!(p.fragments[0].before.is_empty());
    assert!(!p.fragments[0].source.contains("atomic"));
}

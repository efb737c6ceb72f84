//! The `ModelNew` export of call-library programs: every op a torch call.

use mtmc_actions::op::Op;
use mtmc_coder::export::to_model_new;
use mtmc_coder::program::Program;

mod common;

/// Every graph of the 200 shared problems exports
/// with no kernel at all, and Python parses the file.
#[test]
fn every_op_can_stay_a_torch_call() {
    let traces = mtmc_actions::import::SHARED_TRACES;
    let mut files = Vec::new();
    let mut missing = Vec::new();
    for line in traces.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let level = v["level"].as_u64().unwrap();
        let name = v["name"].as_str().unwrap();
        let g = common::traced(level, name);
        match to_model_new(&g, &Program::default(), "class Model: pass\n") {
            Ok(code) => files.push((format!("L{level}_{name}"), code)),
            Err(e) => missing.push((level, format!("L{level}/{name}: {e}"))),
        }
    }
    assert!(
        missing.is_empty() && files.len() == 200,
        "{} of 200 render: {missing:#?}",
        files.len()
    );
    let dir = tempfile::tempdir().unwrap();
    for (name, code) in &files {
        assert!(!code.contains("_KERNELS[\""), "{name} launches a kernel");
        std::fs::write(dir.path().join(format!("{name}.py")), code).unwrap();
    }
    let parsed = std::process::Command::new("python3")
        .args([
            "-c",
            "import ast, pathlib, sys\nfor f in pathlib.Path(sys.argv[1]).glob('*.py'):\n    ast.parse(f.read_text(), str(f))",
        ])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        parsed.status.success(),
        "{}",
        String::from_utf8_lossy(&parsed.stderr)
    );
}

/// The shared problem's code, from the problems file beside the checkout.
fn problem_code(level: u64, name: &str) -> String {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../shared/kernelbench/problems.jsonl"
    );
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("these tests read the shared problems at {path}: {e}"));
    text.lines()
        .find_map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            (v["level"] == level && v["name"] == name)
                .then(|| v["code"].as_str().unwrap().to_string())
        })
        .unwrap_or_else(|| panic!("no shared problem L{level}/{name}"))
}

/// Runs `exported` with torch on the CPU and asserts that it computes
/// what the problem's Model computes on `inputs` (a Python list).
#[track_caller]
fn runs_like_the_model(python: &str, exported: &str, inputs: &str, what: &str) {
    run_against_the_model(
        python,
        exported,
        inputs,
        "want = new.reference_parameters(*args)\ngot = new(*args)\nassert got.shape == want.shape, (got.shape, want.shape)\nassert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()\n",
        what,
    );
}

/// Runs `exported` with torch on the CPU: its `ModelNew` as `new` (built
/// from the problem's init inputs), `args` the inputs, then `checks`
/// (Python asserting what it must); fails with their error.
fn run_against_the_model(python: &str, exported: &str, inputs: &str, checks: &str, what: &str) {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("model_new.py");
    std::fs::write(&file, exported).unwrap();
    let script = format!(
        "import runpy, torch\nns = runpy.run_path({:?})\nexec(ns['_PROBLEM'], p := {{}})\ntorch.manual_seed(0)\nnew = ns['ModelNew'](*p['get_init_inputs']())\nargs = {inputs}\n{checks}print('same')",
        file.display()
    );
    let out = std::process::Command::new(python)
        .args(["-c", &script])
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("same"),
        "{what}: {}\n{exported}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// With torch on the CPU (`$MTMC_TEST_PYTHON`): a call-library export
/// takes the Model's arguments as the Model does (a Python scalar
/// included), reads constants torch.fx lifted out of the forward, splits a
/// tensor into several (L3/50's query, key and value), runs recurrent
/// stacks (an LSTM's last hidden state, a bidirectional GRU's), indexes a
/// table by a tensor (L3/30), and computes what the Model computes on
/// small inputs (L3/30 and L3/50 on their own).
#[test]
fn call_library_exports_run_like_the_model_on_the_cpu() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    for (level, name, inputs) in [
        (
            1,
            "5_Matrix_scalar_multiplication",
            "[torch.rand(8, 16), 3.14]",
        ),
        // Its cat, narrow and cumsum are one exclusive scan.
        (1, "92_cumsum_exclusive", "[torch.rand(8, 33)]"),
        // Norms written out op by op, each one norm op.
        (1, "36_RMSNorm_", "[torch.randn(2, 64, 5, 7)]"),
        (1, "39_L2Norm_", "[torch.randn(4, 33)]"),
        (
            2,
            "31_Conv2d_Min_Add_Multiply",
            "[torch.rand(2, 64, 12, 12)]",
        ),
        (3, "50_ReLUSelfAttention", "p['get_inputs']()"),
        // Recurrent stacks with their initial states (a short sequence).
        (
            3,
            "36_LSTMHn",
            "[torch.rand(10, 6, 128), torch.rand(6, 10, 256), torch.rand(6, 10, 256)]",
        ),
        (
            3,
            "42_GRUBidirectionalHidden",
            "[torch.rand(5, 10, 128), torch.rand(12, 10, 256)]",
        ),
        // A table indexed by a tensor, a clamp bounded by a tensor.
        (3, "30_SwinTransformerV2", "p['get_inputs']()"),
    ] {
        let code = problem_code(level, name);
        let g = common::traced(level, name);
        let exported = to_model_new(&g, &Program::default(), &code).unwrap();
        runs_like_the_model(&python, &exported, inputs, &format!("L{level}/{name}"));
    }
}

/// With torch on the CPU: the channels-last rewrite of convolution
/// problems exports with the convolution on channels-last operands, the
/// ops after it in that layout (its bias added by the first of them;
/// softmax over the channels as the last dim; a second convolution reading the first's channels-last result
/// as it is), and the result a permuted view; it computes what the Model
/// computes on small inputs.
#[test]
fn channels_last_exports_run_like_the_model_on_the_cpu() {
    let python = std::env::var("MTMC_TEST_PYTHON").ok();
    for (level, name, inputs) in [
        (
            1,
            "86_conv_depthwise_separable_2D",
            "[torch.rand(2, 64, 9, 7)]",
        ),
        (
            2,
            "91_ConvTranspose2d_Softmax_BiasAdd_Scaling_Sigmoid",
            "[torch.rand(2, 64, 5, 6)]",
        ),
        (2, "24_Conv3d_Min_Softmax", "[torch.rand(2, 3, 6, 7, 5)]"),
        // Its result is a reshape of the traced shape: checked, not run.
        (2, "32_Conv2d_Scaling_Min", ""),
        (2, "57_Conv2d_ReLU_HardSwish", "[torch.rand(2, 8, 7, 6)]"),
        (
            2,
            "35_Conv2d_Subtract_HardSwish_MaxPool_Mish",
            "[torch.rand(2, 64, 10, 9)]",
        ),
        (
            2,
            "52_Conv2d_Activation_BatchNorm",
            "[torch.rand(2, 64, 7, 6)]",
        ),
        (
            2,
            "72_ConvTranspose3d_BatchNorm_AvgPool_AvgPool",
            "[torch.rand(2, 3, 4, 4, 4)]",
        ),
        // Flattened at the traced shape: checked, not run.
        (2, "67_Conv2d_GELU_GlobalAvgPool", ""),
    ] {
        let g = common::traced(level, name);
        let (r, applied) = mtmc_actions::rewrite::rewrite_all(&g)
            .unwrap_or_else(|| panic!("L{level}/{name}: no rewrite"));
        assert!(
            applied.contains(&"channels_last"),
            "L{level}/{name}: {applied:?}"
        );
        if level == 2 {
            // The convolution's bias is added by the op after it (by the
            // chain of L2/52's two elementwise readers).
            assert!(
                applied.contains(&"conv_bias_in_epilogue"),
                "L{level}/{name}: {applied:?}"
            );
        }
        let exported = to_model_new(&r, &Program::default(), &problem_code(level, name)).unwrap();
        assert!(
            exported.contains("memory_format=torch.channels_last"),
            "L{level}/{name}:\n{exported}"
        );
        // Inputs of 32 channels or more go through the transpose kernel
        // (torch's copy off the GPU, as here).
        let input = g.inputs(
            g.nodes()
                .find(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Conv(_)))
                .unwrap()
                .0,
        )[0];
        assert_eq!(
            exported.contains("= F.conv") && exported.contains("(_channels_last("),
            g.tensor(input).shape[1] >= 32,
            "L{level}/{name}:\n{exported}"
        );
        // No permute back to NC… order is copied: the result is a view.
        let copied_back = exported.lines().find(|l| {
            l.ends_with(".permute(0, 3, 1, 2,).contiguous()")
                || l.ends_with(".permute(0, 4, 1, 2, 3,).contiguous()")
        });
        assert!(copied_back.is_none(), "L{level}/{name}: {copied_back:?}");
        let Some(python) = python.as_ref().filter(|_| !inputs.is_empty()) else {
            continue;
        };
        runs_like_the_model(python, &exported, inputs, &format!("L{level}/{name}"));
    }
}

/// The transpose kernel that gives a convolution its channels-last input
/// compiles with NVRTC for sm_90.
#[test]
fn the_channels_last_transpose_compiles() {
    let f = mtmc_coder::program::Fragment {
        name: "mtmc_to_channels_last".into(),
        action: mtmc_coder::action::Action::kernel_for(vec![0], Default::default()),
        lang: mtmc_coder::program::Lang::Cuda,
        source: mtmc_coder::export::CHANNELS_LAST.into(),
        inputs: Vec::new(),
        outputs: Vec::new(),
        region: Vec::new(),
        launch: mtmc_coder::program::Launch {
            grid: 1,
            block: 256,
            sizes: Vec::new(),
            shared: 0,
        },
        before: Vec::new(),
    };
    common::compiles(&f, "the channels-last transpose");
}

/// Level-2 problems whose scales and shifts after a linear layer fold into
/// its weights: the export computes the folded weights once and keeps
/// them until a parameter changes. With torch on the CPU it computes what
/// the Model computes, reuses the kept weights on a second call, and
/// recomputes them after the parameters are scaled in place.
#[test]
fn folded_weights_are_kept_until_a_parameter_changes() {
    let python = std::env::var("MTMC_TEST_PYTHON").ok();
    let mut folded = 0;
    for (name, inputs) in [
        ("9_Matmul_Subtract_Multiply_ReLU", "[torch.rand(4, 8192)]"),
        ("12_Gemm_Multiply_LeakyReLU", "[torch.rand(4, 8192)]"),
        ("39_Gemm_Scale_BatchNorm", "[torch.rand(8, 4096)]"),
        ("86_Matmul_Divide_GELU", "[torch.rand(4, 8192)]"),
    ] {
        let g = common::traced(2, name);
        let Some(r) = mtmc_actions::rewrite::fold_into_weights(&g) else {
            panic!("L2/{name}: nothing folds");
        };
        folded += 1;
        let exported = to_model_new(&r, &Program::default(), &problem_code(2, name)).unwrap();
        assert!(
            exported.contains("if getattr(self, \"_derived_key\", None) != _key:"),
            "L2/{name}:\n{exported}"
        );
        let Some(python) = python.as_ref() else {
            continue;
        };
        follows_parameter_changes(python, &exported, inputs, &format!("L2/{name}"));
    }
    assert_eq!(folded, 4);
}

/// Runs `exported` on `inputs` with torch on the CPU: it computes what the
/// Model computes, keeps its derived weights on a second call, and
/// recomputes them (and still agrees) after every parameter is scaled in
/// place.
fn follows_parameter_changes(python: &str, exported: &str, inputs: &str, what: &str) {
    run_against_the_model(
        python,
        exported,
        inputs,
        "def same():\n    want = new.reference_parameters(*args)\n    got = new(*args)\n    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4), (got - want).abs().max()\nsame()\nkept = new._derived\nsame()\nassert new._derived is kept, 'recomputed with no parameter changed'\nwith torch.no_grad():\n    for q in new.parameters():\n        q.mul_(0.5)\nsame()\nassert new._derived is not kept, 'not recomputed after the parameters changed'\n",
        what,
    );
}

/// A program replayed from a CUDA graph exports a `forward` that replays
/// a graph of the program's own forward (`_forward`). With torch on the
/// CPU, where nothing is captured, it computes what the Model computes;
/// the graph's key stays while new values are written into the same
/// input tensors and moves with another input tensor, a parameter changed
/// in place, torch's TF32 switch, or a parameter replaced (even by one on
/// the same storage), each of which captures again. The model's tensors
/// are listed once, and again only after a registration; a second program
/// loaded registers no more hooks.
#[test]
fn cuda_graph_exports_replay_and_recapture_when_their_key_moves() {
    let python = std::env::var("MTMC_TEST_PYTHON").ok();
    for (level, name, inputs) in [
        (
            2,
            "31_Conv2d_Min_Add_Multiply",
            "[torch.rand(2, 64, 12, 12)]",
        ),
        (3, "50_ReLUSelfAttention", "p['get_inputs']()"),
    ] {
        let what = format!("L{level}/{name}");
        let g = common::traced(level, name);
        let program = Program {
            cuda_graph: true,
            ..Program::default()
        };
        let exported = to_model_new(&g, &program, &problem_code(level, name)).unwrap();
        for line in [
            "    def forward(self, *args, **kwargs):\n        return _replay(self, args, kwargs)\n",
            "    def _forward(self, *args, **kwargs):\n",
            "            with torch.cuda.graph(graph):\n",
            "        model._graph.replay()\n",
        ] {
            assert!(
                exported.contains(line),
                "{what}: no {line:?} in\n{exported}"
            );
        }
        let plain = to_model_new(&g, &Program::default(), &problem_code(level, name)).unwrap();
        assert!(
            !plain.contains("_replay"),
            "{what}: replays without the flag"
        );
        let Some(python) = python.as_ref() else {
            continue;
        };
        runs_like_the_model(python, &exported, inputs, &what);
        run_against_the_model(
            python,
            &exported,
            inputs,
            "key = lambda: ns['_graph_key'](new, args, {})\nfirst = key()\nassert key() == first\nfor a in args:\n    a.copy_(torch.rand_like(a))\nassert key() == first, 'new values in the same tensors'\nargs = [a.clone() for a in args]\nmoved = key()\nassert moved != first, 'other input tensors'\nwith torch.no_grad():\n    next(new.parameters()).mul_(0.5)\nassert key() != moved, 'a parameter changed in place'\nscaled = key()\ntorch.backends.cudnn.allow_tf32 = not torch.backends.cudnn.allow_tf32\nassert key() != scaled, 'the TF32 switch'\nswitched = key()\nlisted = new._graph_tensors\nassert key() == switched and new._graph_tensors is listed, 'the tensors listed again with nothing registered'\nname, q = next(new.named_parameters())\nowner, _, attr = name.rpartition('.')\nsetattr(new.get_submodule(owner), attr, torch.nn.Parameter(q.detach()))\nassert key() != switched, 'a parameter replaced by one on the same storage'\nassert new._graph_tensors is not listed, 'the tensors not listed again after a registration'\nhooks = len(torch.nn.modules.module._global_parameter_registration_hooks)\nrunpy.run_path(ns['__file__'])\nassert len(torch.nn.modules.module._global_parameter_registration_hooks) == hooks, 'hooks registered again by a second program'\n",
            &what,
        );
    }
}

/// The graph of a problem's `code`, traced with torch by `python`.
fn trace(python: &str, code: &str) -> mtmc_actions::graph::OpGraph {
    let problem = serde_json::json!({"level": 9, "problem_id": 1, "name": "traced", "code": code});
    let mut child = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../env/python/trace_graph.py"
        ))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    use std::io::Write as _;
    writeln!(child.stdin.take().unwrap(), "{problem}").unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success());
    let line = String::from_utf8(out.stdout).unwrap();
    let t = mtmc_actions::import::parse_trace(line.trim()).unwrap();
    mtmc_actions::import::import_trace(&t).unwrap().graph
}

/// `code`'s graph, traced with torch, asserting that it has each op of
/// `want` (as displayed) and none starting with one of `never`.
#[track_caller]
fn traced_with_ops(
    python: &str,
    code: &str,
    want: &[&str],
    never: &[&str],
) -> mtmc_actions::graph::OpGraph {
    let g = trace(python, code);
    let ops: Vec<String> = g.nodes().map(|(_, n)| n.op.to_string()).collect();
    for op in want {
        assert!(ops.iter().any(|o| o == op), "{op}: {ops:?}");
    }
    for prefix in never {
        assert!(
            !ops.iter().any(|o| o.starts_with(prefix)),
            "{prefix}: {ops:?}"
        );
    }
    g
}

/// With torch on the CPU: L3/35 draws its LSTM's initial states with
/// `torch.randn` in its forward; the export draws them from the same
/// generator in the same order, so under the same seed it computes what
/// the Model computes, and under another seed something else.
#[test]
fn random_states_drawn_in_the_forward_are_drawn_alike() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = problem_code(3, "35_LSTM");
    let g = common::traced(3, "35_LSTM");
    let exported = to_model_new(&g, &Program::default(), &code).unwrap();
    assert_eq!(exported.matches("= torch.randn((").count(), 2, "{exported}");
    run_against_the_model(
        &python,
        &exported,
        "[torch.rand(10, 6, 128)]",
        "torch.manual_seed(7)\nwant = new.reference_parameters(*args)\ntorch.manual_seed(7)\ngot = new(*args)\nassert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()\ntorch.manual_seed(8)\nassert not torch.allclose(new(*args), want, atol=1e-5, rtol=1e-5)\n",
        "L3/35",
    );
}

/// With torch on the CPU: casts, the KL divergence's batch mean, hinge
/// and cosine embedding losses (their margins read from the call) and an
/// eval-mode batch norm export as torch calls, cosine similarity is
/// expanded into the ops torch computes it with, and an exclusive scan
/// written as a slice of torch's inclusive one is one scan; the export
/// computes what the Model does.
#[test]
fn casts_losses_and_sliced_scans_export_like_the_model() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.bn = nn.BatchNorm1d(9)\n        with torch.no_grad():\n            self.bn.running_mean.uniform_(-1, 1)\n            self.bn.running_var.uniform_(0.5, 2)\n            self.bn.weight.uniform_(0.5, 2)\n        self.eval()\n\n    def forward(self, x, p, q, sign):\n        exclusive = torch.cat((torch.zeros_like(x.select(1, 0).unsqueeze(1)), torch.cumsum(x, dim=1)[:, :-1]), dim=1)\n        kl = F.kl_div(torch.log(p), q, reduction='batchmean')\n        hinge = F.hinge_embedding_loss(x, sign, margin=0.5)\n        cosine = F.cosine_embedding_loss(p, q, sign[:, 0], margin=0.1)\n        similar = F.cosine_similarity(x, p, dim=1, eps=1e-6)\n        losses = torch.argmax(x, dim=1).float() + kl + hinge + cosine + similar\n        return exclusive + losses.unsqueeze(1) + self.bn(x)\n\n\ndef get_inputs():\n    return [torch.randn(6, 9), torch.rand(6, 9).softmax(1), torch.rand(6, 9).softmax(1), torch.randint(0, 2, (6, 9)).float() * 2 - 1]\n\n\ndef get_init_inputs():\n    return []\n";
    let g = traced_with_ops(
        &python,
        code,
        &[
            "cumsum dim=1 exclusive",
            "cast f32",
            "Hinge { margin: 0.5 } loss (Mean)",
            "Cosine { margin: 0.1 } loss (Mean)",
            "KlDiv { log_target: false } loss (BatchMean)",
            "batch_norm eps=0.00001 stats=running affine",
        ],
        &["concat", "opaque"],
    );
    let exported = to_model_new(&g, &Program::default(), code).unwrap();
    runs_like_the_model(&python, &exported, "p['get_inputs']()", "casts and losses");
}

/// An eval-mode batch norm (running statistics) after a convolution and a
/// scale, traced from a Model with torch: it folds into the convolution's
/// weights and a bias it did not have, and the export computes what the
/// Model computes, before and after the parameters change.
#[test]
fn an_eval_mode_batch_norm_folds_into_the_convolution_before_it() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.conv = nn.Conv2d(3, 8, 3, bias=False)\n        self.bn = nn.BatchNorm2d(8)\n        with torch.no_grad():\n            self.bn.running_mean.uniform_(-1, 1)\n            self.bn.running_var.uniform_(0.5, 2)\n            self.bn.weight.uniform_(0.5, 2)\n            self.bn.bias.uniform_(-1, 1)\n        self.eval()\n\n    def forward(self, x):\n        return torch.relu(self.bn(self.conv(x) * 2.0))\n\n\ndef get_inputs():\n    return [torch.rand(2, 3, 10, 10)]\n\n\ndef get_init_inputs():\n    return []\n";
    let g = trace(&python, code);
    assert!(
        g.nodes().any(|(_, n)| matches!(
            n.op,
            mtmc_actions::op::Op::Norm(mtmc_actions::op::Norm {
                batch_stats: false,
                ..
            })
        )),
        "the trace holds an eval-mode batch norm"
    );
    let r = mtmc_actions::rewrite::fold_into_weights(&g).expect("the norm folds");
    assert!(
        !r.nodes()
            .any(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Norm(_))),
        "no norm left"
    );
    let exported = to_model_new(&r, &Program::default(), code).unwrap();
    follows_parameter_changes(
        &python,
        &exported,
        "[torch.rand(2, 3, 10, 10)]",
        "eval conv bn",
    );
}

/// What derives from parameters alone is computed in the kept block; an
/// output that is a view of it is returned as a copy (a caller writing
/// into it must not change the kept tensor).
#[test]
fn an_output_viewing_a_kept_tensor_is_a_copy() {
    use mtmc_actions::dtype::TensorType;
    use mtmc_actions::graph::{OpGraph, TensorRef};
    use mtmc_actions::op::{BinaryOp, Layout, Op};
    let f = |s: &[u64]| vec![TensorType::new(s.to_vec(), mtmc_actions::DType::F32)];
    let mut g = OpGraph::new();
    let x = g
        .add("x", Op::Input { name: "x".into() }, &[], f(&[4, 8]))
        .unwrap();
    let w = g
        .add(
            "w",
            Op::Param {
                name: "w".into(),
                trainable: true,
            },
            &[],
            f(&[8, 8]),
        )
        .unwrap();
    let scalar = |op| Op::Scalar {
        op,
        value: 2.0,
        scalar_first: false,
    };
    let doubled = g
        .add(
            "doubled",
            scalar(BinaryOp::Mul),
            &[TensorRef::first(w)],
            f(&[8, 8]),
        )
        .unwrap();
    let flat = g
        .add(
            "flat",
            Op::Layout(Layout::Reshape),
            &[TensorRef::first(doubled)],
            f(&[64]),
        )
        .unwrap();
    let y = g
        .add(
            "y",
            scalar(BinaryOp::Add),
            &[TensorRef::first(x)],
            f(&[4, 8]),
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(flat), TensorRef::first(y)]);
    let exported = to_model_new(&g, &Program::default(), "class Model: pass\n").unwrap();
    let kept = exported
        .lines()
        .position(|l| l.contains("_derived_key\", None) != _key"))
        .unwrap_or_else(|| panic!("no kept block:\n{exported}"));
    let doubled_at = exported
        .lines()
        .position(|l| l.contains("(p_w * 2"))
        .unwrap_or_else(|| panic!("w * 2 not rendered:\n{exported}"));
    assert!(doubled_at > kept, "w * 2 is in the kept block:\n{exported}");
    let flat_var = format!("t{}", flat.index());
    assert!(
        exported.contains(&format!("return ({flat_var}.clone(), t{},)", y.index())),
        "{exported}"
    );
}

/// With torch on the CPU: recurrent stacks (an LSTM with its states, a
/// GRU without, so from zeros; a bidirectional Elman RNN with ReLU and no
/// biases, batch first), indexing by tensors (a table by a flattened
/// index, columns by an index, two index tensors at once), clamps bounded
/// by a tensor and a scalar `torch.tensor` export as torch calls and
/// compute what the Model does.
#[test]
fn recurrent_stacks_and_tensor_indexing_export_like_the_model() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = "import torch\nimport torch.nn as nn\n\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.lstm = nn.LSTM(8, 12, 2)\n        self.gru = nn.GRU(12, 6, 2, batch_first=True)\n        self.rnn = nn.RNN(6, 5, 2, nonlinearity='relu', bias=False, batch_first=True, bidirectional=True)\n        self.table = nn.Parameter(torch.randn(16, 3))\n        self.register_buffer('index', torch.randint(0, 16, (4, 4)))\n\n    def forward(self, x, h0, c0, columns, rows):\n        out, (h, c) = self.lstm(x, (h0, c0))\n        g, _ = self.gru(out.transpose(0, 1))\n        r, hr = self.rnn(g)\n        bias = self.table[self.index.view(-1)].view(4, 4, 3)\n        picked = r[:, columns] * torch.tensor(0.5)\n        pairs = bias[rows, columns]\n        bounded = torch.clamp(c, max=torch.log(torch.tensor(1.2))) + h.clamp(min=c.mean(0))\n        return picked.sum() + hr.sum() + bounded.sum() + pairs.sum() + bias.sum(2)\n\n\ndef get_inputs():\n    return [torch.rand(7, 3, 8), torch.rand(2, 3, 12), torch.rand(2, 3, 12), torch.tensor([0, 2, 2, 1]), torch.tensor([3, 0, 1, 1])]\n\n\ndef get_init_inputs():\n    return []\n";
    let g = traced_with_ops(
        &python,
        code,
        &[
            "gather [#]",
            "gather [:, #]",
            "gather [#, #]",
            "minimum",
            "maximum",
        ],
        &["opaque", "constant", "clamp"],
    );
    let exported = to_model_new(&g, &Program::default(), code).unwrap();
    for call in ["torch.lstm(", "torch.gru(", "torch.rnn_relu("] {
        assert!(exported.contains(call), "{call}: {exported}");
    }
    runs_like_the_model(
        &python,
        &exported,
        "p['get_inputs']()",
        "recurrent stacks and gathers",
    );
}

/// A torch call's result that is only returned keeps torch's strides:
/// L1/97's attention (the memory-efficient kernel writes it head-major,
/// and making it dense was a copy of the whole output), the last op of
/// L2/31; a result another op reads, the convolution's, is still made
/// dense. With torch on the CPU both compute what the Model computes, with
/// the strides the Model's result has.
#[test]
fn a_result_only_returned_keeps_torch_strides() {
    let python = std::env::var("MTMC_TEST_PYTHON").ok();
    for (level, name, inputs, last, read) in [
        (
            1,
            "97_ScaledDotProductAttention",
            "[torch.rand(2, 3, 16, 8), torch.rand(2, 3, 16, 8), torch.rand(2, 3, 16, 8)]",
            "F.scaled_dot_product_attention(",
            None,
        ),
        (
            2,
            "31_Conv2d_Min_Add_Multiply",
            "[torch.rand(2, 64, 12, 12)]",
            " * ",
            Some("F.conv2d("),
        ),
    ] {
        let code = problem_code(level, name);
        let g = common::traced(level, name);
        let exported = to_model_new(&g, &Program::default(), &code).unwrap();
        let line = |call: &str| {
            exported
                .lines()
                .rfind(|l| l.contains(call))
                .unwrap_or_else(|| panic!("L{level}/{name}: no `{call}`:\n{exported}"))
        };
        assert!(
            !line(last).ends_with(".contiguous()"),
            "L{level}/{name}: the returned result is copied dense:\n{exported}"
        );
        if let Some(read) = read {
            assert!(
                line(read).ends_with(".contiguous()"),
                "L{level}/{name}: a result another op reads is not dense:\n{exported}"
            );
        }
        if let Some(python) = &python {
            run_against_the_model(
                python,
                &exported,
                inputs,
                "want = new.reference_parameters(*args)\ngot = new(*args)\nassert got.stride() == want.stride(), (got.stride(), want.stride())\nassert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()\n",
                &format!("L{level}/{name}"),
            );
        }
    }
}

/// With torch on the CPU: attention written out op by op (a causal mask
/// from a buffer filled with -inf and the scale after the product, as in
/// L3/44; torch's multi-head attention, scaled on q, as in L3/31) exports,
/// after the rewrites, as one `scaled_dot_product_attention` call with the
/// mask's complement, and computes what the Model computes.
#[test]
fn attention_written_op_by_op_exports_as_one_call() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let causal = "import math, torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.c_attn = nn.Linear(32, 96)\n        self.drop = nn.Dropout(0.0)\n        self.register_buffer('bias', torch.tril(torch.ones(24, 24)).view(1, 1, 24, 24))\n\n    def forward(self, x):\n        B, T, C = x.size()\n        q, k, v = self.c_attn(x).split(32, dim=2)\n        q = q.view(B, T, 4, 8).transpose(1, 2)\n        k = k.view(B, T, 4, 8).transpose(1, 2)\n        v = v.view(B, T, 4, 8).transpose(1, 2)\n        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))\n        att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float('-inf'))\n        att = self.drop(F.softmax(att, dim=-1))\n        return (att @ v).transpose(1, 2).contiguous().view(B, T, C)\n\ndef get_inputs():\n    return [torch.rand(2, 16, 32)]\n\ndef get_init_inputs():\n    return []\n";
    let heads = "import torch\nimport torch.nn as nn\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n        self.attn = nn.MultiheadAttention(32, 4)\n\n    def forward(self, x):\n        return self.attn(x, x, x)[0]\n\ndef get_inputs():\n    return [torch.rand(20, 2, 32)]\n\ndef get_init_inputs():\n    return []\n";
    for (what, code, mask) in [("causal", causal, true), ("multi-head", heads, false)] {
        let g = trace(&python, code);
        let (r, applied) = mtmc_actions::rewrite::rewrite_all(&g).unwrap();
        assert!(
            applied.contains(&"attention_in_one_call"),
            "{what}: {applied:?}"
        );
        let exported = to_model_new(&r, &Program::default(), code).unwrap();
        let calls: Vec<&str> = exported
            .lines()
            .filter(|l| l.contains("F.scaled_dot_product_attention("))
            .collect();
        assert_eq!(calls.len(), 1, "{what}:\n{exported}");
        assert_eq!(calls[0].contains("attn_mask="), mask, "{what}:\n{exported}");
        let forward = &exported[exported.find("class ModelNew").unwrap()..];
        assert!(!forward.contains("softmax("), "{what}:\n{exported}");
        runs_like_the_model(&python, &exported, "p['get_inputs']()", what);
    }
}

/// Traces one problem (`{"level", "name", "code"}`) with the real tracer:
/// the parsed trace and its JSON text.
fn trace_with(python: &str, request: &serde_json::Value) -> (mtmc_actions::import::Trace, String) {
    let mut tracer = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../env/python/trace_graph.py"
        ))
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = tracer.stdin.take().unwrap();
        writeln!(stdin, "{request}").unwrap();
    }
    let traced = tracer.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&traced.stdout).into_owned();
    let trace = mtmc_actions::import::parse_trace(text.trim())
        .unwrap_or_else(|e| panic!("{e}: {text}{}", String::from_utf8_lossy(&traced.stderr)));
    (trace, text)
}

/// With torch on the CPU: calls the op vocabulary does not model, one of
/// each kind (`tests/opaque/calls.py`: a submodule, a torch function, a
/// tensor method with keyword arguments), traced by the real tracer,
/// stay opaque nodes that keep the call, and the call-library export
/// makes each again as the problem made it (the submodule the problem's
/// own model holds): it computes what the Model computes, call after call.
#[test]
fn opaque_calls_are_made_again_as_the_problem_made_them() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/opaque/calls.py"
    ))
    .unwrap();
    let request = serde_json::json!({"level": 1, "name": "1_OpaqueCalls", "code": code});
    let (trace, text) = trace_with(&python, &request);
    assert_eq!(trace.status, "ok", "{text}");
    let g = mtmc_actions::import::import_trace(&trace).unwrap().graph;
    let opaque: Vec<String> = g.opaque_nodes().map(|(_, n)| n.op.to_string()).collect();
    assert_eq!(opaque.len(), 3, "{opaque:?}");
    let exported = to_model_new(&g, &Program::default(), &code).unwrap();
    for call in [
        "self.reference_parameters.get_submodule(\"patches\")(",
        "torch._C._special.special_bessel_j0(",
        ".unfold(2, size=4, step=2)",
    ] {
        assert!(exported.contains(call), "{call}\n{exported}");
    }
    run_against_the_model(
        &python,
        &exported,
        "[torch.rand(2, 3, 8, 9) for _ in range(3)]",
        "for x in args:\n    want = new.reference_parameters(x)\n    got = new(x)\n    assert got.shape == want.shape, (got.shape, want.shape)\n    assert torch.allclose(got, want, atol=1e-6), (got - want).abs().max()\n",
        "opaque calls",
    );
}

/// With torch on the CPU: a model fx traces only in part
/// (`tests/opaque/partial.py`: one submodule branches on a value computed
/// from the input, one keeps a running sum in attributes) traces with
/// exactly those two submodules kept as calls of their own forward, each
/// with its reason, and every other call lowered; the export calls them
/// on the problem's own model and gives the Model's sequence of outputs
/// call after call, through both branches.
#[test]
fn a_partial_trace_keeps_what_fx_cannot_follow_as_the_problems_own_calls() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/opaque/partial.py"
    ))
    .unwrap();
    let request = serde_json::json!({"level": 1, "name": "1_Partial", "code": code});
    let (trace, text) = trace_with(&python, &request);
    assert_eq!(trace.status, "ok", "{text}");
    assert_eq!(trace.method.as_deref(), Some("fx_partial"), "{text}");
    let untraced: Vec<&str> = trace.untraced.iter().map(|u| u.module.as_str()).collect();
    assert_eq!(untraced, ["gate", "acc"], "{text}");
    assert!(
        trace.untraced[0].reason.contains("control flow")
            && trace.untraced[1].reason
                == "keeps state across calls: it assigns or updates self.calls, self.total",
        "{:?}",
        trace.untraced
    );
    let g = mtmc_actions::import::import_trace(&trace).unwrap().graph;
    let opaque: Vec<String> = g.opaque_nodes().map(|(_, n)| n.op.to_string()).collect();
    assert_eq!(
        opaque,
        ["opaque Gate `gate`", "opaque Accumulate `acc`"],
        "{opaque:?}"
    );
    assert!(g.opaque_nodes().all(|(_, n)| n.op.is_untraced()));
    // The layers around them are the graph's own ops.
    assert!(g.nodes().any(|(_, n)| matches!(n.op, Op::MatMul(_))));
    let exported = to_model_new(&g, &Program::default(), &code).unwrap();
    for call in [
        "self.reference_parameters.get_submodule(\"gate\")(",
        "self.reference_parameters.get_submodule(\"acc\")(",
    ] {
        assert!(exported.contains(call), "{call}\n{exported}");
    }
    run_against_the_model(
        &python,
        &exported,
        "[torch.randn(16, 32) + s for s in (3.0, -3.0, 3.0, -3.0, 3.0)]",
        "model = p['Model'](*p['get_init_inputs']())\nmodel.load_state_dict(new.reference_parameters.state_dict())\nbranches = set()\nfor x in args:\n    want, got = model(x), new(x)\n    branches.add(bool((torch.tanh(model.inp(x)) + x).mean() > 0))\n    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()\nassert branches == {True, False}, branches\nassert model.acc.calls == new.reference_parameters.acc.calls == 5\nassert not torch.equal(model(args[0]), model(args[0])), 'the state changed nothing'\n",
        "a partial trace",
    );
}

/// With torch on the CPU: a model mtmc has no graph of (one that keeps
/// state across calls, `tests/opaque/stateful.py`) exports as its own
/// forward, and gives the Model's sequence of outputs call after call
/// (the same input three times, three outputs).
#[test]
fn a_model_with_no_graph_is_its_own_forward_call_after_call() {
    let Ok(python) = std::env::var("MTMC_TEST_PYTHON") else {
        return;
    };
    let code = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/opaque/stateful.py"
    ))
    .unwrap();
    let exported = mtmc_coder::export::whole_forward(&code);
    run_against_the_model(
        &python,
        &exported,
        "[torch.rand(4, 8)] * 3",
        "model = p['Model'](*p['get_init_inputs']())\noutputs = []\nfor x in args:\n    want, got = model(x), new(x)\n    assert torch.equal(got, want), (got - want).abs().max()\n    outputs.append(got)\nassert not torch.equal(outputs[0], outputs[1]), 'the state changed nothing'\n",
        "a stateful model",
    );
}

//! Import of torch traces: the committed traces of the 200 shared problems,
//! and small hand-written traces for the edge cases.

use std::collections::BTreeMap;

use mtmc_actions::import::{ImportError, import_trace, parse_trace};
use mtmc_actions::op::{CallArg, CallKind, Fill, NormKind, Op, OpClass, OpaqueCall, ReduceOp};
use mtmc_actions::{OpGraph, graph_cost, node_cost};

const FIXTURES: &str = mtmc_actions::import::SHARED_TRACES;

fn fixtures() -> BTreeMap<String, OpGraph> {
    FIXTURES
        .lines()
        .map(|line| {
            let trace = parse_trace(line).unwrap();
            let id = format!(
                "L{}/{}",
                trace.level.unwrap(),
                trace.name.as_deref().unwrap()
            );
            let graph = import_trace(&trace)
                .unwrap_or_else(|e| panic!("{id} does not import: {e}"))
                .graph;
            (id, graph)
        })
        .collect()
}

fn opaque_targets(g: &OpGraph) -> Vec<String> {
    g.opaque_nodes()
        .map(|(_, n)| match &n.op {
            Op::Opaque { target, .. } => target.clone(),
            _ => unreachable!(),
        })
        .collect()
}

#[test]
fn all_200_shared_problems_import_into_well_formed_graphs() {
    let graphs = fixtures();
    assert_eq!(graphs.len(), 200);
    for (id, g) in &graphs {
        assert!(!g.outputs().is_empty(), "{id} has no outputs");
        for t in g.outputs() {
            assert!(
                !g.node(t.node).op.is_source(),
                "{id}: an output is a graph source"
            );
        }
        for (nid, n) in g.nodes() {
            let no_inputs = g.inputs(nid).is_empty();
            let creates = matches!(n.op, Op::Constant { .. }) || n.op.is_source();
            assert!(
                !no_inputs || creates,
                "{id}: node `{}` ({}) has no inputs",
                n.name,
                n.op
            );
        }
    }
}

#[test]
fn every_shared_problem_traces_with_no_opaque_node() {
    for (id, g) in &fixtures() {
        assert!(
            opaque_targets(g).is_empty(),
            "{id}: opaque {:?}",
            g.opaque_nodes()
                .map(|(_, n)| n.op.to_string())
                .collect::<Vec<_>>()
        );
    }
}

#[test]
fn multihead_attention_expands_into_projections_and_attention() {
    let g = &fixtures()["L3/31_VisionAttention"];
    let (e, n, h, l) = (128u64, 2u64, 4u64, 16384u64);
    let flops = |name: &str| {
        let (id, _) = g.nodes().find(|(_, node)| node.name == name).unwrap();
        node_cost(g, id).flops
    };
    // q/k/v and output projections: 2·L·N·E·E plus the bias.
    for proj in ["attn.q_proj", "attn.k_proj", "attn.v_proj", "attn.out_proj"] {
        assert_eq!(flops(proj), 2 * l * n * e * e + l * n * e, "{proj}");
    }
    // need_weights=True (the default): scores and context are explicit
    // batched products over N·H heads.
    assert_eq!(flops("attn.scores"), 2 * n * h * l * l * (e / h));
    assert_eq!(flops("attn.context"), 2 * n * h * l * l * (e / h));
    // The weights averaged over the heads are made, but the model returns
    // only the output: nothing reads them, so they are dropped.
    assert!(!g.nodes().any(|(_, node)| node.name == "attn.weights"));
}

#[test]
fn transformer_encoder_layer_expands_post_norm_with_relu() {
    let g = &fixtures()["L3/32_ConvolutionalVisionTransformer"];
    let layer: Vec<String> = g
        .nodes()
        .filter(|(_, n)| n.name.starts_with("transformer_layers_0."))
        .filter(|(_, n)| !matches!(n.op, Op::Layout(_)))
        .map(|(_, n)| {
            n.name
                .trim_start_matches("transformer_layers_0.")
                .to_string()
        })
        .collect();
    assert_eq!(
        layer,
        [
            "q_proj",
            "k_proj",
            "v_proj",
            "attention",
            "out_proj",
            "residual1",
            "norm1",
            "linear1",
            "activation",
            "linear2",
            "residual2",
            "norm2"
        ]
    );
}

#[test]
fn square_matmul_has_two_n_cubed_flops() {
    let g = &fixtures()["L1/1_Square_matrix_multiplication_"];
    let n = 4096u64;
    assert_eq!(graph_cost(g).unfused.flops, 2 * n * n * n);
    assert_eq!(graph_cost(g).fused_bytes, 3 * 4 * n * n);
}

#[test]
fn a_transposed_operand_becomes_the_matmul_flag() {
    let g = &fixtures()["L1/16_Matmul_with_transposed_A"];
    let ops: Vec<String> = g.nodes().map(|(_, n)| n.op.to_string()).collect();
    assert_eq!(ops, ["input A", "input B", "matmul Aᵀ"]);
    // A is [K, M] = [8192, 2048]: the contraction runs over 8192.
    assert_eq!(graph_cost(g).unfused.flops, 2 * 2048 * 4096 * 8192);
}

#[test]
fn conv_relu_bias_add_counts_each_op() {
    let g = &fixtures()["L2/1_Conv2D_ReLU_BiasAdd"];
    // x [128,64,128,128], weight [128,64,3,3] + bias → [128,128,126,126]
    let out = 128u64 * 128 * 126 * 126;
    let conv = 2 * out * 64 * 9 + out;
    let relu = out;
    let add = out;
    assert_eq!(graph_cost(g).unfused.flops, conv + relu + add);
    let classes = g.op_classes();
    assert_eq!(classes, [OpClass::Conv, OpClass::Pointwise], "{classes:?}");
}

#[test]
fn kernelbench_runs_batch_norm_in_training_mode() {
    // KernelBench never calls eval(): batch norm normalizes with batch statistics.
    let g = &fixtures()["L2/39_Gemm_Scale_BatchNorm"];
    let norm = g
        .nodes()
        .find_map(|(_, n)| match &n.op {
            Op::Norm(norm) => Some(norm.clone()),
            _ => None,
        })
        .unwrap();
    assert_eq!(norm.kind, NormKind::Batch);
    assert!(norm.batch_stats);
}

#[test]
fn max_with_dim_keeps_values_and_indices() {
    let g = &fixtures()["L2/80_Gemm_Max_Subtract_GELU"];
    let (id, node) = g
        .nodes()
        .find(|(_, n)| matches!(&n.op, Op::Reduce(r) if r.op == ReduceOp::Max { indices: true }))
        .unwrap();
    assert_eq!(node.outputs.len(), 2);
    // The subtraction reads the values (output 0).
    let consumer = g.consumers(id)[0];
    assert!(
        g.inputs(consumer)
            .iter()
            .any(|t| t.node == id && t.output == 0)
    );
}

fn trace(nodes: &str, outputs: &str) -> String {
    format!(
        r#"{{"schema": 1, "level": 1, "name": "t", "code_sha256": "", "torch": "test",
            "status": "ok", "method": "fx", "nodes": [{nodes}], "outputs": [{outputs}]}}"#
    )
}

const X: &str = r#"{"name": "x", "op": "input", "target": "x",
    "out": {"tensor": {"shape": [4, 8], "dtype": "float32"}}}"#;

#[test]
fn an_unknown_call_becomes_an_opaque_node_with_its_inputs() {
    let text = trace(
        &format!(
            r#"{X}, {{"name": "f", "op": "function", "target": "torch.special.bessel_j0",
            "args": [{{"node": "x"}}], "kwargs": {{}},
            "out": {{"tensor": {{"shape": [4, 8], "dtype": "float32"}}}}}}"#
        ),
        r#"{"node": "f"}"#,
    );
    let g = import_trace(&parse_trace(&text).unwrap()).unwrap().graph;
    let (id, n) = g.opaque_nodes().next().expect("the call is kept");
    // The call kept as it was made, for the export to make it again.
    assert_eq!(
        n.op,
        Op::Opaque {
            target: "torch.special.bessel_j0".into(),
            reason: "`special.bessel_j0` is not in the op vocabulary".into(),
            call: Some(Box::new(OpaqueCall {
                kind: CallKind::Function,
                target: "torch.special.bessel_j0".into(),
                args: vec![CallArg::Input(0)],
                kwargs: vec![],
                untraced: false,
            })),
        }
    );
    assert_eq!(g.inputs(id).len(), 1);
    assert_eq!(g.outputs()[0].node, id);
    let cost = node_cost(&g, id);
    assert!(!cost.exact);
    assert_eq!(cost.bytes, 2 * 4 * 32);
}

#[test]
fn eval_mode_batch_norm_reads_running_statistics() {
    let text = trace(
        &format!(
            r#"{X}, {{"name": "bn", "op": "module", "target": "bn", "module": "BatchNorm1d",
            "training": false,
            "attrs": {{"eps": 0.001, "affine": true, "track_running_stats": true}},
            "params": {{"weight": {{"shape": [8], "dtype": "float32", "trainable": true}},
                        "bias": {{"shape": [8], "dtype": "float32", "trainable": true}},
                        "running_mean": {{"shape": [8], "dtype": "float32"}},
                        "running_var": {{"shape": [8], "dtype": "float32"}}}},
            "args": [{{"node": "x"}}], "kwargs": {{}},
            "out": {{"tensor": {{"shape": [4, 8], "dtype": "float32"}}}}}}"#
        ),
        r#"{"node": "bn"}"#,
    );
    let g = import_trace(&parse_trace(&text).unwrap()).unwrap().graph;
    let (id, n) = g.nodes().find(|(_, n)| n.name == "bn").unwrap();
    match &n.op {
        Op::Norm(norm) => {
            assert!(!norm.batch_stats);
            assert_eq!(norm.eps, 0.001);
            assert!(norm.affine && norm.bias);
        }
        other => panic!("not a norm: {other}"),
    }
    // x, weight, bias, running_mean, running_var
    assert_eq!(g.inputs(id).len(), 5);
}

#[test]
fn masked_multihead_attention_stays_opaque_with_the_reason() {
    let q = r#"{"name": "q", "op": "input", "target": "q",
        "out": {"tensor": {"shape": [8, 2, 16], "dtype": "float32"}}}"#;
    let m = r#"{"name": "m", "op": "input", "target": "m",
        "out": {"tensor": {"shape": [8, 8], "dtype": "bool"}}}"#;
    let text = trace(
        &format!(
            r#"{q}, {m}, {{"name": "attn", "op": "module", "target": "attn",
            "module": "MultiheadAttention", "training": false,
            "attrs": {{"embed_dim": 16, "num_heads": 2, "batch_first": false, "dropout": 0.0}},
            "params": {{"in_proj_weight": {{"shape": [48, 16], "dtype": "float32"}},
                        "out_proj.weight": {{"shape": [16, 16], "dtype": "float32"}}}},
            "args": [{{"node": "q"}}, {{"node": "q"}}, {{"node": "q"}}],
            "kwargs": {{"attn_mask": {{"node": "m"}}}},
            "out": {{"tuple": [{{"tensor": {{"shape": [8, 2, 16], "dtype": "float32"}}}},
                              {{"tensor": {{"shape": [2, 8, 8], "dtype": "float32"}}}}]}}}}"#
        ),
        r#"{"node": "attn"}"#,
    );
    let g = import_trace(&parse_trace(&text).unwrap()).unwrap().graph;
    let (id, n) = g.opaque_nodes().next().expect("kept as one opaque node");
    let Op::Opaque {
        target,
        reason,
        call,
    } = &n.op
    else {
        panic!("{:?}", n.op)
    };
    assert_eq!(
        (target.as_str(), reason.as_str()),
        (
            "torch.nn.MultiheadAttention",
            "not expanded: `attn_mask` is not modelled in the expansion"
        )
    );
    // The module called again by its path, on the traced arguments.
    let call = call.as_ref().unwrap();
    assert_eq!(
        (call.kind, call.target.as_str()),
        (CallKind::Module, "attn")
    );
    let q = CallArg::Input;
    assert_eq!(call.args, [q(0), q(1), q(2)]);
    assert_eq!(call.kwargs, [("attn_mask".to_string(), q(3))]);
    // query, key, value, the mask and both weights; nothing half-expanded.
    assert_eq!(g.inputs(id).len(), 6);
    assert_eq!(g.len(), 5);
}

#[test]
fn broken_traces_are_refused_with_the_reason() {
    let dangling = trace(
        r#"{"name": "r", "op": "function", "target": "torch.relu", "args": [{"node": "nope"}],
            "kwargs": {}, "out": {"tensor": {"shape": [1], "dtype": "float32"}}}"#,
        r#"{"node": "r"}"#,
    );
    let e = import_trace(&parse_trace(&dangling).unwrap()).unwrap_err();
    assert_eq!(
        e.to_string(),
        "malformed trace at node `r`: reference to unknown node `nope`"
    );
    let failed = r#"{"schema": 1, "status": "error", "error": "problem code failed: SyntaxError"}"#;
    assert!(matches!(
        import_trace(&parse_trace(failed).unwrap()),
        Err(ImportError::Failed(m)) if m == "problem code failed: SyntaxError"
    ));
    let future = r#"{"schema": 99, "status": "ok"}"#;
    assert_eq!(
        parse_trace(future).unwrap_err().to_string(),
        "trace schema 99 is not supported (this mtmc reads schema 1); regenerate it"
    );
}

#[test]
fn an_exclusive_cumsum_written_with_cat_and_narrow_becomes_one_scan() {
    // L1/92: cat([zeros_like(x[:, :1]), cumsum(x.narrow(1, 0, n - 1), 1)], 1).
    let graphs = fixtures();
    let g = &graphs["L1/92_cumsum_exclusive"];
    // The select feeding zeros_like only for its shape is gone too.
    let ops: Vec<String> = g.nodes().map(|(_, n)| n.op.to_string()).collect();
    assert_eq!(ops, ["input x", "cumsum dim=1 exclusive"]);
    let out = g.outputs()[0];
    assert_eq!(g.tensor(out).shape, [32768, 32768]);
    assert_eq!(
        g.inputs(out.node)[0].node,
        g.order()[0],
        "it scans x itself"
    );
}

/// A random draw is rendered only where a program can draw the same
/// numbers: `randn`/`rand` naming the device (or `_like` a tensor) from
/// its global generator; on the default device, with a generator of its
/// own, or of another distribution, it is a random fill of no known kind.
#[test]
fn random_draws_know_their_distribution_where_a_program_can_repeat_them() {
    let draw = |target: &str, args: &str, kwargs: &str| {
        let text = trace(
            &format!(
                r#"{X}, {{"name": "r", "op": "function", "target": "{target}",
                "args": [{args}], "kwargs": {{{kwargs}}},
                "out": {{"tensor": {{"shape": [4, 8], "dtype": "float32"}}}}}}"#
            ),
            r#"{"node": "r"}"#,
        );
        let g = import_trace(&parse_trace(&text).unwrap()).unwrap().graph;
        let (_, n) = g.nodes().find(|(_, n)| n.name == "r").unwrap();
        n.op.clone()
    };
    let on_device = r#""device": {"device": "cuda:0"}"#;
    for (target, args, kwargs, fill) in [
        ("torch.randn", "4, 8", on_device, Fill::RandomNormal),
        ("torch.rand", "4, 8", on_device, Fill::RandomUniform),
        (
            "torch.randn_like",
            r#"{"node": "x"}"#,
            "",
            Fill::RandomNormal,
        ),
        ("torch.randn", "4, 8", "", Fill::Random),
        (
            "torch.rand",
            "4, 8",
            r#""device": {"device": "cuda:0"}, "generator": null"#,
            Fill::RandomUniform,
        ),
        (
            "torch.rand",
            "4, 8",
            r#""device": {"device": "cuda:0"}, "generator": "g""#,
            Fill::Random,
        ),
        ("torch.randint", "0, 5, [4, 8]", on_device, Fill::Random),
    ] {
        assert_eq!(
            draw(target, args, kwargs),
            Op::Constant { fill },
            "{target}({args}, {kwargs})"
        );
    }
}

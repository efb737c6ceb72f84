use super::layout::BACK;
use super::*;
use crate::intent::{Bindings, compile, parse_shapes};
use crate::op::{BinaryOp, Conv, Norm, NormKind, UnaryOp};

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(crate::DType::F32),
    };
    compile(src, &b).unwrap()
}

#[test]
fn a_sum_over_gemm_features_becomes_a_gemv_against_reduced_weights() {
    let g = graph(
        "y = sum((x @ w + b) * 0.5 - 2, dim=1)",
        "x=64x128,w=128x256,b=256",
    );
    let r = reduce_before_gemm(&g).unwrap();
    let ops: Vec<String> = r.nodes().map(|(_, n)| n.op.to_string()).collect();
    // No 64x256 product any more: the weights are summed over the
    // features, and x meets them in a GEMV.
    assert!(
        r.nodes()
            .all(|(_, n)| n.outputs.iter().all(|t| t.shape != [64, 256])),
        "{ops:?}"
    );
    assert!(ops.iter().any(|o| o == "matmul"), "{ops:?}");
    // The constant added to each of 256 features adds 512 to the sum.
    assert!(ops.iter().any(|o| o.contains("512")), "{ops:?}");
    assert_eq!(r.tensor(r.outputs()[0]).shape, [64]);
}

#[test]
fn nonlinear_steps_and_other_dims_are_left_alone() {
    for src in [
        "y = sum(sigmoid(x @ w), dim=1)",
        "y = sum(x @ w, dim=0)",
        "y = max(x @ w, dim=1)",
    ] {
        let g = graph(src, "x=64x128,w=128x256");
        assert!(reduce_before_gemm(&g).is_none(), "{src}");
    }
}

/// The ops of `g` in order, as displayed.
fn ops(g: &OpGraph) -> Vec<String> {
    g.order()
        .iter()
        .map(|&n| g.node(n).op.to_string())
        .collect()
}

#[test]
fn ops_after_a_channels_last_tensor_work_in_its_layout() {
    let g = graph(
        "y = softmax(sum(x * 2, dim=2, keepdim=true) + b, dim=1)",
        "x=2x3x4x5,b=3x1x1",
    );
    let x = g.nodes().find(|(_, n)| n.name == "x").unwrap().0;
    let r = sink_layout(&g, &[x]);
    let ops = ops(&r);
    let shapes: Vec<Vec<u64>> = r
        .order()
        .iter()
        .map(|&n| r.node(n).outputs[0].shape.clone())
        .collect();
    // x is read as [2, 4, 5, 3]; the sum over dim 2 (H) is over dim 1
    // there; the bias is reshaped to [1, 1, 1, 3]; the softmax over the
    // channels is over the last dim; one permute back at the output.
    assert!(ops.contains(&"permute [0, 2, 3, 1]".to_string()), "{ops:?}");
    assert!(shapes.contains(&vec![2, 4, 5, 3]), "{shapes:?}");
    assert!(
        ops.iter().any(|o| o.contains("sum") && o.contains("[1]")),
        "{ops:?}"
    );
    assert!(shapes.contains(&vec![1, 1, 1, 3]), "{shapes:?}");
    assert!(
        ops.iter().any(|o| o.contains("softmax") && o.contains('3')),
        "{ops:?}"
    );
    assert_eq!(ops.last().unwrap(), "permute [0, 3, 1, 2]", "{ops:?}");
    assert_eq!(r.tensor(r.outputs()[0]).shape, [2, 3, 1, 5]);
    assert_eq!(
        ops.iter().filter(|o| o.starts_with("permute")).count(),
        2,
        "{ops:?}"
    );
}

#[test]
fn a_full_size_operand_in_the_old_layout_stops_the_new_one() {
    // `x + z` would need z transposed: it reads x permuted back.
    let g = graph("y = relu(x) + z", "x=2x3x4x5,z=2x3x4x5");
    let x = g.nodes().find(|(_, n)| n.name == "x").unwrap().0;
    let r = sink_layout(&g, &[x]);
    let ops = ops(&r);
    let back = r
        .order()
        .iter()
        .position(|&n| r.node(n).name.ends_with(BACK))
        .unwrap();
    let add = ops.iter().position(|o| o == "+").unwrap();
    assert!(back < add, "{ops:?}");
    assert_eq!(r.tensor(r.outputs()[0]).shape, [2, 3, 4, 5]);
}

/// `g` with the inputs named in `names` made parameters.
fn with_parameters(mut g: OpGraph, names: &[&str]) -> OpGraph {
    let ids: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| names.contains(&n.name.as_str()))
        .map(|(id, _)| id)
        .collect();
    for id in ids {
        let name = g.node(id).name.clone();
        *g.op_mut(id) = Op::Param {
            name,
            trainable: true,
        };
    }
    g
}

#[test]
fn scales_and_shifts_after_a_linear_layer_fold_into_its_weights() {
    let g = with_parameters(
        graph(
            "y = relu((2 * linear(x, w, b) / s + t) * 0.5)",
            "x=64x128,w=256x128,b=256,s=256,t=256",
        ),
        &["w", "b", "s", "t"],
    );
    let r = fold_into_weights(&g).unwrap();
    // One product, then the relu: every step went into the weights
    // (three scales: `* 2`, `/ s`, `* 0.5`) and the bias (all four).
    let after = |r: &OpGraph| -> Vec<String> {
        r.order()
            .iter()
            .skip_while(|&&n| !matches!(r.node(n).op, Op::MatMul(_)))
            .filter(|&&n| !r.node(n).op.is_source())
            .map(|&n| r.node(n).op.to_string())
            .collect()
    };
    assert_eq!(after(&r), ["matmul Bᵀ +bias", "relu"], "{:?}", computed(&r));
    let weights = r.nodes().filter(|(_, n)| n.outputs[0].shape == [256, 128]);
    assert_eq!(
        weights.filter(|(_, n)| !n.op.is_source()).count(),
        3,
        "{:?}",
        computed(&r)
    );
    let product = r
        .nodes()
        .find(|(_, n)| matches!(n.op, Op::MatMul(_)))
        .unwrap()
        .0;
    assert!(
        r.inputs(product)[1..]
            .iter()
            .all(|t| !matches!(r.node(t.node).op, Op::Param { .. })),
        "the product reads the folded weights and bias"
    );
    assert_eq!(r.tensor(r.outputs()[0]).shape, [64, 256]);
    // Without a bias the shift stays after the product.
    let g = with_parameters(
        graph("y = linear(x, w) * s + t", "x=64x128,w=256x128,s=256,t=256"),
        &["w", "s", "t"],
    );
    let r = fold_into_weights(&g).unwrap();
    assert_eq!(after(&r), ["matmul Bᵀ +bias"], "{:?}", computed(&r));
    assert!(
        r.nodes().any(|(_, n)| matches!(n.op, Op::Constant { .. })),
        "a zero bias to shift: {:?}",
        computed(&r)
    );
}

#[test]
fn an_eval_mode_batch_norm_after_a_convolution_folds_into_it() {
    let mut g = OpGraph::new();
    let f = |s: &[u64]| vec![TensorType::new(s.to_vec(), crate::DType::F32)];
    let x = g
        .add("x", Op::Input { name: "x".into() }, &[], f(&[2, 3, 8, 8]))
        .unwrap();
    let param = |g: &mut OpGraph, name: &str, s: &[u64]| {
        let id = g
            .add(
                name,
                Op::Param {
                    name: name.into(),
                    trainable: true,
                },
                &[],
                f(s),
            )
            .unwrap();
        TensorRef::first(id)
    };
    let w = param(&mut g, "w", &[4, 3, 3, 3]);
    let stats: Vec<TensorRef> = ["gamma", "beta", "mean", "var"]
        .iter()
        .map(|n| param(&mut g, n, &[4]))
        .collect();
    let conv = g
        .add(
            "conv",
            Op::Conv(Conv {
                spatial: 2,
                transposed: false,
                kernel: vec![3, 3],
                stride: vec![1, 1],
                padding: vec![0, 0],
                dilation: vec![1, 1],
                output_padding: vec![0, 0],
                groups: 1,
                bias: false,
            }),
            &[TensorRef::first(x), w],
            f(&[2, 4, 6, 6]),
        )
        .unwrap();
    let scaled = g
        .add(
            "scaled",
            Op::Scalar {
                op: BinaryOp::Mul,
                value: 2.0,
                scalar_first: false,
            },
            &[TensorRef::first(conv)],
            f(&[2, 4, 6, 6]),
        )
        .unwrap();
    let mut ins = vec![TensorRef::first(scaled)];
    ins.extend(stats);
    let bn = g
        .add(
            "bn",
            Op::Norm(Norm {
                kind: NormKind::Batch,
                eps: 1e-5,
                affine: true,
                bias: true,
                batch_stats: false,
            }),
            &ins,
            f(&[2, 4, 6, 6]),
        )
        .unwrap();
    let y = g
        .add(
            "y",
            Op::Unary(UnaryOp::Relu),
            &[TensorRef::first(bn)],
            f(&[2, 4, 6, 6]),
        )
        .unwrap();
    g.set_outputs(vec![TensorRef::first(y)]);
    let r = fold_into_weights(&g).unwrap();
    // The convolution with a bias, then the relu; the norm's scale is
    // computed from its parameters (`gamma / sqrt(var + eps)`).
    let ops = computed(&r);
    let conv_at = ops.iter().position(|o| o.starts_with("conv")).unwrap();
    assert_eq!(ops[conv_at + 1..], ["relu"], "{ops:?}");
    assert!(!ops.iter().any(|o| o.contains("norm")), "{ops:?}");
    assert!(ops.iter().any(|o| o == "sqrt"), "{ops:?}");
    let folded = r
        .nodes()
        .find(|(_, n)| matches!(n.op, Op::Conv(_)))
        .unwrap();
    assert!(matches!(folded.1.op, Op::Conv(Conv { bias: true, .. })));
    assert_eq!(r.inputs(folded.0).len(), 3);
    // With batch statistics (training mode) it does not fold.
    let Op::Norm(n) = g.op_mut(bn) else {
        unreachable!()
    };
    n.batch_stats = true;
    assert!(
        fold_into_weights(&g)
            .unwrap()
            .nodes()
            .any(|(_, n)| matches!(n.op, Op::Norm(_)))
    );
}

#[test]
fn weights_that_are_inputs_and_nonlinear_steps_do_not_fold() {
    // Weights read from the forward's inputs are no parameters.
    let g = graph("y = linear(x, w, b) * 2", "x=64x128,w=256x128,b=256");
    assert!(fold_into_weights(&g).is_none());
    // A nonlinear step, a constant divided by the product, a full-size
    // operand, an operand read from the inputs.
    for (src, operand) in [
        ("y = relu(linear(x, w, b)) * 2", ""),
        ("y = 2 / linear(x, w, b)", ""),
        ("y = linear(x, w, b) * v", ",v=64x256"),
        ("y = linear(x, w, b) * u", ",u=256"),
    ] {
        let g = with_parameters(
            graph(src, &format!("x=64x128,w=256x128,b=256{operand}")),
            &["w", "b", "v"],
        );
        assert!(fold_into_weights(&g).is_none(), "{src}");
    }
}

#[test]
fn reductions_over_size_one_dims_become_views() {
    let g = graph(
        "y = logsumexp(sum(x, dim=1, keepdim=true), dim=1)",
        "x=8x16",
    );
    let r = drop_size_one_reductions(&g).unwrap();
    let last = r.outputs()[0].node;
    assert!(r.node(last).op.is_view());
    assert!(drop_size_one_reductions(&graph("y = sum(x, dim=1)", "x=8x16")).is_none());
}

/// The ops of `g` that are not views, as shown.
fn computed(g: &OpGraph) -> Vec<String> {
    g.nodes()
        .filter(|(_, n)| !n.op.is_source() && !n.op.is_view())
        .map(|(_, n)| n.op.to_string())
        .collect()
}

#[test]
fn a_clamp_inside_a_wider_clamp_becomes_a_view() {
    // The inner clamp is the wider: the outer alone gives the values.
    let g = graph("y = clamp(clamp(x, min=-2, max=2), min=-1, max=1)", "x=64");
    assert_eq!(computed(&drop_nested_clamps(&g).unwrap()), ["clamp(-1, 1)"]);
    // A relu after a clamp into [0.5, 3] changes nothing.
    let g = graph("y = relu(clamp(x, min=0.5, max=3))", "x=64");
    assert_eq!(
        computed(&drop_nested_clamps(&g).unwrap()),
        ["clamp(0.5, 3)"]
    );
    // relu then relu6: relu is the wider (no upper bound) inner one.
    let g = graph("y = relu6(relu(x))", "x=64");
    assert_eq!(computed(&drop_nested_clamps(&g).unwrap()), ["relu6"]);
    // Overlapping intervals: both are needed.
    let g = graph(
        "y = clamp(clamp(x, min=-1, max=1), min=-2, max=0.5)",
        "x=64",
    );
    assert!(drop_nested_clamps(&g).is_none());
    // A clamp to [-1, 1] after tanh changes nothing; to [0, 0.5] it does.
    let g = graph("y = clamp(tanh(x), min=-1, max=1)", "x=64");
    assert_eq!(computed(&drop_nested_clamps(&g).unwrap()), ["tanh"]);
    assert!(drop_nested_clamps(&graph("y = clamp(sigmoid(x), min=0, max=0.5)", "x=64")).is_none());
    // An inner clamp read elsewhere stays.
    let g = graph(
        "c = clamp(x, min=-2, max=2); y = clamp(c, min=-1, max=1) + c",
        "x=64",
    );
    assert!(drop_nested_clamps(&g).is_none());
}

/// A shared problem's traced graph.
fn traced(level: u64, name: &str) -> OpGraph {
    crate::import::shared_graph(level, name).unwrap()
}

#[test]
fn attention_written_op_by_op_becomes_one_call() {
    // L3/44: scores scaled after the product, a causal mask filled
    // with -inf, inactive dropout. L3/31 (torch's multi-head
    // attention, written out): the scale on q.
    for (level, name, scale, masked) in [
        (3, "44_MiniGPTBlock", 0.10206207261596577, true),
        (3, "31_VisionAttention", 0.17677669529663687, false),
    ] {
        let g = traced(level, name);
        let r = attention_in_one_call(&g).unwrap_or_else(|| panic!("{name}"));
        let calls: Vec<_> = r
            .nodes()
            .filter(|(_, n)| matches!(n.op, Op::Attention(_)))
            .collect();
        assert_eq!(calls.len(), 1, "{name}: {:?}", ops(&r));
        let (call, node) = calls[0];
        let Op::Attention(a) = &node.op else {
            unreachable!()
        };
        assert_eq!((a.causal, a.scale, a.mask), (false, Some(scale), masked));
        // No softmax, and no tensor of the scores' shape, left.
        let scores = g
            .nodes()
            .find(|(_, n)| matches!(n.op, Op::Softmax { .. }))
            .map(|(_, n)| n.outputs[0].shape.clone())
            .unwrap();
        for (_, n) in r.nodes() {
            assert!(!matches!(n.op, Op::Softmax { .. }), "{name}");
            assert!(
                n.outputs.iter().all(|t| t.shape != scores),
                "{name}: {} {:?}",
                n.op,
                n.outputs[0].shape
            );
        }
        let ins = r.inputs(call);
        assert_eq!(ins.len(), 3 + usize::from(masked));
        // The call's shapes and what reads its result are the product's.
        let old = g
            .nodes()
            .find(|(_, n)| n.name == node.name)
            .map(|(id, _)| id)
            .unwrap();
        assert_eq!(g.node(old).outputs, node.outputs);
        let readers = |g: &OpGraph, id| -> Vec<String> {
            g.consumers(id)
                .iter()
                .map(|&c| g.node(c).name.clone())
                .collect()
        };
        assert_eq!(readers(&g, old), readers(&r, call));
        if masked {
            // The call's mask is the -inf mask's complement.
            let kept = r.node(ins[3].node);
            assert_eq!(kept.op.to_string(), "x == 0", "{name}");
            let dropped_where = r.node(r.inputs(ins[3].node)[0].node);
            assert_eq!(dropped_where.name, "__eq__", "{name}");
        } else {
            // q comes unscaled: the scale is the call's.
            assert!(!ops(&r).iter().any(|o| o.starts_with("x * 0.17")), "{name}");
        }
        assert!(
            rewrite_all(&g)
                .unwrap()
                .1
                .contains(&"attention_in_one_call")
        );
    }
}

#[test]
fn attention_whose_scores_are_read_elsewhere_or_not_filled_with_minus_infinity_stays() {
    let g = traced(3, "44_MiniGPTBlock");
    let node = |g: &OpGraph, name: &str| {
        g.nodes()
            .find(|(_, n)| n.name == name)
            .map(|(id, _)| id)
            .unwrap()
    };
    // The softmax also returned.
    let mut returned = g.clone();
    let mut outs = returned.outputs().to_vec();
    outs.push(TensorRef::first(node(&g, "softmax")));
    returned.set_outputs(outs);
    assert!(attention_in_one_call(&returned).is_none());
    // A large finite fill instead of -inf, or a negative scale.
    for op in [
        Op::Where { fill: Some(-1e9) },
        Op::Scalar {
            op: BinaryOp::Mul,
            value: -0.5,
            scalar_first: false,
        },
    ] {
        let mut other = g.clone();
        let at = node(
            &g,
            if matches!(op, Op::Where { .. }) {
                "masked_fill"
            } else {
                "mul"
            },
        );
        *other.op_mut(at) = op;
        assert!(attention_in_one_call(&other).is_none());
    }
    // Log-softmax.
    let mut log = g.clone();
    *log.op_mut(node(&g, "softmax")) = Op::Softmax { dim: 3, log: true };
    assert!(attention_in_one_call(&log).is_none());
}

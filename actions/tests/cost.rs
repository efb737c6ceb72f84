//! FLOPs, bytes and roofline on cases whose figures are known by hand.

use mtmc_actions::device::{MathMode, builtin_devices, find_device, roofline};
use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_actions::op::{Conv, Layout, Op};
use mtmc_actions::{DType, OpGraph, TensorRef, TensorType, graph_cost, node_cost};

fn intent(src: &str, shapes: &str) -> OpGraph {
    compile(
        src,
        &Bindings {
            shapes: parse_shapes(shapes).unwrap(),
            dtype: Some(DType::F32),
        },
    )
    .unwrap()
}

fn node(g: &OpGraph, name: &str) -> mtmc_actions::NodeId {
    g.nodes().find(|(_, n)| n.name == name).unwrap().0
}

#[test]
fn matmul_costs_two_m_n_k() {
    let g = intent("c = a @ b", "a=128x256,b=256x512");
    let c = node_cost(&g, node(&g, "c"));
    assert_eq!(c.flops, 2 * 128 * 512 * 256);
    assert_eq!(c.bytes, 4 * (128 * 256 + 256 * 512 + 128 * 512));
    assert!(c.exact);
}

#[test]
fn batched_matmul_counts_every_batch() {
    let g = intent("c = a @ b", "a=16x128x64,b=64x32");
    assert_eq!(node_cost(&g, node(&g, "c")).flops, 2 * 16 * 128 * 32 * 64);
}

#[test]
fn an_elementwise_chain_moves_its_data_once_when_fused() {
    let g = intent("t = sigmoid(x * 2 + 1)", "x=1000x1000");
    let n = 1_000_000u64;
    let cost = graph_cost(&g);
    // mul 1 + add 1 + sigmoid 4 FLOPs per element.
    assert_eq!(cost.unfused.flops, 6 * n);
    // Three kernels each read and write the tensor ...
    assert_eq!(cost.unfused.bytes, 3 * 2 * 4 * n);
    // ... but a fused kernel reads x and writes t once.
    assert_eq!(cost.fused_bytes, 2 * 4 * n);
}

#[test]
fn convolution_flops_follow_the_output_and_kernel() {
    let t = |s: &[u64]| TensorType::new(s.to_vec(), DType::F32);
    let mut g = OpGraph::new();
    let x = g.add_input("x", t(&[8, 3, 32, 32]));
    let w = g.add_param("w", t(&[16, 3, 3, 3]));
    let conv = Conv::dense(&[3, 3]);
    let y = g
        .add(
            "y",
            Op::Conv(conv.clone()),
            &[x, w],
            vec![t(&[8, 16, 30, 30])],
        )
        .unwrap();
    // 2 · (output elements) · (input channels per group) · (kernel area).
    assert_eq!(node_cost(&g, y).flops, 2 * (8 * 16 * 30 * 30) * 3 * 9);
    // Transposed: every input element scatters into out_channels · kernel area.
    let yt = g
        .add(
            "yt",
            Op::Conv(Conv {
                transposed: true,
                ..conv
            }),
            &[x, w],
            vec![t(&[8, 16, 34, 34])],
        )
        .unwrap();
    assert_eq!(node_cost(&g, yt).flops, 2 * (8 * 3 * 32 * 32) * 16 * 9);
}

#[test]
fn a_broadcast_view_costs_the_bytes_under_it() {
    let t = |s: &[u64]| TensorType::new(s.to_vec(), DType::F32);
    let mut g = OpGraph::new();
    let b = g
        .add(
            "b",
            Op::Input { name: "b".into() },
            &[],
            vec![t(&[1, 1024])],
        )
        .unwrap();
    let x = g
        .add(
            "x",
            Op::Input { name: "x".into() },
            &[],
            vec![t(&[1024, 1024])],
        )
        .unwrap();
    let e = g
        .add(
            "e",
            Op::Layout(Layout::Expand),
            &[TensorRef::first(b)],
            vec![t(&[1024, 1024])],
        )
        .unwrap();
    let s = g
        .add(
            "s",
            Op::Binary(mtmc_actions::op::BinaryOp::Add),
            &[TensorRef::first(x), TensorRef::first(e)],
            vec![t(&[1024, 1024])],
        )
        .unwrap();
    assert_eq!(node_cost(&g, e).bytes, 0);
    assert_eq!(
        node_cost(&g, s).bytes,
        4 * (1024 * 1024 + 1024 + 1024 * 1024)
    );
}

#[test]
fn roofline_picks_the_binding_limit() {
    let specs = builtin_devices();
    let h100 = find_device(&specs, "H100").unwrap();
    // A large fp32 matmul is compute-bound on CUDA cores ...
    let g = intent("c = a @ b", "a=4096x4096,b=4096x4096");
    let r = roofline(&g, h100, MathMode::default());
    let flops = 2.0 * 4096f64.powi(3);
    assert!((r.time_s - flops / 66.9e12).abs() < 1e-9);
    assert_eq!(r.bound, mtmc_actions::device::Bound::Compute);
    // ... and an elementwise op is memory-bound.
    let g = intent("y = relu(x)", "x=4096x4096");
    let r = roofline(&g, h100, MathMode::default());
    assert!((r.time_s - 2.0 * 4.0 * 4096.0 * 4096.0 / 3350e9).abs() < 1e-12);
    assert_eq!(r.bound, mtmc_actions::device::Bound::Memory);
    // H200 has more bandwidth, so the same memory-bound graph is faster there.
    let h200 = find_device(&specs, "H200").unwrap();
    assert!(roofline(&g, h200, MathMode::default()).time_s < r.time_s);
}

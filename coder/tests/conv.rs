//! The convolution family (implicit GEMM), compiled with real NVRTC on
//! KernelBench's traced graphs: 1-, 2- and 3-d, strides, padding and
//! dilation, weight rows off 16 bytes, a bias and a pointwise chain
//! fused after it, and the convolutions it refuses.

use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::Op;
use mtmc_coder::program::Fragment;
use mtmc_coder::template::{Refusal, product};

mod common;
use common::{compiles, realize_with_rest, traced};

/// The convolution and every non-source op after it, as one region.
fn realize(g: &OpGraph) -> Result<Fragment, Refusal> {
    realize_with_rest(g, |op| matches!(op, Op::Conv(_)))
}

#[test]
fn convolutions_of_one_group_compile_as_implicit_gemms() {
    // (level, name, inputs: x, weight, bias and the chain's operands)
    for (level, name, inputs) in [
        (1, "54_conv_standard_3D__square_input__square_kernel", 2),
        (1, "67_conv_standard_1D", 2),
        (1, "76_conv_standard_1D_dilated_strided__", 2),
        (
            1,
            "80_conv_standard_2D_square_input_asymmetric_kernel___dilated____padded__",
            2,
        ),
        (1, "87_conv_pointwise_2D", 2),
        // A bias, then ReLU and a bias add fused after it.
        (2, "1_Conv2D_ReLU_BiasAdd", 4),
        (2, "57_Conv2d_ReLU_HardSwish", 3),
    ] {
        let g = traced(level, name);
        let f = realize(&g).unwrap_or_else(|r| panic!("{name}: refused: {r}"));
        compiles(&f, name);
        assert!(f.name.ends_with("_conv"), "{name}: {}", f.name);
        assert_eq!(f.inputs.len(), inputs, "{name}");
        assert_eq!(f.outputs, g.outputs(), "{name}: writes the chain's result");
        assert_eq!(f.launch.block, 128, "{name}");
        assert!(f.source.contains("mma.sync.aligned.m16n8k8"), "{name}");
        // Input elements are gathered four bytes at a time, zero-filled
        // outside the input.
        assert!(f.source.contains("cp.async.ca.shared.global"), "{name}");
    }
}

#[test]
fn block_columns_follow_the_output_channels() {
    // L2/57: 64 output channels of 126x126 positions, batch 128, into
    // blocks of 128 rows and 64 columns.
    let g = traced(2, "57_Conv2d_ReLU_HardSwish");
    let f = realize(&g).unwrap();
    assert_eq!(
        u64::from(f.launch.grid),
        (128u64 * 126 * 126).div_ceil(128),
        "one block column"
    );
    assert!(
        f.source.contains("implicit GEMM 2032128x64x72"),
        "{}",
        f.source.lines().next().unwrap()
    );
}

#[test]
fn transposed_and_grouped_convolutions_are_refused_with_the_reason() {
    for (name, why) in [
        (
            "57_conv_transposed_2D__square_input__square_kernel",
            "transposed",
        ),
        (
            "82_conv_depthwise_2D_square_input_square_kernel",
            "channel groups",
        ),
    ] {
        let g = traced(1, name);
        let conv = g
            .nodes()
            .find(|(_, n)| matches!(n.op, Op::Conv(_)))
            .unwrap();
        assert!(!product(&conv.1.op), "{name}: not a template product");
        let r = realize(&g).expect_err(name);
        assert!(r.to_string().contains(why), "{name}: {r}");
    }
}

#[test]
fn a_convolution_and_a_wgmma_product_compile_in_one_module() {
    // A program's CUDA fragments are joined into one module (the export's
    // `_SOURCE`): LeNet-5's first convolution (an implicit GEMM on the
    // `mma.sync` path) and its first linear layer (both operands
    // K-contiguous: the `wgmma` path) each declare dynamic shared memory,
    // and the two declarations must not clash.
    let g = traced(3, "4_LeNet5");
    let conv = common::realize_first(&g, |op| matches!(op, Op::Conv(_))).expect("a conv kernel");
    let gemm = common::realize_first(&g, |op| matches!(op, Op::MatMul(_))).expect("a GEMM kernel");
    assert!(gemm.source.contains("wgmma.mma_async"), "{}", gemm.source);
    assert!(!conv.source.contains("wgmma.mma_async"));
    let unit = mtmc_env::nvrtc::CompileUnit {
        name: "program.cu".into(),
        source: format!("{}\n{}", conv.source, gemm.source),
    };
    let r = mtmc_env::nvrtc::compile(&unit, mtmc_env::nvrtc::Arch::SM90).expect("NVRTC");
    assert!(r.ok, "{}", r.log);
}

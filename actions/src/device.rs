//! Device specifications and the roofline time of a graph.
//!
//! Specs are data (`data/devices.json`, compiled in; a user may load others),
//! so adding a GPU never touches code.

use std::fmt;

use crate::cost::{GraphCost, graph_cost, node_cost};
use crate::dtype::DType;
use crate::graph::{NodeId, OpGraph};
use crate::op::OpClass;

/// Peak rates and bandwidth of one GPU model.
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct DeviceSpec {
    /// Short name (`H100`).
    pub name: String,
    /// Other names it is known by, including what the driver reports.
    #[serde(default)]
    pub aliases: Vec<String>,
    /// Where the figures come from.
    pub source: String,
    /// Device memory.
    pub memory_gib: f64,
    /// DRAM bandwidth, GB/s (10⁹ bytes per second).
    pub memory_bandwidth_gbs: f64,
    /// L2 cache size.
    pub l2_mib: f64,
    /// Streaming multiprocessors.
    pub sms: u32,
    /// Peak math rates, TFLOP/s.
    pub tflops: PeakRates,
}

/// Peak math rates in TFLOP/s (10¹² FLOP per second).
#[derive(Clone, Debug, PartialEq, serde::Deserialize, serde::Serialize)]
pub struct PeakRates {
    /// FP64 on CUDA cores.
    pub fp64: f64,
    /// FP32 on CUDA cores.
    pub fp32: f64,
    /// FP16/BF16 on CUDA cores.
    pub half_vector: f64,
    /// FP64 on tensor cores.
    pub fp64_tensor: f64,
    /// TF32 on tensor cores.
    pub tf32_tensor: f64,
    /// BF16 on tensor cores.
    pub bf16_tensor: f64,
    /// FP16 on tensor cores.
    pub fp16_tensor: f64,
}

/// The built-in specs (H100, H200).
pub fn builtin_devices() -> Vec<DeviceSpec> {
    parse_devices(include_str!("../data/devices.json"))
        .expect("the built-in device table is valid JSON of the DeviceSpec shape")
}

/// Parses a JSON array of device specs.
pub fn parse_devices(json: &str) -> Result<Vec<DeviceSpec>, serde_json::Error> {
    serde_json::from_str(json)
}

/// Finds a spec by name or alias, ignoring case.
pub fn find_device<'a>(specs: &'a [DeviceSpec], name: &str) -> Option<&'a DeviceSpec> {
    specs.iter().find(|s| {
        s.name.eq_ignore_ascii_case(name) || s.aliases.iter().any(|a| a.eq_ignore_ascii_case(name))
    })
}

/// Which math the kernels may use.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MathMode {
    /// fp32 matrix products may run as TF32 on tensor cores. KernelBench's
    /// fp32 tolerance (1e-4) rules this out, so it is off by default.
    pub allow_tf32: bool,
    /// Convolutions run as TF32: cuDNN does so under torch's defaults
    /// (`torch.backends.cudnn.allow_tf32`). Where the reference's outputs
    /// are TF32-rounded, this is the problem's math
    /// (`Outcome::problem_math` in the env).
    pub conv_tf32: bool,
    /// fp32 matrix products and convolutions may run as three TF32
    /// products each on tensor cores (a value and its TF32 remainder:
    /// fp32 accuracy at a third of the TF32 rate), as mtmc's GEMM and
    /// implicit-GEMM kernels do; the rate is the faster of that and the
    /// CUDA cores' fp32. Off in the problem's math, whose fp32 rate these
    /// kernels can pass; the planner's early stop reads it.
    pub split_tf32: bool,
}

impl DeviceSpec {
    /// Peak FLOP/s for an op class on operands of `dtype`.
    pub fn rate(&self, class: OpClass, dtype: DType, math: MathMode) -> f64 {
        let tensor_core = matches!(
            class,
            OpClass::Matmul | OpClass::Conv | OpClass::Attention | OpClass::Rnn
        );
        let r = &self.tflops;
        let tflops = match (tensor_core, dtype) {
            (true, DType::BF16) => r.bf16_tensor,
            (true, DType::F16) => r.fp16_tensor,
            (true, DType::F64) => r.fp64_tensor,
            (true, _) if math.allow_tf32 || (class == OpClass::Conv && math.conv_tf32) => {
                r.tf32_tensor
            }
            (true, DType::F32)
                if math.split_tf32 && matches!(class, OpClass::Matmul | OpClass::Conv) =>
            {
                (r.tf32_tensor / 3.0).max(r.fp32)
            }
            (_, DType::F16 | DType::BF16) => r.half_vector,
            (_, DType::F64) => r.fp64,
            _ => r.fp32,
        };
        tflops * 1e12
    }

    /// DRAM bandwidth in bytes per second.
    pub fn bandwidth(&self) -> f64 {
        self.memory_bandwidth_gbs * 1e9
    }
}

/// What limits a roofline bound.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bound {
    /// Math throughput.
    Compute,
    /// DRAM bandwidth.
    Memory,
}

/// Lower bounds on a graph's run time on one device.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Roofline {
    /// Σ FLOPs of each node / the node's peak rate.
    pub compute_s: f64,
    /// Compulsory traffic of the fully fused graph / bandwidth.
    pub memory_s: f64,
    /// max(compute, memory): no implementation can be faster.
    pub time_s: f64,
    /// Σ over nodes of max(node compute, node traffic / bandwidth): the bound
    /// for running every op as its own kernel.
    pub unfused_s: f64,
    /// What limits `time_s`.
    pub bound: Bound,
    /// The totals it was computed from.
    pub cost: GraphCost,
}

/// The roofline bound of `g` on `spec`.
pub fn roofline(g: &OpGraph, spec: &DeviceSpec, math: MathMode) -> Roofline {
    let cost = graph_cost(g);
    let mut compute_s = 0.0;
    let mut unfused_s = 0.0;
    for (id, node) in g.nodes() {
        let c = node_cost(g, id);
        let t_compute = c.flops as f64 / spec.rate(node.op.class(), node_dtype(g, id), math);
        compute_s += t_compute;
        unfused_s += t_compute.max(c.bytes as f64 / spec.bandwidth());
    }
    let memory_s = cost.fused_bytes as f64 / spec.bandwidth();
    let (time_s, bound) = if compute_s >= memory_s {
        (compute_s, Bound::Compute)
    } else {
        (memory_s, Bound::Memory)
    };
    Roofline {
        compute_s,
        memory_s,
        time_s,
        unfused_s,
        bound,
        cost,
    }
}

/// The dtype a node's math runs in, for its peak rate: its first input's,
/// else its first output's, else float32.
pub fn node_dtype(g: &OpGraph, id: NodeId) -> DType {
    g.inputs(id)
        .first()
        .map(|&t| g.tensor(t).dtype)
        .or_else(|| g.node(id).outputs.first().map(|t| t.dtype))
        .unwrap_or(DType::F32)
}

impl fmt::Display for Bound {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Bound::Compute => "compute-bound",
            Bound::Memory => "memory-bound",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtin_specs_are_found_by_name_and_driver_alias() {
        let specs = builtin_devices();
        assert_eq!(find_device(&specs, "h100").unwrap().name, "H100");
        assert_eq!(
            find_device(&specs, "NVIDIA H100 80GB HBM3").unwrap().name,
            "H100"
        );
        assert_eq!(find_device(&specs, "H200").unwrap().name, "H200");
        assert!(find_device(&specs, "A100").is_none());
    }

    #[test]
    fn fp32_matmul_uses_cuda_cores_unless_tf32_is_allowed() {
        let h100 = find_device(&builtin_devices(), "H100").unwrap().clone();
        let strict = h100.rate(OpClass::Matmul, DType::F32, MathMode::default());
        let tf32 = h100.rate(
            OpClass::Matmul,
            DType::F32,
            MathMode {
                allow_tf32: true,
                ..MathMode::default()
            },
        );
        let tflops = |r: f64| (r / 1e12 * 10.0).round() / 10.0;
        assert_eq!(tflops(strict), 66.9);
        assert_eq!(tflops(tf32), 494.7);
        assert_eq!(
            tflops(h100.rate(OpClass::Pointwise, DType::BF16, MathMode::default())),
            133.8
        );
    }

    #[test]
    fn split_tf32_runs_fp32_products_at_a_third_of_the_tf32_rate() {
        let h100 = find_device(&builtin_devices(), "H100").unwrap().clone();
        let split = MathMode {
            split_tf32: true,
            ..MathMode::default()
        };
        let tflops = |class, dtype, math| (h100.rate(class, dtype, math) / 1e11).round() / 10.0;
        assert_eq!(tflops(OpClass::Matmul, DType::F32, split), 164.9);
        assert_eq!(tflops(OpClass::Conv, DType::F32, split), 164.9);
        // A TF32 convolution stays at the TF32 rate; other classes and
        // dtypes are untouched.
        let conv_tf32 = MathMode {
            conv_tf32: true,
            ..split
        };
        assert_eq!(tflops(OpClass::Conv, DType::F32, conv_tf32), 494.7);
        assert_eq!(tflops(OpClass::Attention, DType::F32, split), 66.9);
        assert_eq!(tflops(OpClass::Pointwise, DType::F32, split), 66.9);
        assert_eq!(tflops(OpClass::Matmul, DType::F16, split), 989.4);
    }
}

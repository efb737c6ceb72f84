//! What an evaluation found: the one record every evaluator returns.
//!
//! An [`Outcome`] says whether the candidate compiled (with the log), whether
//! it ran and was correct (error figures, first bad element), how fast it
//! was against the baselines timed in the same run, how close it came to the
//! roofline, and what each kernel costs in registers, spills, shared memory
//! and occupancy. It serializes to JSON for reports and trajectories.

use std::collections::BTreeMap;

use mtmc_actions::device::{DeviceSpec, MathMode, roofline};
use mtmc_actions::graph::OpGraph;
use serde::{Deserialize, Serialize};

/// Which evaluator produced an outcome.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EvaluatorKind {
    /// The Python worker: the problem's PyTorch model is the reference.
    Worker,
    /// cudarc in a child process: kernels with a launch plan, checked
    /// against the f64 CPU reference.
    Native,
    /// NVRTC only: compiled, nothing run.
    CompileOnly,
}

impl EvaluatorKind {
    /// The name used in reports and flags.
    pub fn name(self) -> &'static str {
        match self {
            EvaluatorKind::Worker => "worker",
            EvaluatorKind::Native => "native",
            EvaluatorKind::CompileOnly => "compile-only",
        }
    }
}

/// The verdict.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Status {
    /// Every check passed and it was timed.
    Correct,
    /// It ran and a check failed (`why` says which).
    Incorrect,
    /// It did not compile or load (`error`, `compile.log`).
    CompileError,
    /// It failed while running (`error`).
    RuntimeError,
    /// It overran the wall-clock limit; its worker was stopped.
    Timeout,
    /// Its worker died (a segfault, a fatal CUDA error).
    Crashed,
    /// It compiled; nothing was run (no GPU, or compile-only asked for).
    CompiledOnly,
    /// It passed every check, but its time is below what the GPU can do at
    /// all ([`Outcome::add_roofline`]): not a speedup, whatever it printed.
    Implausible,
    /// It passed a screen ([`Outcome::screen`]: the first correctness
    /// trial and a short timing), more than the screening margin slower
    /// than the fastest screened program of its problem, and was not given
    /// the full protocol: neither correct nor a figure.
    Screened,
}

impl Status {
    /// The name used in reports.
    pub fn name(self) -> &'static str {
        match self {
            Status::Correct => "correct",
            Status::Incorrect => "incorrect",
            Status::CompileError => "compile_error",
            Status::RuntimeError => "runtime_error",
            Status::Timeout => "timeout",
            Status::Crashed => "crashed",
            Status::CompiledOnly => "compiled_only",
            Status::Implausible => "implausible",
            Status::Screened => "screened",
        }
    }

    /// Whether the candidate ran on a GPU at all.
    pub fn ran(self) -> bool {
        matches!(
            self,
            Status::Correct
                | Status::Incorrect
                | Status::RuntimeError
                | Status::Implausible
                | Status::Screened
        )
    }
}

/// Timing statistics of one callable, milliseconds per call.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Timing {
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub median_ms: f64,
    /// Sample standard deviation.
    pub std_ms: f64,
    /// Fastest trial.
    pub min_ms: f64,
    /// Slowest trial.
    pub max_ms: f64,
    /// Timed trials.
    pub trials: u32,
    /// How the calls were timed: `judge` (the judge's spans of calls in the
    /// candidate's own process, on a GPU), `cuda_events` (events in the
    /// process that ran the calls: the native evaluator, and outcomes
    /// recorded before the judge ran candidates apart), or `host` where
    /// there was no GPU (tests).
    #[serde(default = "cuda_events")]
    pub clock: String,
}

fn cuda_events() -> String {
    "cuda_events".into()
}

impl Timing {
    /// `trials` calls of `ms` each, on `clock` (a figure given rather than
    /// measured: tests, and rules checked against one time).
    pub fn constant(ms: f64, trials: u32, clock: &str) -> Timing {
        Timing {
            mean_ms: ms,
            median_ms: ms,
            std_ms: 0.0,
            min_ms: ms,
            max_ms: ms,
            trials,
            clock: clock.into(),
        }
    }
}

/// A baseline's timing, or why it has none.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Baseline {
    /// The timing.
    #[serde(flatten)]
    pub timing: Option<Timing>,
    /// Why it could not be timed (torch.compile failed, …).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Read from the baseline cache instead of measured now.
    #[serde(default)]
    pub cached: bool,
    /// When it was measured (UTC).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub measured_at: Option<String>,
    /// Timed trial by trial beside the candidate (eager), instead of alone
    /// before any candidate code ran.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub paired: bool,
    /// Paired: the mean of the timing alone, which bounds the paired one.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub alone_mean_ms: Option<f64>,
    /// Why the timing alone was used where a paired one was taken.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
}

/// The correctness checks' figures.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Correctness {
    /// Trials run (each with fresh inputs).
    pub trials: u32,
    /// Largest absolute error.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "float::option"
    )]
    pub max_abs_err: Option<f64>,
    /// Largest absolute error over the largest reference magnitude.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        with = "float::option"
    )]
    pub rel_to_scale: Option<f64>,
    /// First element outside tolerance: its index, expected and got.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bad: Option<BadElement>,
    /// Elements compared per output, where not all were (the f64 reference
    /// samples large outputs).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub elements_checked: Option<u64>,
}

/// One element outside tolerance.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct BadElement {
    /// Its index, one entry per dimension.
    pub index: Vec<u64>,
    /// The reference's value.
    #[serde(with = "float")]
    pub expected: f64,
    /// The candidate's value.
    #[serde(with = "float")]
    pub got: f64,
}

/// JSON has no NaN or infinities, and a wrong output is full of them:
/// non-finite floats are written as the strings `NaN`, `inf`, `-inf`.
mod float {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(x: &f64, s: S) -> Result<S::Ok, S::Error> {
        if x.is_finite() {
            s.serialize_f64(*x)
        } else {
            s.serialize_str(&x.to_string())
        }
    }

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Float {
        Number(f64),
        Text(String),
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<f64, D::Error> {
        match Float::deserialize(d)? {
            Float::Number(x) => Ok(x),
            Float::Text(t) => t.parse().map_err(serde::de::Error::custom),
        }
    }

    /// The same for optional floats.
    pub mod option {
        use serde::{Deserialize, Deserializer, Serializer};

        pub fn serialize<S: Serializer>(x: &Option<f64>, s: S) -> Result<S::Ok, S::Error> {
            match x {
                Some(x) => super::serialize(x, s),
                None => s.serialize_none(),
            }
        }

        pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
            match Option::<super::Float>::deserialize(d)? {
                None => Ok(None),
                Some(super::Float::Number(x)) => Ok(Some(x)),
                Some(super::Float::Text(t)) => {
                    t.parse().map(Some).map_err(serde::de::Error::custom)
                }
            }
        }
    }
}

/// One kernel's resources, from ptxas or the kernel object.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct KernelReport {
    /// Kernel name.
    pub name: String,
    /// Where the figures come from: `nvrtc`, `cupy`, `triton`.
    pub source: String,
    /// Registers per thread.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub registers: Option<u32>,
    /// Static shared memory per block, bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub shared_bytes: Option<u32>,
    /// Local memory per thread (stack and spills), bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub local_bytes: Option<u32>,
    /// Spilled bytes (stores + loads) or spilled registers (Triton).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub spills: Option<u32>,
    /// Theoretical occupancy at the launch's block size, 0–1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub occupancy: Option<f64>,
    /// The block size (threads) the occupancy is for.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_threads: Option<u32>,
}

/// Achieved rates against the device's roofline.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Achieved {
    /// Minimum bytes over the candidate's mean time, GB/s.
    pub bandwidth_gbps: f64,
    /// FLOPs over the candidate's mean time, TFLOP/s.
    pub tflops: f64,
    /// The roofline's lower bound on the time, ms.
    pub roofline_ms: f64,
    /// Roofline time over the candidate's mean time (1 = at the roofline).
    pub roofline_fraction: f64,
    /// The device the roofline is for.
    pub device: String,
}

/// What kept the candidate from the judge, and what the judge checked,
/// as the worker reports it.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct Integrity {
    /// What held between the candidate's process and the judge (`a process
    /// of its own`, `user id N`, the Landlock rules).
    #[serde(default)]
    pub confinement: Vec<String>,
    /// Whether the problem's model keeps state across calls, so that the
    /// judge mirrored every call of the candidate's, in order, on a fresh
    /// model of its own for each call's reference (lockstep).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub lockstep: bool,
    /// The trial on inputs from a normal distribution: `passed`, or why it
    /// was skipped.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub second_distribution: Option<String>,
    /// Calls in the timing phase (warm-ups, timed, checked and watched).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub calls: Option<u32>,
    /// Warm-up calls among them.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub warmup: Option<u32>,
    /// Calls whose outputs the judge compared, chosen at random.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub checked: Option<u32>,
    /// Calls run with the watchers on (torch ops, swallowed exceptions).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub watched: Option<u32>,
    /// Steps on which eager ran beside the candidate (0: not paired).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eager_beside: Option<u32>,
    /// The span of a call that does nothing, subtracted from every call's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub null_ms: Option<f64>,
    /// The judge's step after a call of the reference's (median): what a
    /// call's own step takes beyond it is work left running, and counts.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seal_ms: Option<f64>,
    /// The judge's L2 flush right after the candidate's calls (median; of
    /// every flush while its process lived where eager was not beside it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub flush_ms: Option<f64>,
    /// How long, on average per step, the judge's flushes waited for the
    /// GPU beyond a flush with no candidate: charged to the candidate's
    /// call of the step (work it left running between calls), ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub between_ms: Option<f64>,
    /// The native evaluator: the seed of the output elements it sampled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub sample_seed: Option<u64>,
    /// Implausible: the time no implementation can beat on this GPU, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub floor_ms: Option<f64>,
}

/// Times below the floor divided by this are implausible: the datasheet's
/// peak rates with a quarter to spare.
pub const PLAUSIBLE_MARGIN: f64 = 1.25;

/// Everything one evaluation found.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Outcome {
    /// Which evaluator.
    pub evaluator: EvaluatorKind,
    /// The verdict.
    pub status: Status,
    /// The device it ran on, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub device: Option<String>,
    /// The error or traceback's last line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why it is incorrect, or why it was not run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// The compiler's log (NVRTC), where the evaluator compiled.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile_log: Option<String>,
    /// Seconds to compile or load the candidate.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_seconds: Option<f64>,
    /// The correctness figures.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub correctness: Option<Correctness>,
    /// The candidate's timing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<Timing>,
    /// The baselines, by name (`eager`, `compile`).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub baselines: BTreeMap<String, Baseline>,
    /// Achieved rates and the fraction of roofline.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub achieved: Option<Achieved>,
    /// Per-kernel resources.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub kernels: Vec<KernelReport>,
    /// The torch (aten) ops the candidate ran, with counts: library calls.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub torch_ops: BTreeMap<String, u32>,
    /// Wall-clock seconds of the whole evaluation, as the caller saw it.
    #[serde(default)]
    pub wall_seconds: f64,
    /// Seconds per phase, as the evaluator saw them: `reference` (the
    /// problem's side, zero when cached), `load`, `check`, `timing`.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub phases: BTreeMap<String, f64>,
    /// Whether the problem's reference outputs are TF32-rounded (the
    /// worker found them more than KernelBench's 1e-4 away from the same
    /// forward with TF32 off: cuDNN convolutions under torch's default
    /// switches). An exact float32 kernel cannot meet the tolerance then.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reference_tf32: bool,
    /// Whether the candidate was judged with the reference outputs
    /// recomputed for each check: it ran out of GPU memory beside the
    /// outputs kept for the checks, and was judged once more without them.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub references_recomputed: bool,
    /// The check that failed (`correctness_trial`, `second_distribution`,
    /// `timed_call`, `mutation`, `fallback`, `strict`, `scaled_parameters`,
    /// `work_between_calls`, `implausible`), where one did.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub failed_check: Option<String>,
    /// What kept the candidate apart and what was checked.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub integrity: Option<Integrity>,
    /// The timed calls of a screen, where this outcome is one: a short
    /// judgement (KernelBench's first correctness trial, a few timed calls,
    /// no eager beside) that ranks candidates, never the full protocol's
    /// figures ([`Outcome::is_full`]).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub screen: Option<u32>,
}

impl Outcome {
    /// An outcome with only a verdict.
    pub fn new(evaluator: EvaluatorKind, status: Status) -> Outcome {
        Outcome {
            evaluator,
            status,
            device: None,
            error: None,
            why: None,
            compile_log: None,
            load_seconds: None,
            correctness: None,
            runtime: None,
            baselines: BTreeMap::new(),
            achieved: None,
            kernels: Vec::new(),
            torch_ops: BTreeMap::new(),
            wall_seconds: 0.0,
            phases: BTreeMap::new(),
            reference_tf32: false,
            references_recomputed: false,
            failed_check: None,
            integrity: None,
            screen: None,
        }
    }

    /// Whether the outcome is the full protocol's (not a screen's): only
    /// such an outcome's figures are reported.
    pub fn is_full(&self) -> bool {
        self.screen.is_none()
    }

    /// Baseline mean over the candidate's mean, when both were timed by
    /// the full protocol (not a screen) and the time is plausible.
    pub fn speedup_vs(&self, baseline: &str) -> Option<f64> {
        if self.status == Status::Implausible || !self.is_full() {
            return None;
        }
        let b = self.baselines.get(baseline)?.timing.as_ref()?;
        Some(b.mean_ms / self.runtime.as_ref()?.mean_ms)
    }

    /// The math the problem allows a program: float32 everywhere, and
    /// convolutions at the TF32 rate only where the reference's own ran on
    /// TF32 ([`Outcome::reference_tf32`]). Where the reference is exact
    /// float32, a TF32 convolution misses the tolerance, and convolutions
    /// take the CUDA-core FP32 rate, as float32 matrix products do.
    pub fn problem_math(&self) -> MathMode {
        MathMode {
            allow_tf32: false,
            conv_tf32: self.reference_tf32,
            split_tf32: false,
        }
    }

    /// Fills [`Outcome::achieved`] from the problem's graph and the
    /// device's roofline under [`Outcome::problem_math`], when the
    /// candidate was timed on a GPU. Bytes are the fused minimum (inputs,
    /// parameters and outputs once).
    ///
    /// A correct outcome whose time is below [`plausible_floor`] divided by
    /// [`PLAUSIBLE_MARGIN`] becomes [`Status::Implausible`], with the floor
    /// in its integrity report and its figures kept.
    pub fn add_roofline(&mut self, graph: &OpGraph, device: &DeviceSpec) {
        let Some(rt) = &self.runtime else { return };
        if !matches!(rt.clock.as_str(), "cuda_events" | "judge") {
            return;
        }
        let floor_ms = plausible_floor(graph, device) * 1e3;
        if self.status == Status::Correct && rt.mean_ms < floor_ms / PLAUSIBLE_MARGIN {
            self.status = Status::Implausible;
            self.failed_check = Some("implausible".into());
            self.why = Some(format!(
                "{:.4} ms a call is below what the {} can do at all: {floor_ms:.4} ms at its peak rates (fastest math the tolerance allows, outputs beyond L2 written once), with a margin of {PLAUSIBLE_MARGIN}x; the time is not counted",
                rt.mean_ms, device.name
            ));
            self.integrity
                .get_or_insert_with(Integrity::default)
                .floor_ms = Some(floor_ms);
        }
        if rt.mean_ms <= 0.0 {
            return;
        }
        let roof = roofline(graph, device, self.problem_math());
        let seconds = rt.mean_ms * 1e-3;
        self.achieved = Some(Achieved {
            bandwidth_gbps: roof.cost.fused_bytes as f64 / seconds / 1e9,
            tflops: roof.cost.unfused.flops as f64 / seconds / 1e12,
            roofline_ms: roof.time_s * 1e3,
            roofline_fraction: roof.time_s / seconds,
            device: device.name.clone(),
        });
    }
}

/// Seconds no implementation of `graph` can beat on `device`: its FLOPs at
/// the fastest math a float problem's tolerance could allow (TF32 or half
/// precision on tensor cores; convolutions left out, which Winograd and FFT
/// algorithms compute with fewer), or writing the outputs that do not fit in
/// L2 once at peak bandwidth, whichever is longer. Outputs that can be views
/// of inputs (a reshape, transpose, broadcast, slice or `contiguous` of one)
/// write nothing. Every figure is the datasheet's, so a real kernel stays
/// above it.
pub fn plausible_floor(graph: &OpGraph, device: &DeviceSpec) -> f64 {
    use mtmc_actions::op::{Layout, Op, OpClass};
    let fastest = MathMode {
        allow_tf32: true,
        conv_tf32: true,
        split_tf32: false,
    };
    let mut compute_s = 0.0;
    for (id, node) in graph.nodes() {
        if node.op.class() == OpClass::Conv {
            continue;
        }
        let cost = mtmc_actions::cost::node_cost(graph, id);
        if !cost.exact {
            continue;
        }
        let dtype = mtmc_actions::device::node_dtype(graph, id);
        compute_s += cost.flops as f64 / device.rate(node.op.class(), dtype, fastest);
    }
    let mut written: Vec<_> = graph.outputs().to_vec();
    written.sort_by_key(|t| (t.node, t.output));
    written.dedup();
    let mut out_bytes = 0u64;
    for t in written {
        let mut node = t.node;
        // A view of a source writes nothing.
        loop {
            let n = graph.node(node);
            if n.op.is_source() {
                break;
            }
            if !matches!(
                n.op,
                Op::Layout(
                    Layout::Reshape
                        | Layout::Permute { .. }
                        | Layout::Expand
                        | Layout::Slice { .. }
                        | Layout::Copy
                )
            ) {
                out_bytes += graph.tensor(t).bytes();
                break;
            }
            match graph.inputs(node).first() {
                Some(src) => node = src.node,
                None => break,
            }
        }
    }
    let l2 = device.l2_mib * 1024.0 * 1024.0;
    let memory_s = (out_bytes as f64 - l2).max(0.0) / device.bandwidth();
    compute_s.max(memory_s)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A time the worker wrote (Python's shortest repr) reads back as the
    /// same double and is written again with the same digits: a report
    /// and the baseline cache it was taken from agree to the last digit.
    #[test]
    fn times_are_read_and_written_to_the_last_digit() {
        for text in [
            "3.1685925499912146",
            "0.30000000000000004",
            "1.7976931348623157e308",
        ] {
            let x: f64 = text.parse().unwrap();
            let read: f64 = serde_json::from_str(text).unwrap();
            assert_eq!(read.to_bits(), x.to_bits(), "{text}");
            assert_eq!(
                serde_json::to_string(&read)
                    .unwrap()
                    .parse::<f64>()
                    .unwrap(),
                x
            );
        }
    }

    #[test]
    fn non_finite_figures_survive_json() {
        let mut o = Outcome::new(EvaluatorKind::Native, Status::Incorrect);
        o.correctness = Some(Correctness {
            trials: 1,
            max_abs_err: Some(f64::INFINITY),
            rel_to_scale: Some(f64::NAN),
            first_bad: Some(BadElement {
                index: vec![3, 5],
                expected: 0.25,
                got: f64::NAN,
            }),
            elements_checked: Some(10),
        });
        let text = serde_json::to_string(&o).unwrap();
        assert!(text.contains(r#""got":"NaN""#), "{text}");
        let back: Outcome = serde_json::from_str(&text).unwrap();
        let c = back.correctness.unwrap();
        assert_eq!(c.max_abs_err, Some(f64::INFINITY));
        assert!(c.rel_to_scale.unwrap().is_nan());
        let bad = c.first_bad.unwrap();
        assert_eq!((bad.expected, bad.got.is_nan()), (0.25, true));
    }

    fn timed(mean_ms: f64, clock: &str) -> Outcome {
        let mut o = Outcome::new(EvaluatorKind::Worker, Status::Correct);
        o.runtime = Some(Timing::constant(mean_ms, 100, clock));
        o
    }

    /// L1/19: ReLU over 4096 × 393216 floats, 6.4 GB written.
    fn relu_graph(reshape_only: bool) -> OpGraph {
        use mtmc_actions::op::{Layout, Op, UnaryOp};
        use mtmc_actions::{DType, TensorType};
        let t = TensorType::new(vec![4096, 393216], DType::F32);
        let mut g = OpGraph::new();
        let x = g.add_input("x", t.clone());
        let op = if reshape_only {
            Op::Layout(Layout::Reshape)
        } else {
            Op::Unary(UnaryOp::Relu)
        };
        let y = g.add("y", op, &[x], vec![t]);
        g.set_outputs(vec![mtmc_actions::TensorRef::first(y.unwrap())]);
        g
    }

    #[test]
    fn a_time_below_what_the_gpu_can_do_is_implausible_and_never_a_speedup() {
        let specs = mtmc_actions::device::builtin_devices();
        let h200 = mtmc_actions::device::find_device(&specs, "H200").unwrap();
        let g = relu_graph(false);
        // Writing 6.4 GB less the 60 MiB of L2 at 4.8 TB/s.
        let floor = plausible_floor(&g, h200) * 1e3;
        let expected = (4096.0 * 393216.0 * 4.0 - 60.0 * 1024.0 * 1024.0) / 4.8e12 * 1e3;
        assert!((floor - expected).abs() < 1e-9, "{floor} vs {expected}");
        // An honest ReLU (3.1 ms on an H200) stands.
        let mut honest = timed(3.1, "judge");
        honest.baselines.insert(
            "eager".into(),
            Baseline {
                timing: honest.runtime.clone(),
                ..Baseline::default()
            },
        );
        honest.add_roofline(&g, h200);
        assert_eq!(honest.status, Status::Correct);
        assert_eq!(honest.speedup_vs("eager"), Some(1.0));
        // 146x faster than that is below the floor with its margin.
        let mut fast = timed(3.1 / 146.0, "judge");
        fast.baselines = honest.baselines.clone();
        fast.add_roofline(&g, h200);
        assert_eq!(fast.status, Status::Implausible);
        assert_eq!(fast.failed_check.as_deref(), Some("implausible"));
        assert_eq!(fast.speedup_vs("eager"), None);
        assert!(fast.runtime.is_some(), "the figures are kept");
        let why = fast.why.unwrap();
        assert!(why.contains("below what the H200 can do at all"), "{why}");
        assert!((fast.integrity.unwrap().floor_ms.unwrap() - floor).abs() < 1e-12);
        // Just above the floor with its margin: not refused.
        let mut edge = timed(floor / PLAUSIBLE_MARGIN * 1.01, "judge");
        edge.add_roofline(&g, h200);
        assert_eq!(edge.status, Status::Correct);
        // Host timings (tests on the CPU) are never judged against a GPU.
        let mut host = timed(1e-6, "host");
        host.add_roofline(&g, h200);
        assert_eq!(host.status, Status::Correct);
    }

    #[test]
    fn an_output_that_is_a_view_of_an_input_has_no_floor() {
        let specs = mtmc_actions::device::builtin_devices();
        let h200 = mtmc_actions::device::find_device(&specs, "H200").unwrap();
        assert_eq!(plausible_floor(&relu_graph(true), h200), 0.0);
    }

    /// L2/57's convolution: 128 × 8 × 128 × 128 in, 64 channels of 3 × 3.
    fn few_channel_convolution() -> OpGraph {
        use mtmc_actions::op::{Conv, Op};
        use mtmc_actions::{DType, TensorType};
        let t = |s: &[u64]| TensorType::new(s.to_vec(), DType::F32);
        let mut g = OpGraph::new();
        let x = g.add_input("x", t(&[128, 8, 128, 128]));
        let w = g.add_param("w", t(&[64, 8, 3, 3]));
        let conv = Op::Conv(Conv::dense(&[3, 3]));
        let y = g.add("y", conv, &[x, w], vec![t(&[128, 64, 126, 126])]);
        g.set_outputs(vec![mtmc_actions::TensorRef::first(y.unwrap())]);
        g
    }

    #[test]
    fn the_roofline_runs_convolutions_at_tf32_only_where_the_reference_did() {
        let specs = mtmc_actions::device::builtin_devices();
        let h100 = mtmc_actions::device::find_device(&specs, "H100").unwrap();
        let g = few_channel_convolution();
        let flops = 2.0 * (128.0 * 64.0 * 126.0 * 126.0) * 8.0 * 9.0;
        let achieved = |reference_tf32: bool| {
            let mut o = Outcome::new(EvaluatorKind::Worker, Status::Correct);
            o.reference_tf32 = reference_tf32;
            o.runtime = Some(Timing::constant(1.0, 100, "cuda_events"));
            o.add_roofline(&g, h100);
            let bound = roofline(&g, h100, o.problem_math()).bound;
            (o.achieved.unwrap().roofline_ms, bound)
        };
        // An exact float32 reference: the convolution's FLOPs at the FP32
        // rate bind.
        let (ms, bound) = achieved(false);
        assert!((ms - flops / 66.9e12 * 1e3).abs() < 1e-9, "{ms}");
        assert_eq!(bound, mtmc_actions::device::Bound::Compute);
        // A TF32 reference: the same FLOPs on tensor cores take less than
        // moving the input and output once, and the bytes bind.
        let (ms, bound) = achieved(true);
        let bytes =
            4.0 * (128.0 * 8.0 * 128.0 * 128.0 + 64.0 * 8.0 * 9.0 + 128.0 * 64.0 * 126.0 * 126.0);
        assert!((ms - bytes / 3350e9 * 1e3).abs() < 1e-9, "{ms}");
        assert_eq!(bound, mtmc_actions::device::Bound::Memory);
    }
}

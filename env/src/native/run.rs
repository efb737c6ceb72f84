//! The native child's work on the GPU: compile, load, launch, check, time.
//! The only module of the evaluator with `unsafe`: kernel launches and
//! stream-ordered memsets through cudarc's raw calls.
#![allow(unsafe_code)]

use std::collections::HashMap;
use std::sync::Arc;
use std::time::Instant;

use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, DevicePtr, DriverError, LaunchConfig,
    PushKernelArg, result, sys,
};
use cudarc::nvrtc::Ptx;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{BinaryOp, Op, UnaryOp};
use serde::Deserialize;

use super::{Arg, CudaProgram, graph_inputs};
use crate::nvrtc::{self, Arch, CompileUnit, SmLimits};
use crate::outcome::{
    BadElement, Correctness, EvaluatorKind, Integrity, KernelReport, Outcome, Status, Timing,
};
use crate::reference::{Reference, Rng, Values, elements_to_check, unravel};

/// The protocol's numbers, as the request carries them.
#[derive(Clone, Debug, Deserialize)]
pub struct Settings {
    #[serde(default = "seed")]
    seed: u64,
    #[serde(default = "five")]
    correctness_trials: u32,
    #[serde(default = "three")]
    warmup: u32,
    #[serde(default = "hundred")]
    trials: u32,
    #[serde(default = "tolerance")]
    atol: f64,
    #[serde(default = "tolerance")]
    rtol: f64,
    /// The seed of the sampled elements (fresh in every evaluation when
    /// absent).
    #[serde(default)]
    sample_seed: Option<u64>,
}

fn seed() -> u64 {
    42
}
fn five() -> u32 {
    5
}
fn three() -> u32 {
    3
}
fn hundred() -> u32 {
    100
}
fn tolerance() -> f64 {
    1e-4
}

/// Bytes written before every timed run: more than the H100's and H200's
/// L2 (50 MB and 60 MB), so that no run starts with its data cached.
const FLUSH_BYTES: usize = 256 << 20;

/// Elements of an output checked whole up to this count; beyond it, the
/// edges and `SAMPLED` random ones.
const CHECK_ALL_UP_TO: usize = 1 << 16;
const SAMPLED: usize = 4096;

/// The GPU this child runs on.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    name: String,
    arch: Arch,
    flush: CudaSlice<u8>,
}

impl Gpu {
    /// Opens GPU 0 (the parent chose it with `CUDA_VISIBLE_DEVICES`).
    pub fn open() -> Result<Gpu, String> {
        // SAFETY: only tries to dlopen the driver library by its known names.
        if !unsafe { sys::is_culib_present() } {
            return Err("libcuda (the NVIDIA driver library) is not found: the native evaluator needs a GPU".into());
        }
        let ctx = CudaContext::new(0).map_err(|e| format!("no CUDA device: {e}"))?;
        let name = ctx.name().map_err(|e| e.to_string())?;
        let (major, minor) = ctx.compute_capability().map_err(|e| e.to_string())?;
        let stream = ctx.default_stream();
        let flush = stream
            .alloc_zeros::<u8>(FLUSH_BYTES)
            .map_err(|e| e.to_string())?;
        Ok(Gpu {
            ctx,
            stream,
            name,
            arch: Arch {
                major: major as u32,
                minor: minor as u32,
            },
            flush,
        })
    }
}

/// A CUDA error after which the context cannot be used again.
fn fatal(e: &DriverError) -> bool {
    use sys::cudaError_enum as E;
    !matches!(
        e.0,
        E::CUDA_ERROR_INVALID_VALUE
            | E::CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES
            | E::CUDA_ERROR_INVALID_HANDLE
            | E::CUDA_ERROR_NOT_FOUND
            | E::CUDA_ERROR_OUT_OF_MEMORY
    )
}

fn memset(stream: &CudaStream, buf: &CudaSlice<u8>, value: u8) -> Result<(), DriverError> {
    let (ptr, _sync) = buf.device_ptr(stream);
    // SAFETY: `ptr` is a live allocation of `buf.len()` bytes made on this
    // stream's context; any byte pattern is valid for the raw bytes.
    unsafe { result::memset_d8_async(ptr, value, buf.len(), stream.cu_stream()) }
}

enum Scalar {
    I64(i64),
    I32(i32),
    U32(u32),
    F32(f32),
}

struct Loaded<'p> {
    program: &'p CudaProgram,
    functions: HashMap<String, CudaFunction>,
    buffers: HashMap<String, CudaSlice<u8>>,
}

impl Loaded<'_> {
    /// Every launch of the plan, in order, on the stream.
    fn launch_all(&self, stream: &Arc<CudaStream>) -> Result<(), DriverError> {
        for l in &self.program.launches {
            let scalars: Vec<Scalar> = l
                .args
                .iter()
                .filter_map(|a| match a {
                    Arg::Buffer(_) => None,
                    Arg::I64(v) => Some(Scalar::I64(*v)),
                    Arg::I32(v) => Some(Scalar::I32(*v)),
                    Arg::U32(v) => Some(Scalar::U32(*v)),
                    Arg::F32(v) => Some(Scalar::F32(*v)),
                })
                .collect();
            let mut b = stream.launch_builder(&self.functions[&l.kernel]);
            let mut next = scalars.iter();
            for a in &l.args {
                match a {
                    Arg::Buffer(name) => {
                        b.arg(&self.buffers[name]);
                    }
                    _ => match next.next().expect("one scalar per scalar argument") {
                        Scalar::I64(v) => {
                            b.arg(v);
                        }
                        Scalar::I32(v) => {
                            b.arg(v);
                        }
                        Scalar::U32(v) => {
                            b.arg(v);
                        }
                        Scalar::F32(v) => {
                            b.arg(v);
                        }
                    },
                }
            }
            let cfg = LaunchConfig {
                grid_dim: (l.grid[0], l.grid[1], l.grid[2]),
                block_dim: (l.block[0], l.block[1], l.block[2]),
                shared_mem_bytes: l.shared_bytes,
            };
            // SAFETY: the kernel reads the arguments the program declares;
            // a program whose arguments do not match its kernel can fault
            // the GPU, which costs this child process only (the parent
            // replaces it).
            unsafe { b.launch(cfg) }?;
        }
        Ok(())
    }

    fn poison_outputs(&self, stream: &CudaStream) -> Result<(), DriverError> {
        for b in &self.program.buffers {
            if b.input.is_none() {
                // All bits set: NaN as float32, so an element the program
                // never writes cannot pass.
                memset(stream, &self.buffers[&b.name], 0xFF)?;
            }
        }
        Ok(())
    }
}

/// Inputs drawn from a log/sqrt-safe range when the graph needs positive
/// values, else from [-1, 1): never zeros, and both signs where allowed.
fn input_range(g: &OpGraph) -> (f64, f64) {
    let positive = g.nodes().any(|(_, n)| {
        matches!(
            n.op,
            Op::Unary(UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt)
                | Op::Binary(BinaryOp::Pow)
                | Op::Scalar {
                    op: BinaryOp::Pow,
                    ..
                }
        )
    });
    if positive { (0.1, 1.1) } else { (-1.0, 1.0) }
}

/// How a trial's inputs are drawn.
#[derive(Clone, Copy, PartialEq)]
enum Draw {
    /// Uniform over [`input_range`].
    Uniform,
    /// Standard normal, as KernelBench's `torch.randn` draws (only where
    /// the graph takes inputs of either sign).
    Normal,
}

fn draw_inputs(g: &OpGraph, seed: u64, draw: Draw) -> Vec<(String, Vec<f32>)> {
    let (lo, hi) = input_range(g);
    graph_inputs(g)
        .into_iter()
        .enumerate()
        .map(|(k, (name, ty))| {
            let mut rng = Rng::new(seed ^ (0x9E37_79B9 * (k as u64 + 1)));
            let v = (0..ty.numel())
                .map(|_| match draw {
                    Draw::Uniform => rng.uniform(lo, hi) as f32,
                    Draw::Normal => rng.normal() as f32,
                })
                .collect();
            (name, v)
        })
        .collect()
}

/// A seed no candidate can know ahead: the clock and the process id mixed,
/// for the elements each evaluation samples.
fn fresh_seed() -> u64 {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    Rng::new(now ^ (u64::from(std::process::id()) << 32)).next_u64()
}

fn to_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_ne_bytes()).collect()
}

fn from_bytes(b: &[u8]) -> Vec<f32> {
    b.chunks_exact(4)
        .map(|c| f32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// What one check of the outputs found.
struct Check {
    max_abs: f64,
    scale: f64,
    checked: u64,
    bad: Option<(usize, Vec<u64>, f64, f64)>,
}

fn check_outputs(
    g: &OpGraph,
    inputs: &[(String, Vec<f32>)],
    outputs: &[Vec<f32>],
    s: &Settings,
    rng: &mut Rng,
) -> Result<Check, String> {
    let values: HashMap<String, Values> = inputs
        .iter()
        .map(|(n, v)| (n.clone(), Values::F32(v)))
        .collect();
    let mut r = Reference::with_values(g, &values).map_err(|e| e.to_string())?;
    let mut c = Check {
        max_abs: 0.0,
        scale: 0.0,
        checked: 0,
        bad: None,
    };
    for (k, out) in outputs.iter().enumerate() {
        let t = g.outputs()[k];
        let shape: Vec<usize> = g.tensor(t).shape.iter().map(|&d| d as usize).collect();
        for i in elements_to_check(&shape, CHECK_ALL_UP_TO, SAMPLED, rng) {
            let expected = r.element(t, i).map_err(|e| e.to_string())?;
            let got = f64::from(out[i]);
            let diff = (got - expected).abs();
            c.checked += 1;
            c.scale = c.scale.max(if expected.is_finite() {
                expected.abs()
            } else {
                0.0
            });
            c.max_abs = c
                .max_abs
                .max(if diff.is_nan() { f64::INFINITY } else { diff });
            let close = diff <= s.atol + s.rtol * expected.abs() || (got == expected);
            if !close && c.bad.is_none() {
                let index = unravel(i, &shape).into_iter().map(|x| x as u64).collect();
                c.bad = Some((k, index, expected, got));
            }
        }
    }
    Ok(c)
}

/// Judges `program` on `graph`. The flag says whether the CUDA context was
/// lost (the parent then replaces this process).
pub fn evaluate(
    gpu: &Gpu,
    graph: &OpGraph,
    program: &CudaProgram,
    s: &Settings,
) -> (Outcome, bool) {
    let mut o = Outcome::new(EvaluatorKind::Native, Status::CompileError);
    o.device = Some(gpu.name.clone());
    match run(gpu, graph, program, s, &mut o) {
        Ok(()) => (o, false),
        Err(Failure::Driver(e)) => {
            o.status = Status::RuntimeError;
            o.error = Some(format!("{e:?}"));
            o.runtime = None;
            let lost = fatal(&e);
            (o, lost)
        }
        Err(Failure::Judged) => (o, false),
    }
}

enum Failure {
    /// A CUDA call failed.
    Driver(DriverError),
    /// The outcome says why (compile error, incorrect, …).
    Judged,
}

impl From<DriverError> for Failure {
    fn from(e: DriverError) -> Failure {
        Failure::Driver(e)
    }
}

fn judged(o: &mut Outcome, status: Status, text: String) -> Failure {
    o.status = status;
    if status == Status::Incorrect {
        o.why = Some(text);
    } else {
        o.error = Some(text);
    }
    Failure::Judged
}

fn run(
    gpu: &Gpu,
    g: &OpGraph,
    p: &CudaProgram,
    s: &Settings,
    o: &mut Outcome,
) -> Result<(), Failure> {
    if let Err(e) = p.check(g) {
        return Err(judged(
            o,
            Status::CompileError,
            format!("the launch plan does not fit the problem: {e}"),
        ));
    }
    // The reference must be able to judge before anything runs.
    let zeros: Vec<(String, Vec<f32>)> = graph_inputs(g)
        .into_iter()
        .map(|(n, ty)| (n, vec![0.5; ty.numel() as usize]))
        .collect();
    let values: HashMap<String, Values> = zeros
        .iter()
        .map(|(n, v)| (n.clone(), Values::F32(v)))
        .collect();
    let mut probe = Reference::with_values(g, &values)
        .map_err(|e| judged(o, Status::CompileError, e.to_string()))?;
    for &t in g.outputs() {
        probe
            .element(t, 0)
            .map_err(|e| judged(o, Status::CompileError, e.to_string()))?;
    }

    let began = Instant::now();
    let unit = CompileUnit {
        name: "program.cu".into(),
        source: p.source.clone(),
    };
    let report = nvrtc::compile(&unit, gpu.arch)
        .map_err(|e| judged(o, Status::CompileError, e.to_string()))?;
    o.compile_log = Some(report.log.clone());
    if !report.ok {
        let first = report
            .diagnostics
            .iter()
            .find(|d| d.severity == "error")
            .map_or("the program does not compile".to_string(), |d| {
                match d.line {
                    Some(line) => format!("program.cu:{line}: {}", d.message),
                    None => d.message.clone(),
                }
            });
        return Err(judged(o, Status::CompileError, first));
    }
    o.kernels = report
        .kernels
        .iter()
        .map(|k| KernelReport {
            name: k.name.clone(),
            source: "nvrtc".into(),
            registers: Some(k.registers),
            shared_bytes: Some(k.shared_bytes),
            local_bytes: Some(k.stack_bytes),
            spills: Some(k.spill_store_bytes + k.spill_load_bytes),
            occupancy: p
                .block_threads(&k.name)
                .map(|b| nvrtc::occupancy(k, b, p.dynamic_shared(&k.name), SmLimits::SM90)),
            block_threads: p.block_threads(&k.name),
        })
        .collect();
    let cubin = report.cubin.clone().unwrap_or_default();
    let module = gpu.ctx.load_module(Ptx::from_binary(cubin)).map_err(|e| {
        judged(
            o,
            Status::CompileError,
            format!("the driver could not load the module: {e:?}"),
        )
    })?;
    let mut functions = HashMap::new();
    for l in &p.launches {
        if !functions.contains_key(&l.kernel) {
            let f = module.load_function(&l.kernel).map_err(|_| {
                judged(
                    o,
                    Status::CompileError,
                    format!(
                        "the source has no kernel `{}` (kernels are `extern \"C\" __global__`)",
                        l.kernel
                    ),
                )
            })?;
            // Past 48 KiB of dynamic shared memory a kernel opts in.
            let shared = p.dynamic_shared(&l.kernel);
            if shared > 48 * 1024 {
                f.set_attribute(
                    cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                    shared as i32,
                )
                .map_err(|e| {
                    judged(
                        o,
                        Status::RuntimeError,
                        format!("`{}` cannot have {shared} bytes of shared memory: {e:?}", l.kernel),
                    )
                })?;
            }
            functions.insert(l.kernel.clone(), f);
        }
    }
    let stream = &gpu.stream;
    let mut buffers = HashMap::new();
    let inputs_ty = graph_inputs(g);
    for b in &p.buffers {
        let bytes = if let Some(name) = &b.input {
            inputs_ty
                .iter()
                .find(|(n, _)| n == name)
                .expect("checked")
                .1
                .bytes()
        } else if let Some(k) = b.output {
            g.tensor(g.outputs()[k]).bytes()
        } else {
            b.bytes.expect("checked")
        };
        buffers.insert(
            b.name.clone(),
            stream.alloc_zeros::<u8>(bytes.max(1) as usize)?,
        );
    }
    let loaded = Loaded {
        program: p,
        functions,
        buffers,
    };
    o.load_seconds = Some(began.elapsed().as_secs_f64());

    let buffer_of_input = |name: &str| {
        p.buffers
            .iter()
            .find(|b| b.input.as_deref() == Some(name))
            .expect("checked")
            .name
            .clone()
    };
    let output_buffers: Vec<String> = (0..g.outputs().len())
        .map(|k| {
            p.buffers
                .iter()
                .find(|b| b.output == Some(k))
                .expect("checked")
                .name
                .clone()
        })
        .collect();
    let upload = |inputs: &[(String, Vec<f32>)], loaded: &mut Loaded| -> Result<(), DriverError> {
        for (name, v) in inputs {
            let buf = loaded
                .buffers
                .get_mut(&buffer_of_input(name))
                .expect("allocated");
            stream.memcpy_htod(&to_bytes(v), buf)?;
        }
        Ok(())
    };
    let mut loaded = loaded;
    let mut seeds = Rng::new(s.seed);
    let trial_seeds: Vec<u64> = (0..s.correctness_trials)
        .map(|_| seeds.next_u64())
        .collect();
    let after_timing_seed = seeds.next_u64();
    let normal_seed = seeds.next_u64();
    // The sampled elements differ in every evaluation (a kernel wrong only
    // where a fixed sample never looks cannot pass); the outcome keeps the
    // seed, and a request can fix it to judge the same elements again.
    let sample_seed = s.sample_seed.unwrap_or_else(fresh_seed);
    let mut sample = Rng::new(sample_seed);
    o.integrity = Some(Integrity {
        confinement: vec!["a process of its own (the native runner)".into()],
        sample_seed: Some(sample_seed),
        ..Integrity::default()
    });
    let checked_began = Instant::now();
    let mut correctness = Correctness::default();
    let mut max_abs: f64 = 0.0;
    let mut scale: f64 = 0.0;

    let judge_run = |inputs: &[(String, Vec<f32>)],
                     loaded: &Loaded,
                     sample: &mut Rng,
                     o: &mut Outcome,
                     after_timing: bool|
     -> Result<Check, Failure> {
        loaded.poison_outputs(stream)?;
        loaded.launch_all(stream)?;
        stream.synchronize()?;
        for (name, v) in inputs {
            let now = stream.clone_dtoh(&loaded.buffers[&buffer_of_input(name)])?;
            if now != to_bytes(v) {
                return Err(judged(
                    o,
                    Status::Incorrect,
                    format!("the program modified input `{name}`"),
                ));
            }
        }
        let outputs: Vec<Vec<f32>> = output_buffers
            .iter()
            .map(|b| {
                stream
                    .clone_dtoh(&loaded.buffers[b])
                    .map(|bytes| from_bytes(&bytes))
            })
            .collect::<Result<_, _>>()?;
        let c = check_outputs(g, inputs, &outputs, s, sample)
            .map_err(|e| judged(o, Status::CompileError, e))?;
        if let Some((k, index, expected, got)) = &c.bad {
            o.correctness = Some(Correctness {
                trials: 0,
                max_abs_err: Some(c.max_abs),
                rel_to_scale: (c.scale > 0.0).then(|| c.max_abs / c.scale),
                first_bad: Some(BadElement {
                    index: index.clone(),
                    expected: *expected,
                    got: *got,
                }),
                elements_checked: Some(c.checked),
            });
            let where_ = if output_buffers.len() > 1 {
                format!("output {k}: ")
            } else {
                String::new()
            };
            let when = if after_timing {
                "after timing, on new values in the same input buffers: "
            } else {
                ""
            };
            return Err(judged(
                o,
                Status::Incorrect,
                format!("{when}{where_}values differ from the f64 reference beyond tolerance"),
            ));
        }
        if c.scale > 0.0 && c.max_abs > 1e-2 * c.scale {
            return Err(judged(
                o,
                Status::Incorrect,
                format!(
                    "error is {:.2}% of the output's scale",
                    100.0 * c.max_abs / c.scale
                ),
            ));
        }
        Ok(c)
    };

    // KernelBench's trials, then one on normal inputs where the graph takes
    // inputs of either sign.
    let normal = input_range(g).0 < 0.0;
    let mut trials: Vec<(u64, Draw)> = trial_seeds.iter().map(|&t| (t, Draw::Uniform)).collect();
    if normal {
        trials.push((normal_seed, Draw::Normal));
    }
    for (n, &(seed, draw)) in trials.iter().enumerate() {
        let inputs = draw_inputs(g, seed, draw);
        upload(&inputs, &mut loaded)?;
        let c = judge_run(&inputs, &loaded, &mut sample, o, false).inspect_err(|_| {
            if let Some(c) = o.correctness.as_mut() {
                c.trials = n as u32 + 1;
            }
            if draw == Draw::Normal {
                o.failed_check = Some("second_distribution".into());
                if let Some(why) = o.why.as_mut() {
                    *why = format!("on inputs drawn from a normal distribution: {why}");
                }
            }
        })?;
        max_abs = max_abs.max(c.max_abs);
        scale = scale.max(c.scale);
        correctness.trials = n as u32 + 1;
        correctness.elements_checked = Some(correctness.elements_checked.unwrap_or(0) + c.checked);
    }
    correctness.max_abs_err = Some(max_abs);
    correctness.rel_to_scale = (scale > 0.0).then(|| max_abs / scale);
    if let Some(i) = o.integrity.as_mut() {
        i.second_distribution = Some(if normal {
            "passed".into()
        } else {
            "skipped: the graph takes positive inputs (log, sqrt, pow)".into()
        });
    }
    o.phases
        .insert("check".into(), checked_began.elapsed().as_secs_f64());

    // Timing, on the first trial's inputs.
    let timing_began = Instant::now();
    let inputs = draw_inputs(g, trial_seeds[0], Draw::Uniform);
    upload(&inputs, &mut loaded)?;
    for _ in 0..s.warmup {
        loaded.launch_all(stream)?;
    }
    stream.synchronize()?;
    let start = gpu
        .ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let end = gpu
        .ctx
        .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))?;
    let mut times = Vec::with_capacity(s.trials as usize);
    for k in 0..s.trials {
        memset(stream, &gpu.flush, (k % 251) as u8)?;
        start.record(stream)?;
        loaded.launch_all(stream)?;
        end.record(stream)?;
        end.synchronize()?;
        times.push(f64::from(start.elapsed_ms(&end)?));
    }
    o.phases
        .insert("timing".into(), timing_began.elapsed().as_secs_f64());

    // New values in the same buffers.
    let fresh = draw_inputs(g, after_timing_seed, Draw::Uniform);
    upload(&fresh, &mut loaded)?;
    judge_run(&fresh, &loaded, &mut sample, o, true)?;

    o.status = Status::Correct;
    o.correctness = Some(correctness);
    o.runtime = Some(stats(&times));
    Ok(())
}

fn stats(times: &[f64]) -> Timing {
    let n = times.len().max(1);
    let mean = times.iter().sum::<f64>() / n as f64;
    let mut sorted = times.to_vec();
    sorted.sort_by(f64::total_cmp);
    let median = if sorted.is_empty() {
        0.0
    } else if n % 2 == 1 {
        sorted[n / 2]
    } else {
        0.5 * (sorted[n / 2 - 1] + sorted[n / 2])
    };
    let var = times.iter().map(|t| (t - mean) * (t - mean)).sum::<f64>()
        / (n.saturating_sub(1).max(1)) as f64;
    Timing {
        mean_ms: mean,
        median_ms: median,
        std_ms: var.sqrt(),
        min_ms: sorted.first().copied().unwrap_or(0.0),
        max_ms: sorted.last().copied().unwrap_or(0.0),
        trials: times.len() as u32,
        clock: "cuda_events".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_evaluation_samples_other_elements() {
        // Two evaluations' seeds differ, and so do the elements they check
        // beyond the edges of a large output.
        let (a, b) = (fresh_seed(), fresh_seed());
        assert_ne!(a, b);
        let shape = [4096, 4096];
        let picked =
            |seed| elements_to_check(&shape, CHECK_ALL_UP_TO, SAMPLED, &mut Rng::new(seed));
        let (pa, pb) = (picked(a), picked(b));
        // The edges are checked in every evaluation; the 4096 sampled
        // beyond them are (nearly all) others.
        let only_a = pa.iter().filter(|i| pb.binary_search(i).is_err()).count();
        assert!(
            only_a > 4000,
            "{only_a} of {} elements in one only",
            pa.len()
        );
        // A fixed seed picks the same ones (a request can repeat a sample).
        assert_eq!(picked(a), pa);
    }

    #[test]
    fn normal_inputs_take_both_signs_and_the_usual_spread() {
        let mut g = OpGraph::new();
        let t = mtmc_actions::TensorType::new(vec![100_000], mtmc_actions::DType::F32);
        let x = g.add_input("x", t.clone());
        let y = g.add("y", Op::Unary(UnaryOp::Relu), &[x], vec![t]).unwrap();
        g.set_outputs(vec![mtmc_actions::TensorRef::first(y)]);
        let v = &draw_inputs(&g, 7, Draw::Normal)[0].1;
        let n = v.len() as f64;
        let mean = v.iter().map(|&x| f64::from(x)).sum::<f64>() / n;
        let var = v
            .iter()
            .map(|&x| (f64::from(x) - mean).powi(2))
            .sum::<f64>()
            / n;
        assert!(
            mean.abs() < 0.02 && (var - 1.0).abs() < 0.03,
            "{mean} {var}"
        );
        assert!(v.iter().any(|&x| x < -2.0) && v.iter().any(|&x| x > 2.0));
    }
}

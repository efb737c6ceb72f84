//! The evaluators behind one interface: a candidate goes in, an
//! [`Outcome`] comes out.
//!
//! - [`WorkerEvaluator`]: the Python worker runs the KernelBench protocol
//!   against the problem's PyTorch model (CUDA through cupy/NVRTC, Triton).
//! - [`NativeEvaluator`]: CUDA programs with a launch plan, through cudarc
//!   in a child process, against the f64 CPU reference (intents, and
//!   KernelBench problems whose graph it can compute).
//! - [`CompileOnly`]: for machines without a GPU: every CUDA source of the
//!   candidate is compiled with NVRTC and its kernels' resources are read;
//!   the outcome says that nothing was run.
//!
//! Which ones a machine has is [`available`]'s answer (`mtmc doctor`).

use std::future::Future;
use std::path::PathBuf;
use std::time::{Duration, Instant};

pub use crate::error::EvalError;
use crate::native::{CudaProgram, GraphSource, NativeEvaluator};
use crate::nvrtc::{self, Arch, CompileUnit, KernelResources, NvrtcError, SmLimits};
use crate::outcome::{EvaluatorKind, KernelReport, Outcome, Status};
use crate::worker::{self, Protocol, WorkerError, WorkerSlot};

/// A problem as the evaluators see it.
#[derive(Clone, Debug)]
pub struct ProblemSource {
    /// File name, for messages (`19_ReLU.py`).
    pub name: String,
    /// The PyTorch program defining `Model`, `get_inputs`, `get_init_inputs`
    /// (empty for an intent).
    pub code: String,
    /// Where its op graph comes from, for the native evaluator's f64
    /// reference.
    pub graph: Option<GraphSource>,
}

/// What is evaluated.
#[derive(Clone, Debug)]
pub enum Candidate {
    /// A Python file defining `ModelNew` (its kernels compiled with NVRTC
    /// through cupy, or Triton).
    Python {
        /// File name.
        name: String,
        /// Source.
        code: String,
    },
    /// CUDA kernels with their launch plan (the native evaluator).
    Cuda {
        /// File name.
        name: String,
        /// The program.
        program: CudaProgram,
    },
}

impl Candidate {
    /// The candidate's name.
    pub fn name(&self) -> &str {
        match self {
            Candidate::Python { name, .. } | Candidate::Cuda { name, .. } => name,
        }
    }
}

/// One way of judging candidates.
pub trait Evaluator {
    /// Which evaluator this is.
    fn kind(&self) -> EvaluatorKind;

    /// Evaluates `candidate` on `problem`.
    fn evaluate(
        &mut self,
        problem: &ProblemSource,
        candidate: &Candidate,
    ) -> impl Future<Output = Result<Outcome, EvalError>>;
}

/// Where candidates run, and how inputs are made.
#[derive(Clone, Debug)]
pub struct WorkerSettings {
    /// The KernelBench protocol's numbers.
    pub protocol: Protocol,
    /// Baselines to time (`eager`, `compile`).
    pub baselines: Vec<String>,
    /// Where baseline timings are cached per (problem, GPU, torch version).
    pub baseline_cache: Option<PathBuf>,
    /// Draw inputs on the GPU (fast) instead of on the host and copying them
    /// over (KernelBench's exact values).
    pub inputs_on_device: bool,
    /// Run on the CPU (tests on machines without a GPU).
    pub cpu: bool,
    /// Fail candidates that compute with torch ops.
    pub strict: bool,
    /// Recompute the reference outputs for every check instead of keeping
    /// them, as the worker does on its own when they would take more than
    /// about half of the GPU's memory.
    pub recompute_references: bool,
    /// Time eager trial by trial beside each candidate (bounded by its time
    /// alone) instead of taking its time alone, measured once per problem.
    pub paired_eager: bool,
    /// Screen candidates instead of judging them: KernelBench's first
    /// correctness trial, then this many timed calls (a few of them
    /// compared), no eager beside, no check with the parameters scaled.
    /// The reference side is the full protocol's (a screen and a full
    /// judgement of the same problem share it).
    pub screen: Option<u32>,
    /// Wall-clock limit per candidate.
    pub limit: Duration,
    /// Wall-clock limit for a problem's reference side and baselines
    /// (torch.compile takes a while).
    pub prepare_limit: Duration,
}

impl Default for WorkerSettings {
    fn default() -> WorkerSettings {
        WorkerSettings {
            protocol: Protocol::KERNELBENCH_FP32,
            baselines: vec!["eager".into()],
            baseline_cache: None,
            inputs_on_device: true,
            cpu: false,
            strict: false,
            recompute_references: false,
            paired_eager: true,
            screen: None,
            limit: Duration::from_secs(120),
            prepare_limit: Duration::from_secs(600),
        }
    }
}

/// The worker's request `op` (`prepare`, `eval`) of `problem` under
/// `settings`, without a candidate.
pub(crate) fn request(s: &WorkerSettings, op: &str, problem: &ProblemSource) -> serde_json::Value {
    let p = &s.protocol;
    serde_json::json!({
        "op": op,
        "problem": {"name": problem.name, "code": problem.code},
        "seed": p.seed,
        "correctness_trials": p.correctness_trials,
        "warmup": p.warmup,
        "trials": p.trials,
        "atol": p.atol,
        "rtol": p.rtol,
        "baselines": s.baselines,
        "baseline_cache": s.baseline_cache,
        "inputs": if s.inputs_on_device { "device" } else { "host" },
        "device": if s.cpu { "cpu" } else { "cuda" },
        "strict": s.strict,
        "references": if s.recompute_references { "recompute" } else { "auto" },
        "paired_eager": s.paired_eager,
        "screen": s.screen,
        "limit_seconds": if op == "prepare" { s.prepare_limit } else { s.limit }.as_secs_f64(),
    })
}

/// The Python worker behind [`Evaluator`].
pub struct WorkerEvaluator {
    /// The worker process slot (started lazily, replaced after faults).
    pub slot: WorkerSlot,
    /// The settings of every request.
    pub settings: WorkerSettings,
    prepared: Option<String>,
    /// Whether the worker keeps the prepared problem's reference outputs
    /// (on the GPU, or on the host without one) instead of recomputing
    /// them for each check.
    references_kept: bool,
}

impl WorkerEvaluator {
    /// An evaluator on `slot`.
    pub fn new(slot: WorkerSlot, settings: WorkerSettings) -> WorkerEvaluator {
        WorkerEvaluator {
            slot,
            settings,
            prepared: None,
            references_kept: false,
        }
    }

    fn request(&self, op: &str, problem: &ProblemSource) -> serde_json::Value {
        request(&self.settings, op, problem)
    }

    /// Computes the problem's reference side and baselines now, under the
    /// longer prepare limit, so that the first candidate's limit covers the
    /// candidate alone. Returns the worker's report.
    pub async fn prepare(
        &mut self,
        problem: &ProblemSource,
    ) -> Result<serde_json::Value, WorkerError> {
        let request = self.request("prepare", problem);
        let limit = self.settings.prepare_limit;
        let report = self.slot.request(request, limit).await?;
        self.prepared = Some(problem.code.clone());
        // Kept on the device or the host; recomputed for each check, or
        // given call by call in lockstep (a model that keeps state), there
        // is nothing to free by judging again.
        self.references_kept = !matches!(
            report["refs_kept"].as_str(),
            Some("recomputed" | "lockstep")
        );
        Ok(report)
    }
}

impl Evaluator for WorkerEvaluator {
    fn kind(&self) -> EvaluatorKind {
        EvaluatorKind::Worker
    }

    async fn evaluate(
        &mut self,
        problem: &ProblemSource,
        candidate: &Candidate,
    ) -> Result<Outcome, EvalError> {
        let Candidate::Python { name, code } = candidate else {
            return Err(EvalError::Unsupported(format!(
                "the worker runs Python candidates; {} is a CUDA program (use the native evaluator)",
                candidate.name()
            )));
        };
        if problem.code.is_empty() {
            return Err(EvalError::Unsupported(format!(
                "the worker needs the problem's PyTorch code, and {} has none (an intent): use a CUDA program and the native evaluator",
                problem.name
            )));
        }
        let mut outcome = self.judge(name, code, problem).await?;
        // The worker keeps the reference outputs on the GPU when they take
        // at most about half of its memory; a candidate that needs more than
        // the rest is judged once more with them recomputed for each check,
        // by a fresh worker: the old one's memory (the kept outputs, its
        // inputs' pool, what it shared with runners it killed) is gone with
        // its process, not left to its allocator (on an H200 the old judge
        // still held 72 GiB when the candidate was judged again in it).
        if outcome.status == Status::RuntimeError
            && self.references_kept
            && outcome
                .error
                .as_deref()
                .is_some_and(|e| e.contains("out of memory"))
        {
            self.settings.recompute_references = true;
            self.prepared = None;
            self.slot.discard();
            let again = self.judge(name, code, problem).await;
            self.settings.recompute_references = false;
            // The worker's reference side is now the recomputing one.
            self.prepared = None;
            let first = outcome.wall_seconds;
            outcome = again?;
            outcome.wall_seconds += first;
            outcome.references_recomputed = true;
        }
        Ok(outcome)
    }
}

impl WorkerEvaluator {
    /// One evaluation of the Python candidate `code` on `problem`, the
    /// reference side built first where the worker has none for it (its
    /// wall-clock seconds are the candidate's alone).
    async fn judge(
        &mut self,
        name: &str,
        code: &str,
        problem: &ProblemSource,
    ) -> Result<Outcome, EvalError> {
        // A fresh worker has no reference side: build it under the prepare
        // limit, not the candidate's.
        if self.prepared.as_deref() != Some(problem.code.as_str()) || self.slot.is_idle() {
            self.prepare(problem).await?;
        }
        let mut request = self.request("eval", problem);
        request["candidate"] = serde_json::json!({"name": name, "code": code});
        let started = Instant::now();
        let mut outcome = worker::run_eval(&mut self.slot, request, self.settings.limit).await?;
        outcome.wall_seconds = started.elapsed().as_secs_f64();
        Ok(outcome)
    }
}

/// The CUDA sources inside a Python candidate: its string literals (triple
/// quoted, as kernels are written by hand, or one-line with escapes, as
/// mtmc's own `ModelNew` writes them) that define a `__global__` function.
pub fn cuda_sources(python: &str) -> Vec<String> {
    let mut found = Vec::new();
    let mut rest = python;
    while let Some(start) = rest.find(['"', '\'']) {
        // A raw string (`r"…"`) keeps its backslashes.
        let raw = rest[..start].ends_with(['r', 'R']);
        let quote = &rest[start..];
        let delimiter = if quote.starts_with("\"\"\"") {
            "\"\"\""
        } else if quote.starts_with("\'\'\'") {
            "\'\'\'"
        } else {
            let (body, after) = short_string(quote, raw);
            if body.contains("__global__") {
                found.push(body);
            }
            rest = after;
            continue;
        };
        let body = &quote[3..];
        match body.find(delimiter) {
            Some(end) => {
                if body[..end].contains("__global__") {
                    found.push(body[..end].to_string());
                }
                rest = &body[end + 3..];
            }
            None => break,
        }
    }
    found
}

/// A one-line string literal at the start of `s` (its quote first): its
/// value, escapes decoded unless `raw`, and the text after it.
fn short_string(s: &str, raw: bool) -> (String, &str) {
    let quote = s.as_bytes()[0] as char;
    let mut value = String::new();
    let mut chars = s.char_indices().skip(1);
    while let Some((i, c)) = chars.next() {
        match c {
            '\n' => return (value, &s[i..]),
            c if c == quote => return (value, &s[i + 1..]),
            '\\' => {
                let Some((_, e)) = chars.next() else { break };
                if raw {
                    value.push('\\');
                    value.push(e);
                    continue;
                }
                match e {
                    'n' => value.push('\n'),
                    't' => value.push('\t'),
                    'r' => value.push('\r'),
                    '0' => value.push('\0'),
                    '\n' => {}
                    'u' | 'x' => {
                        let digits: String = (0..if e == 'u' { 4 } else { 2 })
                            .filter_map(|_| chars.next().map(|(_, d)| d))
                            .collect();
                        match u32::from_str_radix(&digits, 16)
                            .ok()
                            .and_then(char::from_u32)
                        {
                            Some(d) => value.push(d),
                            None => {
                                value.push('\\');
                                value.push(e);
                                value.push_str(&digits);
                            }
                        }
                    }
                    'a' => value.push('\u{7}'),
                    'b' => value.push('\u{8}'),
                    'f' => value.push('\u{c}'),
                    'v' => value.push('\u{b}'),
                    '\\' | '\'' | '"' => value.push(e),
                    // Python keeps an unknown escape as it is written.
                    other => {
                        value.push('\\');
                        value.push(other);
                    }
                }
            }
            c => value.push(c),
        }
    }
    (value, "")
}

/// NVRTC only: compiles and reports, runs nothing.
pub struct CompileOnly {
    /// The target architecture.
    pub arch: Arch,
    /// Why nothing is run, for the outcome (`no GPU on this machine`).
    pub reason: String,
}

impl CompileOnly {
    /// Compiles each CUDA source; the outcome is `compiled_only` when all
    /// compile, else `compile_error` with the first failing log.
    pub fn compile_sources(&self, sources: &[(String, String)]) -> Result<Outcome, NvrtcError> {
        let mut outcome = Outcome::new(EvaluatorKind::CompileOnly, Status::CompiledOnly);
        let started = Instant::now();
        let mut logs = Vec::new();
        for (name, source) in sources {
            let report = nvrtc::compile(
                &CompileUnit {
                    name: name.clone(),
                    source: source.clone(),
                },
                self.arch,
            )?;
            if !report.log.trim().is_empty() {
                logs.push(format!("{name}:\n{}", report.log.trim_end()));
            }
            if !report.ok {
                outcome.status = Status::CompileError;
                outcome.error = Some(
                    report
                        .diagnostics
                        .iter()
                        .find(|d| d.severity == "error")
                        .map_or_else(
                            || format!("{name} does not compile"),
                            |d| match d.line {
                                Some(line) => format!("{name}:{line}: {}", d.message),
                                None => format!("{name}: {}", d.message),
                            },
                        ),
                );
                break;
            }
            outcome
                .kernels
                .extend(report.kernels.iter().map(|k| KernelReport {
                    name: k.name.clone(),
                    source: "nvrtc".into(),
                    registers: Some(k.registers),
                    shared_bytes: Some(k.shared_bytes),
                    local_bytes: Some(k.stack_bytes),
                    spills: Some(k.spill_store_bytes + k.spill_load_bytes),
                    occupancy: Some(nvrtc::occupancy(k, 256, 0, SmLimits::SM90)),
                    block_threads: Some(256),
                }));
        }
        outcome.load_seconds = Some(started.elapsed().as_secs_f64());
        outcome.wall_seconds = started.elapsed().as_secs_f64();
        outcome.compile_log = Some(logs.join("\n"));
        if outcome.status == Status::CompiledOnly {
            outcome.why = Some(format!(
                "compile only ({}): {} kernel(s) compiled for {}; nothing was run, so nothing is known of correctness or speed",
                self.reason,
                outcome.kernels.len(),
                self.arch.target()
            ));
        }
        Ok(outcome)
    }
}

impl Evaluator for CompileOnly {
    fn kind(&self) -> EvaluatorKind {
        EvaluatorKind::CompileOnly
    }

    async fn evaluate(
        &mut self,
        problem: &ProblemSource,
        candidate: &Candidate,
    ) -> Result<Outcome, EvalError> {
        let (name, code) = match candidate {
            Candidate::Python { name, code } => (name, code),
            Candidate::Cuda { name, program } => {
                if let Some(source) = &problem.graph {
                    let graph = source.graph().map_err(EvalError::Unsupported)?;
                    if let Err(e) = program.check(&graph) {
                        let mut o = Outcome::new(EvaluatorKind::CompileOnly, Status::CompileError);
                        o.error = Some(format!("the launch plan does not fit the problem: {e}"));
                        return Ok(o);
                    }
                }
                let mut outcome =
                    self.compile_sources(&[(name.clone(), program.source.clone())])?;
                for k in &mut outcome.kernels {
                    if let Some(block) = program.block_threads(&k.name) {
                        k.occupancy =
                            Some(block_occupancy(k, block, program.dynamic_shared(&k.name)));
                        k.block_threads = Some(block);
                    }
                }
                return Ok(outcome);
            }
        };
        let sources: Vec<(String, String)> = cuda_sources(code)
            .into_iter()
            .enumerate()
            .map(|(i, s)| (format!("{name}#cuda{}", i + 1), s))
            .collect();
        let mut outcome = self.compile_sources(&sources)?;
        if sources.is_empty() {
            outcome.why = Some(format!(
                "compile only ({}): {name} holds no CUDA source (a string with a __global__ function); Triton and torch code need a GPU",
                self.reason
            ));
        }
        Ok(outcome)
    }
}

/// Occupancy from a report's figures (registers, shared memory) at `block`
/// threads.
fn block_occupancy(k: &KernelReport, block: u32, dynamic_shared: u32) -> f64 {
    let r = KernelResources {
        name: k.name.clone(),
        registers: k.registers.unwrap_or(0),
        shared_bytes: k.shared_bytes.unwrap_or(0),
        ..KernelResources::default()
    };
    nvrtc::occupancy(&r, block, dynamic_shared, SmLimits::SM90)
}

impl Evaluator for NativeEvaluator {
    fn kind(&self) -> EvaluatorKind {
        EvaluatorKind::Native
    }

    async fn evaluate(
        &mut self,
        problem: &ProblemSource,
        candidate: &Candidate,
    ) -> Result<Outcome, EvalError> {
        let Candidate::Cuda { program, .. } = candidate else {
            return Err(EvalError::Unsupported(format!(
                "the native evaluator runs CUDA programs (JSON with a launch plan); {} is Python (use the worker)",
                candidate.name()
            )));
        };
        let graph = problem.graph.as_ref().ok_or_else(|| {
            EvalError::Unsupported(format!(
                "{} has no op graph for the f64 reference",
                problem.name
            ))
        })?;
        self.evaluate_program(graph, program).await
    }
}

/// Which evaluators this machine can use, from `mtmc doctor`'s checks:
/// each with what it can do, or what it needs.
pub fn available(checks: &[crate::probe::Check]) -> Vec<(EvaluatorKind, Result<String, String>)> {
    let ok = |component: &str| checks.iter().any(|c| c.component == component && c.ok);
    let torch_gpu = checks
        .iter()
        .any(|c| c.component == "torch" && c.ok && c.detail.contains("sees a GPU"));
    vec![
        (
            EvaluatorKind::Worker,
            match (ok("GPU"), torch_gpu) {
                (true, true) => Ok(
                    "torch on the GPU: KernelBench problems, with cupy/NVRTC and Triton candidates"
                        .into(),
                ),
                (false, _) => Err("needs a GPU".into()),
                (true, false) => {
                    Err("needs torch that sees the GPU in the worker's Python (MTMC_PYTHON)".into())
                }
            },
        ),
        (
            EvaluatorKind::Native,
            if ok("GPU") && ok("NVRTC") {
                Ok("cudarc: CUDA programs with a launch plan, checked against the f64 CPU reference".into())
            } else {
                Err("needs a GPU and NVRTC".into())
            },
        ),
        (
            EvaluatorKind::CompileOnly,
            if ok("NVRTC") {
                Ok("NVRTC: compiles a candidate's CUDA and reads each kernel's resources; runs nothing".into())
            } else {
                Err("needs NVRTC 13 (pip install 'nvidia-cuda-nvrtc==13.0.*')".into())
            },
        ),
    ]
}

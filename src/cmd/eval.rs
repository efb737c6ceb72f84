//! `mtmc eval`: run candidates through an evaluator and print each Outcome.
//!
//! With a GPU and torch, the Python worker runs the KernelBench protocol;
//! without a GPU, the compile-only evaluator compiles the candidate's CUDA
//! with NVRTC and says that nothing was run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mtmc_actions::device::{MathMode, builtin_devices, find_device};
use mtmc_actions::graph::OpGraph;
use mtmc_env::evaluator::{
    Candidate, CompileOnly, EvalError, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings,
};
use mtmc_env::nvrtc::Arch;
use mtmc_env::outcome::{EvaluatorKind, Outcome, Status};
use mtmc_env::pool::WorkerPool;
use mtmc_env::worker::{Protocol, WorkerError, WorkerSlot};

use crate::source::{Problems, cache_dir};

/// Which evaluator `mtmc eval` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Choice {
    /// The worker when this machine has a GPU, else compile-only.
    Auto,
    /// The Python worker (KernelBench protocol on the GPU).
    Worker,
    /// NVRTC only; nothing is run.
    CompileOnly,
}

/// What `mtmc eval` was asked to do.
pub struct Request<'a> {
    /// Problems path.
    pub kernelbench: Option<&'a Path>,
    /// Problem name.
    pub problem: &'a str,
    /// Candidates' Python sources (each defines `ModelNew`), evaluated in
    /// order by one worker slot.
    pub candidates: &'a [PathBuf],
    /// Which evaluator.
    pub evaluator: Choice,
    /// Timed trials.
    pub trials: u32,
    /// Wall-clock limit for each candidate's evaluation.
    pub timeout: Duration,
    /// Baselines to time (`eager`, `compile`).
    pub baselines: Vec<String>,
    /// Read and write the baseline cache.
    pub baseline_cache: bool,
    /// Draw inputs on the host as KernelBench does (slower).
    pub host_inputs: bool,
    /// Run the worker on the CPU (checks only; timings are host-clock).
    pub cpu: bool,
    /// Fail candidates that compute with torch ops.
    pub strict: bool,
    /// Where to write the outcomes as JSON.
    pub json: Option<&'a Path>,
}

/// Evaluates and prints.
pub fn run(out: &mut dyn std::io::Write, req: Request<'_>) -> Result<()> {
    let problems = Problems::load(req.kernelbench)?;
    let p = problems.find(req.problem)?;
    if p.code.is_empty() {
        bail!(
            "`mtmc eval` needs {p}'s code, and the built-in set has graphs only: pass --kernelbench PATH \
             (a problems.jsonl or a KernelBench checkout)"
        );
    }
    let graph: Option<OpGraph> = problems.graphs(&[p])?.remove(0).graph.ok();
    let mut candidates = Vec::new();
    for path in req.candidates {
        let code = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read candidate `{}`", path.display()))?;
        let name = path
            .file_name()
            .map_or("candidate.py".into(), |n| n.to_string_lossy().into_owned());
        candidates.push(Candidate::Python { name, code });
    }
    let problem = ProblemSource {
        name: format!("{}.py", p.name),
        code: p.code.clone(),
    };
    let kind = match req.evaluator {
        Choice::Worker => EvaluatorKind::Worker,
        Choice::CompileOnly => EvaluatorKind::CompileOnly,
        Choice::Auto if req.cpu => EvaluatorKind::Worker,
        Choice::Auto => match mtmc_env::probe::driver() {
            Ok(d) if !d.gpus.is_empty() => EvaluatorKind::Worker,
            _ => EvaluatorKind::CompileOnly,
        },
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let mut outcomes = Vec::new();
    let device_spec = builtin_devices();
    match kind {
        EvaluatorKind::CompileOnly => {
            let reason = match req.evaluator {
                Choice::CompileOnly => "asked for".to_string(),
                _ => "no GPU on this machine".to_string(),
            };
            let mut ev = CompileOnly {
                arch: Arch::SM90,
                reason,
            };
            for c in &candidates {
                let o = runtime.block_on(ev.evaluate(&problem, c))?;
                print(out, c.name(), &o)?;
                outcomes.push(serde_json::json!({"candidate": c.name(), "outcome": o}));
            }
        }
        EvaluatorKind::Worker | EvaluatorKind::Native => {
            let settings = WorkerSettings {
                protocol: Protocol {
                    trials: req.trials,
                    ..Protocol::KERNELBENCH_FP32
                },
                baselines: req.baselines.clone(),
                baseline_cache: req
                    .baseline_cache
                    .then(|| cache_dir().map(|d| d.join("baselines")))
                    .flatten(),
                inputs_on_device: !req.host_inputs,
                cpu: req.cpu,
                strict: req.strict,
                limit: req.timeout,
                prepare_limit: req.timeout.max(Duration::from_secs(900)),
            };
            let gpus = match mtmc_env::probe::driver() {
                Ok(d) if !req.cpu => d.gpus.len() as u32,
                _ => 0,
            };
            if gpus > 1 && candidates.len() > 1 {
                return run_on_gpus(
                    out,
                    &req,
                    &runtime,
                    &problem,
                    candidates,
                    gpus,
                    &settings,
                    graph.as_ref(),
                );
            }
            let mut ev = WorkerEvaluator::new(WorkerSlot::new(None), settings);
            if !req.baselines.is_empty() {
                writeln!(
                    out,
                    "{p}: reference outputs and baselines ({})…",
                    req.baselines.join(", ")
                )?;
                out.flush()?;
            }
            for c in &candidates {
                let o = match runtime.block_on(ev.evaluate(&problem, c)) {
                    Err(EvalError::Worker(WorkerError::Failed(e)))
                        if e.contains("No module named 'torch'") =>
                    {
                        bail!(
                            "{} has no torch, which evaluation needs: install it there, or set MTMC_PYTHON to a Python that has it",
                            mtmc_env::python::interpreter().to_string_lossy()
                        )
                    }
                    Err(EvalError::Worker(e)) if e.lost_worker() => {
                        bail!("the reference side of {p} could not be computed: {e}")
                    }
                    other => other.with_context(|| format!("evaluating {}", c.name()))?,
                };
                let mut o = o;
                if o.status == Status::CompiledOnly {
                    bail!(
                        "nothing was run: {}; use --evaluator compile-only on machines without a GPU",
                        o.why
                            .as_deref()
                            .unwrap_or("the worker could not run the candidate")
                    );
                }
                if let (Some(g), Some(spec)) = (
                    &graph,
                    find_device(&device_spec, o.device.as_deref().unwrap_or("")),
                ) {
                    o.add_roofline(g, spec, MathMode::default());
                }
                print(out, c.name(), &o)?;
                out.flush()?;
                outcomes.push(serde_json::json!({"candidate": c.name(), "outcome": o}));
            }
            writeln!(
                out,
                "{p}: {} candidate(s), {} worker start(s)",
                outcomes.len(),
                ev.slot.starts
            )?;
        }
    }
    write_json(req.json, &outcomes)
}

/// Several GPUs: one worker each, candidates dispatched to whichever is
/// free; outcomes printed in the candidates' order when all are done.
#[allow(clippy::too_many_arguments)]
fn run_on_gpus(
    out: &mut dyn std::io::Write,
    req: &Request<'_>,
    runtime: &tokio::runtime::Runtime,
    problem: &ProblemSource,
    candidates: Vec<Candidate>,
    gpus: u32,
    settings: &WorkerSettings,
    graph: Option<&OpGraph>,
) -> Result<()> {
    let ordinals: Vec<u32> = (0..gpus).collect();
    let mut pool = WorkerPool::new(&ordinals, settings);
    let names: Vec<String> = candidates.iter().map(|c| c.name().to_string()).collect();
    writeln!(
        out,
        "{} candidate(s) on {gpus} GPUs, one worker each…",
        names.len()
    )?;
    out.flush()?;
    let results = runtime.block_on(pool.evaluate_all(problem, candidates));
    let specs = builtin_devices();
    let mut outcomes = Vec::new();
    for (name, d) in names.iter().zip(results) {
        let mut o = d.result.with_context(|| format!("evaluating {name}"))?;
        if let (Some(g), Some(spec)) = (
            graph,
            find_device(&specs, o.device.as_deref().unwrap_or("")),
        ) {
            o.add_roofline(g, spec, MathMode::default());
        }
        writeln!(out, "[GPU {}]", d.slot)?;
        print(out, name, &o)?;
        outcomes.push(serde_json::json!({"candidate": name, "gpu": d.slot, "outcome": o}));
    }
    let starts: u32 = pool.evaluators().iter().map(|e| e.slot.starts).sum();
    writeln!(
        out,
        "{} candidate(s) on {gpus} GPUs, {starts} worker start(s)",
        outcomes.len()
    )?;
    write_json(req.json, &outcomes)
}

fn write_json(path: Option<&Path>, outcomes: &[serde_json::Value]) -> Result<()> {
    if let Some(path) = path {
        let text = serde_json::to_string_pretty(outcomes).expect("outcomes serialize");
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}

/// Prints one outcome in a few lines; `--json` keeps everything.
pub fn print(out: &mut dyn std::io::Write, candidate: &str, o: &Outcome) -> Result<()> {
    writeln!(
        out,
        "{candidate}: {} ({})",
        o.status.name(),
        o.evaluator.name()
    )?;
    for (label, value) in [("error", &o.error), ("why", &o.why)] {
        if let Some(v) = value {
            // The first line; the JSON output keeps the whole text.
            writeln!(out, "  {label}: {}", v.lines().next().unwrap_or_default())?;
        }
    }
    if let Some(c) = &o.correctness {
        if let Some(bad) = &c.first_bad {
            writeln!(
                out,
                "  first bad element {:?}: expected {}, got {}",
                bad.index, bad.expected, bad.got
            )?;
        }
        if let Some(err) = c.max_abs_err {
            write!(
                out,
                "  {} correctness trial(s), max abs error {err:.3e}",
                c.trials
            )?;
            match c.rel_to_scale {
                Some(r) => writeln!(out, " ({r:.2e} of the output's scale)")?,
                None => writeln!(out)?,
            }
        }
    }
    if let Some(s) = o.load_seconds {
        writeln!(out, "  load (compile) {s:.2} s")?;
    }
    for k in &o.kernels {
        let field =
            |v: Option<u32>, unit: &str| v.map_or("?".to_string(), |v| format!("{v}{unit}"));
        write!(
            out,
            "  kernel {} ({}): {} registers, {} shared, {} local",
            k.name,
            k.source,
            field(k.registers, ""),
            field(k.shared_bytes, " B"),
            field(k.local_bytes, " B")
        )?;
        match k.occupancy {
            Some(occ) => writeln!(out, ", occupancy {:.0}% at 256 threads", occ * 100.0)?,
            None => writeln!(out)?,
        }
    }
    if !o.torch_ops.is_empty() {
        let ops: Vec<String> = o
            .torch_ops
            .iter()
            .map(|(k, n)| format!("{k}×{n}"))
            .collect();
        writeln!(out, "  torch ops: {}", ops.join(", "))?;
    }
    if let Some(r) = &o.runtime {
        writeln!(
            out,
            "  candidate  mean {:.4} ms  median {:.4} ms  std {:.4} ms  ({} trials, {})",
            r.mean_ms, r.median_ms, r.std_ms, r.trials, r.clock
        )?;
    }
    for (name, b) in &o.baselines {
        match (&b.timing, &b.error) {
            (Some(t), _) => {
                let cached = if b.cached { ", cached" } else { "" };
                write!(
                    out,
                    "  {name:<9}  mean {:.4} ms  median {:.4} ms  std {:.4} ms{cached}",
                    t.mean_ms, t.median_ms, t.std_ms
                )?;
                match o.speedup_vs(name) {
                    Some(s) => writeln!(out, "  → speedup {s:.3}x")?,
                    None => writeln!(out)?,
                }
            }
            (None, Some(e)) => writeln!(
                out,
                "  {name:<9}  failed: {}",
                e.lines().next().unwrap_or("")
            )?,
            (None, None) => {}
        }
    }
    if let Some(a) = &o.achieved {
        writeln!(
            out,
            "  achieved {:.0} GB/s, {:.2} TFLOP/s; {:.0}% of the {} roofline ({:.4} ms)",
            a.bandwidth_gbps,
            a.tflops,
            a.roofline_fraction * 100.0,
            a.device,
            a.roofline_ms
        )?;
    }
    let phases: Vec<String> = o
        .phases
        .iter()
        .filter(|(_, s)| **s >= 0.005)
        .map(|(k, s)| format!("{k} {s:.2}"))
        .collect();
    if phases.is_empty() {
        writeln!(out, "  wall {:.2} s", o.wall_seconds)?;
    } else {
        writeln!(
            out,
            "  wall {:.2} s ({})",
            o.wall_seconds,
            phases.join(", ")
        )?;
    }
    Ok(())
}

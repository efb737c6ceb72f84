//! `mtmc eval`: run candidates through an evaluator and print each Outcome.
//!
//! Python candidates (`ModelNew`) go to the worker, which runs the
//! KernelBench protocol against the problem's PyTorch model; CUDA programs
//! (JSON with a launch plan) go to the native evaluator, checked against
//! the f64 CPU reference (this is how intents are evaluated). Without a
//! GPU, the compile-only evaluator compiles the candidates' CUDA with NVRTC
//! and says that nothing was run.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mtmc_actions::device::{builtin_devices, find_device};
use mtmc_actions::graph::OpGraph;
use mtmc_env::evaluator::{
    Candidate, CompileOnly, EvalError, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings,
};
use mtmc_env::native::{CudaProgram, GraphSource, NativeEvaluator};
use mtmc_env::nvrtc::Arch;
use mtmc_env::outcome::{EvaluatorKind, Outcome, Status};
use mtmc_env::pool::WorkerPool;
use mtmc_env::worker::{Protocol, WorkerError, WorkerSlot};

use mtmc_search::source::{Problems, cache_dir};

/// Which evaluator `mtmc eval` uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Choice {
    /// With a GPU: the worker for Python candidates, native for CUDA
    /// programs; without one, compile-only.
    Auto,
    /// The Python worker (KernelBench protocol on the GPU).
    Worker,
    /// cudarc and the f64 reference (CUDA programs).
    Native,
    /// NVRTC only; nothing is run.
    CompileOnly,
}

/// What `mtmc eval` was asked to do.
pub struct Request<'a> {
    /// The problem or intent.
    pub subject: mtmc_search::subject::Subject<'a>,
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
    /// Time eager beside each candidate (`WorkerSettings::paired_eager`).
    pub paired_eager: bool,
    /// Screen instead of judging: this many timed calls
    /// (`WorkerSettings::screen`).
    pub screen: Option<u32>,
    /// Where to write the outcomes as JSON.
    pub json: Option<&'a Path>,
}

/// The problem as the evaluators see it, and its graph when it has one.
fn resolve(
    subject: &mtmc_search::subject::Subject<'_>,
) -> Result<(String, ProblemSource, Option<OpGraph>)> {
    use mtmc_search::subject::Subject;
    match subject {
        Subject::Problem { kernelbench, name } => {
            let problems = Problems::load(*kernelbench)?;
            let p = problems.find(name)?;
            let traced = problems.graphs(&[p])?.remove(0);
            let graph = traced.graph.ok();
            Ok((
                p.full_name(),
                ProblemSource {
                    name: format!("{}.py", p.name),
                    code: p.code.clone(),
                    graph: traced.trace.map(|t| GraphSource::Trace(Box::new(t))),
                },
                graph,
            ))
        }
        Subject::Intent {
            text,
            origin,
            bindings,
        } => {
            let graph = mtmc_actions::intent::compile(text, bindings)
                .with_context(|| format!("in {origin}"))?;
            Ok((
                "intent".to_string(),
                ProblemSource {
                    name: "intent".into(),
                    code: String::new(),
                    graph: Some(GraphSource::Intent {
                        text: text.clone(),
                        shapes: bindings.shapes.clone(),
                        dtype: bindings.dtype,
                    }),
                },
                Some(graph),
            ))
        }
    }
}

fn load_candidate(path: &Path) -> Result<Candidate> {
    let name = path
        .file_name()
        .map_or("candidate".into(), |n| n.to_string_lossy().into_owned());
    if path.extension().is_some_and(|e| e == "json") {
        let program = CudaProgram::load(path).map_err(anyhow::Error::msg)?;
        return Ok(Candidate::Cuda { name, program });
    }
    let code = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read candidate `{}`", path.display()))?;
    Ok(Candidate::Python { name, code })
}

/// The evaluators of one `mtmc eval` run, started as candidates need them.
struct Judges {
    settings: WorkerSettings,
    gpu: bool,
    choice: Choice,
    worker: Option<WorkerEvaluator>,
    native: Option<NativeEvaluator>,
    compile_only: CompileOnly,
}

impl Judges {
    fn kind_for(&self, c: &Candidate) -> Result<EvaluatorKind> {
        let python = matches!(c, Candidate::Python { .. });
        Ok(match (self.choice, python) {
            (Choice::CompileOnly, _) => EvaluatorKind::CompileOnly,
            (Choice::Worker, true) => EvaluatorKind::Worker,
            (Choice::Native, false) => EvaluatorKind::Native,
            (Choice::Worker, false) => bail!(
                "{} is a CUDA program: the worker runs Python candidates (use --evaluator native or auto)",
                c.name()
            ),
            (Choice::Native, true) => bail!(
                "{} is Python: the native evaluator runs CUDA programs (use --evaluator worker or auto)",
                c.name()
            ),
            (Choice::Auto, true) if self.gpu || self.settings.cpu => EvaluatorKind::Worker,
            (Choice::Auto, false) if self.gpu => EvaluatorKind::Native,
            (Choice::Auto, _) => EvaluatorKind::CompileOnly,
        })
    }

    async fn judge(
        &mut self,
        problem: &ProblemSource,
        c: &Candidate,
    ) -> Result<Outcome, EvalError> {
        match self
            .kind_for(c)
            .map_err(|e| EvalError::Unsupported(e.to_string()))?
        {
            EvaluatorKind::Worker => {
                let settings = self.settings.clone();
                let ev = self
                    .worker
                    .get_or_insert_with(|| WorkerEvaluator::new(WorkerSlot::new(None), settings));
                ev.evaluate(problem, c).await
            }
            EvaluatorKind::Native => {
                let protocol = self.settings.protocol.clone();
                let limit = self.settings.limit;
                let exe = std::env::current_exe().map_err(|e| {
                    EvalError::Unsupported(format!(
                        "cannot find the mtmc binary to run the native evaluator: {e}"
                    ))
                })?;
                let ev = self
                    .native
                    .get_or_insert_with(|| NativeEvaluator::new(exe.into(), None, protocol, limit));
                ev.evaluate(problem, c).await
            }
            EvaluatorKind::CompileOnly => self.compile_only.evaluate(problem, c).await,
        }
    }

    fn starts(&self) -> u32 {
        self.worker.as_ref().map_or(0, |w| w.slot.starts)
            + self.native.as_ref().map_or(0, |n| n.slot.starts)
    }
}

/// Evaluates and prints.
pub fn run(out: &mut dyn std::io::Write, req: Request<'_>) -> Result<()> {
    let (title, problem, graph) = resolve(&req.subject)?;
    let candidates = req
        .candidates
        .iter()
        .map(|p| load_candidate(p))
        .collect::<Result<Vec<_>>>()?;
    // The worker's settings do nothing for CUDA programs, which the
    // native evaluator judges: say so rather than ignore them.
    if !candidates
        .iter()
        .any(|c| matches!(c, Candidate::Python { .. }))
    {
        let given: Vec<&str> = [
            (req.host_inputs, "--host-inputs"),
            (req.strict, "--strict"),
            (!req.baseline_cache, "--fresh-baselines"),
            (!req.paired_eager, "--eager-alone"),
            (req.screen.is_some(), "--screen"),
        ]
        .into_iter()
        .filter_map(|(on, flag)| on.then_some(flag))
        .collect();
        if !given.is_empty() {
            bail!(
                "{} only change{} how the worker judges Python candidates, and every candidate here is a CUDA program, which the native evaluator judges: drop {}",
                given.join(" and "),
                if given.len() == 1 { "s" } else { "" },
                if given.len() == 1 { "it" } else { "them" }
            );
        }
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let gpus = match mtmc_env::probe::driver() {
        Ok(d) if !req.cpu => d.gpus.len() as u32,
        _ => 0,
    };
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
        recompute_references: false,
        paired_eager: req.paired_eager,
        screen: req.screen,
        limit: req.timeout,
        prepare_limit: req.timeout.max(Duration::from_secs(900)),
    };
    let all_python = candidates
        .iter()
        .all(|c| matches!(c, Candidate::Python { .. }));
    let worker = matches!(req.evaluator, Choice::Auto | Choice::Worker);
    // Several judges at once: a cluster's workers, or one worker per GPU.
    let pool = if let Some(cluster) = mtmc_search::cluster::shared() {
        if !(all_python && worker) {
            bail!(
                "--cluster: the cluster's workers judge Python candidates by the worker (the KernelBench protocol); judge CUDA programs, or another --evaluator, without it"
            );
        }
        let pool = WorkerPool::on_cluster(cluster, &settings);
        let how = format!("the cluster's {} worker(s)", pool.slots());
        Some((pool, how))
    } else if gpus > 1 && candidates.len() > 1 && all_python && worker {
        let ordinals: Vec<u32> = (0..gpus).collect();
        let pool = WorkerPool::new(&ordinals, &settings);
        Some((pool, format!("{gpus} GPUs, one worker each")))
    } else {
        None
    };
    if let Some((pool, how)) = pool {
        return run_on_pool(
            out,
            &req,
            &runtime,
            &problem,
            candidates,
            pool,
            &how,
            graph.as_ref(),
        );
    }
    let mut judges = Judges {
        settings,
        gpu: gpus > 0,
        choice: req.evaluator,
        worker: None,
        native: None,
        compile_only: CompileOnly {
            arch: Arch::SM90,
            reason: if req.evaluator == Choice::CompileOnly {
                "asked for".into()
            } else {
                "no GPU on this machine".into()
            },
        },
    };
    for c in &candidates {
        if judges.kind_for(c)? == EvaluatorKind::Worker && problem.code.is_empty() {
            match &req.subject {
                mtmc_search::subject::Subject::Problem { .. } => bail!(
                    "`mtmc eval` needs {title}'s code to run {}, and the built-in set has graphs only: pass --kernelbench PATH \
                     (a problems.jsonl or a KernelBench checkout)",
                    c.name()
                ),
                mtmc_search::subject::Subject::Intent { .. } => bail!(
                    "{} is Python, and an intent has no PyTorch model to check it against: write the candidate as a CUDA program (.json)",
                    c.name()
                ),
            }
        }
    }
    if judges.kind_for(&candidates[0])? == EvaluatorKind::Worker && !req.baselines.is_empty() {
        writeln!(
            out,
            "{title}: reference outputs and baselines ({})…",
            req.baselines.join(", ")
        )?;
        out.flush()?;
    }
    let specs = builtin_devices();
    let mut outcomes = Vec::new();
    for c in &candidates {
        let mut o = match runtime.block_on(judges.judge(&problem, c)) {
            Err(EvalError::Worker(WorkerError::Failed(e)))
                if e.contains("No module named 'torch'") =>
            {
                bail!(
                    "{} has no torch, which evaluation needs: install it there, or set MTMC_PYTHON to a Python that has it",
                    mtmc_env::python::interpreter().to_string_lossy()
                )
            }
            Err(EvalError::Worker(e))
                if e.lost_worker() && matches!(c, Candidate::Python { .. }) =>
            {
                bail!("the reference side of {title} could not be computed: {e}")
            }
            other => other.with_context(|| format!("evaluating {}", c.name()))?,
        };
        if o.status == Status::CompiledOnly && o.evaluator == EvaluatorKind::Worker {
            bail!(
                "nothing was run: {}; use --evaluator compile-only on machines without a GPU",
                o.why
                    .as_deref()
                    .unwrap_or("the worker could not run the candidate")
            );
        }
        if let (Some(g), Some(spec)) = (
            &graph,
            find_device(&specs, o.device.as_deref().unwrap_or("")),
        ) {
            o.add_roofline(g, spec);
        }
        print(out, c.name(), &o)?;
        out.flush()?;
        outcomes.push(serde_json::json!({"candidate": c.name(), "outcome": o}));
        // After every candidate, so that an interrupted run keeps what it judged.
        write_json(req.json, &outcomes)?;
    }
    let starts = judges.starts();
    if starts > 0 {
        writeln!(
            out,
            "{title}: {} candidate(s), {starts} worker start(s)",
            outcomes.len()
        )?;
    }
    write_json(req.json, &outcomes)
}

/// Several judges at once (one worker per GPU of this machine, or a
/// cluster's workers): candidates dispatched to whichever is free,
/// outcomes printed in the candidates' order when all are done.
#[allow(clippy::too_many_arguments)]
fn run_on_pool(
    out: &mut dyn std::io::Write,
    req: &Request<'_>,
    runtime: &tokio::runtime::Runtime,
    problem: &ProblemSource,
    candidates: Vec<Candidate>,
    mut pool: WorkerPool,
    how: &str,
    graph: Option<&OpGraph>,
) -> Result<()> {
    let names: Vec<String> = candidates.iter().map(|c| c.name().to_string()).collect();
    writeln!(out, "{} candidate(s) on {how}…", names.len())?;
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
            o.add_roofline(g, spec);
        }
        match pool.cluster() {
            Some(c) => writeln!(
                out,
                "[worker {}]",
                c.workers.get(d.slot).map_or("lost", |w| w.address.as_str())
            )?,
            None => writeln!(out, "[GPU {}]", d.slot)?,
        }
        print(out, name, &o)?;
        outcomes.push(serde_json::json!({"candidate": name, "gpu": d.slot, "outcome": o}));
    }
    if pool.cluster().is_some() {
        writeln!(out, "{} candidate(s) on {how}", outcomes.len())?;
    } else {
        let starts: u32 = pool.evaluators().iter().map(|e| e.slot.starts).sum();
        writeln!(
            out,
            "{} candidate(s) on {how}, {starts} worker start(s)",
            outcomes.len()
        )?;
    }
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

/// What kept the candidate apart from the judge and what the judge checked.
fn print_integrity(out: &mut dyn std::io::Write, i: &mtmc_env::outcome::Integrity) -> Result<()> {
    if !i.confinement.is_empty() {
        writeln!(out, "  apart from the judge: {}", i.confinement.join("; "))?;
    }
    if let (Some(calls), Some(warmup), Some(checked)) = (i.calls, i.warmup, i.checked) {
        write!(
            out,
            "  {calls} timed-phase calls on fresh inputs ({warmup} warm-ups), {checked} compared at random after they returned"
        )?;
        if let Some(beside) = i.eager_beside.filter(|&n| n > 0) {
            write!(out, "; eager beside {beside} of them")?;
        }
        if let Some(null) = i.null_ms {
            write!(out, "; {null:.4} ms a call that does nothing, subtracted")?;
        }
        match i.between_ms.filter(|&b| b > 0.0) {
            Some(b) => writeln!(out, "; {b:.4} ms per call of GPU work between calls, added")?,
            None => writeln!(out)?,
        }
    }
    if i.lockstep {
        writeln!(
            out,
            "  the problem's model keeps state across calls: every call was mirrored, in order, on a fresh model of the judge's (lockstep)"
        )?;
    }
    if let Some(second) = &i.second_distribution {
        writeln!(out, "  inputs from a normal distribution: {second}")?;
    }
    if let Some(seed) = i.sample_seed {
        writeln!(out, "  sampled output elements: seed {seed}")?;
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
    if let Some(check) = &o.failed_check {
        writeln!(out, "  failed check: {check}")?;
    }
    if let Some(calls) = o.screen {
        writeln!(
            out,
            "  a screen, not the full protocol: KernelBench's first correctness trial and {calls} timed call(s); its figures rank candidates and are not reported as the protocol's"
        )?;
    }
    if o.references_recomputed {
        writeln!(
            out,
            "  judged again with the reference outputs recomputed for each check: beside them kept on the GPU it ran out of memory"
        )?;
    }
    if let Some(i) = &o.integrity {
        print_integrity(out, i)?;
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
        match (k.occupancy, k.block_threads) {
            (Some(occ), Some(block)) => {
                writeln!(out, ", occupancy {:.0}% at {block} threads", occ * 100.0)?
            }
            _ => writeln!(out)?,
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
                let how = match (b.paired, b.cached) {
                    (true, _) => ", timed beside the candidate",
                    (false, true) => ", cached",
                    (false, false) => "",
                };
                write!(
                    out,
                    "  {name:<9}  mean {:.4} ms  median {:.4} ms  std {:.4} ms{how}",
                    t.mean_ms, t.median_ms, t.std_ms
                )?;
                match o.speedup_vs(name) {
                    Some(s) => writeln!(out, "  → speedup {s:.3}x")?,
                    None => writeln!(out)?,
                }
                if let Some(why) = &b.why {
                    writeln!(out, "    {why}")?;
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

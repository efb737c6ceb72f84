//! `mtmc bench`: `optimize` over a set of KernelBench problems, with
//! KernelBench's metrics.
//!
//! Every finished problem is appended to `DIR/results.jsonl` at once, so a
//! run stopped by Ctrl-C (or a crash) keeps what it finished and the next
//! run with the same `--out` starts where it stopped. Ctrl-C stops it
//! between two variants of a problem, keeping nothing of that problem, and
//! the summary of the finished ones is still written. `DIR/bench.json`
//! holds the summary and every problem's record; each problem's generated
//! code, report and log are in `DIR/L<level>_<name>/`.
//!
//! Metrics, per level and over all: correct programs (and those that are
//! library calls only, counted apart); fast_p, the fraction of problems
//! with a correct program more than p times as fast as eager PyTorch;
//! geometric-mean speedups over eager and torch.compile, both timed in
//! this run, taken over the problems with a correct timed program; the
//! mean fraction of the roofline; and the fraction of judged programs
//! that were correct.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use mtmc_actions::problem::Problem;
use mtmc_env::outcome::Status;
use serde::{Deserialize, Serialize};

use mtmc_actions::device::{Bound, builtin_devices, find_device, roofline};
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::OpClass;
use mtmc_env::evaluator::{Candidate, Evaluator, ProblemSource};
use mtmc_env::native::{Arg, Buffer, CudaProgram, GraphSource, Launch, NativeEvaluator};
use mtmc_env::worker::Protocol;

use crate::optimize::{ProblemJudge, Target};

/// What `mtmc bench` was asked to do.
pub struct Request<'a> {
    /// The stop a signal asks for, read between items of work: the
    /// binary's [`Interrupt::catch`], or an [`Interrupt::new`] a caller
    /// sets itself.
    pub stop: crate::interrupt::Interrupt,
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// Problems by name; empty with `levels` or `all`.
    pub names: &'a [String],
    /// Whole levels.
    pub levels: &'a [u32],
    /// Every problem.
    pub all: bool,
    /// Where everything goes.
    pub out_dir: &'a Path,
    /// The code to write.
    pub target: Target,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Forget earlier results in `out_dir` and start over.
    pub fresh: bool,
    /// Strict mode: every op in a custom kernel.
    pub strict: bool,
}

/// One problem's result: a line of `results.jsonl`.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Record {
    /// `L1/19_ReLU`.
    pub problem: String,
    /// Its level.
    pub level: u32,
    /// The code written: `cuda` or `triton`.
    #[serde(default = "cuda")]
    pub target: String,
    /// Written in strict mode (every op a custom kernel).
    #[serde(default)]
    pub strict: bool,
    /// `correct`, `compiled_only`, `no_correct_variant`, `not_covered` or
    /// `error`.
    pub status: String,
    /// Why it is not correct, when it is not.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// The graph's op classes, pointwise left out when another is there
    /// (`reduce`, `pool+reduce`, `pointwise`): the family the bandwidth
    /// table groups it in.
    #[serde(default)]
    pub family: String,
    /// Memory-bound on the GPU it ran on (its roofline's memory term is the
    /// larger).
    #[serde(default)]
    pub memory_bound: bool,
    /// The best program's minimum bytes over its mean time, GB/s.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bandwidth_gbps: Option<f64>,
    /// The program has no kernel: every op is a library call.
    pub call_library_only: bool,
    /// Kernels in the program.
    pub kernels: usize,
    /// Ops kept as library calls.
    pub library_calls: usize,
    /// Variants handed to the evaluator, and how many were correct.
    pub judged: usize,
    /// Correct judged variants.
    pub judged_correct: usize,
    /// The best program's mean time, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mean_ms: Option<f64>,
    /// Eager PyTorch's mean time, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub eager_ms: Option<f64>,
    /// torch.compile's mean time, ms.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub compile_ms: Option<f64>,
    /// Eager time over the program's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speedup_eager: Option<f64>,
    /// torch.compile time over the program's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub speedup_compile: Option<f64>,
    /// Roofline time over the program's.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub roofline_fraction: Option<f64>,
    /// Wall seconds spent on the problem.
    pub seconds: f64,
    /// The folder with its code and report, relative to the bench folder.
    pub dir: String,
}

/// The metrics over a set of records.
#[derive(Debug, Default, Serialize)]
pub struct Metrics {
    /// Problems.
    pub problems: usize,
    /// With a correct program.
    pub correct: usize,
    /// Of which the program is library calls only.
    pub correct_call_library_only: usize,
    /// Compiled but not run (no GPU).
    pub compiled_only: usize,
    /// Of which the program is library calls only.
    pub compiled_only_call_library_only: usize,
    /// fast_0 (= correct / problems), fast_1, fast_2.
    pub fast: [f64; 3],
    /// Geometric-mean speedup over eager, over correct timed problems.
    pub geomean_vs_eager: Option<f64>,
    /// The same over torch.compile.
    pub geomean_vs_compile: Option<f64>,
    /// Mean fraction of the roofline over correct timed problems.
    pub mean_roofline_fraction: Option<f64>,
    /// Judged programs, and the fraction of them that were correct.
    pub judged: usize,
    /// Correct judged programs over judged programs.
    pub judged_correct_fraction: Option<f64>,
}

impl Metrics {
    /// The metrics of `records`.
    pub fn of<'a>(records: impl IntoIterator<Item = &'a Record>) -> Metrics {
        let records: Vec<&Record> = records.into_iter().collect();
        let correct: Vec<&&Record> = records.iter().filter(|r| r.status == "correct").collect();
        let n = records.len();
        let fast = |p: f64| {
            if n == 0 {
                return 0.0;
            }
            let k = correct
                .iter()
                .filter(|r| p == 0.0 || r.speedup_eager.is_some_and(|s| s > p))
                .count();
            k as f64 / n as f64
        };
        let geomean = |f: &dyn Fn(&Record) -> Option<f64>| {
            let v: Vec<f64> = correct.iter().filter_map(|r| f(r)).collect();
            (!v.is_empty()).then(|| (v.iter().map(|x| x.ln()).sum::<f64>() / v.len() as f64).exp())
        };
        let roof: Vec<f64> = correct.iter().filter_map(|r| r.roofline_fraction).collect();
        let judged: usize = records.iter().map(|r| r.judged).sum();
        let judged_correct: usize = records.iter().map(|r| r.judged_correct).sum();
        Metrics {
            problems: n,
            correct: correct.len(),
            correct_call_library_only: correct.iter().filter(|r| r.call_library_only).count(),
            compiled_only: records
                .iter()
                .filter(|r| r.status == "compiled_only")
                .count(),
            compiled_only_call_library_only: records
                .iter()
                .filter(|r| r.status == "compiled_only" && r.call_library_only)
                .count(),
            fast: [fast(0.0), fast(1.0), fast(2.0)],
            geomean_vs_eager: geomean(&|r| r.speedup_eager),
            geomean_vs_compile: geomean(&|r| r.speedup_compile),
            mean_roofline_fraction: (!roof.is_empty())
                .then(|| roof.iter().sum::<f64>() / roof.len() as f64),
            judged,
            judged_correct_fraction: (judged > 0).then(|| judged_correct as f64 / judged as f64),
        }
    }
}

/// Records written before the target was recorded wrote CUDA.
fn cuda() -> String {
    "cuda".into()
}

/// The folder name of a problem's results.
fn dir_name(p: &Problem) -> String {
    format!("L{}_{}", p.level, p.name)
}

/// Runs the bench and prints the table.
pub fn run(out: &mut dyn std::io::Write, req: Request<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    problems.check_levels(req.levels)?;
    let chosen = problems.choose(req.names, |p| req.all || req.levels.contains(&p.level))?;
    if chosen.is_empty() {
        bail!("name the problems to bench, or pass --level N (repeatable) or --all");
    }
    crate::source::require_code("bench", &chosen)?;
    std::fs::create_dir_all(req.out_dir)
        .with_context(|| format!("cannot create `{}`", req.out_dir.display()))?;
    let results_path = req.out_dir.join("results.jsonl");
    if req.fresh && results_path.exists() {
        std::fs::remove_file(&results_path)
            .with_context(|| format!("cannot remove `{}`", results_path.display()))?;
    }
    let mut done: BTreeMap<String, Record> = BTreeMap::new();
    if let Ok(text) = std::fs::read_to_string(&results_path) {
        for (i, line) in text.lines().enumerate() {
            // A line cut short by a kill is dropped; the problem runs again.
            match serde_json::from_str::<Record>(line) {
                Ok(r) => {
                    done.insert(r.problem.clone(), r);
                }
                Err(_) if i + 1 == text.lines().count() => {}
                Err(e) => bail!(
                    "`{}` line {} is not a result ({e}); pass --fresh to start over",
                    results_path.display(),
                    i + 1
                ),
            }
        }
    }
    // Results of another mode are not mixed into this one's metrics.
    if let Some(r) = done
        .values()
        .find(|r| r.target != req.target.name() || r.strict != req.strict)
    {
        let mode = |target: &str, strict: bool| {
            format!("--target {target}{}", if strict { " --strict" } else { "" })
        };
        bail!(
            "`{}` holds results of {} ({}), not of {}: pass --fresh to start over, or another --out",
            results_path.display(),
            mode(&r.target, r.strict),
            r.problem,
            mode(req.target.name(), req.strict)
        );
    }
    let todo: Vec<&Problem> = chosen
        .iter()
        .copied()
        .filter(|p| !done.contains_key(&p.full_name()))
        .collect();
    let cluster = crate::cluster::gpu();
    let gpu = cluster.is_some() || mtmc_env::probe::driver().is_ok_and(|d| !d.gpus.is_empty());
    writeln!(
        out,
        "bench: {} problem(s), {} already done in {} ({}), {} to run; {}{}",
        chosen.len(),
        chosen.len() - todo.len(),
        req.out_dir.display(),
        if done.is_empty() {
            "none"
        } else {
            "pass --fresh to start over"
        },
        todo.len(),
        if gpu {
            format!(
                "{}; eager and torch.compile timed in this run",
                crate::cluster::judged_on()
            )
        } else {
            "no GPU: compile only, nothing is run or timed".into()
        },
        if req.strict {
            "; strict: every op in a custom kernel"
        } else {
            ""
        }
    )?;
    // The copy the bandwidth table compares with, timed in this run.
    let copy_gbps = if let Some(g) = &cluster {
        writeln!(
            out,
            "copy bandwidth: not measured (the copy runs on this machine's GPU; the cluster's workers with the {g} judge the candidates)"
        )?;
        None
    } else if gpu {
        let gbps = copy_bandwidth(req.timeout).context("cannot measure the copy bandwidth")?;
        writeln!(
            out,
            "copy bandwidth: {gbps:.0} GB/s (a 1 GiB device-to-device copy, bytes read and written, timed like every candidate)"
        )?;
        Some(gbps)
    } else {
        None
    };
    // From here Ctrl-C stops the run between two variants: the problem in
    // flight is not kept (its folder is written again by the next run).
    let stop = req.stop.clone();
    let mut judge = ProblemJudge::new(gpu, req.timeout, false, req.strict).stopping_on(&stop);
    let mut results = crate::files::open_to_append(&results_path)?;
    let bar = crate::fmt::progress_bar(todo.len() as u64);
    let mut finished = 0;
    for p in &todo {
        if stop.requested() {
            break;
        }
        bar.set_message(p.full_name());
        let record = bench_one(&problems, p, &mut judge, req.out_dir, req.target);
        if stop.requested() {
            bar.suspend(|| writeln!(out, "{p}: interrupted, not kept"))?;
            break;
        }
        finished += 1;
        let line = bench_line(&record);
        bar.suspend(|| writeln!(out, "{line}"))?;
        writeln!(results, "{}", serde_json::to_string(&record)?)
            .and_then(|()| results.sync_data())
            .with_context(|| format!("cannot write `{}`", results_path.display()))?;
        done.insert(record.problem.clone(), record);
        bar.inc(1);
    }
    bar.finish_and_clear();
    let records: Vec<&Record> = chosen
        .iter()
        .filter_map(|p| done.get(&p.full_name()))
        .collect();
    let mut levels: BTreeMap<String, Metrics> = BTreeMap::new();
    let level_set: std::collections::BTreeSet<u32> = records.iter().map(|r| r.level).collect();
    for l in &level_set {
        levels.insert(
            format!("L{l}"),
            Metrics::of(records.iter().copied().filter(|r| r.level == *l)),
        );
    }
    levels.insert("all".into(), Metrics::of(records.iter().copied()));
    let bandwidth = copy_gbps.map(|c| bandwidth_table(&records, c));
    let summary = serde_json::json!({
        "copy_gbps": copy_gbps,
        "bandwidth": bandwidth,
        "target": req.target.name(),
        "strict": req.strict,
        "gpu": gpu,
        "levels": levels,
        "problems": records,
    });
    let bench_json = req.out_dir.join("bench.json");
    std::fs::write(&bench_json, serde_json::to_string_pretty(&summary)? + "\n")
        .with_context(|| format!("cannot write `{}`", bench_json.display()))?;
    writeln!(out)?;
    print_table(out, &levels, gpu)?;
    if let (Some(copy), Some(rows)) = (copy_gbps, &bandwidth)
        && !rows.is_empty()
    {
        writeln!(
            out,
            "\nbandwidth of the memory-bound problems written as kernels only, against the copy ({copy:.0} GB/s):\n"
        )?;
        writeln!(
            out,
            "| family | problems | median GB/s | median of copy | lowest of copy (problem) | at >= 70% of copy |"
        )?;
        writeln!(out, "|---|---|---|---|---|---|")?;
        for r in rows {
            writeln!(
                out,
                "| {} | {} | {:.0} | {:.0}% | {:.0}% ({}) | {} of {} |",
                r.family,
                r.problems,
                r.median_gbps,
                100.0 * r.median_of_copy,
                100.0 * r.lowest_of_copy,
                r.lowest,
                r.at_70_percent,
                r.problems
            )?;
        }
    }
    let missed: Vec<&&Record> = records
        .iter()
        .filter(|r| r.status != "correct" && r.status != "compiled_only")
        .collect();
    if !missed.is_empty() {
        let what = if gpu { "not correct" } else { "not compiled" };
        writeln!(out, "\n{what} ({}):", missed.len())?;
        for r in missed {
            writeln!(
                out,
                "  {} — {}: {}",
                r.problem,
                r.status,
                r.why.as_deref().unwrap_or("").lines().next().unwrap_or("")
            )?;
        }
    }
    writeln!(out, "\nwrote {}", bench_json.display())?;
    if finished < todo.len() {
        return Err(crate::interrupt::Interrupted(format!(
            "stopped after {finished} of the {} problem(s) to run; every finished problem is in {} and in the table above: run the same command again to resume",
            todo.len(),
            results_path.display()
        ))
        .into());
    }
    Ok(())
}

/// Optimizes one problem, its log and code in its own folder.
fn bench_one(
    problems: &crate::source::Problems,
    p: &Problem,
    judge: &mut ProblemJudge,
    root: &Path,
    target: Target,
) -> Record {
    let started = Instant::now();
    let dir = dir_name(p);
    let out_dir = root.join(&dir);
    let mut record = Record {
        problem: p.full_name(),
        level: p.level,
        target: target.name().into(),
        strict: judge.strict,
        status: "error".into(),
        why: None,
        family: String::new(),
        memory_bound: false,
        bandwidth_gbps: None,
        call_library_only: false,
        kernels: 0,
        library_calls: 0,
        judged: 0,
        judged_correct: 0,
        mean_ms: None,
        eager_ms: None,
        compile_ms: None,
        speedup_eager: None,
        speedup_compile: None,
        roofline_fraction: None,
        seconds: 0.0,
        dir: dir.clone(),
    };
    let mut log = Vec::new();
    let result = std::fs::create_dir_all(&out_dir)
        .with_context(|| format!("cannot create `{}`", out_dir.display()))
        .and_then(|()| Ok(problems.graphs(&[p])?.remove(0).graph));
    let mut graph = None;
    let optimized = result.and_then(|g| match g {
        Ok(g) => {
            record.family = family(&g);
            let s = crate::optimize::optimize_problem_or_forward(
                &mut log, p, &g, judge, &out_dir, target,
            );
            if s.as_ref().is_ok_and(|s| s.whole_forward) {
                record.family = "whole forward".into();
            }
            graph = Some(g);
            s
        }
        // No graph: the whole forward stays the problem's code (not in
        // strict mode, which wants kernels).
        Err(why) if !judge.strict => {
            record.family = "whole forward".into();
            crate::optimize::optimize_whole_forward(
                &mut log,
                p,
                judge,
                &out_dir,
                crate::optimize::WholeForward::NoGraph(&why),
            )
        }
        Err(why) => Err(anyhow::anyhow!("{p} has no graph: {why}")),
    });
    match optimized {
        Ok(s) => {
            record.kernels = s.kernels;
            record.library_calls = s.library_calls;
            record.call_library_only = s.best.is_some() && s.kernels == 0;
            record.judged = s.judged;
            record.judged_correct = s.correct;
            match s.best {
                Some(o) if o.status == Status::Correct => {
                    record.status = "correct".into();
                    record.mean_ms = o.runtime.as_ref().map(|t| t.mean_ms);
                    let base = |b: &str| {
                        o.baselines
                            .get(b)
                            .and_then(|b| b.timing.as_ref())
                            .map(|t| t.mean_ms)
                    };
                    record.eager_ms = base("eager");
                    record.compile_ms = base("compile");
                    record.speedup_eager = o.speedup_vs("eager");
                    record.speedup_compile = o.speedup_vs("compile");
                    record.roofline_fraction = o.achieved.as_ref().map(|a| a.roofline_fraction);
                    record.bandwidth_gbps = o.achieved.as_ref().map(|a| a.bandwidth_gbps);
                    let spec =
                        find_device(&builtin_devices(), o.device.as_deref().unwrap_or("")).cloned();
                    record.memory_bound = match (&graph, spec) {
                        (Some(g), Some(spec)) => {
                            roofline(g, &spec, o.problem_math()).bound == Bound::Memory
                        }
                        _ => false,
                    };
                }
                Some(_) => record.status = "compiled_only".into(),
                None => {
                    record.status = "no_correct_variant".into();
                    record.why = Some(first_failure(&log));
                }
            }
        }
        Err(e) => {
            let chain: Vec<String> = e.chain().map(ToString::to_string).collect();
            let why = chain.join(": ");
            record.status = if why.contains("no family yet") {
                "not_covered".into()
            } else {
                "error".into()
            };
            record.why = Some(why.clone());
            let _ = writeln!(log, "error: {why}");
        }
    }
    record.seconds = started.elapsed().as_secs_f64();
    let _ = std::fs::write(out_dir.join("log.txt"), &log);
    record
}

/// The family a graph is benched in: its op classes but layout, with
/// pointwise left out when another class is there.
fn family(g: &OpGraph) -> String {
    let classes: Vec<OpClass> = g
        .op_classes()
        .into_iter()
        .filter(|c| !matches!(c, OpClass::Layout | OpClass::Dropout))
        .collect();
    let main: Vec<&str> = classes
        .iter()
        .filter(|c| **c != OpClass::Pointwise || classes.len() == 1)
        .map(|c| c.name())
        .collect();
    main.join("+")
}

/// The intent whose program the copy kernel is: one GiB in, one out.
const COPY_INTENT: &str = "y = x * 1.0";
const COPY_SHAPE: &str = "x=16384x16384";

/// A device-to-device copy of one GiB (16-byte loads and stores, a thread
/// per four floats), checked and timed by the native evaluator under the
/// protocol every candidate meets (L2 flushed before each timed run): the
/// bandwidth memory-bound programs are compared with. Bytes read and
/// written both count.
fn copy_bandwidth(timeout: Duration) -> Result<f64> {
    let shapes = mtmc_actions::intent::parse_shapes(COPY_SHAPE)?;
    let bindings = mtmc_actions::intent::Bindings {
        shapes: shapes.clone(),
        dtype: None,
    };
    let g = mtmc_actions::intent::compile(COPY_INTENT, &bindings)?;
    let n4: u64 = shapes["x"].iter().product::<u64>() / 4;
    let block = 256u64;
    let program = CudaProgram {
        source: "extern \"C\" __global__ void copy4(const float4* __restrict__ x, float4* __restrict__ y, long long n4) {\n    long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;\n    if (i < n4) y[i] = x[i];\n}\n".into(),
        buffers: vec![
            Buffer {
                name: "x".into(),
                input: Some("x".into()),
                output: None,
                bytes: None,
            },
            Buffer {
                name: "y".into(),
                input: None,
                output: Some(0),
                bytes: None,
            },
        ],
        launches: vec![Launch {
            kernel: "copy4".into(),
            grid: [n4.div_ceil(block) as u32, 1, 1],
            block: [block as u32, 1, 1],
            shared_bytes: 0,
            args: vec![
                Arg::Buffer("x".into()),
                Arg::Buffer("y".into()),
                Arg::I64(n4 as i64),
            ],
        }],
    };
    let problem = ProblemSource {
        name: "copy".into(),
        code: String::new(),
        graph: Some(GraphSource::Intent {
            text: COPY_INTENT.into(),
            shapes,
            dtype: None,
        }),
    };
    let exe = std::env::current_exe().context("cannot find the mtmc binary")?;
    let mut native = NativeEvaluator::new(exe.into(), None, Protocol::KERNELBENCH_FP32, timeout);
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let candidate = Candidate::Cuda {
        name: "copy".into(),
        program,
    };
    let mut o = runtime.block_on(native.evaluate(&problem, &candidate))?;
    if o.status != Status::Correct {
        bail!(
            "the copy kernel that measures the bandwidth was {}: {}",
            o.status.name(),
            o.why.or(o.error).unwrap_or_default()
        );
    }
    if let Some(spec) = find_device(&builtin_devices(), o.device.as_deref().unwrap_or("")) {
        o.add_roofline(&g, spec);
    }
    o.achieved.map(|a| a.bandwidth_gbps).context(
        "the copy ran on a GPU mtmc has no figures for, so its bytes per second are unknown",
    )
}

/// One row of the bandwidth table: a family's memory-bound problems whose
/// best program is kernels only (no library call), against the copy.
#[derive(Debug, Serialize)]
pub struct FamilyBandwidth {
    /// The family.
    pub family: String,
    /// Its memory-bound problems with a correct program of kernels only.
    pub problems: usize,
    /// Median GB/s.
    pub median_gbps: f64,
    /// Median over the copy's GB/s.
    pub median_of_copy: f64,
    /// Lowest over the copy's GB/s, and its problem.
    pub lowest_of_copy: f64,
    /// The problem with the lowest.
    pub lowest: String,
    /// Problems at 70 % of the copy or more.
    pub at_70_percent: usize,
}

/// The bandwidth table's rows, by family.
fn bandwidth_table(records: &[&Record], copy_gbps: f64) -> Vec<FamilyBandwidth> {
    let mut by: BTreeMap<&str, Vec<(&str, f64)>> = BTreeMap::new();
    for r in records {
        // A program with a library call measures the library too.
        if let (true, 0, Some(gbps), false) = (
            r.memory_bound,
            r.library_calls,
            r.bandwidth_gbps,
            r.family.is_empty(),
        ) && r.status == "correct"
        {
            by.entry(&r.family).or_default().push((&r.problem, gbps));
        }
    }
    by.into_iter()
        .map(|(family, mut v)| {
            v.sort_by(|a, b| a.1.total_cmp(&b.1));
            let n = v.len();
            let median = if n % 2 == 1 {
                v[n / 2].1
            } else {
                0.5 * (v[n / 2 - 1].1 + v[n / 2].1)
            };
            FamilyBandwidth {
                family: family.to_string(),
                problems: n,
                median_gbps: median,
                median_of_copy: median / copy_gbps,
                lowest_of_copy: v[0].1 / copy_gbps,
                lowest: v[0].0.to_string(),
                at_70_percent: v.iter().filter(|x| x.1 >= 0.7 * copy_gbps).count(),
            }
        })
        .collect()
}

/// The reason on the log's first rolled-back or failed variant (the
/// plainest variant, tried first).
fn first_failure(log: &[u8]) -> String {
    String::from_utf8_lossy(log)
        .lines()
        .find_map(|l| {
            let (_, why) = l.split_once(": ")?;
            (why.contains("rolled back") || why.contains("incorrect") || why.contains("error"))
                .then(|| why.trim().to_string())
        })
        .unwrap_or_else(|| "no variant was correct".into())
}

/// One line per finished problem.
fn bench_line(r: &Record) -> String {
    let mut line = format!("{:<58} {:<18}", r.problem, r.status);
    if let (Some(ms), Some(e)) = (r.mean_ms, r.speedup_eager) {
        line += &format!(" {ms:>9.4} ms  x{e:.3} eager");
        if let Some(c) = r.speedup_compile {
            line += &format!("  x{c:.3} compile");
        }
    } else if let Some(why) = &r.why {
        line += " ";
        line += why.lines().next().unwrap_or("");
    }
    if r.call_library_only {
        line += "  [call-library only]";
    } else if r.library_calls > 0 && r.status == "correct" {
        line += &format!("  [{} library call(s)]", r.library_calls);
    }
    line
}

fn print_table(
    out: &mut dyn std::io::Write,
    levels: &BTreeMap<String, Metrics>,
    gpu: bool,
) -> Result<()> {
    let opt = |v: Option<f64>, pct: bool| match v {
        Some(x) if pct => format!("{:.0}%", 100.0 * x),
        Some(x) => format!("{x:.3}"),
        None => "-".into(),
    };
    if !gpu {
        writeln!(
            out,
            "| level | problems | compiled (not run) | of which call-library only |"
        )?;
        writeln!(out, "|---|---|---|---|")?;
        for (name, m) in levels {
            writeln!(
                out,
                "| {name} | {} | {} | {} |",
                m.problems, m.compiled_only, m.compiled_only_call_library_only
            )?;
        }
        writeln!(
            out,
            "\nno GPU: programs were compiled with NVRTC; nothing was run or timed, so correctness and speed are unknown"
        )?;
        return Ok(());
    }
    writeln!(
        out,
        "| level | problems | correct | of which call-library only | fast_0 | fast_1 | fast_2 | geomean vs eager | geomean vs compile | mean roofline | judged correct |"
    )?;
    writeln!(out, "|---|---|---|---|---|---|---|---|---|---|---|")?;
    for (name, m) in levels {
        writeln!(
            out,
            "| {name} | {} | {} | {} | {:.0}% | {:.0}% | {:.0}% | {} | {} | {} | {} of {} |",
            m.problems,
            m.correct,
            m.correct_call_library_only,
            100.0 * m.fast[0],
            100.0 * m.fast[1],
            100.0 * m.fast[2],
            opt(m.geomean_vs_eager, false),
            opt(m.geomean_vs_compile, false),
            opt(m.mean_roofline_fraction, true),
            opt(m.judged_correct_fraction, true),
            m.judged,
        )?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn graph(text: &str, shapes: &str) -> OpGraph {
        let bindings = mtmc_actions::intent::Bindings {
            shapes: mtmc_actions::intent::parse_shapes(shapes).unwrap(),
            dtype: None,
        };
        mtmc_actions::intent::compile(text, &bindings).unwrap()
    }

    #[test]
    fn a_family_is_the_op_classes_with_pointwise_left_out_beside_others() {
        assert_eq!(family(&graph("y = relu(x) * 2.0", "x=4x8")), "pointwise");
        assert_eq!(family(&graph("y = sum(relu(x), dim=1)", "x=4x8")), "reduce");
        assert_eq!(
            family(&graph("y = softmax(x @ w, dim=1)", "x=4x8,w=8x8")),
            "matmul+softmax"
        );
    }

    fn record(problem: &str, family: &str, gbps: f64) -> Record {
        Record {
            problem: problem.into(),
            level: 1,
            target: "cuda".into(),
            strict: false,
            status: "correct".into(),
            why: None,
            family: family.into(),
            memory_bound: true,
            bandwidth_gbps: Some(gbps),
            call_library_only: false,
            kernels: 1,
            library_calls: 0,
            judged: 1,
            judged_correct: 1,
            mean_ms: Some(1.0),
            eager_ms: None,
            compile_ms: None,
            speedup_eager: None,
            speedup_compile: None,
            roofline_fraction: None,
            seconds: 1.0,
            dir: String::new(),
        }
    }

    #[test]
    fn the_bandwidth_table_takes_memory_bound_kernels_by_family_against_the_copy() {
        let library_only = Record {
            call_library_only: true,
            library_calls: 1,
            ..record("L1/4", "reduce", 2900.0)
        };
        let with_a_library_call = Record {
            library_calls: 1,
            ..record("L2/1", "conv", 600.0)
        };
        let compute_bound = Record {
            memory_bound: false,
            ..record("L1/5", "reduce", 100.0)
        };
        let wrong = Record {
            status: "no_correct_variant".into(),
            ..record("L1/6", "reduce", 100.0)
        };
        let records = [
            record("L1/1", "pointwise", 2400.0),
            record("L1/2", "reduce", 1500.0),
            record("L1/3", "reduce", 2700.0),
            library_only,
            with_a_library_call,
            compute_bound,
            wrong,
        ];
        let refs: Vec<&Record> = records.iter().collect();
        let rows = bandwidth_table(&refs, 3000.0);
        assert_eq!(rows.len(), 2);
        let (p, r) = (&rows[0], &rows[1]);
        assert_eq!(
            (p.family.as_str(), p.problems, p.at_70_percent),
            ("pointwise", 1, 1)
        );
        assert!((p.median_of_copy - 0.8).abs() < 1e-12);
        assert_eq!(
            (r.family.as_str(), r.problems, r.at_70_percent),
            ("reduce", 2, 1)
        );
        assert!((r.median_gbps - 2100.0).abs() < 1e-9);
        assert!((r.lowest_of_copy - 0.5).abs() < 1e-12);
        assert_eq!(r.lowest, "L1/2");
    }
}

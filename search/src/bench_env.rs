//! `mtmc bench-env`: how fast the environment judges candidates.
//!
//! For each benchmark problem (an L1 elementwise one and an L2 GEMM with an
//! epilogue), copies of one hand-written candidate go through the whole
//! protocol (compile + 5 correctness trials + timed trials) with the worker
//! warm: on the fast path (NVRTC through cupy; Triton), and once on the slow
//! path (load_inline, as KernelBench builds `ModelNew` files). Each copy
//! differs in a comment, so no compile cache serves it. The table gives the
//! median wall seconds per candidate, candidates per minute, and the slow
//! path over the fast path, all measured in this run. With a screen, the
//! fast-path copies are screened too (`screen N` rows: the first correctness
//! trial and N timed calls, as exploration screens).

use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use mtmc_env::bench::{self, CANDIDATES};
use mtmc_env::evaluator::{Candidate, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings};
use mtmc_env::outcome::{Outcome, Status};
use mtmc_env::worker::{Protocol, WorkerSlot};

use crate::fmt::table;
use crate::source::{Problems, cache_dir};

/// What `mtmc bench-env` was asked to do.
pub struct Request<'a> {
    /// Problems path.
    pub kernelbench: Option<&'a Path>,
    /// Fast-path copies per problem.
    pub copies: u32,
    /// Triton copies per problem that has a Triton candidate.
    pub triton_copies: u32,
    /// Also time the load_inline path (about a minute per problem).
    pub slow: bool,
    /// Wall-clock limit per candidate.
    pub timeout: Duration,
    /// Also screen the fast-path copies with this many timed calls.
    pub screen: Option<u32>,
    /// Where to write every outcome as JSON.
    pub json: Option<&'a Path>,
}

struct Row {
    problem: String,
    path: bench::Path,
    /// The screen's timed calls, for a row of screens.
    screen: Option<u32>,
    walls: Vec<f64>,
    outcomes: Vec<Outcome>,
}

impl Row {
    fn median(&self) -> Option<f64> {
        median(&self.walls)
    }
}

/// The median of `values` (none when there are none).
pub(crate) fn median(values: &[f64]) -> Option<f64> {
    if values.is_empty() {
        return None;
    }
    let mut v = values.to_vec();
    v.sort_by(f64::total_cmp);
    let n = v.len();
    Some(if n % 2 == 1 {
        v[n / 2]
    } else {
        0.5 * (v[n / 2 - 1] + v[n / 2])
    })
}

/// Runs the benchmark and prints the table last.
pub fn run(out: &mut dyn std::io::Write, req: Request<'_>) -> Result<()> {
    let problems = Problems::load(req.kernelbench)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let tag = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut names: Vec<&str> = CANDIDATES.iter().map(|c| c.problem).collect();
    names.dedup();
    let mut rows: Vec<Row> = Vec::new();
    let mut prepared = Vec::new();
    for name in names {
        let p = problems.find(name)?;
        crate::source::require_code("bench-env", &[p])?;
        let problem = ProblemSource {
            name: format!("{}.py", p.name),
            code: p.code.clone(),
            graph: None,
        };
        let settings = WorkerSettings {
            protocol: Protocol::KERNELBENCH_FP32,
            baselines: vec!["eager".into(), "compile".into()],
            baseline_cache: cache_dir().map(|d| d.join("baselines")),
            limit: req.timeout,
            ..WorkerSettings::default()
        };
        let mut ev = WorkerEvaluator::new(WorkerSlot::new(None), settings);
        eprintln!("{p}: reference outputs and baselines (eager, torch.compile)…");
        let began = Instant::now();
        let report = runtime
            .block_on(ev.prepare(&problem))
            .with_context(|| format!("preparing {p}"))?;
        if report["status"] == "not_run" {
            bail!("bench-env needs a GPU: {}", report["why"]);
        }
        let prep = began.elapsed().as_secs_f64();
        eprintln!("{p}: ready in {prep:.1} s");
        prepared
            .push(serde_json::json!({"problem": p.full_name(), "seconds": prep, "report": report}));
        // Each candidate judged, then the fast path's screened too.
        let mut passes = Vec::new();
        for c in CANDIDATES.iter().filter(|c| c.problem == name) {
            passes.push((c, None));
            if c.path == bench::Path::Nvrtc && req.screen.is_some() {
                passes.push((c, req.screen));
            }
        }
        for (c, screen) in passes {
            let copies = match c.path {
                bench::Path::Nvrtc => req.copies,
                bench::Path::Triton => req.triton_copies,
                bench::Path::LoadInline => u32::from(req.slow),
            };
            let mut row = Row {
                problem: p.full_name(),
                path: c.path,
                screen,
                walls: Vec::new(),
                outcomes: Vec::new(),
            };
            ev.settings.screen = screen;
            let pass = screen.map_or(String::new(), |n| format!(" screen {n}"));
            for k in 0..copies {
                let candidate = Candidate::Python {
                    name: format!("{}#{k}", c.file),
                    code: bench::with_nonce(c, &format!("mtmc bench-env {tag}{pass} copy {k}")),
                };
                let o = runtime
                    .block_on(ev.evaluate(&problem, &candidate))
                    .with_context(|| format!("evaluating {}", candidate.name()))?;
                eprintln!(
                    "  {}{pass} {}/{copies}: {} in {:.2} s{}",
                    c.path.name(),
                    k + 1,
                    o.status.name(),
                    o.wall_seconds,
                    o.speedup_vs("eager")
                        .map_or(String::new(), |s| format!(", {s:.3}x eager"))
                );
                row.walls.push(o.wall_seconds);
                row.outcomes.push(o);
            }
            if copies > 0 {
                rows.push(row);
            }
        }
        write_json(req.json, &prepared, &rows)?;
    }
    print_table(out, &rows)
}

fn write_json(path: Option<&Path>, prepared: &[serde_json::Value], rows: &[Row]) -> Result<()> {
    let Some(path) = path else { return Ok(()) };
    let rows: Vec<serde_json::Value> = rows
        .iter()
        .map(|r| {
            serde_json::json!({
                "problem": r.problem,
                "path": r.path.name(),
                "screen": r.screen,
                "wall_seconds": r.walls,
                "outcomes": r.outcomes,
            })
        })
        .collect();
    let text =
        serde_json::to_string_pretty(&serde_json::json!({"prepare": prepared, "rows": rows}))
            .expect("the report serializes");
    std::fs::write(path, text + "\n").with_context(|| format!("cannot write `{}`", path.display()))
}

fn print_table(out: &mut dyn std::io::Write, rows: &[Row]) -> Result<()> {
    let fmt = |v: Option<f64>, p: usize| v.map_or("-".to_string(), |v| format!("{v:.p$}"));
    // A screen's rows give no speedup (`Outcome::speedup_vs` is the full
    // protocol's only).
    let table_rows: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            let correct = r
                .outcomes
                .iter()
                .filter(|o| o.status == Status::Correct)
                .count();
            let total: f64 = r.walls.iter().sum();
            let speedups = |b: &str| -> Vec<f64> {
                r.outcomes.iter().filter_map(|o| o.speedup_vs(b)).collect()
            };
            vec![
                r.problem.clone(),
                match r.screen {
                    Some(n) => format!("{}, screen {n}", r.path.name()),
                    None => r.path.name().to_string(),
                },
                r.walls.len().to_string(),
                correct.to_string(),
                fmt(r.median(), 2),
                fmt(r.walls.iter().copied().reduce(f64::min), 2),
                fmt(r.walls.iter().copied().reduce(f64::max), 2),
                fmt(
                    (total > 0.0).then(|| 60.0 * r.walls.len() as f64 / total),
                    1,
                ),
                fmt(median(&speedups("eager")), 3),
                fmt(median(&speedups("compile")), 3),
            ]
        })
        .collect();
    writeln!(out)?;
    write!(
        out,
        "{}",
        table(
            &[
                "PROBLEM",
                "PATH",
                "N",
                "CORRECT",
                "MEDIAN S",
                "MIN S",
                "MAX S",
                "CAND/MIN",
                "VS EAGER",
                "VS COMPILE"
            ],
            &table_rows,
            &[2, 3, 4, 5, 6, 7, 8, 9]
        )
    )?;
    let mut problems: Vec<&str> = rows.iter().map(|r| r.problem.as_str()).collect();
    problems.dedup();
    for p in problems {
        let of = |path| {
            rows.iter()
                .find(|r| r.problem == p && r.path == path && r.screen.is_none())
                .and_then(Row::median)
        };
        if let (Some(fast), Some(slow)) = (of(bench::Path::Nvrtc), of(bench::Path::LoadInline)) {
            writeln!(
                out,
                "{p}: load_inline {slow:.2} s / nvrtc {fast:.2} s per candidate = {:.1}x",
                slow / fast
            )?;
        }
    }
    Ok(())
}

//! `mtmc eval`: run one candidate `ModelNew` through the KernelBench
//! protocol in the evaluation worker and print the outcome.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mtmc_env::worker::{EvalOutcome, Protocol, WorkerError, WorkerSlot, evaluate};

use crate::source::Problems;

/// What `mtmc eval` was asked to do.
pub struct Request<'a> {
    /// Problems path.
    pub kernelbench: Option<&'a Path>,
    /// Problem name.
    pub problem: &'a str,
    /// Candidates' Python sources (each defines `ModelNew`), evaluated in
    /// order by one worker slot.
    pub candidates: &'a [std::path::PathBuf],
    /// Timed trials.
    pub trials: u32,
    /// Wall-clock limit for each candidate's evaluation.
    pub timeout: Duration,
    /// Where to write the outcome as JSON.
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
    let mut sources = Vec::new();
    for path in req.candidates {
        let code = std::fs::read_to_string(path)
            .with_context(|| format!("cannot read candidate `{}`", path.display()))?;
        let name = path
            .file_name()
            .map_or("candidate.py".into(), |n| n.to_string_lossy().into_owned());
        sources.push((name, code));
    }
    let protocol = Protocol {
        trials: req.trials,
        ..Protocol::KERNELBENCH_FP32
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let problem = (format!("{}.py", p.name), p.code.clone());
    let mut slot = WorkerSlot::new(None);
    let mut outcomes = Vec::new();
    for (name, code) in &sources {
        let outcome = runtime.block_on(evaluate(
            &mut slot,
            (&problem.0, &problem.1),
            (name, code),
            &protocol,
            req.timeout,
        ));
        let outcome = match outcome {
            Err(WorkerError::Failed(e)) if e.contains("No module named 'torch'") => bail!(
                "{} has no torch, which evaluation needs: install it there, or set MTMC_PYTHON to a Python that has it",
                mtmc_env::python::interpreter().to_string_lossy()
            ),
            other => other?,
        };
        if outcome.status == "not_run" {
            bail!(
                "nothing was run: {}",
                outcome
                    .why
                    .as_deref()
                    .unwrap_or("the worker could not run the candidate")
            );
        }
        print(out, name, &outcome)?;
        out.flush()?;
        outcomes.push(serde_json::json!({"candidate": name, "outcome": outcome}));
    }
    writeln!(
        out,
        "{p}: {} candidate(s), {} worker start(s)",
        outcomes.len(),
        slot.starts
    )?;
    if let Some(path) = req.json {
        let text = serde_json::to_string_pretty(&outcomes).expect("outcomes serialize");
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}

fn print(out: &mut dyn std::io::Write, candidate: &str, o: &EvalOutcome) -> Result<()> {
    writeln!(out, "{candidate}: {}", o.status)?;
    for (label, value) in [("error", &o.error), ("why", &o.why)] {
        if let Some(v) = value {
            // The first line; the JSON output keeps the whole text.
            writeln!(out, "  {label}: {}", v.lines().next().unwrap_or_default())?;
        }
    }
    if let Some(index) = &o.first_bad_index {
        writeln!(
            out,
            "  first bad element {index:?}: expected {}, got {}",
            o.expected.unwrap_or(f64::NAN),
            o.got.unwrap_or(f64::NAN)
        )?;
    }
    if let (Some(n), Some(err)) = (o.trials_run, o.max_abs_err) {
        write!(out, "  {n} correctness trial(s), max abs error {err:.3e}")?;
        match o.rel_to_scale {
            Some(r) => writeln!(out, " ({r:.2e} of the output's scale)")?,
            None => writeln!(out)?,
        }
    }
    if let Some(s) = o.load_seconds {
        writeln!(out, "  load (compile) {s:.2} s")?;
    }
    if let Some(r) = &o.runtime {
        writeln!(
            out,
            "  candidate  mean {:.4} ms  median {:.4} ms  std {:.4} ms  ({} trials)",
            r.mean_ms, r.median_ms, r.std_ms, r.trials
        )?;
    }
    if let Some(b) = &o.baseline_eager {
        writeln!(
            out,
            "  eager      mean {:.4} ms  median {:.4} ms  std {:.4} ms",
            b.mean_ms, b.median_ms, b.std_ms
        )?;
    }
    if let Some(s) = o.speedup_vs_eager() {
        writeln!(out, "  speedup vs eager {s:.3}x")?;
    }
    Ok(())
}

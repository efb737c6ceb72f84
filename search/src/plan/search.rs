//! `mtmc optimize --planner`: a planned search on one problem, its
//! report and the best program judged again.

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mtmc_planner::store::Store;

use super::choice::Choice;
use super::episode::{Gpus, PlanSettings, plan_problem};
use crate::interrupt::Interrupted;
use crate::optimize::ProblemJudge;

/// What `mtmc optimize --planner` was asked to do.
pub struct OptimizeRequest<'a> {
    /// The stop a signal asks for, read between items of work: the
    /// binary's [`Interrupt::catch`], or an [`Interrupt::new`] a caller
    /// sets itself.
    pub stop: crate::interrupt::Interrupt,
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// The problem.
    pub name: &'a str,
    /// The planner.
    pub planner: Choice,
    /// The search's settings.
    pub settings: PlanSettings,
    /// Where the steps are recorded, if anywhere.
    pub store: Option<&'a Path>,
    /// Where the best program and the report go.
    pub out_dir: &'a Path,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Seed (the random planner).
    pub seed: u64,
    /// Let the trained policy's STOP end the search early.
    pub policy_stops: bool,
}

/// The store a checkpoint was trained on (`trajectories` in its
/// `train.json`), opened for its knowledge-base priors; none, with a
/// warning, when it is not there.
fn trained_knowledge(out: &mut dyn std::io::Write, dir: &Path) -> Result<Option<Store>> {
    let recorded = std::fs::read_to_string(dir.join("train.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["trajectories"].as_str().map(PathBuf::from));
    match recorded {
        Some(path) if path.exists() => {
            writeln!(
                out,
                "knowledge base: {} (the store the planner was trained on)",
                path.display()
            )?;
            Ok(Some(Store::open_to_read(&path)?))
        }
        other => {
            writeln!(
                out,
                "warning: {}: the planner's moves are chosen without the knowledge base it learned with; pass --trajectories with that store",
                match other {
                    Some(path) => format!(
                        "the store it was trained on, `{}`, is not here",
                        path.display()
                    ),
                    None => format!(
                        "`{}` does not name the store it was trained on",
                        dir.join("train.json").display()
                    ),
                }
            )?;
            Ok(None)
        }
    }
}

/// A planner-guided search on one KernelBench problem.
pub fn optimize(out: &mut dyn std::io::Write, req: OptimizeRequest<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let p = problems.find(req.name)?;
    let g = problems
        .graphs(&[p])?
        .remove(0)
        .graph
        .map_err(|e| {
            anyhow::anyhow!(
                "{p} has no graph: {e}; a planner has nothing to choose there (`mtmc optimize {}` without --planner writes its whole forward as the problem's own code)",
                p.full_name()
            )
        })?;
    let gpus = Gpus::probe();
    let gpu = gpus.any();
    if !gpu {
        writeln!(
            out,
            "no GPU: every program is judged by compile only (nothing is run or timed)"
        )?;
    }
    // Ctrl-C stops the search between rounds: the best program so far is
    // written, the round in flight is not kept.
    let stop = req.stop.clone();
    let mut judge = ProblemJudge::new(gpu, req.timeout, true, false).stopping_on(&stop);
    let mut loaded = req.planner.load(req.seed)?.policy_stops(req.policy_stops);
    let mut store = req.store.map(Store::open).transpose()?;
    if let Some(s) = &store {
        gpus.claim(out, s)?;
    }
    let knowledge = match (&req.planner, req.store) {
        (Choice::Trained(dir), None) => trained_knowledge(out, dir)?,
        _ => None,
    };
    let r = plan_problem(
        out,
        p,
        &g,
        &mut judge,
        &mut loaded,
        &req.settings,
        store.as_mut(),
        knowledge.as_ref(),
        Some(req.out_dir),
        req.seed,
    )?;
    let report = req.out_dir.join("report.json");
    if r.interrupted {
        let spent = format!(
            "after {} of {} evaluation(s)",
            r.evaluations, req.settings.budget
        );
        return Err(Interrupted(if r.wrote {
            format!(
                "stopped {spent}; the best program so far ({}) is in {}",
                match r.best {
                    b if b > 0.0 => format!("{b:.3}x"),
                    _ => "compiled only: nothing was timed".into(),
                },
                req.out_dir.display()
            )
        } else {
            format!(
                "stopped {spent}, before any program was correct; the attempts are in {}",
                report.display()
            )
        })
        .into());
    }
    if !r.wrote {
        bail!(
            "no program was correct in {} evaluation(s); the attempts are in {}",
            r.evaluations,
            report.display()
        );
    }
    if let Some(again) = r.rejudged {
        add_rejudged(&report, r.best, again)?;
    }
    Ok(())
}

/// Adds to the search's report the best program's speedup as found and as
/// judged once more.
fn add_rejudged(path: &Path, found: f64, again: f64) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read `{}`", path.display()))?;
    let mut report: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("`{}` is not the report JSON", path.display()))?;
    report["best_speedup"] = serde_json::json!({ "found": found, "judged_again": again });
    std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("cannot write `{}`", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_report_gets_the_best_speedup_found_and_judged_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("report.json");
        std::fs::write(&path, r#"{"subject": "L2/97", "attempts": [1, 2]}"#).unwrap();
        add_rejudged(&path, 1.31, 1.18).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["subject"], "L2/97");
        assert_eq!(v["attempts"], serde_json::json!([1, 2]));
        assert_eq!(
            v["best_speedup"],
            serde_json::json!({"found": 1.31, "judged_again": 1.18})
        );
        std::fs::write(&path, "not json").unwrap();
        let err = add_rejudged(&path, 1.0, 1.0).unwrap_err();
        assert!(
            format!("{err:#}").contains("is not the report JSON"),
            "{err:#}"
        );
    }
}

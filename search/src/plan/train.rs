//! `mtmc train`: PPO and the reward-to-go model on the recorded tree.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use mtmc_env::outcome::Status;
use mtmc_planner::features::Problem as PlanProblem;
use mtmc_planner::policy::Checkpoint;
use mtmc_planner::ppo::PpoConfig;
use mtmc_planner::space::Move;
use mtmc_planner::store::Store;
use mtmc_planner::tree::{self, TreeProblem};

use super::split::{Split, held_out};
use crate::interrupt::Interrupted;

/// A warning when programs recorded for `problems` were compiled only
/// (recorded where no GPU was found, so nothing timed them): how many, and
/// `all` or `some` for what follows when it is every one or not.
pub(super) fn compiled_only_warning(
    problems: &[TreeProblem],
    all: &str,
    some: &str,
) -> Option<String> {
    let total: usize = problems.iter().map(|p| p.evals.len()).sum();
    let only = problems
        .iter()
        .flat_map(|p| p.evals.values())
        .filter(|d| d.status == Status::CompiledOnly)
        .count();
    (only > 0).then(|| {
        let (which, so) = if only == total {
            (format!("all {total}"), all)
        } else {
            (format!("{only} of the {total}"), some)
        };
        format!(
            "warning: {which} recorded programs were compiled only (recorded where no GPU was found): nothing timed them, so {so}; record them with `mtmc explore` on a GPU"
        )
    })
}

/// What `mtmc train` was asked to do.
pub struct TrainRequest<'a> {
    /// The stop a signal asks for, read between items of work: the
    /// binary's [`Interrupt::catch`], or an [`Interrupt::new`] a caller
    /// sets itself.
    pub stop: crate::interrupt::Interrupt,
    /// The store.
    pub store: &'a Path,
    /// The checkpoint folder.
    pub out_dir: &'a Path,
    /// Iterations in all.
    pub iterations: usize,
    /// PPO's settings.
    pub ppo: PpoConfig,
    /// Continue from the checkpoint in `out_dir`.
    pub resume: bool,
    /// Where PPO runs.
    pub device: mtmc_planner::policy::Device,
    /// Leave the validation problems out too.
    pub validation: bool,
    /// Policies in the committee (1: one policy).
    pub members: usize,
    /// The GPU whose outcomes to read (`--gpu NAME`; none: the store's).
    pub gpu: Option<&'a str>,
}

/// Trains the policy on the training problems' recorded tree, then the
/// reward-to-go model, and reports its ranking quality on the held-out
/// problems' steps.
pub fn train(out: &mut dyn std::io::Write, req: TrainRequest<'_>) -> Result<()> {
    if !req.device.available() {
        return Err(mtmc_planner::train::TrainError::NoCuda.into());
    }
    let cost = req.ppo.step_cost;
    if !(cost.is_finite() && cost >= 0.0) {
        bail!(
            "--step-cost {cost}: give a cost of 0 or more (0, the default, charges nothing per evaluation)"
        );
    }
    let store = Store::open_to_read(req.store)?;
    let gpu = store.gpu_for(req.gpu)?;
    // The problems it trains on: those the knowledge base may read.
    let split = if req.validation {
        Split::Validation
    } else {
        Split::Train
    };
    let trains = |name: &str| split.knows(name);
    let all = tree::load(&store, &trains)?;
    let (train, test): (Vec<TreeProblem>, Vec<TreeProblem>) =
        all.into_iter().partition(|p| trains(&p.problem.name));
    if train.is_empty() {
        bail!(
            "`{}` has no recorded training problem: run `mtmc explore --split train` first",
            req.store.display()
        );
    }
    let checkpoint = Checkpoint::at(req.out_dir);
    if !req.resume && checkpoint.exists() {
        bail!(
            "`{}` already holds a checkpoint: pass --resume to continue it, or another --out",
            req.out_dir.display()
        );
    }
    let members = req.members.max(1);
    // A resumed committee goes on with every member it has: fewer would
    // leave trained members out of it without a word (more train the new
    // ones, as a run with that many from the start would).
    let resuming = req.resume && checkpoint.exists();
    let held = match resuming {
        true => checkpoint.meta()?.members.len() + 1,
        false => 1,
    };
    if members < held {
        bail!(
            "checkpoint `{}` is a committee of {held}: resume it with --members {held} (or more, to add members), or train another --out",
            req.out_dir.display()
        );
    }
    // Member k (1-based) trains with seed + k - 1; the first is the
    // folder itself.
    let member_name = |k: usize| format!("member-{k}");
    let member_dir = |k: usize| match k {
        1 => req.out_dir.to_path_buf(),
        _ => req.out_dir.join(member_name(k)),
    };
    let transitions: usize = train.iter().map(|p| p.evals.len()).sum();
    // Ctrl-C stops training after the iteration in flight, its checkpoint
    // and curves written: `--resume` continues it exactly.
    let stop = req.stop.clone();
    writeln!(
        out,
        "train: {} training problem(s) ({} recorded programs{}), {} held out{}; {} iteration(s) of {} episodes on the {}, discount {}{}{}",
        train.len(),
        transitions,
        gpu.map_or(String::new(), |g| format!(", judged on the {g}")),
        test.len(),
        if req.validation {
            " (test and validation)"
        } else {
            ""
        },
        req.iterations,
        req.ppo.episodes,
        req.device.name(),
        req.ppo.gamma,
        if members > 1 {
            format!(
                "; a committee of {members} (seeds {}..={})",
                req.ppo.seed,
                req.ppo.seed + members as u64 - 1
            )
        } else {
            String::new()
        },
        match (resuming, members > held) {
            (true, true) => format!(", resuming (the committee of {held} grows to {members})"),
            (true, false) => ", resuming".to_string(),
            (false, _) => String::new(),
        }
    )?;
    let unflagged = store.problems_without_rewrite_flags()?;
    if let Some(first) = unflagged.first() {
        writeln!(
            out,
            "warning: {} problem(s) ({first}{}) were recorded by an mtmc before the graph features flagged the rewrites that apply; they read as if none applied. `mtmc explore` records a problem again when it runs an episode on it (`--episodes` one more than the store holds)",
            unflagged.len(),
            if unflagged.len() > 1 { ", …" } else { "" }
        )?;
    }
    if let Some(line) = compiled_only_warning(
        &train,
        "this checkpoint learns nothing of speed",
        "they teach the planner nothing of speed",
    ) {
        writeln!(out, "{line}")?;
    }
    let train = Arc::new(train);
    let t0 = Instant::now();
    let mut finals = Vec::new();
    let mut rows = Vec::new();
    for k in 1..=members {
        let dir = member_dir(k);
        let ppo = mtmc_planner::ppo::PpoConfig {
            seed: req.ppo.seed + k as u64 - 1,
            ..req.ppo.clone()
        };
        let bar = ProgressBar::new(req.iterations as u64);
        let prefix = if members > 1 {
            format!("member {k}/{members} ")
        } else {
            String::new()
        };
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{prefix}{{bar:30}} {{pos}}/{{len}} [{{elapsed}} < {{eta}}] {{msg}}"
            ))
            .expect("a valid template"),
        );
        let member_rows = mtmc_planner::train::train(
            req.device,
            mtmc_planner::train::Run {
                problems: train.clone(),
                config: &ppo,
                iterations: req.iterations,
                dir: &dir,
                resume: req.resume && Checkpoint::at(&dir).exists(),
                members: match k {
                    1 => (2..=members).map(member_name).collect(),
                    _ => Vec::new(),
                },
            },
            |r| {
                bar.set_position(r.iteration as u64);
                bar.set_message(format!(
                    "return {:.3}, best {:.3}x, entropy {:.3}",
                    r.mean_return, r.best_speedup, r.entropy
                ));
                match stop.requested() {
                    true => std::ops::ControlFlow::Break(()),
                    false => std::ops::ControlFlow::Continue(()),
                }
            },
        )?;
        bar.finish_and_clear();
        let done = member_rows.last().map_or(0, |r| r.iteration);
        if let (Some(first), Some(last)) = (member_rows.first(), member_rows.last()) {
            writeln!(
                out,
                "{prefix}iterations {}..{}: mean return {:.3} -> {:.3}, best speedup (geomean) {:.3}x -> {:.3}x, entropy {:.3} -> {:.3}, value loss {:.4} -> {:.4}",
                first.iteration,
                last.iteration,
                first.mean_return,
                last.mean_return,
                first.best_speedup,
                last.best_speedup,
                first.entropy,
                last.entropy,
                first.value_loss,
                last.value_loss
            )?;
        }
        finals.push(serde_json::json!({
            "folder": dir.display().to_string(),
            "seed": ppo.seed,
            "last": member_rows.last(),
        }));
        if k == 1 {
            rows = member_rows;
            // The first member's every meta names the others (a
            // committee cut short is refused until `--resume` finishes
            // it); one that trained no iteration more here, resumed with
            // more members, is named them now.
            if checkpoint.exists() {
                let mut meta = checkpoint.meta()?;
                meta.members = (2..=members).map(member_name).collect();
                checkpoint.write_meta(&meta)?;
            }
        }
        if stop.requested() {
            return Err(Interrupted(format!(
                "stopped {}after iteration {done} of {}; the checkpoint in {} holds every finished iteration: run the same command with --resume to finish it",
                if members > 1 {
                    format!("in member {k}/{members} ")
                } else {
                    String::new()
                },
                req.iterations,
                req.out_dir.display()
            ))
            .into());
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    // The reward-to-go model: fitted on the training problems' steps,
    // ranked on the held-out ones'. It reads the observations as recorded:
    // steps recorded by an mtmc whose observations had another length are
    // left out, and without any step to fit on no model is written (one
    // fitted on nothing would rerank the policy's moves by chance).
    let mut steps = store.steps()?;
    // A problem's graph features are those of every step of it: steps
    // recorded before a graph feature existed read it as this build does.
    let problems: std::collections::BTreeMap<String, PlanProblem> = store
        .problems()?
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect();
    for s in &mut steps {
        if let Some(p) = problems.get(&s.problem) {
            p.restore(&mut s.observation);
        }
    }
    let samples = mtmc_planner::rtg::samples(&steps);
    let stop = Move::Stop.index();
    let stale: Vec<usize> = steps
        .iter()
        .filter(|s| s.action != stop && s.observation.len() != mtmc_planner::features::OBS)
        .map(|s| s.observation.len())
        .collect();
    let left_out = stale.len();
    let other: std::collections::BTreeSet<usize> = stale.into_iter().collect();
    let (fit, rest): (Vec<_>, Vec<_>) = samples.into_iter().partition(|s| trains(&s.problem));
    let held: Vec<_> = rest.into_iter().filter(|s| held_out(&s.problem)).collect();
    let ranking = if fit.is_empty() {
        for f in ["rtg.json", "rtg.mpk"] {
            let path = req.out_dir.join(f);
            if path.exists() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove `{}`", path.display()))?;
            }
        }
        writeln!(
            out,
            "reward-to-go: no model written: no training problem's recorded step holds an observation of this mtmc's {} numbers{}; the trained planner follows its policy alone (record steps with this mtmc's `explore` to fit one)",
            mtmc_planner::features::OBS,
            if other.is_empty() {
                String::new()
            } else {
                format!(
                    " ({left_out} step(s) recorded with {} numbers)",
                    other
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(" or ")
                )
            }
        )?;
        None
    } else {
        let rtg = mtmc_planner::rtg::fit(&fit, 64, 60, req.ppo.seed);
        mtmc_planner::rtg::save(&rtg, req.out_dir, 64).map_err(anyhow::Error::msg)?;
        let ranking = mtmc_planner::rtg::ranking(&rtg, &held);
        writeln!(
            out,
            "reward-to-go: fitted on {} step(s); on {} held-out step(s): {}{}",
            fit.len(),
            ranking.samples,
            if ranking.pairs > 0 {
                format!(
                    "Spearman {:.3}, pairwise accuracy {:.3} over {} pair(s)",
                    ranking.spearman, ranking.pairwise, ranking.pairs
                )
            } else {
                "no pair to rank (record steps of the held-out problems to measure the ranking)"
                    .to_string()
            },
            if left_out > 0 {
                format!(
                    "; {left_out} step(s) with observations of another length (another mtmc's) left out"
                )
            } else {
                String::new()
            }
        )?;
        Some(ranking)
    };
    let summary = serde_json::json!({
        // The knowledge base the policy's observations were built from;
        // `optimize --planner` reads its priors there.
        "trajectories": std::fs::canonicalize(req.store)
            .unwrap_or_else(|_| req.store.to_path_buf())
            .display()
            .to_string(),
        "iterations": rows.len(),
        "seconds": seconds,
        // Whether the validation problems were left out too.
        "validation": req.validation,
        "ppo": req.ppo,
        "members": finals,
        "reward_to_go": ranking,
        "curves": rows,
    });
    let path = req.out_dir.join("train.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")
        .with_context(|| format!("cannot write `{}`", path.display()))?;
    writeln!(
        out,
        "wrote {}: policy.mpk, optimizer.mpk, {}curves.csv, curves.svg, train.json{} ({seconds:.1} s)",
        req.out_dir.display(),
        if ranking.is_some() { "rtg.mpk, " } else { "" },
        match members {
            1 => String::new(),
            2 => format!(
                ", and member {} (its own policy and curves)",
                member_name(2)
            ),
            _ => format!(
                ", and members {}..{} (each its own policy and curves)",
                member_name(2),
                member_name(members)
            ),
        }
    )?;
    Ok(())
}

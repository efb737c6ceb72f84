//! `mtmc explore` (episodes that fill the trajectory store) and
//! `mtmc merge` (stores joined into one).

use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Result, bail};
use mtmc_planner::store::Store;

use super::choice::Choice;
use super::counted;
use super::enumerate::{BEYOND, Beyond, Recording, enumerate_problem, extend_problem, kinds_mask};
use super::episode::{Gpus, PlanSettings, plan_problem};
use super::rejudge::chosen;
use super::split::Split;
use crate::interrupt::Interrupted;
use crate::optimize::ProblemJudge;

/// What `mtmc explore` was asked to do.
pub struct ExploreRequest<'a> {
    /// The stop a signal asks for, read between items of work: the
    /// binary's [`Interrupt::catch`], or an [`Interrupt::new`] a caller
    /// sets itself.
    pub stop: crate::interrupt::Interrupt,
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// Problems by name.
    pub names: &'a [String],
    /// Whole levels.
    pub levels: &'a [u32],
    /// Which side of the split.
    pub split: Split,
    /// The planner that explores.
    pub planner: Choice,
    /// Episodes per problem.
    pub episodes: usize,
    /// Evaluations per episode.
    pub budget: usize,
    /// The store.
    pub store: &'a Path,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Seed.
    pub seed: u64,
    /// Action kinds (`KINDS`): with the exhaustive planner, evaluate the
    /// programs one such move beyond the recorded ones instead
    /// (`extend_problem`), in the order it says.
    pub beyond: Beyond<'a>,
    /// Judge again the recorded programs whose code changed
    /// ([`Reuse::Unchanged`](super::judging::Reuse::Unchanged)).
    pub rejudge_changed: bool,
    /// Screen each round's programs before the full protocol (on a GPU).
    pub screening: Option<crate::screen::Screening>,
}

/// `mtmc merge`: copies each store of `from`, in order, into `into`.
pub fn merge(out: &mut dyn std::io::Write, into: &Path, from: &[PathBuf]) -> Result<()> {
    // Every source must be there before the target is created.
    if let Some(missing) = from.iter().find(|f| !f.is_file()) {
        return Err(mtmc_planner::store::StoreError::no_file(missing).into());
    }
    let mut store = Store::open(into)?;
    for source in from {
        let m = store.merge(source)?;
        writeln!(
            out,
            "{}: {} episode(s), {} step(s) and {} newly judged program(s) merged; {} problem(s) new to {}{}{}{}{}",
            source.display(),
            m.episodes,
            m.steps,
            m.evaluations,
            m.problems,
            into.display(),
            counted(m.skipped, |n| format!(
                "; {n} episode(s) it already held skipped"
            )),
            counted(m.replaced, |n| format!(
                "; {n} program(s) it had judged with another outcome now hold this store's"
            )),
            counted(m.kept, |n| format!(
                "; {n} program(s) it compiled only (no GPU) keep the outcome {} had from a GPU",
                into.display()
            )),
            m.named_gpu
                .as_ref()
                .map(|g| format!(
                    "; {} named no GPU and now names the one {} names, the {g}",
                    into.display(),
                    source.display()
                ))
                .unwrap_or_default()
        )?;
    }
    Ok(())
}

/// Runs episodes on each chosen problem, recording them; problems with
/// enough finished episodes of this planner in the store are skipped, so a
/// stopped run resumes.
pub fn explore(out: &mut dyn std::io::Write, req: ExploreRequest<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let chosen = chosen(&problems, req.names, req.levels, req.split)?;
    crate::source::require_code("explore", &chosen)?;
    kinds_mask("--beyond", req.beyond.kinds)?;
    if req.beyond.shallow_first && req.beyond.kinds.is_empty() {
        bail!(
            "--shallow-first orders the parents of the programs --beyond judges: give --beyond KIND (with --planner exhaustive) too"
        );
    }
    if !req.beyond.kinds.is_empty() && !matches!(req.planner, Choice::Exhaustive) {
        bail!(
            "--beyond enumerates the programs beyond the recorded ones, which only the exhaustive planner does: add --planner exhaustive"
        );
    }
    let mut store = Store::open(req.store)?;
    let gpus = Gpus::probe();
    gpus.claim(out, &store)?;
    let mut loaded = req.planner.load(req.seed)?;
    let gpu = gpus.any();
    // Ctrl-C stops between rounds: every step finished is kept, the
    // episode in flight is left unfinished (run again to resume).
    let stop = req.stop.clone();
    let mut judge = ProblemJudge::with_baselines(gpu, req.timeout, true, &["eager"], false)
        .stopping_on(&stop)
        .screening(req.screening);
    let name = if req.beyond.kinds.is_empty() {
        loaded.planner.name()
    } else {
        BEYOND
    };
    let done = store.finished_episodes(name)?;
    let work: Vec<(&mtmc_actions::problem::Problem, usize)> = chosen
        .iter()
        .map(|p| {
            (
                *p,
                req.episodes
                    .saturating_sub(done.get(&p.full_name()).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let total: usize = work.iter().map(|w| w.1).sum();
    writeln!(
        out,
        "explore: {} problem(s), {} episode(s) to run ({} already in {}); planner {}, budget {}; {}",
        chosen.len(),
        total,
        chosen.len() * req.episodes - total,
        req.store.display(),
        if req.beyond.kinds.is_empty() {
            name.to_string()
        } else {
            format!(
                "{name} (one {} move beyond the recorded programs, {})",
                req.beyond.kinds.join(" or "),
                if req.beyond.shallow_first {
                    "the parents nearest the library program first"
                } else {
                    "the fastest parents first"
                }
            )
        },
        req.budget,
        if gpu {
            crate::cluster::judged_on()
        } else {
            "no GPU: compile only, nothing is run or timed".into()
        }
    )?;
    let graphs = problems.graphs(&work.iter().map(|w| w.0).collect::<Vec<_>>())?;
    let bar = crate::fmt::progress_bar(total as u64);
    let settings = PlanSettings {
        budget: req.budget,
        near_roofline: f64::INFINITY,
        verbose: false,
        reuse: true,
        rejudge_changed: req.rejudge_changed,
        rejudge: false,
        knowledge: req.split,
    };
    let mut log = Vec::new();
    let mut changed = 0;
    // Where a signal stopped the run: the episode, and the episodes after
    // it not started.
    let mut stopped: Option<(String, usize)> = None;
    let mut started = 0;
    let began = std::time::Instant::now();
    'problems: for ((p, n), traced) in work.iter().zip(graphs) {
        let g = match traced.graph {
            Ok(g) => g,
            Err(e) => {
                bar.suspend(|| writeln!(out, "{}: no graph ({e}); skipped", p.full_name()))?;
                bar.inc(*n as u64);
                started += n;
                continue;
            }
        };
        for k in 0..*n {
            if stop.requested() {
                stopped = Some((
                    format!("before {} episode {}", p.full_name(), k + 1),
                    total - started - 1,
                ));
                break 'problems;
            }
            started += 1;
            bar.set_message(format!("{} episode {}", p.full_name(), k + 1));
            log.clear();
            let seed = req.seed.wrapping_add(k as u64);
            let r = if !req.beyond.kinds.is_empty() {
                extend_problem(
                    &mut log,
                    p,
                    &g,
                    &mut judge,
                    req.budget,
                    req.beyond,
                    &mut Recording {
                        store: &mut store,
                        version: &loaded.version,
                        seed,
                        knowledge: req.split,
                        rejudge_changed: req.rejudge_changed,
                    },
                )
            } else if matches!(req.planner, Choice::Exhaustive) {
                enumerate_problem(
                    &mut log,
                    p,
                    &g,
                    &mut judge,
                    req.budget,
                    &mut Recording {
                        store: &mut store,
                        version: &loaded.version,
                        seed,
                        knowledge: req.split,
                        rejudge_changed: req.rejudge_changed,
                    },
                )
            } else {
                plan_problem(
                    &mut log,
                    p,
                    &g,
                    &mut judge,
                    &mut loaded,
                    &settings,
                    Some(&mut store),
                    None,
                    None,
                    seed,
                )
            };
            match r {
                Ok(r) => bar.suspend(|| {
                    changed += r.changed;
                    if r.interrupted {
                        stopped = Some((
                            format!("in {} episode {}", p.full_name(), k + 1),
                            total - started,
                        ));
                    }
                    writeln!(
                        out,
                        "{}: episode {}: best {:.3}x in {} evaluation(s){}{}",
                        p.full_name(),
                        k + 1,
                        r.best,
                        r.evaluations,
                        if req.rejudge_changed {
                            format!(", {} of them recorded programs judged again", r.changed)
                        } else {
                            String::new()
                        },
                        if r.interrupted {
                            "; interrupted: its steps are kept, the episode is left unfinished"
                        } else {
                            ""
                        }
                    )
                })?,
                Err(e) => {
                    bar.suspend(|| writeln!(out, "{}: episode failed: {e:#}", p.full_name()))?
                }
            }
            bar.inc(1);
            if stopped.is_some() {
                break 'problems;
            }
        }
    }
    bar.finish_and_clear();
    if let (true, Some(s)) = (gpu, req.screening) {
        let minutes = began.elapsed().as_secs_f64() / 60.0;
        writeln!(
            out,
            "screening: {} program(s) screened ({} timed calls each), {} of them within {:.0}% of their problem's fastest screen and given the full protocol; {:.1} programs judged a minute",
            judge.screened,
            s.calls,
            judge.promoted,
            100.0 * s.margin,
            if minutes > 0.0 {
                judge.screened as f64 / minutes
            } else {
                0.0
            }
        )?;
    }
    if req.rejudge_changed {
        writeln!(
            out,
            "{changed} recorded program(s) judged again: this build writes other code for them than the code judged, or the store kept no hash of that code"
        )?;
    }
    writeln!(
        out,
        "store: {} ({} steps in all)",
        req.store.display(),
        store.steps()?.len()
    )?;
    match stopped {
        Some((at, left)) => Err(Interrupted(format!(
            "stopped {at}{}; every finished step is kept: run again to resume",
            counted(left, |n| format!(", {n} episode(s) after it not started"))
        ))
        .into()),
        None => Ok(()),
    }
}

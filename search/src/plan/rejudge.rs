//! `mtmc rejudge`: the recorded programs judged again, and what changed.

use std::path::Path;
use std::time::Duration;

use anyhow::{Result, bail};
use indicatif::ProgressBar;
use mtmc_actions::graph::OpGraph;
use mtmc_planner::space::{Config, Move};
use mtmc_planner::store::{Store, correct_speedup};

use super::counted;
use super::enumerate::recorded_walk;
use super::episode::Gpus;
use super::judging::{Judging, Reuse, Round, failed_running, reusable};
use super::split::Split;
use crate::interrupt::Interrupted;
use crate::optimize::ProblemJudge;

/// What [`rejudge_problem`] found on one problem.
pub struct Rejudged {
    /// Recorded programs the walk reached (each built once).
    pub reached: usize,
    /// Of those, the ones judged again: this build writes other code (on
    /// a GPU, also those recorded compiled only). In a dry run, those
    /// whose code changed.
    pub judged: usize,
    /// In a dry run, the programs whose code is unchanged but that were
    /// recorded compiled only: a rejudge on a GPU judges them too.
    pub untimed: usize,
    /// With `failed`, the programs whose recorded judging failed while
    /// they ran ([`failed_running`]): judged again, whether their code
    /// changed or not (in a dry run, those whose code is unchanged are
    /// counted here, the others as changed).
    pub failed: usize,
    /// Of those, the ones whose new outcome the store kept (a compile-only
    /// outcome never replaces a timed one).
    pub kept: usize,
    /// Of those judged again, the ones out of GPU memory beside the kept
    /// reference outputs and so judged with them recomputed for each
    /// check (`Outcome::references_recomputed`).
    pub recomputed: usize,
    /// Recorded programs no walk from the library program reaches through
    /// recorded programs (keys this build's moves no longer make).
    pub unreached: Vec<String>,
    /// The program judged again whose speedup moved most, with its
    /// recorded and new speedups (correct both times).
    pub moved: Option<(String, f64, f64)>,
    /// In a dry run, the keys of the programs whose code changed, in the
    /// walk's order.
    pub changed: Vec<String>,
    /// Whether a signal stopped the walk before its end.
    pub interrupted: bool,
    /// Programs in flight when the signal came, whose new outcomes were
    /// not kept: the signal may have ended their workers, so their
    /// outcome says nothing of their code. The next rejudge judges them.
    pub dropped: usize,
}

/// How many of a problem's changed programs a dry run names.
const NAMED: usize = 5;

/// `mtmc rejudge` on one problem: every recorded program of it, reached
/// from the library program by moves through recorded programs, breadth
/// first, is built; where its fragments' hash differs from the recorded
/// one (a coder change since it was judged) it is judged again, and its
/// new outcome replaces the recorded one in the store's evaluations. No
/// episode or step is recorded: the steps keep what their episodes saw.
/// Once the judge's stop is asked for it judges no further round, and
/// keeps nothing of the round in flight.
pub fn rejudge_problem(
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    store: &mut Store,
    bar: &ProgressBar,
    req: &RejudgeRequest<'_>,
) -> Result<Rejudged> {
    let (dry_run, failed) = (req.dry_run, req.failed);
    let mut j = Judging::new(p, g, judge)?;
    j.retry_failed = failed;
    let name = j.problem.name.clone();
    let recorded = store.evaluations(&name)?;
    let mut walk: Vec<Config> = recorded_walk(&recorded, j.problem.shape)
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    let seen: std::collections::BTreeSet<String> = walk.iter().map(Config::key).collect();
    walk.retain(|c| recorded.contains_key(&c.key()));
    let mut out = Rejudged {
        reached: walk.len(),
        judged: 0,
        untimed: 0,
        failed: 0,
        kept: 0,
        recomputed: 0,
        unreached: recorded
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect(),
        moved: None,
        changed: Vec::new(),
        interrupted: false,
        dropped: 0,
    };
    bar.set_length(bar.length().unwrap_or(0) + walk.len() as u64);
    j.prebuild(&walk);
    if dry_run {
        // What a rejudge would judge: the programs whose code changed and,
        // on a GPU, those recorded where no GPU timed them.
        for c in &walk {
            if judge.stop_requested() {
                out.interrupted = true;
                break;
            }
            bar.inc(1);
            let d = &recorded[&c.key()];
            if !j.same_code(store, c, d)?.0 {
                out.judged += 1;
                out.changed.push(c.key());
            } else if !reusable(d, true) {
                out.untimed += 1;
            } else if failed && failed_running(d) {
                out.failed += 1;
            }
        }
        return Ok(out);
    }
    let per = judge.in_flight().max(1);
    for round in walk.chunks(per) {
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|c| (Move::Stop, c.clone(), c.key()))
            .collect();
        let evaluated = match j.evaluate(judge, Reuse::Unchanged(&*store), &asked)? {
            Round::Judged(e) => e,
            Round::Dropped(n) => {
                out.interrupted = true;
                out.dropped = n;
                break;
            }
        };
        out.judged += evaluated.iter().filter(|e| !e.reused).count();
        for (ev, c) in evaluated.into_iter().zip(round) {
            bar.inc(1);
            if ev.reused {
                continue;
            }
            let key = c.key();
            out.failed += usize::from(failed && failed_running(&recorded[&key]));
            out.recomputed +=
                usize::from(ev.outcome.as_ref().is_some_and(|o| o.references_recomputed));
            if store.judged_again(&name, &key, &ev.diagnosis, &ev.hash)? {
                out.kept += 1;
            }
            let old = recorded.get(&key).and_then(correct_speedup);
            let new = correct_speedup(&ev.diagnosis);
            if let (Some(a), Some(b)) = (old, new) {
                let far = |x: f64, y: f64| (y / x).ln().abs();
                if out
                    .moved
                    .as_ref()
                    .is_none_or(|(_, x, y)| far(a, b) > far(*x, *y))
                {
                    out.moved = Some((key, a, b));
                }
            }
        }
    }
    Ok(out)
}

/// `; changed: KEY, KEY, …` for a dry run's changed programs (the first
/// `NAMED`, and how many more), or nothing.
pub(super) fn named(changed: &[String]) -> String {
    if changed.is_empty() {
        return String::new();
    }
    let shown = changed[..changed.len().min(NAMED)].join(", ");
    match changed.len().saturating_sub(NAMED) {
        0 => format!("; changed: {shown}"),
        more => format!("; changed: {shown} and {more} more"),
    }
}

/// The problems `names` and `levels` choose of `problems`, on `split`'s
/// side; an error where that leaves none.
pub(super) fn chosen<'p>(
    problems: &'p crate::source::Problems,
    names: &[String],
    levels: &[u32],
    split: Split,
) -> Result<Vec<&'p mtmc_actions::problem::Problem>> {
    problems.check_levels(levels)?;
    let mut chosen = problems.choose(names, |p| levels.contains(&p.level))?;
    chosen.retain(|p| split.keeps(&p.full_name()));
    if chosen.is_empty() {
        bail!("no problem chosen: name problems or pass --level N (and check --split)");
    }
    Ok(chosen)
}

/// What `mtmc rejudge` was asked to do.
pub struct RejudgeRequest<'a> {
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
    /// The store.
    pub store: &'a Path,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Only count what would be judged again: build, judge nothing, write
    /// nothing.
    pub dry_run: bool,
    /// Also judge again the programs whose recorded judging failed while
    /// they ran ([`failed_running`]), their code unchanged.
    pub failed: bool,
    /// The GPU the store must be of (`--gpu NAME`; none: the store's).
    pub gpu: Option<&'a str>,
}

/// `mtmc rejudge`: [`rejudge_problem`] on each chosen problem the store
/// holds programs of, a line per problem.
pub fn rejudge(out: &mut dyn std::io::Write, req: RejudgeRequest<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let mut chosen = chosen(&problems, req.names, req.levels, req.split)?;
    if !req.store.is_file() {
        return Err(mtmc_planner::store::StoreError::no_file(req.store).into());
    }
    // Judging needs each problem's code for its ModelNew: say so once.
    crate::source::require_code("rejudge", &chosen)?;
    if req.dry_run {
        // The coder compiles every fragment it writes and falls back where
        // one fails: without NVRTC it writes other programs than the ones
        // recorded, and every one would read as changed.
        let nvrtc = mtmc_env::probe::nvrtc(None);
        if !nvrtc.ok {
            bail!(
                "rejudge --dry-run builds every program as the coder does, compiling each fragment with NVRTC: {}; {}",
                nvrtc.detail,
                nvrtc.fix.unwrap_or_default()
            );
        }
    }
    let mut store = if req.dry_run {
        Store::open_to_read(req.store)?
    } else {
        Store::open(req.store)?
    };
    store.gpu_for(req.gpu)?;
    let held: std::collections::BTreeSet<String> =
        store.problems()?.into_iter().map(|p| p.name).collect();
    chosen.retain(|p| held.contains(&p.full_name()));
    let gpu = if req.dry_run {
        false
    } else {
        let gpus = Gpus::probe();
        gpus.claim(out, &store)?;
        gpus.any()
    };
    // Ctrl-C stops between rounds: the line of the problem it stopped on is
    // written, and what was judged is kept.
    let stop = req.stop.clone();
    writeln!(
        out,
        "rejudge: {} problem(s) with recorded programs in {}; {}",
        chosen.len(),
        req.store.display(),
        if req.dry_run {
            "a dry run: programs built and counted, none judged, nothing written".into()
        } else if gpu {
            crate::cluster::judged_on()
        } else {
            "no GPU: compile only (a compile-only outcome never replaces a timed one)".into()
        }
    )?;
    let mut judge =
        ProblemJudge::with_baselines(gpu, req.timeout, true, &["eager"], false).stopping_on(&stop);
    let graphs = problems.graphs(&chosen)?;
    let bar = crate::fmt::progress_bar(0);
    let (mut judged, mut kept, mut untimed, mut failed, mut with_work) = (0, 0, 0, 0, 0);
    let mut stopped: Option<(String, usize)> = None;
    let total = chosen.len();
    for (i, (p, traced)) in chosen.iter().zip(graphs).enumerate() {
        if stop.requested() {
            stopped.get_or_insert((format!("before {}", p.full_name()), total - i));
            break;
        }
        bar.set_message(p.full_name());
        let g = match traced.graph {
            Ok(g) => g,
            Err(e) => {
                bar.suspend(|| writeln!(out, "{}: no graph ({e}); skipped", p.full_name()))?;
                continue;
            }
        };
        match rejudge_problem(p, &g, &mut judge, &mut store, &bar, &req) {
            Ok(r) => {
                judged += r.judged;
                kept += r.kept;
                untimed += r.untimed;
                failed += r.failed;
                with_work += usize::from(r.judged > 0);
                if r.interrupted {
                    stopped = Some((format!("on {}", p.full_name()), total - i - 1));
                }
                bar.suspend(|| {
                    writeln!(
                        out,
                        "{}: {} recorded program(s) reached, {} {}{}{}{}{}{}",
                        p.full_name(),
                        r.reached,
                        r.judged,
                        if req.dry_run {
                            format!(
                                "to judge again (their code changed){}{}",
                                counted(r.untimed, |n| format!(
                                    ", {n} compiled only (judged too on a GPU)"
                                )),
                                counted(r.failed, |n| format!(
                                    ", {n} failed while running (judged too)"
                                ))
                            )
                        } else if r.failed > 0 {
                            format!(
                                "judged again ({} had failed while running), {} kept",
                                r.failed, r.kept
                            )
                        } else {
                            format!("judged again, {} kept", r.kept)
                        },
                        counted(r.recomputed, |n| format!(
                            " ({n} out of GPU memory beside the kept reference outputs, judged with them recomputed)"
                        )),
                        r.moved
                            .as_ref()
                            .map(|(k, a, b)| format!("; most moved: {k} {a:.3}x -> {b:.3}x"))
                            .unwrap_or_default(),
                        if r.unreached.is_empty() {
                            String::new()
                        } else {
                            format!(
                                "; {} recorded program(s) no move reaches now, left as recorded",
                                r.unreached.len()
                            )
                        },
                        named(&r.changed),
                        if r.interrupted {
                            format!(
                                "; interrupted{}",
                                counted(r.dropped, |n| format!(
                                    ": the {n} program(s) in flight not kept"
                                ))
                            )
                        } else {
                            String::new()
                        }
                    )
                })?;
            }
            Err(e) => bar.suspend(|| writeln!(out, "{}: failed: {e:#}", p.full_name()))?,
        }
    }
    bar.finish_and_clear();
    // What an interrupted run says after its summary, as the error.
    let interrupted = |(at, left): (String, usize), what: &str| {
        Interrupted(format!(
            "stopped {at}{}; {what}",
            counted(left, |n| format!(", {n} problem(s) after it not started"))
        ))
    };
    if req.dry_run {
        writeln!(
            out,
            "{judged} recorded program(s) on {with_work} problem(s) to judge again (this build writes other code for them){}{}; nothing judged or written: run without --dry-run to judge them",
            counted(untimed, |n| format!(
                ", and {n} recorded compiled only that a rejudge on a GPU judges too"
            )),
            counted(failed, |n| format!(
                ", and {n} whose judging failed while they ran (--failed)"
            ))
        )?;
        return match stopped {
            Some(s) => {
                Err(interrupted(s, "the counts above are partial: run again for whole ones").into())
            }
            None => Ok(()),
        };
    }
    writeln!(
        out,
        "{judged} recorded program(s) judged again (this build writes other code for them{}), {kept} new outcome(s) kept in {}",
        counted(failed, |n| format!(
            ", or their judging failed while they ran: {n}"
        )),
        req.store.display()
    )?;
    match stopped {
        Some(s) => Err(interrupted(s, "every outcome above is kept: run again to resume").into()),
        None => Ok(()),
    }
}

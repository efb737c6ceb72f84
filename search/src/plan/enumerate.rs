//! Exhaustive enumeration of a problem's programs (the recorded tree),
//! and its extension beyond the recorded moves (`exhaustive-beyond`).

use anyhow::{Result, bail};
use mtmc_actions::graph::OpGraph;
use mtmc_planner::episode::{Episode, Reward};
use mtmc_planner::features::{Problem as PlanProblem, observe};
use mtmc_planner::space::{ACTIONS, Config, Move};
use mtmc_planner::store::{Store, correct_speedup, now};

use super::episode::EpisodeResult;
use super::judging::{Evaluated, Judging, Reuse, Round};
use super::split::Split;
use crate::optimize::ProblemJudge;

/// Exhaustive search within the budget: every program reachable from the
/// library one, in breadth-first order of the moves that reach it (nearest
/// first), up to `budget` of them, each recorded as a step from the
/// program it was reached from. It builds the complete trajectory tree of
/// small problems, against which the other planners are compared.
pub fn enumerate_problem(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    budget: usize,
    rec: &mut Recording<'_>,
) -> Result<EpisodeResult> {
    let mut j = Judging::new(p, g, judge)?;
    let open = rec.begin(&j, "exhaustive")?;
    let (problem, prior) = (&open.problem, &open.prior);
    let reward = Reward::default();
    let mut e = Episode::new(problem.shape, budget);
    let start = Config::library(problem.shape);
    let mut queue = std::collections::VecDeque::from([(
        start.clone(),
        Move::CallLibrary(mtmc_planner::space::Slot::All),
        start,
    )]);
    let mut queued: std::collections::BTreeSet<String> = ["library".to_string()].into();
    let mut bests = Vec::new();
    let mut interrupted = false;
    while e.step < budget && !queue.is_empty() && !interrupted {
        // Up to one program per worker, in breadth-first order.
        let take = judge.in_flight().min(budget - e.step).min(queue.len());
        let round: Vec<(Config, Move, Config)> = queue.drain(..take).collect();
        let started = now();
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|(_, m, next)| (*m, next.clone(), format!("{} -> {}", m.label(), next.key())))
            .collect();
        let judged = match j.evaluate(
            judge,
            Reuse::of(Some(&*rec.store), true, rec.rejudge_changed),
            &asked,
        )? {
            Round::Judged(judged) => judged,
            Round::Dropped(_) => {
                interrupted = true;
                break;
            }
        };
        for ((ev, (parent, m, next)), (_, _, label)) in judged.into_iter().zip(round).zip(&asked) {
            e.config = parent.clone();
            let obs = observe(problem, &e, prior);
            let r = e.record(m, next.clone(), ev.diagnosis.clone(), &reward);
            bests.push(e.best_speedup());
            rec.step(
                out, &open, ev, &e, &parent, m, &next, label, r, obs, started,
            )?;
            for m in Move::all().filter(|&m| m != Move::Stop) {
                if let Some(c) = next.apply(m, problem.shape)
                    && queued.insert(c.key())
                {
                    queue.push_back((next.clone(), m, c));
                }
            }
        }
    }
    rec.end(&j, &open, e.best_speedup(), e.step, bests, interrupted)
}

/// The library program's configuration, then those of the recorded
/// programs (`recorded`'s keys) that moves through recorded programs reach
/// from it, breadth first, in the order of the moves; each with its depth
/// (the fewest moves that reach it from the library program, 0 for that
/// one).
pub(super) fn recorded_walk<V>(
    recorded: &std::collections::BTreeMap<String, V>,
    shape: mtmc_planner::space::Shape,
) -> Vec<(Config, usize)> {
    let start = Config::library(shape);
    let mut seen: std::collections::BTreeSet<String> = [start.key()].into();
    let mut walk = vec![(start, 0)];
    let mut i = 0;
    while i < walk.len() {
        let (from, depth) = walk[i].clone();
        i += 1;
        for m in Move::all().filter(|&m| m != Move::Stop) {
            if let Some(c) = from.apply(m, shape)
                && recorded.contains_key(&c.key())
                && seen.insert(c.key())
            {
                walk.push((c, depth + 1));
            }
        }
    }
    walk
}

/// The names of the action kinds `explore --beyond` takes.
pub const KINDS: [&str; 8] = [
    "call_library",
    "custom_kernel",
    "fuse",
    "split",
    "retile",
    "vectorize",
    "rewrite",
    "cuda_graph",
];

/// The moves of the action kinds `kinds` (`KINDS`, named by the flag
/// `flag`), as a mask over the flat index ([`mtmc_planner::space::of_kinds`]);
/// an unknown kind is an error that lists the kinds.
pub fn kinds_mask(flag: &str, kinds: &[String]) -> Result<[bool; ACTIONS]> {
    if let Some(k) = kinds.iter().find(|k| !KINDS.contains(&k.as_str())) {
        bail!(
            "{flag} {k}: not an action kind; give one of {}",
            KINDS.join(", ")
        );
    }
    let kinds: Vec<&str> = kinds.iter().map(String::as_str).collect();
    Ok(mtmc_planner::space::of_kinds(&kinds))
}

/// The planner name `explore --beyond` records its episodes under.
pub const BEYOND: &str = "exhaustive-beyond";

/// Which unrecorded programs `explore --beyond` judges: the moves, and the
/// order of the parents they are made from.
#[derive(Clone, Copy)]
pub struct Beyond<'a> {
    /// Action kinds (`KINDS`) whose moves make the programs.
    pub kinds: &'a [String],
    /// The parents fewest moves from the library program first (the
    /// fastest first among those), instead of the fastest first.
    pub shallow_first: bool,
}

/// Evaluates up to `budget` programs that one move of `beyond.kinds` makes
/// from a recorded correct program of `p` and that the store has no
/// outcome for: the parents fastest first (or, `beyond.shallow_first`,
/// nearest the library program first, then fastest), each parent's moves
/// in index order. The recorded programs are those reached from the
/// library program through recorded programs. Each evaluation is one step
/// of a `BEYOND` episode, observed and rewarded as the second step of an
/// episode whose best so far is the parent, so that its reward is what the
/// move earned over the program it refined.
pub fn extend_problem(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    budget: usize,
    beyond: Beyond<'_>,
    rec: &mut Recording<'_>,
) -> Result<EpisodeResult> {
    let mut j = Judging::new(p, g, judge)?;
    let recorded = rec.store.evaluations(&j.problem.name)?;
    let open = rec.begin(&j, BEYOND)?;
    let (problem, prior) = (&open.problem, &open.prior);
    let shape = problem.shape;
    let moves = kinds_mask("--beyond", beyond.kinds)?;
    // The unrecorded programs a move of `kinds` makes from a correct
    // recorded one that the library program reaches, with the parent's
    // depth and speedup.
    let mut candidates: Vec<(usize, f64, Config, Move, Config)> = Vec::new();
    let mut queued: std::collections::BTreeSet<String> = Default::default();
    for (c, depth) in recorded_walk(&recorded, shape) {
        let Some(speedup) = recorded.get(&c.key()).and_then(correct_speedup) else {
            continue;
        };
        for m in Move::all().filter(|&m| m != Move::Stop && moves[m.index()]) {
            if let Some(next) = c.apply(m, shape)
                && !recorded.contains_key(&next.key())
                && queued.insert(next.key())
            {
                candidates.push((depth, speedup, c.clone(), m, next));
            }
        }
    }
    // Fastest parents first (shallowest first, if asked); a stable sort
    // keeps each parent's moves in index order.
    if beyond.shallow_first {
        candidates.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
    } else {
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
    }
    candidates.truncate(budget);
    let ahead: Vec<Config> = candidates.iter().map(|(.., next)| next.clone()).collect();
    j.prebuild(&ahead);
    let reward = Reward::default();
    let mut best = recorded
        .values()
        .filter_map(correct_speedup)
        .fold(0.0, f64::max);
    let mut bests = Vec::new();
    let mut done = 0;
    let mut interrupted = false;
    while done < candidates.len() && !interrupted {
        let take = judge.in_flight().min(candidates.len() - done);
        let round = &candidates[done..done + take];
        done += take;
        let started = now();
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|(_, _, parent, m, next)| {
                (
                    *m,
                    next.clone(),
                    format!("{} -> {} -> {}", parent.key(), m.label(), next.key()),
                )
            })
            .collect();
        let judged = match j.evaluate(judge, Reuse::Nothing, &asked)? {
            Round::Judged(judged) => judged,
            Round::Dropped(_) => {
                done -= take;
                interrupted = true;
                break;
            }
        };
        for (ev, ((_, _, parent, m, next), (_, _, label))) in
            judged.into_iter().zip(round.iter().zip(&asked))
        {
            // An episode at its second step, the parent its best so far.
            let mut e = Episode::new(shape, mtmc_planner::ppo::PpoConfig::default().max_steps);
            let parent_diagnosis = recorded[&parent.key()].clone();
            e.record(Move::Stop, parent.clone(), parent_diagnosis, &reward);
            let obs = observe(problem, &e, prior);
            let r = e.record(*m, next.clone(), ev.diagnosis.clone(), &reward);
            best = best.max(correct_speedup(&ev.diagnosis).unwrap_or(0.0));
            bests.push(best);
            rec.step(out, &open, ev, &e, parent, *m, next, label, r, obs, started)?;
        }
    }
    rec.end(&j, &open, best, done, bests, interrupted)
}

/// Where an enumerating episode (`enumerate_problem`, `extend_problem`)
/// is recorded.
pub struct Recording<'a> {
    /// The store.
    pub store: &'a mut Store,
    /// The planner version its rows carry.
    pub version: &'a str,
    /// The episode's seed.
    pub seed: u64,
    /// The problems whose recorded steps the priors read: those this
    /// split [`Split::knows`].
    pub knowledge: Split,
    /// Judge again the recorded programs whose code changed
    /// ([`Reuse::Unchanged`]) instead of taking every recorded outcome.
    pub rejudge_changed: bool,
}

/// An episode [`Recording::begin`] opened: the problem as the store holds
/// it, its knowledge-base priors, the episode's id.
struct Opened {
    problem: PlanProblem,
    prior: [f32; ACTIONS],
    id: i64,
}

impl Recording<'_> {
    /// Stores `j`'s problem and opens an episode of `planner` on it.
    fn begin(&mut self, j: &Judging<'_>, planner: &str) -> Result<Opened> {
        let problem = j.problem.clone();
        self.store.put_problem(&problem)?;
        let knowledge = self.knowledge;
        let prior = self
            .store
            .prior(&problem.pattern, &problem.name, &|n| knowledge.knows(n))?;
        let id = self
            .store
            .begin_episode(&problem.name, planner, self.version, self.seed)?;
        Ok(Opened { problem, prior, id })
    }

    /// Prints the step that judged `next` (reached from `parent` by `m`;
    /// `e` has recorded it) and records it.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        out: &mut dyn std::io::Write,
        open: &Opened,
        ev: Evaluated,
        e: &Episode,
        parent: &Config,
        m: Move,
        next: &Config,
        label: &str,
        reward: f64,
        obs: Vec<f32>,
        started: f64,
    ) -> Result<()> {
        writeln!(
            out,
            "  {label}: {} (reward {reward:+.3})",
            ev.diagnosis.text()
        )?;
        let record = ev.step(open.id, e, parent.key(), obs, m, next, reward, started)?;
        self.store.add_step(&open.problem, self.version, &record)?;
        Ok(())
    }

    /// Ends the episode with `best` after `evaluations` steps; `bests`
    /// holds the best speedup after each. An episode a signal stopped
    /// (`interrupted`) is left unfinished: its steps are kept, and the
    /// next run of its planner runs it again.
    fn end(
        &mut self,
        j: &Judging<'_>,
        open: &Opened,
        best: f64,
        evaluations: usize,
        bests: Vec<f64>,
        interrupted: bool,
    ) -> Result<EpisodeResult> {
        if !interrupted {
            self.store.end_episode(open.id, best)?;
        }
        Ok(EpisodeResult {
            best,
            evaluations,
            bests,
            wrote: j.found.best.is_some(),
            rejudged: None,
            changed: j.changed,
            interrupted,
        })
    }
}

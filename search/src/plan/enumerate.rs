//! Exhaustive enumeration of a problem's programs (the recorded tree),
//! and its extension beyond the recorded moves (`exhaustive-beyond`):
//! walks in an order fixed ahead, each a planner of the search loop
//! ([`crate::steps::run`]).

use anyhow::{Result, bail};
use mtmc_actions::graph::OpGraph;
use mtmc_env::outcome::Outcome;
use mtmc_planner::episode::{Episode, Reward};
use mtmc_planner::features::{Problem as PlanProblem, observe};
use mtmc_planner::space::{ACTIONS, Config, Move};
use mtmc_planner::store::{Store, correct_speedup, now};

use super::episode::EpisodeResult;
use super::judging::{Evaluated, Judging, Prepared, Reuse, ToJudge, judge_round};
use super::split::Split;
use crate::optimize::ProblemJudge;
use crate::steps::{Found, Proposal};

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
    let j = Judging::new(p, g, judge)?;
    let open = rec.begin(&j, "exhaustive")?;
    let start = Config::library(open.problem.shape);
    let walk = Exhaustive {
        e: Episode::new(open.problem.shape, budget),
        budget,
        queue: [(
            start.clone(),
            Move::CallLibrary(mtmc_planner::space::Slot::All),
            start,
        )]
        .into(),
        queued: ["library".to_string()].into(),
    };
    let reuse = Reusing {
        reuse: true,
        changed: rec.rejudge_changed,
    };
    walk_problem(out, p, judge, j, rec, open, walk, reuse)
}

/// The exhaustive walk: the queue of programs to judge, breadth first,
/// each with the program and move that reach it, and the episode that
/// records them.
struct Exhaustive {
    e: Episode,
    budget: usize,
    queue: std::collections::VecDeque<(Config, Move, Config)>,
    /// The keys of every configuration queued so far.
    queued: std::collections::BTreeSet<String>,
}

impl Walk for Exhaustive {
    fn done(&self) -> bool {
        self.e.step >= self.budget || self.queue.is_empty()
    }

    fn best(&self) -> f64 {
        self.e.best_speedup()
    }

    fn round(&mut self, slots: usize) -> Vec<(Step, String)> {
        let take = slots.min(self.budget - self.e.step).min(self.queue.len());
        self.queue
            .drain(..take)
            .map(|step| {
                let label = format!("{} -> {}", step.1.label(), step.2.key());
                (step, label)
            })
            .collect()
    }

    fn judged(&mut self, open: &Opened, (parent, m, next): Step, ev: &Evaluated) -> Walked<'_> {
        let shape = open.problem.shape;
        let e = &mut self.e;
        e.config = parent.clone();
        let obs = observe(&open.problem, e, &open.prior);
        let reward = e.record(m, next.clone(), ev.diagnosis.clone(), &Reward::default());
        for m in Move::all().filter(|&m| m != Move::Stop) {
            if let Some(c) = next.apply(m, shape)
                && self.queued.insert(c.key())
            {
                self.queue.push_back((next.clone(), m, c));
            }
        }
        Walked {
            e,
            parent,
            m,
            next,
            reward,
            obs,
        }
    }
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
    let shape = open.problem.shape;
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
    let best = recorded
        .values()
        .filter_map(correct_speedup)
        .fold(0.0, f64::max);
    let walk = Extending {
        candidates: candidates
            .into_iter()
            .map(|(.., parent, m, next)| (parent, m, next))
            .collect(),
        recorded,
        best,
        e: Episode::new(shape, 0),
    };
    walk_problem(
        out,
        p,
        judge,
        j,
        rec,
        open,
        walk,
        Reusing {
            reuse: false,
            changed: false,
        },
    )
}

/// The walk beyond the recorded programs: the unrecorded programs to
/// judge in order, each with the recorded parent and the move that make
/// it, and the best speedup so far (the recorded programs' to start).
struct Extending {
    candidates: std::collections::VecDeque<(Config, Move, Config)>,
    /// The recorded diagnoses, by key.
    recorded: std::collections::BTreeMap<String, mtmc_planner::critique::Diagnosis>,
    best: f64,
    /// The episode of the last step judged.
    e: Episode,
}

impl Walk for Extending {
    fn done(&self) -> bool {
        self.candidates.is_empty()
    }

    fn best(&self) -> f64 {
        self.best
    }

    fn round(&mut self, slots: usize) -> Vec<(Step, String)> {
        let take = slots.min(self.candidates.len());
        self.candidates
            .drain(..take)
            .map(|step| {
                let label = format!("{} -> {} -> {}", step.0.key(), step.1.label(), step.2.key());
                (step, label)
            })
            .collect()
    }

    fn judged(&mut self, open: &Opened, (parent, m, next): Step, ev: &Evaluated) -> Walked<'_> {
        // An episode at its second step, the parent its best so far.
        let reward = Reward::default();
        self.e = Episode::new(
            open.problem.shape,
            mtmc_planner::ppo::PpoConfig::default().max_steps,
        );
        let parent_diagnosis = self.recorded[&parent.key()].clone();
        self.e
            .record(Move::Stop, parent.clone(), parent_diagnosis, &reward);
        let obs = observe(&open.problem, &self.e, &open.prior);
        let reward = self
            .e
            .record(m, next.clone(), ev.diagnosis.clone(), &reward);
        self.best = self.best.max(correct_speedup(&ev.diagnosis).unwrap_or(0.0));
        Walked {
            e: &self.e,
            parent,
            m,
            next,
            reward,
            obs,
        }
    }
}

/// A step of a walk: the program it starts from, the move, the program
/// it judges.
type Step = (Config, Move, Config);

/// A walk over a problem's programs in an order fixed ahead (exhaustive,
/// beyond the recorded moves): the planner of [`walk_problem`]'s loop.
trait Walk {
    /// Whether nothing is left to judge.
    fn done(&self) -> bool;

    /// The best speedup so far.
    fn best(&self) -> f64;

    /// The next round, up to `slots` steps, each with its label.
    fn round(&mut self, slots: usize) -> Vec<(Step, String)>;

    /// `step`, evaluated as `ev`: the walk's episode records it.
    fn judged(&mut self, open: &Opened, step: Step, ev: &Evaluated) -> Walked<'_>;
}

/// A step of a [`Walk`] as it is recorded: the episode that recorded it,
/// the move from `parent` to `next`, its reward and the observation it was
/// made from.
struct Walked<'e> {
    e: &'e Episode,
    parent: Config,
    m: Move,
    next: Config,
    reward: f64,
    obs: Vec<f32>,
}

/// What a walk takes from the store: recorded outcomes (`reuse`), only
/// those whose code is unchanged (`changed`); see [`Reuse::of`].
#[derive(Clone, Copy)]
struct Reusing {
    reuse: bool,
    changed: bool,
}

/// Walks `walk` over problem `p` on the search loop ([`crate::steps::run`]),
/// a round of up to one program per worker at a time, each step printed
/// and recorded in the episode `open` of `rec`.
#[allow(clippy::too_many_arguments)]
fn walk_problem<W: Walk>(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    judge: &mut ProblemJudge,
    j: Judging<'_>,
    rec: &mut Recording<'_>,
    open: Opened,
    walk: W,
    reuse: Reusing,
) -> Result<EpisodeResult> {
    let source = j.source.clone();
    let mut walking = Walking {
        j,
        rec,
        open,
        walk,
        reuse,
        slots: judge.in_flight(),
        pending: None,
        steps: 0,
        bests: Vec::new(),
    };
    let stopped = judge.stop_flag();
    let found = crate::steps::run(out, &mut walking, &stopped, |round| {
        judge_round(judge, &source, &p.code, round)
    })?;
    let best = walking.walk.best();
    let Walking {
        j,
        rec,
        open,
        steps,
        bests,
        ..
    } = walking;
    rec.end(&j, &open, best, steps, bests, &found)
}

/// A [`Walk`] as the search loop's planner.
struct Walking<'a, 'r, 's, W: Walk> {
    j: Judging<'a>,
    rec: &'r mut Recording<'s>,
    open: Opened,
    walk: W,
    reuse: Reusing,
    /// Programs in flight at once (one per worker).
    slots: usize,
    /// The round in flight.
    pending: Option<InFlight>,
    /// Steps recorded, and the best speedup after each.
    steps: usize,
    bests: Vec<f64>,
}

/// A walk's round in flight: its steps, what was asked of the judging
/// (with the labels), what it knew before judging, when it started.
struct InFlight {
    steps: Vec<Step>,
    asked: Vec<(Move, Config, String)>,
    prepared: Prepared,
    started: f64,
}

impl<W: Walk> crate::steps::Planner for Walking<'_, '_, '_, W> {
    type Candidate = ToJudge;

    fn done(&self) -> bool {
        self.walk.done()
    }

    fn propose(
        &mut self,
        _out: &mut dyn std::io::Write,
        _found: &mut Found,
        _stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<ToJudge>> {
        let started = now();
        let (steps, labels): (Vec<Step>, Vec<String>) =
            self.walk.round(self.slots).into_iter().unzip();
        let asked: Vec<(Move, Config, String)> = steps
            .iter()
            .zip(labels)
            .map(|((_, m, next), label)| (*m, next.clone(), label))
            .collect();
        let reuse = Reuse::of(Some(&*self.rec.store), self.reuse.reuse, self.reuse.changed);
        let (prepared, to_judge) = self.j.prepare(reuse, &asked)?;
        self.pending = Some(InFlight {
            steps,
            asked,
            prepared,
            started,
        });
        Ok(Proposal::Judge(to_judge))
    }

    fn judged(
        &mut self,
        out: &mut dyn std::io::Write,
        found: &mut Found,
        round: Vec<(ToJudge, Outcome)>,
    ) -> Result<()> {
        let InFlight {
            steps,
            asked,
            prepared,
            started,
        } = self
            .pending
            .take()
            .expect("an outcome follows a proposed round");
        let judged = self.j.finish(found, prepared, &asked, round);
        for ((ev, step), (_, _, label)) in judged.into_iter().zip(steps).zip(&asked) {
            let w = self.walk.judged(&self.open, step, &ev);
            self.steps += 1;
            writeln!(
                out,
                "  {label}: {} (reward {:+.3})",
                ev.diagnosis.text(),
                w.reward
            )?;
            let record = ev.step(
                self.open.id,
                w.e,
                w.parent.key(),
                w.obs,
                w.m,
                &w.next,
                w.reward,
                started,
            )?;
            self.rec
                .store
                .add_step(&self.open.problem, self.rec.version, &record)?;
            self.bests.push(self.walk.best());
        }
        Ok(())
    }

    fn dropped(
        &mut self,
        _out: &mut dyn std::io::Write,
        _found: &mut Found,
        _round: Vec<ToJudge>,
    ) -> Result<()> {
        self.pending = None;
        Ok(())
    }
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

    /// Ends the episode with `best` after `evaluations` steps; `bests`
    /// holds the best speedup after each, `found` what the loop found. An
    /// episode a signal stopped (`found.interrupted`) is left unfinished: its steps are kept, and the
    /// next run of its planner runs it again.
    fn end(
        &mut self,
        j: &Judging<'_>,
        open: &Opened,
        best: f64,
        evaluations: usize,
        bests: Vec<f64>,
        found: &Found,
    ) -> Result<EpisodeResult> {
        let interrupted = found.interrupted;
        if !interrupted {
            self.store.end_episode(open.id, best)?;
        }
        Ok(EpisodeResult {
            best,
            evaluations,
            bests,
            wrote: found.best.is_some(),
            rejudged: None,
            changed: j.changed,
            interrupted,
        })
    }
}

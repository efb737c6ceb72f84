//! The search loop: a [`Planner`] proposes the next round of programs (its
//! coder writes them), the judge judges them together, and [`Found`] keeps
//! every attempt and the best program so far. The built-in variant search
//! (`optimize::variants::VariantPlanner`) and the LLM coder's steps
//! (`optimize::llm::LlmPlanner`) propose one program at a time
//! ([`OneAtATime`]); the planned episode (`plan::episode::EpisodePlanner`)
//! proposes a round of configurations, one per worker, taking recorded
//! outcomes from the store where it may; the exhaustive walks
//! (`plan::enumerate`) propose rounds in an order fixed ahead.
//!
//! Ctrl-C is read between steps: at the top of each step, and after a
//! judged program, whose outcome is then not kept (the signal reaches the
//! judging processes too), unless a cluster judged it.

use std::io::Write;

use anyhow::Result;
use mtmc_coder::action::Params;
use mtmc_coder::program::Program;
use mtmc_env::outcome::{Outcome, Status};

/// Every attempt, and the best program (at infinity when nothing was run
/// and the program only compiled).
#[derive(Default)]
pub(crate) struct Found {
    pub(crate) attempts: Vec<serde_json::Value>,
    /// Programs handed to the evaluator, and how many it found correct.
    pub(crate) judged: usize,
    pub(crate) correct: usize,
    pub(crate) best: Option<(f64, Program, Params, Outcome)>,
    /// Whether a signal stopped the search before its end (the report
    /// says so).
    pub(crate) interrupted: bool,
}

/// What a planner proposes for the next step.
pub(crate) enum Proposal<C> {
    /// Judge these candidates together (one per worker, one round; none
    /// where the planner took every outcome of the round from elsewhere).
    Judge(Vec<C>),
    /// Nothing to judge in this step (a refusal, a program that did not
    /// compile, a variant skipped; the planner said so): the next step.
    Next,
    /// A signal came while the step's program was written: not judged.
    Interrupted { label: String },
    /// The search is over.
    Done,
}

/// Proposes rounds of candidates and hears their outcomes: the planner of
/// the loop ([`run`]).
pub(crate) trait Planner {
    /// What it hands the judge: a program with what the judge needs of it.
    type Candidate;

    /// Whether it has nothing more to propose (the loop then ends without
    /// reading the signal).
    fn done(&self) -> bool;

    /// The next step; `stopped` says whether a signal asked to stop.
    fn propose(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<Self::Candidate>>;

    /// The outcomes of the round it proposed last, in its order (already
    /// counted in `found.judged` and `found.correct`): the planner reports
    /// them and keeps the best.
    fn judged(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        round: Vec<(Self::Candidate, Outcome)>,
    ) -> Result<()>;

    /// A signal came while the round was judged: its outcomes may be the
    /// end of the judging processes, not the programs', and are not kept.
    fn dropped(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        round: Vec<Self::Candidate>,
    ) -> Result<()>;

    /// After the last step (interrupted or not).
    fn finish(&mut self, _out: &mut dyn Write, _found: &mut Found) -> Result<()> {
        Ok(())
    }
}

/// A program proposed alone, as [`OneAtATime`] planners propose: `label`
/// names it on its line, `params` is the launch the report gives for it.
pub(crate) struct Proposed {
    pub(crate) program: Program,
    pub(crate) label: String,
    pub(crate) params: Params,
}

/// A planner of one program per step (the built-in variant search, the
/// LLM coder's steps): a [`Planner`] whose rounds hold one [`Proposed`].
pub(crate) trait OneAtATime {
    /// [`Planner::done`].
    fn done(&self) -> bool;

    /// [`Planner::propose`], of one program.
    fn propose(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<Proposed>>;

    /// The outcome of the program it proposed last.
    fn judged(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        proposed: (Program, Params, String),
        o: Outcome,
    ) -> Result<()>;

    /// [`Planner::finish`].
    fn finish(&mut self, _out: &mut dyn Write, _found: &mut Found) -> Result<()> {
        Ok(())
    }
}

impl<T: OneAtATime> Planner for T {
    type Candidate = Proposed;

    fn done(&self) -> bool {
        OneAtATime::done(self)
    }

    fn propose(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<Proposed>> {
        OneAtATime::propose(self, out, found, stopped)
    }

    fn judged(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        round: Vec<(Proposed, Outcome)>,
    ) -> Result<()> {
        for (p, o) in round {
            OneAtATime::judged(self, out, found, (p.program, p.params, p.label), o)?;
        }
        Ok(())
    }

    fn dropped(
        &mut self,
        out: &mut dyn Write,
        _found: &mut Found,
        round: Vec<Proposed>,
    ) -> Result<()> {
        for p in round {
            writeln!(out, "  {}: interrupted, not kept", p.label)?;
        }
        Ok(())
    }

    fn finish(&mut self, out: &mut dyn Write, found: &mut Found) -> Result<()> {
        OneAtATime::finish(self, out, found)
    }
}

/// Judges each program of a round alone with `judge` (the one-at-a-time
/// searches' judge), in order.
pub(crate) fn each(
    mut judge: impl FnMut(&Program, &str) -> Result<Outcome>,
) -> impl FnMut(&[Proposed]) -> Result<Vec<Outcome>> {
    move |round| round.iter().map(|p| judge(&p.program, &p.label)).collect()
}

/// Runs `planner` until it is done or `stopped` says so, judging each
/// round it proposes with `judge` (an outcome per candidate, in order).
pub(crate) fn run<P: Planner>(
    out: &mut dyn Write,
    planner: &mut P,
    stopped: &dyn Fn() -> bool,
    mut judge: impl FnMut(&[P::Candidate]) -> Result<Vec<Outcome>>,
) -> Result<Found> {
    let mut found = Found::default();
    while !planner.done() {
        if stopped() {
            found.interrupted = true;
            break;
        }
        let round = match planner.propose(out, &mut found, stopped)? {
            Proposal::Judge(round) => round,
            Proposal::Next => continue,
            Proposal::Interrupted { label } => {
                writeln!(out, "  {label}: interrupted, not kept")?;
                found.interrupted = true;
                break;
            }
            Proposal::Done => break,
        };
        let outcomes = if round.is_empty() {
            Ok(Vec::new())
        } else {
            judge(&round)
        };
        let stop = stopped();
        if stop && crate::cluster::shared().is_none() {
            // The signal reaches the judging processes too: these outcomes
            // may be their end, not the programs'. (A cluster's judges are
            // elsewhere, and its bridge ignores the signal: their outcomes
            // are the programs', and kept.)
            planner.dropped(out, &mut found, round)?;
            found.interrupted = true;
            break;
        }
        let outcomes = outcomes?;
        assert_eq!(outcomes.len(), round.len(), "an outcome per candidate");
        for o in &outcomes {
            found.judged += 1;
            found.correct += usize::from(o.status == Status::Correct);
        }
        planner.judged(out, &mut found, round.into_iter().zip(outcomes).collect())?;
        if stop {
            found.interrupted = true;
            break;
        }
    }
    planner.finish(out, &mut found)?;
    Ok(found)
}

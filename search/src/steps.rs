//! The search loop: a [`Planner`] proposes the next program (its coder
//! writes it), the judge judges it, and [`Found`] keeps every attempt and
//! the best program so far. The built-in variant search
//! (`optimize::variants::VariantPlanner`) and the LLM coder's steps
//! (`optimize::llm::LlmPlanner`) are planners of this loop; the planned
//! episode (`plan::episode`) runs rounds of configurations judged with
//! recorded outcomes reused, on a loop of its own.
//!
//! Ctrl-C is read between steps: at the top of each step, and after a
//! judged program, whose outcome is then not kept (the signal reaches the
//! judging processes too).

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
pub(crate) enum Proposal {
    /// Judge `program`: `label` names it on its line, `params` is the
    /// launch the report gives for it.
    Judge {
        program: Program,
        label: String,
        params: Params,
    },
    /// Nothing to judge in this step (a refusal, a program that did not
    /// compile, a variant skipped; the planner said so): the next step.
    Next,
    /// A signal came while the step's program was written: not judged.
    Interrupted { label: String },
    /// The search is over.
    Done,
}

/// Proposes programs and hears their outcomes.
pub(crate) trait Planner {
    /// Whether it has nothing more to propose (the loop then ends without
    /// reading the signal).
    fn done(&self) -> bool;

    /// The next step; `stopped` says whether a signal asked to stop.
    fn propose(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal>;

    /// The outcome of the program it proposed last (already counted in
    /// `found.judged` and `found.correct`): the planner reports it and
    /// keeps it as the best when it is.
    fn judged(
        &mut self,
        out: &mut dyn Write,
        found: &mut Found,
        proposed: (Program, Params, String),
        o: Outcome,
    ) -> Result<()>;

    /// After the last step (interrupted or not).
    fn finish(&mut self, _out: &mut dyn Write, _found: &mut Found) -> Result<()> {
        Ok(())
    }
}

/// Runs `planner` until it is done or `stopped` says so, judging each
/// program it proposes with `judge`.
pub(crate) fn run(
    out: &mut dyn Write,
    planner: &mut dyn Planner,
    stopped: &dyn Fn() -> bool,
    mut judge: impl FnMut(&Program, &str) -> Result<Outcome>,
) -> Result<Found> {
    let mut found = Found::default();
    while !planner.done() {
        if stopped() {
            found.interrupted = true;
            break;
        }
        let (program, label, params) = match planner.propose(out, &mut found, stopped)? {
            Proposal::Judge {
                program,
                label,
                params,
            } => (program, label, params),
            Proposal::Next => continue,
            Proposal::Interrupted { label } => {
                writeln!(out, "  {label}: interrupted, not kept")?;
                found.interrupted = true;
                break;
            }
            Proposal::Done => break,
        };
        let o = judge(&program, &label);
        if stopped() {
            // The signal reaches the judging processes too: this outcome
            // may be their end, not the program's.
            writeln!(out, "  {label}: interrupted, not kept")?;
            found.interrupted = true;
            break;
        }
        let o = o?;
        found.judged += 1;
        found.correct += usize::from(o.status == Status::Correct);
        planner.judged(out, &mut found, (program, params, label), o)?;
    }
    planner.finish(out, &mut found)?;
    Ok(found)
}

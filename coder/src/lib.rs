//! The micro coder: turns one macro action on one region of the op graph
//! into a small fragment of code, compiled alone and rolled back on
//! failure.
//!
//! - [`action`]: what the planner asks for (kind, region, parameters);
//! - [`program`]: fragments and the program they make;
//! - [`template`]: the template coder (rules, no network);
//! - [`llm`]: the LLM coder (a model behind an HTTP endpoint);
//! - [`critique`]: the diagnosis of an outcome, by rules or by a model;
//! - [`session`]: a step at a time, with rollback to the last good program;
//! - [`export`]: a program as a KernelBench `ModelNew` file;
//! - [`render`]: a program as a CUDA program with its launch plan, for the
//!   native evaluator.

pub mod action;
pub mod critique;
pub mod export;
pub mod llm;
pub mod program;
pub mod render;
pub mod session;
pub mod template;

use mtmc_actions::graph::OpGraph;

use crate::action::Action;
use crate::program::{Fragment, Program};
use serde::Serialize;

/// What every coder does: given the last good program, the graph and one
/// action, write one fragment, or refuse with the reason.
pub trait MicroCoder {
    /// The fragment for `action`.
    fn realize(&self, program: &Program, g: &OpGraph, action: &Action)
    -> Result<Fragment, Refusal>;

    /// Hears how a step ended. A coder with memory (the LLM coder) keeps
    /// failures for their repairs and the best program and critiques for
    /// its prompts; the template coders forget.
    fn observe(&self, _note: &Note<'_>) {}

    /// Why the coder can write nothing more in this run (its endpoint is
    /// down, its key refused), when so: the search stops.
    fn halted(&self) -> Option<String> {
        None
    }
}

/// How a step ended, as a coder hears it.
pub enum Note<'a> {
    /// Refused, did not compile, or judged wrong: rolled back.
    Failed(&'a Failure),
    /// Judged by the evaluator (correct or not).
    Judged {
        /// The step's action.
        action: &'a Action,
        /// The critique of its outcome.
        critique: &'a str,
        /// When it is the best program so far: its kernels and figures.
        best: Option<&'a str>,
    },
}

impl<T: MicroCoder + ?Sized> MicroCoder for &T {
    fn realize(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
    ) -> Result<Fragment, Refusal> {
        (**self).realize(program, g, action)
    }

    fn observe(&self, note: &Note<'_>) {
        (**self).observe(note)
    }

    fn halted(&self) -> Option<String> {
        (**self).halted()
    }
}

/// Why a coder wrote nothing for an action.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Refusal(pub String);

impl Refusal {
    /// A refusal with its reason.
    pub fn new(why: impl Into<String>) -> Refusal {
        Refusal(why.into())
    }
}

/// Where a step failed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stage {
    /// The coder wrote nothing.
    Refused,
    /// The fragment did not compile.
    Compile,
    /// The program ran and was judged wrong (or failed to run).
    Outcome,
}

/// A rolled-back step.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Failure {
    /// The action.
    pub action: Action,
    /// Where it failed.
    pub stage: Stage,
    /// The fragment's source, when one was written.
    pub fragment: Option<String>,
    /// The reason: the refusal, the compiler log, or the outcome's verdict.
    pub log: String,
}

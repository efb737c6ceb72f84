//! The micro coder: turns one macro action on one region of the op graph
//! into a small fragment of code, compiled alone and rolled back on
//! failure.
//!
//! - [`action`]: what the planner asks for (kind, region, parameters);
//! - [`program`]: fragments and the program they make;
//! - [`template`]: the template coder (rules, no network);
//! - [`session`]: a step at a time, with rollback to the last good program;
//! - [`export`]: a program as a KernelBench `ModelNew` file;
//! - [`render`]: a program as a CUDA program with its launch plan, for the
//!   native evaluator.

pub mod action;
pub mod export;
pub mod program;
pub mod render;
pub mod session;
pub mod template;

use mtmc_actions::graph::OpGraph;

use crate::action::Action;
use crate::program::{Fragment, Program};
use crate::template::Refusal;

/// What every coder does: given the last good program, the graph and one
/// action, write one fragment, or refuse with the reason.
pub trait MicroCoder {
    /// The fragment for `action`.
    fn realize(&self, program: &Program, g: &OpGraph, action: &Action)
    -> Result<Fragment, Refusal>;
}

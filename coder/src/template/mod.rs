//! The template coder: fragments from rules, no LLM, no network.
//!
//! Families so far: pointwise chains with broadcasting (CUDA). Each family
//! refuses, with the reason, what it cannot write.

mod pointwise;

use mtmc_actions::graph::OpGraph;

use crate::MicroCoder;
use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Program};

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

/// The template coder.
#[derive(Clone, Debug, Default)]
pub struct TemplateCoder;

impl MicroCoder for TemplateCoder {
    fn realize(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
    ) -> Result<Fragment, Refusal> {
        let name = format!("k{}_pointwise", program.fragments.len());
        match action.kind {
            ActionKind::CustomKernel
            | ActionKind::Fuse
            | ActionKind::Retile
            | ActionKind::Vectorize => {
                if action.kind == ActionKind::CustomKernel && action.region.len() != 1 {
                    return Err(Refusal::new(
                        "a custom kernel covers one op; fuse covers several",
                    ));
                }
                // A kernel-level action rewrites the kernel that covers the
                // region now, under its name.
                let name = match action.kind {
                    ActionKind::Retile | ActionKind::Vectorize => program
                        .fragments
                        .iter()
                        .find(|f| f.region.iter().any(|n| action.nodes().contains(n)))
                        .map(|f| f.name.clone())
                        .ok_or_else(|| Refusal::new("no kernel covers this region yet"))?,
                    _ => name,
                };
                pointwise::generate(g, action, &name)
            }
            ActionKind::CallLibrary => Err(Refusal::new(
                "library calls are kept as torch ops in the ModelNew export, not as fragments",
            )),
        }
    }
}

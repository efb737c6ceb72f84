//! Macro actions: what the planner asks the coder to do, on which region of
//! the op graph, with which parameters.

use mtmc_actions::graph::NodeId;
use serde::{Deserialize, Serialize};

/// The kinds of action. Operator-level actions choose how a region is
/// computed; kernel-level ones change how an existing kernel does it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ActionKind {
    /// Keep the region a library call (torch / cuBLAS / cuDNN).
    CallLibrary,
    /// One custom kernel for one op.
    CustomKernel,
    /// One custom kernel for a region of several ops.
    Fuse,
    /// Re-tile an existing kernel (block size, items per thread).
    Retile,
    /// Vectorize an existing kernel's loads and stores.
    Vectorize,
    /// Repair a kernel that did not compile, given the compiler log (LLM
    /// coder).
    FixCompile,
    /// Repair a kernel whose results were wrong, given the verdict (LLM
    /// coder).
    FixCorrectness,
}

impl ActionKind {
    /// Whether the action chooses how a region is computed (the only kind
    /// legal at step 0).
    pub fn operator_level(self) -> bool {
        matches!(
            self,
            ActionKind::CallLibrary | ActionKind::CustomKernel | ActionKind::Fuse
        )
    }
}

/// Launch parameters a kernel-level action sets.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Params {
    /// Threads per block.
    pub block: u32,
    /// Elements per thread per loop trip (vector width): 1, 2 or 4.
    pub vector: u32,
}

impl Default for Params {
    fn default() -> Params {
        Params {
            block: 256,
            vector: 1,
        }
    }
}

/// One action on one region.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Action {
    /// What to do.
    pub kind: ActionKind,
    /// The nodes it covers, in graph order (node indices).
    pub region: Vec<u32>,
    /// Its parameters.
    pub params: Params,
}

impl Action {
    /// The operator-level action that writes `region` as one kernel: a
    /// custom kernel for one node, a fusion for several.
    pub fn kernel_for(region: Vec<u32>, params: Params) -> Action {
        Action {
            kind: if region.len() == 1 {
                ActionKind::CustomKernel
            } else {
                ActionKind::Fuse
            },
            region,
            params,
        }
    }

    /// The region's nodes.
    pub fn nodes(&self) -> Vec<NodeId> {
        self.region
            .iter()
            .map(|&i| NodeId::new(i as usize))
            .collect()
    }
}

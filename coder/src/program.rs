//! Programs: an ordered set of fragments that together compute a graph.
//! A step changes one fragment, never the whole program.

use std::collections::BTreeSet;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use serde::Serialize;

use crate::action::Action;

/// How a fragment is launched: a 1-D grid of 1-D blocks, and the integer
/// arguments that follow the kernel's pointers (sizes, as `long long`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Launch {
    /// Blocks.
    pub grid: u32,
    /// Threads per block.
    pub block: u32,
    /// The sizes passed after the pointers, in order.
    pub sizes: Vec<i64>,
    /// Dynamic shared memory, bytes (past 48 KiB the kernel opts in).
    pub shared: u32,
}

impl Launch {
    /// Warps per block (a Triton program's `num_warps`): at least one.
    pub fn warps(&self) -> u32 {
        (self.block / 32).max(1)
    }
}

/// The language a fragment is written in.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Lang {
    /// CUDA C++, compiled with NVRTC.
    #[default]
    Cuda,
    /// Triton (Python), compiled by Triton.
    Triton,
}

/// One piece of a program: the code for one region of the graph.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Fragment {
    /// Kernel name, unique in the program.
    pub name: String,
    /// The action that made it.
    pub action: Action,
    /// Its language.
    pub lang: Lang,
    /// CUDA C++ defining one `extern "C" __global__` kernel called `name`,
    /// or Python defining one `@triton.jit` function called `name` (its
    /// launch's grid counts programs, its block is the program's warps
    /// times 32).
    pub source: String,
    /// The tensors it reads, in argument order (after them come its
    /// outputs, then the launch's sizes).
    #[serde(skip)]
    pub inputs: Vec<TensorRef>,
    /// The tensors it writes, in argument order.
    #[serde(skip)]
    pub outputs: Vec<TensorRef>,
    /// The nodes it computes.
    #[serde(skip)]
    pub region: Vec<NodeId>,
    /// Its launch.
    pub launch: Launch,
    /// Kernels of `source` launched before `name`, in order, each with the
    /// same pointer arguments and its own grid, block and sizes (a
    /// statistics pass before the pass that writes, say). Usually none.
    pub before: Vec<Pass>,
}

/// A kernel pass launched before a fragment's own kernel.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Pass {
    /// Its name in the fragment's source.
    pub kernel: String,
    /// Its launch.
    pub launch: Launch,
}

impl Fragment {
    /// Every kernel of the fragment with its launch, in launch order.
    pub fn launches(&self) -> impl Iterator<Item = (&str, &Launch)> {
        self.before
            .iter()
            .map(|s| (s.kernel.as_str(), &s.launch))
            .chain(std::iter::once((self.name.as_str(), &self.launch)))
    }
}

/// The tensor whose memory `t` is: `t` itself, or for a view, the
/// tensor it views (through chains of views).
pub fn storage(g: &OpGraph, mut t: TensorRef) -> TensorRef {
    while g.node(t.node).op.is_view() {
        t = g.inputs(t.node)[0];
    }
    t
}

/// Fragments in execution order.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct Program {
    /// The fragments.
    pub fragments: Vec<Fragment>,
    /// The exported forward is captured into a CUDA graph and replayed
    /// (`export::to_model_new`): one launch for the whole forward, where
    /// its Python and launch overheads would otherwise set its time.
    #[serde(skip_serializing_if = "std::ops::Not::not")]
    pub cuda_graph: bool,
}

impl Program {
    /// The nodes some fragment computes.
    pub fn covered(&self) -> BTreeSet<NodeId> {
        self.fragments
            .iter()
            .flat_map(|f| f.region.iter().copied())
            .collect()
    }

    /// The program with `fragment` in place of every fragment whose region
    /// it overlaps, the fragments ordered so that each runs after those
    /// whose outputs it reads.
    pub fn with(&self, fragment: Fragment) -> Program {
        let overlaps = |f: &Fragment| f.region.iter().any(|n| fragment.region.contains(n));
        let mut pending: Vec<Fragment> = self
            .fragments
            .iter()
            .filter(|f| !overlaps(f))
            .cloned()
            .collect();
        pending.push(fragment);
        let mut fragments = Vec::with_capacity(pending.len());
        while !pending.is_empty() {
            // The first fragment none of whose inputs a pending one writes.
            let ready = pending
                .iter()
                .position(|f| {
                    !f.inputs.iter().any(|t| {
                        pending
                            .iter()
                            .any(|o| o.name != f.name && o.outputs.contains(t))
                    })
                })
                .unwrap_or(0);
            fragments.push(pending.remove(ready));
        }
        Program {
            fragments,
            cuda_graph: self.cuda_graph,
        }
    }

    /// The graph nodes (not sources, not views) no fragment computes yet.
    pub fn missing(&self, g: &OpGraph) -> Vec<NodeId> {
        let covered = self.covered();
        g.nodes()
            .filter(|(id, n)| !n.op.is_source() && !n.op.is_view() && !covered.contains(id))
            .map(|(id, _)| id)
            .collect()
    }
}

//! The planner's action space: moves that edit a program's configuration,
//! flattened into one index (kind × region × parameter), and the legality
//! mask.
//!
//! A configuration says how a problem's program is built: which regions of
//! the op graph are custom kernels (the rest stay library calls), whether
//! pointwise chains are fused in front of the row kernels that read them,
//! whether matrix products are tiled GEMM kernels with their epilogue, the
//! launch parameters, the graph it is built from, and whether the forward
//! is replayed from a CUDA graph. The coder turns a configuration into fragments;
//! the planner only edits it. Two configurations with the same [`Config::key`]
//! build the same program, so the key names a node of the trajectory tree.

use serde::{Deserialize, Serialize};

/// Regions a move can name one by one; later regions follow the moves on
/// all regions.
pub const SLOTS: usize = 8;
/// Threads per block a retile move can set.
pub const BLOCKS: [u32; 3] = [128, 256, 512];
/// Vector widths a vectorize move can set.
pub const VECTORS: [u32; 3] = [1, 2, 4];
/// The rewritten graphs a program can be built from besides the traced one
/// (graph 0): graph `k + 1` applies every rewrite of
/// `mtmc_actions::rewrite` that matches but those named in `REWRITTEN[k].1`,
/// and its programs' keys end with `REWRITTEN[k].0`. Channels-last
/// convolutions may run on other TF32 kernels than the reference's, and
/// weights folded before a TF32 convolution round otherwise than its result
/// scaled after it, so each can miss the tolerance where the other rewrites
/// still pay.
pub const REWRITTEN: [(&str, &[&str]); 4] = [
    (" rw", &[]),
    (" rw-cl", &["channels_last"]),
    (" rw-fold", &["fold_into_weights"]),
    (" rw-cl-fold", &["channels_last", "fold_into_weights"]),
];
/// Graphs a program can be built from: the traced one and [`REWRITTEN`].
pub const GRAPHS: usize = 1 + REWRITTEN.len();
/// Index of the stop move (the graph moves follow it, so that the
/// indices of the moves before them stay those the store recorded).
const STOP: usize = 2 * (1 + SLOTS) + 4 + BLOCKS.len() + VECTORS.len();
/// Index of the first CUDA-graph move (after the graph moves, so that the
/// recorded indices stay).
const CUDA_GRAPH: usize = STOP + 1 + GRAPHS;
/// Size of the flat action space.
pub const ACTIONS: usize = CUDA_GRAPH + 2;
/// The end of the key of a program whose forward is replayed from a CUDA
/// graph.
pub const CUDA_GRAPH_KEY: &str = " cuda-graph";

/// The regions a move covers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Slot {
    /// Every region.
    All,
    /// One region, by its index in graph order (below [`SLOTS`]).
    Region(u8),
}

/// One edit of the configuration.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Move {
    /// The regions become library calls again (torch / cuBLAS / cuDNN).
    CallLibrary(Slot),
    /// The regions become custom kernels (a region of several ops is one
    /// fused kernel).
    CustomKernel(Slot),
    /// Pointwise chains are fused into the row kernel that reads them.
    Fuse,
    /// Pointwise chains and row kernels are split into a chain of
    /// sub-kernels.
    Split,
    /// Matrix products become tiled GEMM kernels with their epilogue fused.
    GemmKernel,
    /// Matrix products become library calls again.
    GemmLibrary,
    /// Threads per block of every kernel.
    Retile(u32),
    /// Elements per thread per trip (vector width) of every kernel.
    Vectorize(u32),
    /// End the episode; the best program so far is the answer.
    Stop,
    /// Build from graph `k`: 0 the graph as traced, else rewritten graph
    /// `k - 1` of [`REWRITTEN`] (`mtmc_actions::rewrite`: folded biases
    /// and weights, channels-last convolutions, reductions moved before
    /// GEMMs, ops that change nothing dropped); judged like any other
    /// step.
    Graph(u8),
    /// The forward captured into a CUDA graph and replayed (`true`), or
    /// launched op by op (`false`): one launch for the whole forward,
    /// where Python and launch overheads set its time.
    CudaGraph(bool),
}

/// The moves whose kind ([`Move::kind`]) is one of `kinds`, as a mask over
/// the flat index: the moves an ablation leaves out (`compare --without`).
/// Stop is never among them.
pub fn of_kinds(kinds: &[&str]) -> [bool; ACTIONS] {
    let mut mask = [false; ACTIONS];
    for m in Move::all() {
        mask[m.index()] = m != Move::Stop && kinds.contains(&m.kind());
    }
    mask
}

impl Move {
    /// Every move, in index order.
    pub fn all() -> impl Iterator<Item = Move> {
        (0..ACTIONS).map(Move::from_index)
    }

    /// The flat index.
    pub fn index(self) -> usize {
        let slot = |s: Slot| match s {
            Slot::All => 0,
            Slot::Region(r) => 1 + r as usize,
        };
        let base = 2 * (1 + SLOTS);
        match self {
            Move::CallLibrary(s) => slot(s),
            Move::CustomKernel(s) => 1 + SLOTS + slot(s),
            Move::Fuse => base,
            Move::Split => base + 1,
            Move::GemmKernel => base + 2,
            Move::GemmLibrary => base + 3,
            Move::Retile(b) => base + 4 + BLOCKS.iter().position(|&x| x == b).unwrap_or(1),
            Move::Vectorize(v) => {
                base + 4 + BLOCKS.len() + VECTORS.iter().position(|&x| x == v).unwrap_or(0)
            }
            Move::Stop => STOP,
            // Graph 1 (every rewrite) and graph 0 came first and keep
            // their recorded indices.
            Move::Graph(1) => STOP + 1,
            Move::Graph(0) => STOP + 2,
            Move::Graph(k) => STOP + 1 + k as usize,
            Move::CudaGraph(on) => CUDA_GRAPH + usize::from(!on),
        }
    }

    /// The move at flat index `i` (below [`ACTIONS`]).
    pub fn from_index(i: usize) -> Move {
        let slot = |k: usize| {
            if k == 0 {
                Slot::All
            } else {
                Slot::Region((k - 1) as u8)
            }
        };
        let base = 2 * (1 + SLOTS);
        match i {
            i if i < 1 + SLOTS => Move::CallLibrary(slot(i)),
            i if i < base => Move::CustomKernel(slot(i - 1 - SLOTS)),
            i if i == base => Move::Fuse,
            i if i == base + 1 => Move::Split,
            i if i == base + 2 => Move::GemmKernel,
            i if i == base + 3 => Move::GemmLibrary,
            i if i < base + 4 + BLOCKS.len() => Move::Retile(BLOCKS[i - base - 4]),
            i if i < STOP => Move::Vectorize(VECTORS[i - base - 4 - BLOCKS.len()]),
            i if i == STOP + 1 => Move::Graph(1),
            i if i == STOP + 2 => Move::Graph(0),
            i if i > STOP + 2 && i < CUDA_GRAPH => Move::Graph((i - STOP - 1) as u8),
            i if i == CUDA_GRAPH || i == CUDA_GRAPH + 1 => Move::CudaGraph(i == CUDA_GRAPH),
            _ => Move::Stop,
        }
    }

    /// The action kind's name, as reports and the store write it.
    pub fn kind(self) -> &'static str {
        match self {
            Move::CallLibrary(_) | Move::GemmLibrary => "call_library",
            Move::CustomKernel(_) | Move::GemmKernel => "custom_kernel",
            Move::Fuse => "fuse",
            Move::Split => "split",
            Move::Retile(_) => "retile",
            Move::Vectorize(_) => "vectorize",
            Move::Graph(_) => "rewrite",
            Move::CudaGraph(_) => "cuda_graph",
            Move::Stop => "stop",
        }
    }

    /// Whether the move chooses how ops are computed: by which calls or
    /// kernels, from which graph (the only moves legal at step 0, with
    /// stop).
    pub fn operator_level(self) -> bool {
        matches!(
            self,
            Move::CallLibrary(_)
                | Move::CustomKernel(_)
                | Move::GemmKernel
                | Move::GemmLibrary
                | Move::Graph(_)
        )
    }

    /// A short label: `custom_kernel(all)`, `retile(512)`, …
    pub fn label(self) -> String {
        let slot = |s: Slot| match s {
            Slot::All => "all".to_string(),
            Slot::Region(r) => format!("r{r}"),
        };
        match self {
            Move::CallLibrary(s) | Move::CustomKernel(s) => format!("{}({})", self.kind(), slot(s)),
            Move::GemmKernel => "custom_kernel(gemm)".into(),
            Move::GemmLibrary => "call_library(gemm)".into(),
            Move::Retile(b) => format!("retile({b})"),
            Move::Vectorize(v) => format!("vectorize({v})"),
            Move::Graph(0) => "rewrite(off)".into(),
            Move::Graph(1) => "rewrite(on)".into(),
            Move::Graph(k) => format!("rewrite(but {})", REWRITTEN[k as usize - 1].1.join(", ")),
            Move::CudaGraph(true) => "cuda_graph(on)".into(),
            Move::CudaGraph(false) => "cuda_graph(off)".into(),
            other => other.kind().into(),
        }
    }
}

/// What of a problem the action space depends on.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(from = "ShapeRecord")]
pub struct Shape {
    /// Regions of the traced graph the coder can write kernels for.
    pub regions: usize,
    /// Whether the graph has products the coder writes as kernels: matrix
    /// products and the convolutions its convolution family computes (for
    /// the GEMM moves).
    pub products: bool,
    /// Regions of each rewritten graph of [`REWRITTEN`], where it exists:
    /// some rewrite applies and it differs from the graphs before it (for
    /// the graph moves).
    pub rewritten: [Option<u16>; REWRITTEN.len()],
    /// Whether the graph has convolutions: GEMM kernels then compute them
    /// in exact float32, which misses the tolerance where the reference's
    /// convolutions ran on TF32 (the episode's mask). Shapes recorded
    /// before this flag read `false`; `Store::problems` sets it from the
    /// problem's graph features.
    pub convolutions: bool,
}

impl Shape {
    /// A problem with `regions` regions and no rewritten graph.
    pub fn plain(regions: usize, products: bool) -> Shape {
        Shape {
            regions,
            products,
            rewritten: [None; REWRITTEN.len()],
            convolutions: false,
        }
    }

    /// Regions of graph `k` (0: as traced), or `None` where it does not
    /// exist.
    pub fn regions_of(&self, k: usize) -> Option<usize> {
        match k {
            0 => Some(self.regions),
            k => self
                .rewritten
                .get(k - 1)
                .copied()
                .flatten()
                .map(usize::from),
        }
    }
}

/// A shape as the store holds it: problems recorded before the graph
/// variants have one flag, `rewrites`, for a rewritten graph with as many
/// regions as the traced one (graph 1).
#[derive(Deserialize)]
struct ShapeRecord {
    regions: usize,
    products: bool,
    #[serde(default)]
    rewrites: bool,
    #[serde(default)]
    rewritten: Option<[Option<u16>; REWRITTEN.len()]>,
    #[serde(default)]
    convolutions: bool,
}

impl From<ShapeRecord> for Shape {
    fn from(r: ShapeRecord) -> Shape {
        let mut shape = Shape::plain(r.regions, r.products);
        shape.convolutions = r.convolutions;
        match r.rewritten {
            Some(rewritten) => shape.rewritten = rewritten,
            None if r.rewrites => shape.rewritten[0] = u16::try_from(r.regions).ok(),
            None => {}
        }
        shape
    }
}

/// How a problem's program is built.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Config {
    /// Per region of its graph: a custom kernel (else library calls).
    pub kernels: Vec<bool>,
    /// Pointwise chains fused in front of row kernels.
    pub fuse: bool,
    /// Matrix products as GEMM kernels.
    pub gemm: bool,
    /// Threads per block.
    pub block: u32,
    /// Vector width.
    pub vector: u32,
    /// The graph it is built from: 0 as traced, `k` the rewritten graph
    /// `REWRITTEN[k - 1]`.
    pub graph: u8,
    /// The forward replayed from a CUDA graph (configurations recorded
    /// before the move read `false`).
    #[serde(default)]
    pub cuda_graph: bool,
}

impl Config {
    /// Every op a library call: where an episode starts.
    pub fn library(shape: Shape) -> Config {
        Config {
            kernels: vec![false; shape.regions],
            fuse: true,
            gemm: false,
            block: 256,
            vector: 1,
            graph: 0,
            cuda_graph: false,
        }
    }

    /// Whether any custom kernel (region or GEMM) is in the program.
    pub fn any_kernel(&self) -> bool {
        self.gemm || self.kernels.iter().any(|&k| k)
    }

    /// The name of the program this configuration builds. Settings that
    /// change nothing (launch parameters without region kernels, fusion
    /// with fewer than two region kernels) are left out, so equal
    /// programs have equal keys; the suffix of [`REWRITTEN`] ends the key
    /// of a program built from a rewritten graph (` rw`: every rewrite),
    /// then [`CUDA_GRAPH_KEY`] that of one replayed from a CUDA graph.
    pub fn key(&self) -> String {
        let mut key = self.key_of_graph();
        if let Some(k) = (self.graph as usize).checked_sub(1) {
            key.push_str(REWRITTEN[k].0);
        }
        if self.cuda_graph {
            key.push_str(CUDA_GRAPH_KEY);
        }
        key
    }

    /// The key of the program with the default launch parameters (256
    /// threads, vector width 1): programs with equal structures run the
    /// same kernels on the same values, so they are correct or incorrect
    /// alike (so it was in every recorded tree: launch parameters changed
    /// whether a program compiled, never whether it was correct).
    pub fn structure(&self) -> String {
        Config {
            block: 256,
            vector: 1,
            ..self.clone()
        }
        .key()
    }

    fn key_of_graph(&self) -> String {
        let regions = self.kernels.iter().filter(|&&k| k).count();
        if regions == 0 {
            return if self.gemm {
                "gemm".into()
            } else {
                "library".into()
            };
        }
        let bits: String = self
            .kernels
            .iter()
            .map(|&k| if k { '1' } else { '0' })
            .collect();
        format!(
            "k{bits}{}{} b{} v{}",
            if self.fuse || regions < 2 {
                ""
            } else {
                " split"
            },
            if self.gemm { " gemm" } else { "" },
            self.block,
            self.vector
        )
    }

    /// The configuration after `m`, or `None` where `m` is not possible
    /// here (a region that does not exist, a GEMM move without products, a
    /// graph that does not exist, stop).
    pub fn apply(&self, m: Move, shape: Shape) -> Option<Config> {
        let mut c = self.clone();
        let set = |c: &mut Config, s: Slot, on: bool| match s {
            // The library program exists for every graph; kernels for all
            // regions need a region.
            Slot::All => {
                c.kernels.iter_mut().for_each(|k| *k = on);
                !on || !c.kernels.is_empty()
            }
            Slot::Region(r) => match c.kernels.get_mut(r as usize) {
                Some(k) => {
                    *k = on;
                    true
                }
                None => false,
            },
        };
        let ok = match m {
            Move::CallLibrary(s) => set(&mut c, s, false),
            Move::CustomKernel(s) => set(&mut c, s, true),
            Move::Fuse => {
                c.fuse = true;
                true
            }
            Move::Split => {
                c.fuse = false;
                true
            }
            Move::GemmKernel | Move::GemmLibrary => {
                c.gemm = m == Move::GemmKernel;
                shape.products
            }
            Move::Retile(b) => {
                c.block = b;
                true
            }
            Move::Vectorize(v) => {
                c.vector = v;
                true
            }
            // Another graph may be cut into other regions: its regions
            // are kernels where the program had any region kernel.
            Move::Graph(k) => match shape.regions_of(k as usize) {
                Some(n) => {
                    if n != c.kernels.len() {
                        let any = c.kernels.iter().any(|&k| k);
                        c.kernels = vec![any; n];
                    }
                    c.graph = k;
                    true
                }
                None => false,
            },
            Move::CudaGraph(on) => {
                c.cuda_graph = on;
                true
            }
            Move::Stop => false,
        };
        ok.then_some(c)
    }
}

/// Which moves are legal: stop always; at step 0 operator-level moves only;
/// otherwise any move that builds a program not yet evaluated in this
/// episode (`seen` holds their keys) and, but for calling the library for
/// everything, different from the current one.
pub fn legal(
    config: &Config,
    shape: Shape,
    step: usize,
    seen: &std::collections::BTreeSet<String>,
) -> [bool; ACTIONS] {
    let mut mask = [false; ACTIONS];
    for m in Move::all() {
        mask[m.index()] = match m {
            Move::Stop => true,
            _ if step == 0 && !m.operator_level() => false,
            _ => config.apply(m, shape).is_some_and(|c| {
                let key = c.key();
                // The current program itself is a candidate while it has
                // not been judged (at the start, or after a rollback to
                // it): calling the library for everything is a choice too.
                let again = m == Move::CallLibrary(Slot::All);
                !seen.contains(&key) && (key != config.key() || again)
            }),
        };
    }
    mask
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    #[test]
    fn indices_round_trip() {
        for i in 0..ACTIONS {
            assert_eq!(Move::from_index(i).index(), i, "{:?}", Move::from_index(i));
        }
        // The indices the store recorded before the graph moves stay, and
        // so do those of the first two graph moves.
        assert_eq!(Move::Stop.index(), 28);
        assert_eq!(Move::Vectorize(4).index(), 27);
        assert_eq!(Move::Graph(1).index(), 29);
        assert_eq!(Move::Graph(0).index(), 30);
        assert_eq!(Move::Graph(4).index(), 33);
        assert_eq!(Move::CudaGraph(true).index(), 34);
        assert_eq!(Move::CudaGraph(false).index(), ACTIONS - 1);
    }

    #[test]
    fn a_cuda_graph_is_its_own_program_after_step_zero() {
        let shape = Shape {
            rewritten: [Some(1), None, None, None],
            ..Shape::plain(1, false)
        };
        let lib = Config::library(shape);
        // Not at step 0: it changes how a chosen program is launched.
        let mask = legal(&lib, shape, 0, &BTreeSet::new());
        assert!(!mask[Move::CudaGraph(true).index()]);
        let seen: BTreeSet<String> = ["library".to_string()].into();
        let mask = legal(&lib, shape, 1, &seen);
        assert!(mask[Move::CudaGraph(true).index()]);
        assert!(!mask[Move::CudaGraph(false).index()], "changes nothing");
        // The library program replayed is a program of its own, and the
        // flag survives the moves after it.
        let g = lib.apply(Move::CudaGraph(true), shape).unwrap();
        assert_eq!(g.key(), "library cuda-graph");
        let k = g.apply(Move::CustomKernel(Slot::All), shape).unwrap();
        let k = k.apply(Move::Graph(1), shape).unwrap();
        assert_eq!(k.key(), "k1 b256 v1 rw cuda-graph");
        assert_eq!(k.structure(), "k1 b256 v1 rw cuda-graph");
        let off = k.apply(Move::CudaGraph(false), shape).unwrap();
        assert_eq!(off.key(), "k1 b256 v1 rw");
        assert_eq!(Move::CudaGraph(true).label(), "cuda_graph(on)");
        assert!(!Move::CudaGraph(true).operator_level());
        // Configurations recorded before the move have no flag.
        let old: Config = serde_json::from_str(
            r#"{"kernels":[true],"fuse":true,"gemm":false,"block":256,"vector":1,"graph":0}"#,
        )
        .unwrap();
        assert!(!old.cuda_graph);
        assert_eq!(old.key(), "k1 b256 v1");
    }

    #[test]
    fn graph_moves_name_another_graph_where_one_exists() {
        let shape = Shape {
            regions: 1,
            products: false,
            rewritten: [Some(1), None, Some(2), None],
            convolutions: false,
        };
        let lib = Config::library(shape);
        let rw = lib.apply(Move::Graph(1), shape).unwrap();
        assert_eq!(rw.key(), "library rw");
        let k = rw.apply(Move::CustomKernel(Slot::All), shape).unwrap();
        assert_eq!(k.key(), "k1 b256 v1 rw");
        assert_eq!(k.apply(Move::Graph(0), shape).unwrap().key(), "k1 b256 v1");
        // A graph cut into other regions: kernels for all of them, since
        // the program had a region kernel.
        let nofold = k.apply(Move::Graph(3), shape).unwrap();
        assert_eq!(nofold.key(), "k11 b256 v1 rw-fold");
        assert_eq!(
            nofold.apply(Move::Graph(0), shape).unwrap().key(),
            "k1 b256 v1"
        );
        assert_eq!(
            lib.apply(Move::Graph(3), shape).unwrap().key(),
            "library rw-fold"
        );
        assert!(k.apply(Move::Graph(2), shape).is_none(), "no such graph");
        let mask = legal(&lib, shape, 0, &BTreeSet::new());
        for (k, expect) in [(0, false), (1, true), (2, false), (3, true), (4, false)] {
            assert_eq!(mask[Move::Graph(k).index()], expect, "graph {k} at step 0");
        }
        let none = Shape::plain(1, false);
        assert!(lib.apply(Move::Graph(1), none).is_none());
        assert!(!legal(&lib, none, 0, &BTreeSet::new())[Move::Graph(1).index()]);
        assert_eq!(
            Move::Graph(4).label(),
            "rewrite(but channels_last, fold_into_weights)"
        );
    }

    #[test]
    fn shapes_recorded_before_the_graph_variants_still_load() {
        let old: Shape =
            serde_json::from_str(r#"{"regions":3,"products":true,"rewrites":true}"#).unwrap();
        assert_eq!(old.rewritten, [Some(3), None, None, None]);
        let none: Shape = serde_json::from_str(r#"{"regions":3,"products":false}"#).unwrap();
        assert_eq!(none, Shape::plain(3, false));
        let shape = Shape {
            regions: 2,
            products: false,
            rewritten: [None, Some(1), None, Some(4)],
            convolutions: false,
        };
        let back: Shape = serde_json::from_str(&serde_json::to_string(&shape).unwrap()).unwrap();
        assert_eq!(back, shape);
    }

    #[test]
    fn keys_name_programs_not_settings() {
        let shape = Shape::plain(2, true);
        let lib = Config::library(shape);
        assert_eq!(lib.key(), "library");
        // Launch parameters without kernels build the same program.
        let retiled = lib.apply(Move::Retile(512), shape).unwrap();
        assert_eq!(retiled.key(), "library");
        let k = lib.apply(Move::CustomKernel(Slot::All), shape).unwrap();
        assert_eq!(k.key(), "k11 b256 v1");
        let one = lib
            .apply(Move::CustomKernel(Slot::Region(1)), shape)
            .unwrap();
        assert_eq!(one.key(), "k01 b256 v1");
        // Splitting one kernel changes nothing.
        assert_eq!(one.apply(Move::Split, shape).unwrap().key(), one.key());
        assert_eq!(
            k.apply(Move::Split, shape).unwrap().key(),
            "k11 split b256 v1"
        );
        assert!(
            lib.apply(Move::CustomKernel(Slot::Region(2)), shape)
                .is_none()
        );
        assert!(
            lib.apply(
                Move::GemmKernel,
                Shape {
                    products: false,
                    ..shape
                }
            )
            .is_none()
        );
    }

    #[test]
    fn step_zero_is_operator_level_and_stop_is_always_legal() {
        let shape = Shape::plain(3, false);
        let c = Config::library(shape);
        let mask = legal(&c, shape, 0, &BTreeSet::new());
        for m in Move::all() {
            let expect = match m {
                Move::Stop | Move::CallLibrary(Slot::All) | Move::CustomKernel(Slot::All) => true,
                Move::CustomKernel(Slot::Region(r)) => (r as usize) < 3,
                _ => false,
            };
            assert_eq!(mask[m.index()], expect, "{m:?}");
        }
        // Later, a move that rebuilds a program already judged is masked.
        let k = c.apply(Move::CustomKernel(Slot::All), shape).unwrap();
        let seen: BTreeSet<String> = ["library".to_string(), k.key()].into();
        let mask = legal(&k, shape, 1, &seen);
        assert!(!mask[Move::CallLibrary(Slot::All).index()]);
        assert!(!mask[Move::Vectorize(1).index()], "changes nothing");
        assert!(mask[Move::Vectorize(4).index()]);
        assert!(mask[Move::Split.index()]);
        assert!(!mask[Move::GemmKernel.index()]);
        assert!(mask[Move::Stop.index()]);
    }
}

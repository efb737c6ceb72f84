//! The observation: the problem's graph features, the current program's
//! configuration, the last outcome's diagnosis, the best result so far and
//! its diagnosis, the step, and what worked before on similar problems.

use mtmc_actions::device::{Bound, DeviceSpec, MathMode, roofline};
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::OpClass;
use mtmc_actions::rewrite::{REWRITES, rewrite_all};
use serde::{Deserialize, Serialize};

use crate::critique::{self, Diagnosis};
use crate::episode::Episode;
use crate::space::{ACTIONS, BLOCKS, GRAPHS, SLOTS, Shape, VECTORS};

/// Op classes counted in the graph features (sources are not).
const CLASSES: [OpClass; 14] = [
    OpClass::Matmul,
    OpClass::Conv,
    OpClass::Pointwise,
    OpClass::Reduction,
    OpClass::Scan,
    OpClass::Softmax,
    OpClass::Norm,
    OpClass::Pool,
    OpClass::Dropout,
    OpClass::Loss,
    OpClass::Attention,
    OpClass::Rnn,
    OpClass::Layout,
    OpClass::Opaque,
];

/// Index of the convolutions' count in [`CLASSES`] (and the features).
const CONV: usize = 1;
const _: () = assert!(matches!(CLASSES[CONV], OpClass::Conv));

/// Graph features before the rewrites' flags.
const GRAPH_BEFORE_REWRITES: usize = CLASSES.len() + 9;
/// Length of [`Problem::features`]: the counts and sizes, then one flag per
/// rewrite of `mtmc_actions::rewrite::REWRITES`, set where it applies to
/// the traced graph (rewritten graph 1 applies it).
pub const GRAPH: usize = GRAPH_BEFORE_REWRITES + REWRITES.len();
/// Length of the configuration's features.
pub const CONFIG: usize = 2 * SLOTS + 2 + BLOCKS.len() + VECTORS.len() + 1 + 2 * (GRAPHS - 1) + 1;
/// Length of the best-so-far features (besides its diagnosis).
pub const BEST: usize = 3;
/// Length of an observation.
pub const OBS: usize = GRAPH + CONFIG + 2 * critique::FEATURES + BEST + 1 + ACTIONS;

/// Length of an observation recorded before the rewrites' flags.
const OBS_BEFORE_REWRITES: usize = OBS - REWRITES.len();
/// Length of an observation recorded before the CUDA-graph moves (and the
/// rewrites' flags): one configuration flag and two moves' priors fewer.
const OBS_BEFORE_CUDA_GRAPH: usize = OBS_BEFORE_REWRITES - 3;

/// A recorded observation in this build's layout: one recorded before the
/// CUDA-graph moves gains their flag (off: no such program existed) and
/// their priors (0: no step of theirs had been recorded); one recorded
/// before the rewrites' flags gains them, cleared (readers that know the
/// problem put its graph features back: [`Problem::restore`]); any other
/// is returned as it is (one of another length is left out by its
/// readers).
pub fn upgrade(mut obs: Vec<f32>) -> Vec<f32> {
    if obs.len() == OBS_BEFORE_CUDA_GRAPH {
        obs.insert(GRAPH_BEFORE_REWRITES + CONFIG - 1, 0.0);
        obs.extend([0.0, 0.0]);
    }
    if obs.len() == OBS_BEFORE_REWRITES {
        obs.splice(
            GRAPH_BEFORE_REWRITES..GRAPH_BEFORE_REWRITES,
            [0.0; REWRITES.len()],
        );
    }
    obs
}

/// What the planner knows of a problem before any step.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Problem {
    /// Its name (`L2/76`, an intent's name).
    pub name: String,
    /// The op-class pattern similar problems share ([`pattern`]).
    pub pattern: String,
    /// The graph features ([`GRAPH`] numbers).
    pub features: Vec<f32>,
    /// What the action space depends on.
    pub shape: Shape,
    /// What limits its roofline.
    pub memory_bound: bool,
}

impl Problem {
    /// The problem named `name` with graph `g`, `regions` regions for
    /// kernels, on device `spec`.
    pub fn new(name: &str, g: &OpGraph, regions: usize, spec: &DeviceSpec) -> Problem {
        let roof = roofline(g, spec, MathMode::default());
        let mut counts = [0u32; CLASSES.len()];
        let mut largest = 1u64;
        let mut nodes = 0u32;
        for (_, n) in g.nodes() {
            let class = n.op.class();
            if let Some(k) = CLASSES.iter().position(|&c| c == class) {
                counts[k] += 1;
                nodes += 1;
            }
            for t in &n.outputs {
                largest = largest.max(t.numel());
            }
        }
        let products = counts[0] > 0;
        let mut f: Vec<f32> = counts
            .iter()
            .map(|&c| ((c as f32).ln_1p() / 3.0).min(1.5))
            .collect();
        let log10 = |x: u64| (x.max(1) as f64).log10() as f32;
        f.push(log10(roof.cost.unfused.flops) / 12.0);
        f.push(log10(roof.cost.unfused.bytes) / 10.0);
        f.push(log10(roof.cost.fused_bytes) / 10.0);
        f.push((roof.cost.unfused.intensity().max(1e-3).ln() / 5.0).clamp(-2.0, 2.0) as f32);
        f.push(f32::from(roof.bound == Bound::Memory));
        f.push(log10(largest) / 9.0);
        f.push(((nodes as f32).ln_1p() / 4.0).min(1.5));
        f.push((regions as f32 / SLOTS as f32).min(2.0));
        f.push(f32::from(products));
        let applied = rewrite_all(g).map(|(_, names)| names).unwrap_or_default();
        f.extend(
            REWRITES
                .iter()
                .map(|(name, _)| f32::from(applied.contains(name))),
        );
        debug_assert_eq!(f.len(), GRAPH);
        Problem {
            name: name.to_string(),
            pattern: pattern(g),
            features: f,
            // Which rewritten graphs exist, and which products the coder
            // writes, is the caller's to say: it needs the rewritten
            // graphs' regions.
            shape: Shape {
                convolutions: counts[CONV] > 0,
                ..Shape::plain(regions, products)
            },
            memory_bound: roof.bound == Bound::Memory,
        }
    }

    /// The same problem as recorded by an mtmc whose graph features came
    /// before the rewrites' flags: those flags cleared (unknown), so that
    /// its observations have this build's length. Features of any other
    /// length are left as they are.
    pub fn upgraded(mut self) -> Problem {
        if self.lacks_rewrite_flags() {
            self.features.extend([0.0; REWRITES.len()]);
        }
        self
    }

    /// Whether its graph features were recorded before the rewrites'
    /// flags.
    pub fn lacks_rewrite_flags(&self) -> bool {
        self.features.len() == GRAPH_BEFORE_REWRITES
    }

    /// Puts this problem's graph features into `obs`, an observation of
    /// one of its steps as recorded: the graph features of a problem are
    /// the same at every step, so an observation recorded before a graph
    /// feature existed reads it as a step observed now would. Nothing
    /// changes where either is of another length than this build's.
    pub fn restore(&self, obs: &mut [f32]) {
        if obs.len() == OBS && self.features.len() == GRAPH {
            obs[..GRAPH].copy_from_slice(&self.features);
        }
    }

    /// Whether the graph features count convolutions: the shape's flag for
    /// a problem recorded before the shape had one.
    pub fn has_convolutions(&self) -> bool {
        self.features.get(CONV).is_some_and(|&x| x > 0.0)
    }

    /// The roofline bound the diagnoses of this problem's outcomes use.
    pub fn bound(&self) -> Bound {
        if self.memory_bound {
            Bound::Memory
        } else {
            Bound::Compute
        }
    }
}

/// The op-class pattern of `g`: its classes in graph order, sources left
/// out, runs of one class written once with their count (`matmul+pointwise*3+reduce`).
/// Problems with equal patterns are "similar" for the knowledge base.
pub fn pattern(g: &OpGraph) -> String {
    let mut runs: Vec<(&str, u32)> = Vec::new();
    for (_, n) in g.nodes() {
        let class = n.op.class();
        if matches!(class, OpClass::Source | OpClass::Layout) {
            continue;
        }
        match runs.last_mut() {
            Some((name, k)) if *name == class.name() => *k += 1,
            _ => runs.push((class.name(), 1)),
        }
    }
    let parts: Vec<String> = runs
        .iter()
        .map(|&(n, k)| {
            if k == 1 {
                n.to_string()
            } else {
                format!("{n}*{k}")
            }
        })
        .collect();
    if parts.is_empty() {
        "empty".into()
    } else {
        parts.join("+")
    }
}

/// The observation vector ([`OBS`] numbers) of `episode` on `problem`,
/// with `prior`: the mean reward of each action on similar problems.
pub fn observe(problem: &Problem, episode: &Episode, prior: &[f32; ACTIONS]) -> Vec<f32> {
    let mut f = Vec::with_capacity(OBS);
    f.extend_from_slice(&problem.features);
    // Configuration.
    let c = &episode.config;
    for s in 0..SLOTS {
        f.push(f32::from(s < c.kernels.len()));
    }
    for s in 0..SLOTS {
        f.push(f32::from(c.kernels.get(s).copied().unwrap_or(false)));
    }
    f.push(f32::from(c.fuse));
    f.push(f32::from(c.gemm));
    f.extend(BLOCKS.iter().map(|&b| f32::from(c.block == b)));
    f.extend(VECTORS.iter().map(|&v| f32::from(c.vector == v)));
    let more = c.kernels.len().saturating_sub(SLOTS);
    f.push(if more == 0 {
        0.0
    } else {
        c.kernels[SLOTS..].iter().filter(|&&k| k).count() as f32 / more as f32
    });
    for k in 1..GRAPHS {
        f.push(f32::from(episode.shape.regions_of(k).is_some()));
    }
    for k in 1..GRAPHS {
        f.push(f32::from(c.graph as usize == k));
    }
    f.push(f32::from(c.cuda_graph));
    // The last outcome and the best one.
    let none = vec![0.0; critique::FEATURES];
    f.extend(
        episode
            .last
            .as_ref()
            .map_or(none.clone(), Diagnosis::features),
    );
    match &episode.best {
        Some(b) => {
            f.push(1.0);
            f.push(b.speedup.max(1e-3).ln().clamp(-4.0, 4.0) as f32);
            f.push(episode.since_best as f32 / episode.max_steps.max(1) as f32);
            f.extend(b.diagnosis.features());
        }
        None => {
            f.extend([0.0; BEST]);
            f.extend(none);
        }
    }
    f.push(episode.step as f32 / episode.max_steps.max(1) as f32);
    f.extend_from_slice(prior);
    debug_assert_eq!(f.len(), OBS);
    f
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::space::{Config, Move};

    /// The rewrites' flags of `features`.
    fn flags(features: &[f32]) -> Vec<f32> {
        features[GRAPH_BEFORE_REWRITES..GRAPH].to_vec()
    }

    #[test]
    fn observations_recorded_before_the_cuda_graph_moves_or_the_rewrites_flags_are_upgraded() {
        let shape = Shape::plain(1, false);
        let mut features = vec![0.5; GRAPH];
        features[GRAPH_BEFORE_REWRITES + 4] = 1.0;
        let problem = Problem {
            name: "p".into(),
            pattern: "pointwise".into(),
            features,
            shape,
            memory_bound: true,
        };
        let mut e = Episode::new(shape, 8);
        e.config = Config::library(shape)
            .apply(Move::CustomKernel(crate::space::Slot::All), shape)
            .unwrap();
        // Ones on both sides of the flag: the last graph's bit before it,
        // the last outcome's features after it.
        e.config.graph = (GRAPHS - 1) as u8;
        e.last = Some(crate::critique::diag(
            mtmc_env::outcome::Status::Correct,
            Some(2.0),
        ));
        let mut prior = [0.0f32; ACTIONS];
        for (i, p) in prior.iter_mut().enumerate().take(ACTIONS - 2) {
            *p = i as f32;
        }
        let now = observe(&problem, &e, &prior);
        // What an mtmc before the rewrites' flags observed, and what it
        // reads as here: the flags cleared, the rest in place.
        let mut before_flags = now.clone();
        before_flags.drain(GRAPH_BEFORE_REWRITES..GRAPH);
        let mut cleared = now.clone();
        cleared[GRAPH_BEFORE_REWRITES..GRAPH].fill(0.0);
        assert_eq!(upgrade(before_flags.clone()), cleared);
        // The same observation as an mtmc before the CUDA-graph moves
        // recorded it: no flags, no CUDA-graph flag, two priors fewer.
        let mut before_moves = before_flags;
        before_moves.remove(GRAPH_BEFORE_REWRITES + CONFIG - 1);
        before_moves.truncate(OBS - REWRITES.len() - 3);
        assert_eq!(upgrade(before_moves), cleared);
        assert_eq!(upgrade(now.clone()), now);
        assert_eq!(upgrade(vec![0.0; OBS - 1]).len(), OBS - 1);
        // The problem's graph features put back read as observed now.
        let mut restored = cleared;
        problem.restore(&mut restored);
        assert_eq!(restored, now);
        // A problem recorded before the flags: cleared, so its
        // observations have this build's length.
        let mut old = problem.clone();
        old.features.truncate(GRAPH_BEFORE_REWRITES);
        assert!(old.lacks_rewrite_flags() && !problem.lacks_rewrite_flags());
        let old = old.upgraded();
        assert_eq!(old.features.len(), GRAPH);
        assert_eq!(flags(&old.features), vec![0.0; REWRITES.len()]);
        assert_eq!(observe(&old, &e, &prior).len(), OBS);
        // Graph features of another length put nothing back.
        let mut odd = problem.clone();
        odd.features.truncate(GRAPH - 1);
        let mut untouched = now.clone();
        odd.restore(&mut untouched);
        assert_eq!(untouched, now);
    }

    /// A shared problem's traced graph.
    fn traced(level: u64, name: &str) -> OpGraph {
        mtmc_actions::import::shared_graph(level, name).unwrap()
    }

    #[test]
    fn the_graph_features_flag_the_rewrites_that_apply() {
        let spec = mtmc_actions::device::builtin_devices()[0].clone();
        let named = |level, name| {
            let p = Problem::new(name, &traced(level, name), 1, &spec);
            assert_eq!(p.features.len(), GRAPH);
            REWRITES
                .iter()
                .zip(flags(&p.features))
                .filter(|&(_, f)| f == 1.0)
                .map(|((n, _), _)| *n)
                .collect::<Vec<_>>()
        };
        assert_eq!(
            named(2, "34_ConvTranspose3d_LayerNorm_GELU_Scaling"),
            ["conv_bias_in_epilogue"]
        );
        assert_eq!(
            named(2, "87_Conv2d_Subtract_Subtract_Mish"),
            [
                "fold_into_weights",
                "conv_bias_in_epilogue",
                "channels_last"
            ]
        );
        assert_eq!(named(3, "44_MiniGPTBlock"), ["attention_in_one_call"]);
        assert!(named(1, "1_Square_matrix_multiplication_").is_empty());
    }
}

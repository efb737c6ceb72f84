//! The offline environment: episodes replayed on the recorded trajectory
//! tree. A state's children are the recorded outcomes of its moves (the
//! store's `evaluations`, by program key), so training needs no GPU; a move
//! whose program was never evaluated is masked.

use std::collections::BTreeMap;
use std::sync::Arc;

pub use burn::rl::{Environment, StepResult};

use crate::critique::Diagnosis;
use crate::episode::{Episode, Reward};
use crate::features::{Problem, observe};
use crate::rng::Rng;
use crate::space::{ACTIONS, Move};
use crate::store::{Store, StoreError};

/// One problem of the tree.
#[derive(Clone, Debug)]
pub struct TreeProblem {
    /// What the planner knows of it.
    pub problem: Problem,
    /// The recorded outcome of each program, by key.
    pub evals: BTreeMap<String, Diagnosis>,
    /// The knowledge-base features for it.
    pub prior: [f32; ACTIONS],
}

impl TreeProblem {
    /// The best speedup any recorded program reached (0 if none was
    /// correct): what an exhaustive search of the tree finds.
    pub fn best(&self) -> f64 {
        self.evals
            .values()
            .filter_map(crate::store::correct_speedup)
            .fold(0.0, f64::max)
    }
}

/// The recorded problems of `store` that have at least one evaluation,
/// each with its knowledge-base prior read from the problems `known`
/// accepts ([`Store::prior`]).
pub fn load(store: &Store, known: &dyn Fn(&str) -> bool) -> Result<Vec<TreeProblem>, StoreError> {
    load_by(store, None, known)
}

/// As [`load`], with each tree built from the episodes of `planner` alone
/// when given (the programs its episodes reached).
pub fn load_by(
    store: &Store,
    planner: Option<&str>,
    known: &dyn Fn(&str) -> bool,
) -> Result<Vec<TreeProblem>, StoreError> {
    let mut out = Vec::new();
    for problem in store.problems()? {
        let evals = match planner {
            Some(by) => store.evaluations_by(&problem.name, by)?,
            None => store.evaluations(&problem.name)?,
        };
        if evals.is_empty() {
            continue;
        }
        let prior = store.prior(&problem.pattern, &problem.name, known)?;
        out.push(TreeProblem {
            problem,
            evals,
            prior,
        });
    }
    Ok(out)
}

/// What the policy sees: the observation and the legal moves.
#[derive(Clone, Debug)]
pub struct Obs {
    /// The observation vector.
    pub features: Vec<f32>,
    /// The legal moves.
    pub mask: [bool; ACTIONS],
}

/// Episodes on the recorded tree, one problem after another (in an order
/// shuffled anew each pass).
#[derive(Clone)]
pub struct TreeEnv {
    problems: Arc<Vec<TreeProblem>>,
    order: Vec<usize>,
    next: usize,
    current: usize,
    episode: Episode,
    reward: Reward,
    max_steps: usize,
    rng: Rng,
}

impl TreeEnv {
    /// An environment over `problems` (not empty) with `max_steps`
    /// evaluations per episode, shuffled by `seed`.
    pub fn new(problems: Arc<Vec<TreeProblem>>, max_steps: usize, seed: u64) -> TreeEnv {
        assert!(!problems.is_empty(), "a tree environment needs problems");
        let shape = problems[0].problem.shape;
        let mut env = TreeEnv {
            order: (0..problems.len()).collect(),
            problems,
            next: 0,
            current: 0,
            episode: Episode::new(shape, max_steps),
            reward: Reward::default(),
            max_steps,
            rng: Rng::new(seed),
        };
        env.reset();
        env
    }

    /// The same environment with the reward `reward`.
    pub fn with_reward(mut self, reward: Reward) -> TreeEnv {
        self.reward = reward;
        self
    }

    /// Starts an episode on problem `k`.
    pub fn start(&mut self, k: usize) {
        self.current = k;
        self.episode = Episode::new(self.problems[k].problem.shape, self.max_steps);
    }

    /// The problem of the running episode.
    pub fn problem(&self) -> &TreeProblem {
        &self.problems[self.current]
    }

    /// The running episode.
    pub fn episode(&self) -> &Episode {
        &self.episode
    }

    /// The legal moves: the episode's, less those whose program the tree
    /// has no outcome for.
    pub fn mask(&self) -> [bool; ACTIONS] {
        let mut mask = self.episode.mask();
        let evals = &self.problem().evals;
        for (i, legal) in mask.iter_mut().enumerate() {
            let m = Move::from_index(i);
            if *legal && m != Move::Stop {
                *legal = self
                    .episode
                    .target(m)
                    .is_some_and(|c| evals.contains_key(&c.key()));
            }
        }
        mask
    }
}

impl Environment for TreeEnv {
    type State = Obs;
    type Action = usize;

    // Episodes end by their own evaluation budget; this is only a bound.
    const MAX_STEPS: usize = 64;

    fn state(&self) -> Obs {
        let p = self.problem();
        Obs {
            features: observe(&p.problem, &self.episode, &p.prior),
            mask: self.mask(),
        }
    }

    fn step(&mut self, action: usize) -> StepResult<Obs> {
        let m = Move::from_index(action);
        let target = self.episode.target(m).filter(|_| m != Move::Stop);
        let reward = match target.and_then(|c| {
            let d = self.problem().evals.get(&c.key())?.clone();
            Some((c, d))
        }) {
            Some((c, d)) => self.episode.record(m, c, d, &self.reward),
            // Stop, or a move the tree cannot answer: the episode ends.
            None => self.episode.stop(),
        };
        let done = self.episode.done || !self.mask().iter().any(|&l| l);
        if done {
            self.episode.done = true;
        }
        StepResult {
            next_state: self.state(),
            reward,
            done,
            truncated: false,
        }
    }

    fn reset(&mut self) {
        if self.next == 0 {
            let mut order = std::mem::take(&mut self.order);
            self.rng.shuffle(&mut order);
            self.order = order;
        }
        let k = self.order[self.next];
        self.next = (self.next + 1) % self.order.len();
        self.start(k);
    }
}

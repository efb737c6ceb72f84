//! The offline environment: episodes replayed on the recorded trajectory
//! tree. A state's children are the recorded outcomes of its moves (the
//! store's `evaluations`, by program key), so training needs no GPU; a move
//! whose program was never evaluated is masked.

use std::collections::{BTreeMap, BTreeSet, HashSet, VecDeque};
use std::sync::Arc;

pub use burn::rl::{Environment, StepResult};

use crate::critique::Diagnosis;
use crate::episode::{Episode, Reward};
use crate::features::{Problem, observe};
use crate::rng::Rng;
use crate::space::{ACTIONS, Config, Move};
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

    /// What an exhaustive search of the tree without the moves `left_out`
    /// finds (an ablation): the best speedup (0 if none was correct) and
    /// the number of recorded programs those moves reach from the library
    /// program — the first move operator-level, as in an episode, and
    /// later moves from correct programs only, since an episode rolls back
    /// the others; every order of the moves, whatever the timings.
    pub fn best_without(&self, left_out: &[bool; ACTIONS]) -> (f64, usize) {
        let shape = self.problem.shape;
        let mut seen: HashSet<Config> = HashSet::new();
        let mut queue = VecDeque::from([(Config::library(shape), true)]);
        let mut best = 0.0f64;
        while let Some((config, first)) = queue.pop_front() {
            for m in Move::all() {
                if m == Move::Stop || left_out[m.index()] || (first && !m.operator_level()) {
                    continue;
                }
                let Some(next) = config.apply(m, shape) else {
                    continue;
                };
                let Some(d) = self.evals.get(&next.key()) else {
                    continue;
                };
                if !seen.insert(next.clone()) {
                    continue;
                }
                if let Some(s) = crate::store::correct_speedup(d) {
                    best = best.max(s);
                    queue.push_back((next, false));
                }
            }
        }
        // Configs that differ in what changes nothing share a program.
        let programs: BTreeSet<String> = seen.iter().map(Config::key).collect();
        (best, programs.len())
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
    /// Moves left out of every episode (an ablation), by flat index.
    left_out: [bool; ACTIONS],
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
            left_out: [false; ACTIONS],
        };
        env.reset();
        env
    }

    /// The same environment with the reward `reward`.
    pub fn with_reward(mut self, reward: Reward) -> TreeEnv {
        self.reward = reward;
        self
    }

    /// The same environment with the moves `left_out` (a mask over the
    /// flat index, [`crate::space::of_kinds`]) never legal: an ablation.
    pub fn without(mut self, left_out: [bool; ACTIONS]) -> TreeEnv {
        self.left_out = left_out;
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

    /// The legal moves: the episode's, less those left out and those whose
    /// program the tree has no outcome for.
    pub fn mask(&self) -> [bool; ACTIONS] {
        let mut mask = self.episode.mask();
        let evals = &self.problem().evals;
        for (i, legal) in mask.iter_mut().enumerate() {
            let m = Move::from_index(i);
            if *legal && m != Move::Stop {
                *legal = !self.left_out[i]
                    && self
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

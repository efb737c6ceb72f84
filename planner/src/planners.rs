//! The planners a search can use, for comparison: the trained policy, a
//! random one, a greedy heuristic of hand-written rules, and exhaustive
//! enumeration (every program in a fixed order, within the budget).

use crate::critique::Limit;
use crate::episode::Episode;
use crate::features::Problem;
use crate::policy::{Committee, Cpu};
use crate::rng::Rng;
use crate::space::{ACTIONS, BLOCKS, GRAPHS, Move, Slot, VECTORS};
use mtmc_env::outcome::Status;

/// Which planner picks the moves.
pub enum Planner {
    /// The trained policy (or committee): its most likely legal move.
    Trained(Box<Committee<Cpu>>),
    /// A legal move other than stop, uniformly (stop when none is left).
    Random(Box<Rng>),
    /// Hand-written rules.
    Greedy,
    /// The first legal move in index order: over an episode it walks the
    /// programs reachable from the library one, none twice.
    Exhaustive,
}

impl Planner {
    /// The planner's name in reports and the store.
    pub fn name(&self) -> &'static str {
        match self {
            Planner::Trained(_) => "trained",
            Planner::Random(_) => "random",
            Planner::Greedy => "greedy",
            Planner::Exhaustive => "exhaustive",
        }
    }

    /// The move to make in `episode` on `problem`, given the observation
    /// `obs` and the legal moves `mask`.
    pub fn choose(
        &mut self,
        problem: &Problem,
        episode: &Episode,
        obs: &[f32],
        mask: &[bool; ACTIONS],
    ) -> Move {
        let stop = Move::Stop;
        let legal: Vec<Move> = Move::all()
            .filter(|m| mask[m.index()] && *m != stop)
            .collect();
        if legal.is_empty() {
            return stop;
        }
        match self {
            Planner::Trained(net) => {
                let p = net.act(obs, mask, &Default::default());
                p.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(stop, |(i, _)| Move::from_index(i))
            }
            Planner::Random(rng) => legal[rng.below(legal.len())],
            Planner::Exhaustive => legal[0],
            Planner::Greedy => greedy(problem, episode, mask),
        }
    }
}

/// The greedy rules: kernels for everything first (or GEMM kernels when
/// there is nothing else); when that is wrong, one region at a time; once
/// correct, a CUDA graph when the best program is launch- or
/// latency-bound, the rewritten graph (when a rewritten graph's program was not
/// correct, the next rewritten graph, with fewer rewrites), then vectorize
/// a memory-bound program,
/// then retile up and down, then GEMM kernels, then split; the library program when nothing else is left
/// untried and nothing is correct yet; stop when no rule applies.
pub fn greedy(problem: &Problem, episode: &Episode, mask: &[bool; ACTIONS]) -> Move {
    let legal = |m: &Move| mask[m.index()];
    let mut order: Vec<Move> = Vec::new();
    let correct = episode
        .last
        .as_ref()
        .is_some_and(|d| matches!(d.status, Status::Correct | Status::CompiledOnly));
    if episode.step == 0 {
        order.extend([
            Move::CustomKernel(Slot::All),
            Move::GemmKernel,
            Move::CallLibrary(Slot::All),
        ]);
    } else if correct || episode.best.is_some() {
        let rewritten_failed =
            !correct && matches!(episode.moves.last(), Some(Move::Graph(k)) if *k > 0);
        if rewritten_failed {
            order.extend((2..GRAPHS as u8).map(Move::Graph));
        }
        // Far from both roofs or bound by launches: one launch for the
        // whole forward.
        let overheads = episode
            .best
            .as_ref()
            .is_some_and(|b| matches!(b.diagnosis.limit, Limit::Launch | Limit::Latency));
        if overheads {
            order.push(Move::CudaGraph(true));
        }
        order.push(Move::Graph(1));
        let memory = episode
            .last
            .as_ref()
            .is_some_and(|d| d.unvectorized || d.limit == Limit::Memory || problem.memory_bound);
        if memory {
            order.extend(VECTORS.iter().rev().map(|&v| Move::Vectorize(v)));
        }
        order.extend([
            Move::Retile(BLOCKS[2]),
            Move::Retile(BLOCKS[0]),
            Move::GemmKernel,
            Move::Split,
        ]);
        order.extend(VECTORS.iter().rev().map(|&v| Move::Vectorize(v)));
        order.push(Move::Retile(BLOCKS[1]));
        order.push(Move::Fuse);
        order.push(Move::CustomKernel(Slot::All));
    } else {
        // Nothing correct yet: kernels one region at a time, then the
        // library program.
        order.extend((0..crate::space::SLOTS as u8).map(|r| Move::CustomKernel(Slot::Region(r))));
        order.push(Move::CallLibrary(Slot::All));
    }
    // The library program is the fallback: it is tried before the budget
    // runs out when nothing is correct.
    if episode.best.is_none() && episode.step + 1 >= episode.max_steps {
        order.insert(0, Move::CallLibrary(Slot::All));
    }
    order.into_iter().find(legal).unwrap_or(Move::Stop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::critique::{Diagnosis, diag};
    use crate::space::Shape;

    /// A compute-bound problem of `shape`.
    fn problem(shape: Shape) -> Problem {
        Problem {
            name: "p".into(),
            pattern: "conv+pointwise".into(),
            features: vec![0.0; crate::features::GRAPH],
            shape,
            memory_bound: false,
        }
    }

    #[test]
    fn greedy_tries_fewer_rewrites_after_a_rewritten_graph_fails() {
        let shape = Shape {
            regions: 1,
            products: false,
            rewritten: [Some(1), Some(1), None, Some(1)],
            convolutions: false,
        };
        let problem = problem(shape);
        let mut e = Episode::new(shape, 8);
        let step = |e: &mut Episode, expect: Move, d: Diagnosis| {
            let m = greedy(&problem, e, &e.mask());
            assert_eq!(m, expect, "after {:?}", e.moves);
            e.take(m, d);
        };
        step(
            &mut e,
            Move::CustomKernel(Slot::All),
            diag(Status::Correct, Some(1.2)),
        );
        step(&mut e, Move::Graph(1), diag(Status::Incorrect, None));
        // Every rewrite missed the tolerance: without channels-last next,
        // then without either of the rewrites that may.
        step(&mut e, Move::Graph(2), diag(Status::Incorrect, None));
        step(&mut e, Move::Graph(4), diag(Status::Correct, Some(1.5)));
        assert_eq!(e.config.key(), "k1 b256 v1 rw-cl-fold");
        // Correct: on to the launch parameters.
        assert_eq!(greedy(&problem, &e, &e.mask()), Move::Retile(512));
    }

    #[test]
    fn greedy_replays_a_launch_bound_program_from_a_cuda_graph() {
        let shape = Shape::plain(2, false);
        let problem = problem(shape);
        for (limit, first) in [
            (Limit::Launch, Move::CudaGraph(true)),
            (Limit::Latency, Move::CudaGraph(true)),
            (Limit::Compute, Move::Retile(512)),
        ] {
            let mut e = Episode::new(shape, 8);
            let mut d = diag(Status::Correct, Some(1.1));
            d.limit = limit;
            e.take(Move::CustomKernel(Slot::All), d);
            assert_eq!(greedy(&problem, &e, &e.mask()), first, "{limit:?}");
        }
    }
}

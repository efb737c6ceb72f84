//! One episode on one problem: the configuration the program is at, what
//! was evaluated, the last diagnosis and the best result so far, and the
//! reward of each step.
//!
//! The reward follows MTMC's shaping (a term for building, one for running
//! correctly, a small cost per evaluation) plus MaxCode's max-reward term:
//! the gain is the growth of the best speedup so far, so an episode's
//! gains add up to `ln max(1, best speedup)` whatever the order in which it
//! was found. ARCHITECTURE.md gives the formula.

use std::collections::BTreeSet;

use mtmc_env::outcome::Status;
use serde::{Deserialize, Serialize};

use crate::critique::Diagnosis;
use crate::space::{ACTIONS, Config, Move, Shape, legal};

/// A correct program at least this fraction of the best speedup is a tie
/// with it: the episode refines it next (the best stays the best). One
/// program's timings move by a few percent from one judging to the next
/// (docs/evaluation.md); chosen on the validation split,
/// where it raised every planner a little and the trained one most.
pub const TIE: f64 = 0.95;

/// The reward's terms.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Reward {
    /// Every evaluation costs this (0 by default: the budget is the
    /// pressure; `mtmc train --step-cost` sets it).
    pub step: f64,
    /// The fragment was refused or did not compile.
    pub build_failed: f64,
    /// It ran and a check failed.
    pub wrong: f64,
    /// It crashed, overran its time or failed while running.
    pub crashed: f64,
    /// It compiled and nothing was run (no GPU).
    pub compiled: f64,
    /// It was the first correct program of the episode.
    pub correct: f64,
    /// Weight of the max-reward term `ln max(1, s) − ln max(1, best)`.
    pub gain: f64,
}

impl Default for Reward {
    fn default() -> Reward {
        Reward {
            step: 0.0,
            build_failed: -0.5,
            wrong: -0.3,
            crashed: -0.4,
            compiled: 0.05,
            correct: 0.1,
            gain: 1.0,
        }
    }
}

impl Reward {
    /// The reward of a step whose outcome is `d`, when the best speedup
    /// before it was `best` (`None`: nothing correct yet).
    pub fn of(&self, d: &Diagnosis, best: Option<f64>) -> f64 {
        let status = match d.status {
            Status::CompileError => self.build_failed,
            // A time no GPU can reach is a wrong program, whatever it printed.
            Status::Incorrect | Status::Implausible => self.wrong,
            Status::RuntimeError | Status::Timeout | Status::Crashed => self.crashed,
            Status::CompiledOnly => self.compiled,
            // Running correctly earns once, for the first correct program:
            // after it only improvements of the best count, so a planner
            // gains nothing by spending evaluations that cannot improve it.
            Status::Correct if best.is_none() => self.correct,
            Status::Correct => 0.0,
            // Passed a screen, slower than the fastest screened by more
            // than the margin: no program to count, nothing wrong.
            Status::Screened => 0.0,
        };
        let gain = match (d.status, d.speedup_eager) {
            (Status::Correct, Some(s)) if s.is_finite() => {
                (s.max(1.0).ln() - best.unwrap_or(1.0).max(1.0).ln()).max(0.0)
            }
            _ => 0.0,
        };
        self.step + status + self.gain * gain
    }
}

/// The best result of an episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Best {
    /// Speedup against eager.
    pub speedup: f64,
    /// The configuration's key.
    pub key: String,
    /// Its diagnosis.
    pub diagnosis: Diagnosis,
}

/// The state of one episode.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    /// What the action space depends on.
    pub shape: Shape,
    /// The current program: the best so far (the start before any).
    pub config: Config,
    /// Steps taken (evaluations made).
    pub step: usize,
    /// Evaluations allowed.
    pub max_steps: usize,
    /// Keys of the programs evaluated.
    pub seen: BTreeSet<String>,
    /// [`Config::structure`] of the programs no move leads to again in
    /// this episode, under any launch parameters: those judged incorrect
    /// (the same kernels with other launch parameters compute the same
    /// values), and the CUDA-graph programs rolled back for being slower
    /// (a graph of the same kernels under other launch parameters replaces
    /// the same launches: in the shipped tree, of 145 ordered pairs of
    /// such graphs where the first lost to the program it replays, the
    /// second was kept in 7, and gained at most 4 % on its own program).
    #[serde(default)]
    pub ruled_out: BTreeSet<String>,
    /// Some judged program found the reference TF32-rounded
    /// ([`Diagnosis::reference_tf32`]): where the graph has convolutions,
    /// GEMM kernels (exact float32 convolutions) cannot be correct then.
    #[serde(default)]
    pub tf32_reference: bool,
    /// The last outcome's diagnosis.
    pub last: Option<Diagnosis>,
    /// The best correct result.
    pub best: Option<Best>,
    /// Steps since the best improved.
    pub since_best: usize,
    /// Stopped, or out of steps.
    pub done: bool,
    /// Moves taken, in order.
    pub moves: Vec<Move>,
}

impl Episode {
    /// An episode at the library program with `max_steps` evaluations.
    pub fn new(shape: Shape, max_steps: usize) -> Episode {
        Episode {
            shape,
            config: Config::library(shape),
            step: 0,
            max_steps,
            seen: BTreeSet::new(),
            ruled_out: BTreeSet::new(),
            tf32_reference: false,
            last: None,
            best: None,
            since_best: 0,
            done: false,
            moves: Vec::new(),
        }
    }

    /// The legal moves now: stop only once out of steps; no move to a
    /// program whose kernels were judged incorrect under other launch
    /// parameters, or to a CUDA graph of kernels whose graph was slower
    /// under other launch parameters ([`Episode::ruled_out`]); once the
    /// reference is known to be TF32-rounded, no move that makes a graph's
    /// convolutions GEMM kernels (in the recorded tree none of the 137
    /// such programs, on 34 problems, was correct).
    pub fn mask(&self) -> [bool; ACTIONS] {
        if self.done {
            return [false; ACTIONS];
        }
        if self.step >= self.max_steps {
            let mut m = [false; ACTIONS];
            m[Move::Stop.index()] = true;
            return m;
        }
        let mut mask = legal(&self.config, self.shape, self.step, &self.seen);
        let exact_convs = self.tf32_reference && self.shape.convolutions;
        if !self.ruled_out.is_empty() || exact_convs {
            for m in Move::all() {
                if mask[m.index()]
                    && self.target(m).is_some_and(|c| {
                        self.ruled_out.contains(&c.structure())
                            || (exact_convs && c.gemm && !self.config.gemm)
                    })
                {
                    mask[m.index()] = false;
                }
            }
        }
        mask
    }

    /// The configuration move `m` asks to evaluate (`None` for stop or a
    /// move that is not possible).
    pub fn target(&self, m: Move) -> Option<Config> {
        self.config.apply(m, self.shape)
    }

    /// Records the outcome `d` of evaluating `next` (reached by `m`) and
    /// returns the step's reward. Moves refine the best program so far: a
    /// program that is not correct, or slower than [`TIE`] times the best,
    /// is rolled back (the episode returns to the program it was refining);
    /// a correct one within that of the best is refined next while the best
    /// stays the best. Without timings, the last
    /// program with kernels that compiled is the one refined.
    pub fn record(&mut self, m: Move, next: Config, d: Diagnosis, reward: &Reward) -> f64 {
        let r = reward.of(&d, self.best.as_ref().map(|b| b.speedup));
        self.seen.insert(next.key());
        self.moves.push(m);
        self.step += 1;
        self.since_best += 1;
        match d.status {
            Status::Correct => {
                let speedup = d.speedup_eager.unwrap_or(0.0);
                if self.best.as_ref().is_none_or(|b| speedup > b.speedup) {
                    self.best = Some(Best {
                        speedup,
                        key: next.key(),
                        diagnosis: d.clone(),
                    });
                    self.since_best = 0;
                    self.config = next;
                } else if self
                    .best
                    .as_ref()
                    .is_some_and(|b| speedup >= b.speedup * TIE)
                {
                    // A tie within the timings' spread: refine it, so that
                    // a move that pays only with another (a rewrite, then
                    // a retile) is not undone before the other is tried.
                    self.config = next;
                } else if next.cuda_graph {
                    self.ruled_out.insert(next.structure());
                }
            }
            // Nothing timed (no GPU): a program with kernels is the one to
            // refine.
            Status::CompiledOnly if next.any_kernel() => self.config = next,
            Status::Incorrect => {
                self.ruled_out.insert(next.structure());
            }
            _ => {}
        }
        self.tf32_reference |= d.reference_tf32;
        self.last = Some(d);
        if self.step >= self.max_steps {
            // Out of evaluations: only stop is left, and it changes nothing.
            self.done = true;
        }
        r
    }

    /// Tests: evaluates move `m`'s program with the outcome `d` and the
    /// default reward.
    #[cfg(test)]
    pub(crate) fn take(&mut self, m: Move, d: Diagnosis) -> f64 {
        let next = self.target(m).expect("a move with a program");
        self.record(m, next, d, &Reward::default())
    }

    /// Ends the episode (reward 0).
    pub fn stop(&mut self) -> f64 {
        self.moves.push(Move::Stop);
        self.done = true;
        0.0
    }

    /// The best speedup found (1 = eager; 0 when nothing was correct).
    pub fn best_speedup(&self) -> f64 {
        self.best.as_ref().map_or(0.0, |b| b.speedup)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::critique::diag;
    use crate::space::Slot;

    #[test]
    fn reward_cases() {
        let eq = |a: f64, b: f64| assert!((a - b).abs() < 1e-12, "{a} != {b}");
        // By default an evaluation costs nothing in itself.
        let free = Reward::default();
        eq(free.of(&diag(Status::Incorrect, None), None), -0.3);
        eq(free.of(&diag(Status::Correct, Some(1.5)), Some(2.0)), 0.0);
        eq(
            free.of(&diag(Status::Correct, Some(2.0)), None),
            0.1 + 2f64.ln(),
        );
        // With a cost of 0.005 per evaluation (`train --step-cost 0.005`).
        let r = Reward {
            step: -0.005,
            ..Reward::default()
        };
        // A fragment that does not compile.
        eq(
            r.of(
                &Diagnosis::failed_to_build("k.cu(1): error: x", false),
                None,
            ),
            -0.505,
        );
        eq(r.of(&diag(Status::Incorrect, None), Some(2.0)), -0.305);
        eq(r.of(&diag(Status::Crashed, None), None), -0.405);
        eq(r.of(&diag(Status::CompiledOnly, None), None), 0.045);
        // Correct but slower than eager: no gain.
        eq(r.of(&diag(Status::Correct, Some(0.5)), None), 0.095);
        // The first correct program at 2x: gain ln 2.
        eq(
            r.of(&diag(Status::Correct, Some(2.0)), None),
            0.095 + 2f64.ln(),
        );
        // Better than the best so far: gain ln(3/2); worse: none.
        // After a correct program, running correctly earns nothing more:
        // better than the best so far gains ln(3/2); worse, only the cost.
        eq(
            r.of(&diag(Status::Correct, Some(3.0)), Some(2.0)),
            -0.005 + 1.5f64.ln(),
        );
        eq(r.of(&diag(Status::Correct, Some(1.5)), Some(2.0)), -0.005);
    }

    #[test]
    fn gains_add_up_to_the_log_of_the_best() {
        let shape = Shape::plain(2, false);
        let r = Reward {
            step: 0.0,
            correct: 0.0,
            ..Reward::default()
        };
        let mut e = Episode::new(shape, 8);
        let mut total = 0.0;
        for (m, s) in [
            (Move::CallLibrary(Slot::All), 1.0),
            (Move::CustomKernel(Slot::All), 1.7),
            (Move::Vectorize(4), 1.2),
            (Move::Retile(512), 2.5),
        ] {
            let next = e.target(m).unwrap();
            assert!(e.mask()[m.index()], "{m:?} legal");
            total += e.record(m, next, diag(Status::Correct, Some(s)), &r);
            if m == Move::Vectorize(4) {
                // Slower than the best: back to the best program.
                assert_eq!(e.config.key(), "k11 b256 v1");
            }
        }
        assert_eq!(e.config.key(), "k11 b512 v1");
        assert!((total - 2.5f64.ln()).abs() < 1e-12);
        assert_eq!(e.best_speedup(), 2.5);
    }

    #[test]
    fn kernels_judged_incorrect_are_not_tried_under_other_launch_parameters() {
        let shape = Shape {
            regions: 1,
            products: false,
            rewritten: [Some(1), Some(1), None, None],
            convolutions: false,
        };
        let mut e = Episode::new(shape, 8);
        let step = |e: &mut Episode, m: Move, d: Diagnosis| {
            assert!(e.mask()[m.index()], "{m:?} legal after {:?}", e.moves);
            e.take(m, d);
        };
        step(
            &mut e,
            Move::CustomKernel(Slot::All),
            diag(Status::Correct, Some(1.2)),
        );
        step(&mut e, Move::Graph(1), diag(Status::Incorrect, None));
        assert_eq!(e.ruled_out.iter().collect::<Vec<_>>(), ["k1 b256 v1 rw"]);
        // A launch parameter that does not compile is no verdict on the
        // kernels' values.
        step(
            &mut e,
            Move::Vectorize(4),
            Diagnosis::failed_to_build("k.cu(1): error: x", false),
        );
        assert_eq!(e.ruled_out.len(), 1);
        step(&mut e, Move::Retile(512), diag(Status::Correct, Some(1.3)));
        assert_eq!(e.config.key(), "k1 b512 v1");
        let mask = e.mask();
        // The rewritten graph's kernels at 512 threads: the same values as
        // at 256, judged incorrect.
        assert_eq!(e.target(Move::Graph(1)).unwrap().key(), "k1 b512 v1 rw");
        assert!(!mask[Move::Graph(1).index()]);
        // Another graph, and other launch parameters of the traced one.
        assert!(mask[Move::Graph(2).index()]);
        assert!(mask[Move::Vectorize(4).index()]);
        assert!(mask[Move::Retile(128).index()]);
    }

    #[test]
    fn a_tf32_reference_masks_gemm_kernels_of_convolutions_only() {
        let tf32 = |s: f64| Diagnosis {
            reference_tf32: true,
            ..diag(Status::Correct, Some(s))
        };
        for convolutions in [true, false] {
            let shape = Shape {
                convolutions,
                ..Shape::plain(2, true)
            };
            let mut e = Episode::new(shape, 8);
            let gemm = Move::GemmKernel.index();
            assert!(e.mask()[gemm], "nothing is known of the reference yet");
            e.take(
                Move::CustomKernel(Slot::Region(0)),
                diag(Status::Correct, Some(1.1)),
            );
            assert!(e.mask()[gemm], "a diagnosis without the flag");
            e.take(Move::CustomKernel(Slot::All), tf32(1.2));
            assert!(e.tf32_reference);
            // Exact float32 convolutions cannot meet a TF32 reference; a
            // graph of matrix products alone keeps its GEMM kernels.
            assert_eq!(
                e.mask()[gemm],
                !convolutions,
                "convolutions: {convolutions}"
            );
            // The flag stays whatever the next outcome says.
            e.take(Move::Vectorize(4), diag(Status::Correct, Some(1.0)));
            assert_eq!(e.mask()[gemm], !convolutions);
            assert!(e.mask()[Move::Retile(512).index()]);
        }
    }

    #[test]
    fn a_tie_with_the_best_is_refined_and_a_slower_program_rolled_back() {
        let shape = Shape::plain(1, false);
        let mut e = Episode::new(shape, 8);
        let r = Reward::default();
        let judge = |e: &mut Episode, m: Move, speedup: f64| {
            let next = e.target(m).unwrap();
            e.record(m, next, diag(Status::Correct, Some(speedup)), &r);
        };
        judge(&mut e, Move::CustomKernel(Slot::All), 2.0);
        let best = e.config.key();
        // Within 5 % of the best: refined next, the best kept.
        judge(&mut e, Move::Retile(512), 2.0 * TIE + 1e-9);
        assert_ne!(e.config.key(), best, "a tie is refined");
        assert_eq!(e.best.as_ref().unwrap().key, best);
        assert_eq!(e.best_speedup(), 2.0);
        assert_eq!(e.since_best, 1);
        let tie = e.config.key();
        // Slower than that: rolled back to the program being refined.
        judge(&mut e, Move::Vectorize(4), 2.0 * TIE - 1e-3);
        assert_eq!(e.config.key(), tie);
        // Faster than the best: the new best, and refined.
        judge(&mut e, Move::Vectorize(2), 2.5);
        assert_eq!(e.best.as_ref().unwrap().key, e.config.key());
        assert_eq!(e.since_best, 0);
    }

    #[test]
    fn a_cuda_graph_that_lost_is_not_tried_on_the_same_kernels_again() {
        let shape = Shape::plain(1, false);
        let graph = Move::CudaGraph(true);
        let mut e = Episode::new(shape, 8);
        e.take(
            Move::CustomKernel(Slot::All),
            diag(Status::Correct, Some(2.0)),
        );
        // A tie is refined and says nothing against the graph.
        let mut tie = e.clone();
        tie.take(graph, diag(Status::Correct, Some(1.95)));
        assert!(tie.config.cuda_graph && tie.ruled_out.is_empty());
        e.take(Move::Retile(512), diag(Status::Correct, Some(2.0)));
        assert!(e.mask()[graph.index()]);
        e.take(graph, diag(Status::Correct, Some(1.5)));
        assert!(!e.config.cuda_graph, "rolled back");
        assert_eq!(
            e.ruled_out.iter().collect::<Vec<_>>(),
            ["k1 b256 v1 cuda-graph"]
        );
        // The same kernels under other launch parameters: no graph.
        e.take(Move::Retile(128), diag(Status::Correct, Some(1.98)));
        assert_eq!(e.config.key(), "k1 b128 v1");
        assert!(!e.mask()[graph.index()]);
        assert!(e.mask()[Move::Vectorize(4).index()]);
        // Other kernels (the library's) may still gain from one.
        e.take(
            Move::CallLibrary(Slot::All),
            diag(Status::Correct, Some(1.97)),
        );
        assert_eq!(e.config.key(), "library");
        assert!(e.mask()[graph.index()]);
    }

    #[test]
    fn a_wrong_program_is_rolled_back_and_not_tried_again() {
        let shape = Shape::plain(1, false);
        let mut e = Episode::new(shape, 2);
        let m = Move::CustomKernel(Slot::All);
        let next = e.target(m).unwrap();
        e.record(m, next, diag(Status::Incorrect, None), &Reward::default());
        assert_eq!(e.config.key(), "library", "rolled back");
        assert!(!e.mask()[m.index()], "the same program is not judged twice");
        assert!(e.mask()[Move::CallLibrary(Slot::All).index()]);
        let m = Move::CallLibrary(Slot::All);
        let next = e.target(m).unwrap();
        e.record(
            m,
            next,
            diag(Status::Correct, Some(1.0)),
            &Reward::default(),
        );
        assert!(e.done, "out of evaluations");
        assert_eq!(e.mask(), [false; ACTIONS]);
    }
}

//! The planner `--planner` names, loaded to act: random, greedy,
//! exhaustive, or a trained checkpoint (its policy and reward-to-go model).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use mtmc_planner::episode::Episode;
use mtmc_planner::features::Problem as PlanProblem;
use mtmc_planner::planners::Planner;
use mtmc_planner::policy::{Checkpoint, Cpu};
use mtmc_planner::rng::Rng;
use mtmc_planner::rtg::RewardToGo;
use mtmc_planner::space::{ACTIONS, Move};

/// Which planner `--planner` names.
#[derive(Clone, Debug)]
pub enum Choice {
    /// A uniformly random legal move.
    Random,
    /// The hand-written rules.
    Greedy,
    /// Every program in a fixed order.
    Exhaustive,
    /// A checkpoint written by `mtmc train`.
    Trained(PathBuf),
}

impl std::str::FromStr for Choice {
    type Err = String;
    fn from_str(s: &str) -> Result<Choice, String> {
        Ok(match s {
            "random" => Choice::Random,
            "greedy" => Choice::Greedy,
            "exhaustive" => Choice::Exhaustive,
            path => {
                let p = PathBuf::from(path);
                if !p.join("meta.json").is_file() {
                    return Err(format!(
                        "`{path}` is neither random, greedy, exhaustive nor a checkpoint folder (one with meta.json, written by `mtmc train --out DIR`)"
                    ));
                }
                Choice::Trained(p)
            }
        })
    }
}

/// A planner ready to act, with its reward-to-go model when the
/// checkpoint has one.
pub struct Loaded {
    pub(super) planner: Planner,
    rtg: Option<RewardToGo<Cpu>>,
    pub(super) version: String,
    /// Whether the trained policy's STOP ends the search while the budget
    /// and other legal moves remain (off: it picks its likeliest other
    /// move, and the search ends at the budget, near the roofline, or when
    /// no legal move is left).
    policy_stops: bool,
    /// The trained planner's last choice: what it weighed.
    considered: Option<Considered>,
}

/// The legal moves the trained planner weighed for one choice: its
/// policy's likeliest ones with their probabilities, and the reward-to-go
/// model's prediction for those it reranked.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct Considered {
    /// Up to [`CONSIDERED`] legal moves (STOP too), likeliest first, each
    /// with the policy's probability and, where the model scored it, the
    /// best speedup it predicts from there.
    moves: Vec<(Move, f32, Option<f32>)>,
    /// The move taken.
    taken: Move,
}

/// How many of the policy's likeliest legal moves [`Considered`] keeps.
const CONSIDERED: usize = 4;

impl Considered {
    /// `policy: m1 0.62, m2 0.20 (…), …; took m`: each move's probability,
    /// and the reward-to-go model's predicted best speedup in brackets
    /// where it reranked that move.
    pub(crate) fn text(&self) -> String {
        let moves: Vec<String> = self
            .moves
            .iter()
            .map(|(m, p, score)| match score {
                Some(s) => format!("{} {p:.2} (predicted {:.3}x)", m.label(), s.exp()),
                None => format!("{} {p:.2}", m.label()),
            })
            .collect();
        format!("policy: {}; took {}", moves.join(", "), self.taken.label())
    }
}

/// Refuses a checkpoint whose `mtmc train` did not finish: `train.json`
/// is written last, after the reward-to-go model, so a run stopped (or
/// killed) once its policies were trained but before that would act
/// without its reward-to-go model; and one resumed to more iterations
/// and stopped after a few would act as a policy no run finished.
pub(super) fn finished(dir: &Path, iteration: usize) -> Result<()> {
    let path = dir.join("train.json");
    let fix = "run the `mtmc train` that wrote it again with --resume to finish it";
    let Ok(text) = std::fs::read_to_string(&path) else {
        bail!(
            "checkpoint `{}` is not finished: it has no train.json, which `mtmc train` writes last (after the reward-to-go model): {fix}",
            dir.display()
        );
    };
    let recorded = serde_json::from_str::<serde_json::Value>(&text)
        .with_context(|| format!("`{}` is not JSON", path.display()))?["iterations"]
        .as_u64();
    match recorded {
        Some(n) if n as usize != iteration => bail!(
            "checkpoint `{}` is not finished: its policy has trained {iteration} iterations, and the run that wrote its train.json trained {n}: {fix}",
            dir.display()
        ),
        _ => Ok(()),
    }
}

impl Choice {
    /// Loads the planner (`seed` drives the random one).
    pub fn load(&self, seed: u64) -> Result<Loaded> {
        Ok(match self {
            Choice::Random => Loaded {
                planner: Planner::Random(Box::new(Rng::new(seed))),
                rtg: None,
                version: "random".into(),
                policy_stops: false,
                considered: None,
            },
            Choice::Greedy => Loaded {
                planner: Planner::Greedy,
                rtg: None,
                version: "greedy".into(),
                policy_stops: false,
                considered: None,
            },
            Choice::Exhaustive => Loaded {
                planner: Planner::Exhaustive,
                rtg: None,
                version: "exhaustive".into(),
                policy_stops: false,
                considered: None,
            },
            Choice::Trained(dir) => {
                let (policy, meta) =
                    Checkpoint::at(dir).load_committee::<Cpu>(&Default::default())?;
                finished(dir, meta.iteration)?;
                Loaded {
                    planner: Planner::Trained(Box::new(policy)),
                    rtg: mtmc_planner::rtg::load(dir).map_err(anyhow::Error::msg)?,
                    version: meta.version,
                    policy_stops: false,
                    considered: None,
                }
            }
        })
    }
}

/// Candidates the reward-to-go model reranks: the policy's most likely
/// legal moves, those at least [`RERANK_WITHIN`] times as likely as its
/// first choice. The model breaks the policy's near-ties; it does not
/// overrule a clear choice (on the validation split, reranking the top
/// three whatever their odds lost 2 % of the geomean; within half of the
/// first choice's probability it matched the policy alone).
const RERANK: usize = 3;

/// See [`RERANK`].
const RERANK_WITHIN: f32 = 0.5;

impl Loaded {
    /// Lets the trained policy's STOP end the search before the budget is
    /// spent (`--policy-stops`); the other planners are not affected.
    pub fn policy_stops(mut self, yes: bool) -> Loaded {
        self.policy_stops = yes;
        self
    }

    /// The next move. The trained planner takes its likeliest legal move
    /// other than STOP (STOP only when [`Loaded::policy_stops`] lets the
    /// policy's first choice end the search, or when nothing else is
    /// legal); with a reward-to-go model, the best-predicted of the
    /// policy's top [`RERANK`].
    pub(super) fn choose(
        &mut self,
        p: &PlanProblem,
        e: &Episode,
        obs: &[f32],
        mask: &[bool; ACTIONS],
    ) -> Move {
        let Planner::Trained(net) = &self.planner else {
            return self.planner.choose(p, e, obs, mask);
        };
        let device = Default::default();
        let probs = net.act(obs, mask, &device);
        let score = |i: usize| self.rtg.as_ref().map(|rtg| rtg.score(obs, i, &device));
        let (taken, scored) = trained_move(&probs, mask, self.policy_stops, score);
        let mut legal: Vec<usize> = (0..ACTIONS).filter(|&i| mask[i]).collect();
        legal.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
        legal.truncate(CONSIDERED);
        for &(i, _) in &scored {
            if !legal.contains(&i) {
                legal.push(i);
            }
        }
        self.considered = Some(Considered {
            moves: legal
                .into_iter()
                .map(|i| {
                    let s = scored.iter().find(|&&(j, _)| j == i).map(|&(_, s)| s);
                    (Move::from_index(i), probs[i], s)
                })
                .collect(),
            taken,
        });
        taken
    }

    /// What the trained planner weighed for its last move (none for the
    /// other planners).
    pub(crate) fn considered(&self) -> Option<&Considered> {
        self.considered.as_ref()
    }
}

/// The trained planner's move, given the policy's probabilities `probs`
/// over the legal moves `mask` and `score` (the reward-to-go model's
/// prediction for a move; none without a model), and the moves the model
/// scored, with their scores.
fn trained_move(
    probs: &[f32],
    mask: &[bool; ACTIONS],
    policy_stops: bool,
    score: impl Fn(usize) -> Option<f32>,
) -> (Move, Vec<(usize, f32)>) {
    let mut top: Vec<usize> = (0..ACTIONS)
        .filter(|&i| mask[i] && i != Move::Stop.index())
        .collect();
    top.sort_by(|&a, &b| probs[b].total_cmp(&probs[a]));
    let stop_first = probs
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .is_some_and(|(i, _)| i == Move::Stop.index());
    if top.is_empty() || policy_stops && stop_first {
        return (Move::Stop, Vec::new());
    }
    top.truncate(RERANK);
    let floor = probs[top[0]] * RERANK_WITHIN;
    top.retain(|&i| probs[i] >= floor);
    // A model breaks the policy's near-ties (a single candidate needs no
    // score); without one, the likeliest.
    let scored: Vec<(usize, f32)> = if top.len() > 1 {
        top.iter()
            .filter_map(|&i| score(i).map(|s| (i, s)))
            .collect()
    } else {
        Vec::new()
    };
    let pick = scored
        .iter()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .map_or(top[0], |&(i, _)| i);
    (Move::from_index(pick), scored)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_trained_planner_stops_early_only_when_asked() {
        let mut mask = [false; ACTIONS];
        let (stop, a, b, c) = (
            Move::Stop.index(),
            Move::Fuse.index(),
            Move::Split.index(),
            Move::GemmKernel.index(),
        );
        for i in [stop, a, b, c] {
            mask[i] = true;
        }
        let mut probs = vec![0.0f32; ACTIONS];
        probs[stop] = 0.5;
        probs[a] = 0.1;
        probs[b] = 0.3;
        probs[c] = 0.06;
        let none = |_: usize| None;
        // The policy's first choice is STOP: the search goes on with its
        // likeliest other move unless the policy may stop it.
        assert_eq!(
            trained_move(&probs, &mask, false, none),
            (Move::Split, vec![])
        );
        assert_eq!(trained_move(&probs, &mask, true, none).0, Move::Stop);
        // The reward-to-go model picks among the moves at least half as
        // likely as the first (Split, Fuse is 1/3: left out; one candidate
        // needs no score).
        let score = |i: usize| Some(if i == a { 9.0 } else { 0.0 });
        assert_eq!(
            trained_move(&probs, &mask, false, score),
            (Move::Split, vec![])
        );
        probs[a] = 0.2;
        assert_eq!(
            trained_move(&probs, &mask, false, score),
            (Move::Fuse, vec![(b, 0.0), (a, 9.0)])
        );
        // Nothing legal but STOP.
        let only = {
            let mut m = [false; ACTIONS];
            m[stop] = true;
            m
        };
        assert_eq!(trained_move(&probs, &only, false, none).0, Move::Stop);
    }

    /// What the trained planner weighed reads as its moves' odds, the
    /// model's predictions where it reranked, and the move taken.
    #[test]
    fn the_considered_moves_read_with_their_odds() {
        let c = Considered {
            moves: vec![
                (Move::Graph(1), 0.62, Some(1.2f32.ln())),
                (Move::Vectorize(4), 0.31, Some(0.0)),
                (Move::Stop, 0.05, None),
            ],
            taken: Move::Graph(1),
        };
        assert_eq!(
            c.text(),
            "policy: rewrite(on) 0.62 (predicted 1.200x), vectorize(4) 0.31 (predicted 1.000x), stop 0.05; took rewrite(on)"
        );
    }
}

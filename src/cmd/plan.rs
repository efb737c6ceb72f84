//! The planner's commands: a planned search on one problem (`optimize
//! --planner`), `explore` (episodes that fill the trajectory store),
//! `train` (PPO and the reward-to-go model on the recorded tree) and
//! `compare` (the planners on the held-out problems' recorded tree).
//!
//! A planned search is an episode: from the library program, each move
//! edits the program's configuration (which regions are kernels, fusion,
//! GEMM kernels, launch parameters); the template coder builds the
//! configuration fragment by fragment (each compiled alone, rolled back on
//! failure) and the worker judges it. Every step goes to the store.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use mtmc_actions::device::{builtin_devices, find_device};
use mtmc_actions::graph::OpGraph;
use mtmc_coder::action::Params;
use mtmc_coder::program::Program;
use mtmc_coder::session::Stage;
use mtmc_coder::template::{TemplateCoder, product};
use mtmc_env::outcome::{Outcome, Status};
use mtmc_planner::critique::Diagnosis;
use mtmc_planner::episode::{Episode, Reward};
use mtmc_planner::features::{Problem as PlanProblem, observe};
use mtmc_planner::planners::Planner;
use mtmc_planner::policy::{Checkpoint, Cpu};
use mtmc_planner::ppo::PpoConfig;
use mtmc_planner::rng::Rng;
use mtmc_planner::rtg::RewardToGo;
use mtmc_planner::space::{ACTIONS, Config, Move, REWRITTEN};
use mtmc_planner::store::{StepRecord, Store, Taken, correct_speedup, now};
use mtmc_planner::tree::{self, TreeEnv, TreeProblem};

use crate::cmd::optimize::{
    Found, Gemm, ProblemJudge, build, conclude, judge_programs, problem_source, regions,
    write_model_new,
};
use crate::cmd::paired::Paired;
use crate::interrupt::{Interrupt, Interrupted};

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
    planner: Planner,
    rtg: Option<RewardToGo<Cpu>>,
    version: String,
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
fn finished(dir: &Path, iteration: usize) -> Result<()> {
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
                planner: Planner::Random(Rng::new(seed)),
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
    fn choose(
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

/// How a planned search runs.
pub struct PlanSettings {
    /// Evaluations per episode.
    pub budget: usize,
    /// Stop once the best program reaches this fraction of the roofline.
    pub near_roofline: f64,
    /// Print each step's critique.
    pub verbose: bool,
    /// Take a program's outcome from the store when it was judged before
    /// (exploration: the tree's node is known), instead of judging again.
    pub reuse: bool,
    /// With `reuse`: build each recorded program first, and take its
    /// recorded outcome only where this build writes the code that was
    /// judged (see [`Reuse::Unchanged`]).
    pub rejudge_changed: bool,
    /// Judge the best program once more after the search (outside the
    /// budget): the best of several timings is the luckiest one, and a
    /// fresh timing of it is what a comparison of planners should read.
    pub rejudge: bool,
    /// The problems whose recorded steps the knowledge-base priors read:
    /// those this split [`Split::knows`].
    pub knowledge: Split,
}

/// What the early stop multiplies a program's fraction of the roofline by
/// (`Diagnosis::roofline`, under the problem's math) to read it against
/// the roofline of `g` where fp32 matrix products and convolutions run as
/// split-TF32 tensor-core products (`MathMode::split_tf32`), as the GEMM
/// and implicit-GEMM kernels do: those pass the problem's roofline, which
/// takes the CUDA cores' fp32 rate (on L2/76 a GEMM program at 1.27x, 94 %
/// of it, stopped searches; the recorded tree's best is 1.36x). Convolutions
/// are taken at the fp32 rate in both (`conv_tf32` off): where the
/// reference's ran on TF32 this rescales more than it should, so the
/// search stops later, never earlier. 1 where no product bounds the
/// time.
fn split_tf32_scale(g: &OpGraph) -> f64 {
    use mtmc_actions::device::{MathMode, roofline};
    let spec = h100();
    let problem = roofline(g, &spec, MathMode::default()).time_s;
    let split = MathMode {
        split_tf32: true,
        ..MathMode::default()
    };
    let bound = roofline(g, &spec, split).time_s;
    if problem > 0.0 && bound > 0.0 {
        (bound / problem).min(1.0)
    } else {
        1.0
    }
}

/// What one planned episode found.
pub struct EpisodeResult {
    /// Best speedup against eager (0: nothing correct).
    pub best: f64,
    /// Evaluations made.
    pub evaluations: usize,
    /// The best speedup after each evaluation.
    pub bests: Vec<f64>,
    /// Whether a program was written.
    pub wrote: bool,
    /// The best program's speedup judged once more (with
    /// [`PlanSettings::rejudge`], on a GPU, when a program was correct; 0
    /// when it was not correct the second time).
    pub rejudged: Option<f64>,
    /// Recorded programs judged again because this build writes their code
    /// otherwise ([`Reuse::Unchanged`]).
    pub changed: usize,
    /// Whether a signal stopped the episode before its end: the round in
    /// flight was not kept, the episode was left unfinished in the store
    /// (steps kept, no end), and the best was not judged again.
    pub interrupted: bool,
}

/// Which recorded outcomes a search takes instead of judging.
#[derive(Clone, Copy)]
pub enum Reuse<'s> {
    /// None: every program is judged.
    Nothing,
    /// Every program the store has an evaluation of (by key).
    Recorded(&'s Store),
    /// Those whose code this build writes as it was when judged: each
    /// recorded program is built, and judged again where its fragments'
    /// hash differs from the recorded one (a coder change since), or where
    /// no hash was kept and it builds now. A program that fails to build
    /// takes its recorded outcome where that was a failure to build too.
    Unchanged(&'s Store),
}

impl<'s> Reuse<'s> {
    /// `store` as the settings ask (`reuse`, `rejudge_changed`).
    fn of(store: Option<&'s Store>, reuse: bool, changed: bool) -> Reuse<'s> {
        match store {
            Some(s) if reuse && changed => Reuse::Unchanged(s),
            Some(s) if reuse => Reuse::Recorded(s),
            _ => Reuse::Nothing,
        }
    }
}

/// Whether a recorded outcome stands for judging the program again: on a
/// GPU, an outcome compiled only (recorded where there was none) holds no
/// timing, so the program is judged.
fn reusable(recorded: &Diagnosis, gpu: bool) -> bool {
    !(gpu && recorded.status == Status::CompiledOnly)
}

/// A clause of a report line that counts `n` of something (`text` writes
/// it), or nothing when there are none.
pub(crate) fn counted(n: usize, text: impl FnOnce(usize) -> String) -> String {
    if n > 0 { text(n) } else { String::new() }
}

/// This machine's GPUs as the driver reports them, probed once for a
/// command: whether there are any (else programs are compiled only), and
/// the names a store that records their outcomes is claimed for.
pub struct Gpus(Option<mtmc_env::probe::Driver>);

impl Gpus {
    /// Asks the driver; no driver, or one that does not start, is no GPU.
    pub fn probe() -> Gpus {
        Gpus(mtmc_env::probe::driver().ok())
    }

    /// Whether programs can be run and timed here.
    pub fn any(&self) -> bool {
        self.0.as_ref().is_some_and(|d| !d.gpus.is_empty())
    }

    /// Before a command writes outcomes judged on these GPUs into `store`:
    /// each GPU, by its device table name (`H100`) where the driver's name
    /// has one, is claimed ([`Store::claim_gpu`]), so a store of another
    /// GPU's outcomes is refused before anything is judged, and a line says
    /// when a store that held outcomes of a GPU it did not name is taken to
    /// be this GPU's. Without a GPU nothing is judged on one, nothing
    /// claimed.
    pub fn claim(&self, out: &mut dyn std::io::Write, store: &Store) -> Result<()> {
        let Some(driver) = &self.0 else {
            return Ok(());
        };
        let specs = builtin_devices();
        for g in &driver.gpus {
            let name = find_device(&specs, &g.name).map_or(g.name.as_str(), |d| d.name.as_str());
            if store.claim_gpu(name)? == mtmc_planner::store::Claim::Unnamed {
                writeln!(
                    out,
                    "{} named no GPU (written by an earlier mtmc): its outcomes are taken to be the {name}'s, as this run's are",
                    store.path().display()
                )?;
            }
        }
        Ok(())
    }
}

/// Whether a recorded outcome is a failure while the program ran (a
/// runtime error, a timeout, a crashed worker) rather than a verdict on
/// its code: what `rejudge --failed` judges again.
fn failed_running(recorded: &Diagnosis) -> bool {
    matches!(
        recorded.status,
        Status::RuntimeError | Status::Timeout | Status::Crashed
    )
}

/// A warning when programs recorded for `problems` were compiled only
/// (recorded where no GPU was found, so nothing timed them): how many, and
/// `all` or `some` for what follows when it is every one or not.
fn compiled_only_warning(problems: &[TreeProblem], all: &str, some: &str) -> Option<String> {
    let total: usize = problems.iter().map(|p| p.evals.len()).sum();
    let only = problems
        .iter()
        .flat_map(|p| p.evals.values())
        .filter(|d| d.status == Status::CompiledOnly)
        .count();
    (only > 0).then(|| {
        let (which, so) = if only == total {
            (format!("all {total}"), all)
        } else {
            (format!("{only} of the {total}"), some)
        };
        format!(
            "warning: {which} recorded programs were compiled only (recorded where no GPU was found): nothing timed them, so {so}; record them with `mtmc explore` on a GPU"
        )
    })
}

/// A step's program: judged before (its recorded diagnosis) or built now.
enum Known {
    Recorded(Diagnosis),
    Built(Result<Program, mtmc_coder::session::Failure>),
}

/// The H100's spec, which the planner's graph features are computed for.
fn h100() -> mtmc_actions::device::DeviceSpec {
    let specs = builtin_devices();
    find_device(&specs, "H100")
        .cloned()
        .unwrap_or_else(|| specs[0].clone())
}

/// Builds configuration `c` of graph `g` cut into `regions`.
fn build_config(
    g: &OpGraph,
    regions: &[Vec<u32>],
    c: &Config,
) -> Result<Program, mtmc_coder::session::Failure> {
    let chosen: Vec<Vec<u32>> = regions
        .iter()
        .zip(&c.kernels)
        .filter(|&(_, &k)| k)
        .map(|(r, _)| r.clone())
        .collect();
    let gemm = if c.gemm { Gemm::Kernel } else { Gemm::Library };
    let params = Params {
        block: c.block,
        vector: c.vector,
    };
    if c.cuda_graph
        && let Some(n) = g.nodes().find(|(_, n)| n.op.draws_random()).map(|(_, n)| n)
    {
        return Err(mtmc_coder::session::Failure {
            action: mtmc_coder::action::Action::kernel_for(Vec::new(), params),
            stage: Stage::Refused,
            fragment: None,
            log: format!(
                "no CUDA graph: `{}` draws random numbers, and the warm-up run before a capture would draw before the forward does (its numbers would differ from torch's for the same seed)",
                n.name
            ),
        });
    }
    build(g, &chosen, params, c.fuse, gemm, TemplateCoder, false).map(|(mut p, _)| {
        p.cuda_graph = c.cuda_graph;
        p
    })
}

/// The SHA-256 of a program's fragments and their concatenated code.
fn fragments(program: &Program) -> (String, String) {
    let mut code: String = program
        .fragments
        .iter()
        .map(|f| format!("// {}\n{}\n", f.name, f.source))
        .collect();
    // The same kernels replayed from a CUDA graph are another program. The
    // line names the replay's version: programs judged with an earlier one
    // (whose key walked the model's modules on every call) read as other
    // code, so `explore --rejudge-changed` judges them again.
    if program.cuda_graph {
        code.insert_str(
            0,
            "// replayed from a CUDA graph (its model's tensors listed once)\n",
        );
    }
    let hash = if code.is_empty() {
        String::new()
    } else {
        crate::source::sha256_hex(&code)
    };
    (hash, code)
}

/// One planned episode on KernelBench problem `p` (graph `g`): each step
/// printed, recorded in `store`, the best program written to `out_dir`.
/// The knowledge-base prior of the observations is read from `knowledge`,
/// or from `store` when there is none (and is zero without either).
#[allow(clippy::too_many_arguments)]
pub fn plan_problem(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    planner: &mut Loaded,
    settings: &PlanSettings,
    mut store: Option<&mut Store>,
    knowledge: Option<&Store>,
    out_dir: Option<&Path>,
    seed: u64,
) -> Result<EpisodeResult> {
    let mut j = Judging::new(p, g, judge)?;
    let problem = j.problem.clone();
    let prior = match knowledge.or(store.as_deref()) {
        Some(s) => s.prior(&problem.pattern, &problem.name, &|n| {
            settings.knowledge.knows(n)
        })?,
        None => [0.0; ACTIONS],
    };
    if let Some(s) = store.as_deref() {
        s.put_problem(&problem)?;
    }
    let episode_id = match store.as_deref() {
        Some(s) => Some(s.begin_episode(
            &problem.name,
            planner.planner.name(),
            &planner.version,
            seed,
        )?),
        None => None,
    };
    let reward = Reward::default();
    let stop_scale = split_tf32_scale(g);
    let mut e = Episode::new(problem.shape, settings.budget);
    let mut bests = Vec::new();
    writeln!(
        out,
        "{}: {} region(s) for kernels, pattern {}{}; planner {}, budget {} evaluations{}",
        problem.name,
        j.regions.len(),
        problem.pattern,
        j.rewritten
            .iter()
            .zip(REWRITTEN)
            .filter_map(|(r, (suffix, _))| r
                .as_ref()
                .map(|r| format!(";{suffix} = {}", r.names.join(" + "))))
            .collect::<String>(),
        planner.planner.name(),
        settings.budget,
        match j.judge.in_flight() {
            1 => String::new(),
            n => format!(", {n} in flight (one per GPU)"),
        }
    )?;
    // A stop asked for by a signal, and the programs of the round it
    // dropped.
    let (mut interrupted, mut dropped) = (false, 0);
    while !e.done {
        if j.judge.stop_requested() {
            interrupted = true;
            break;
        }
        let started = now();
        let obs = observe(&problem, &e, &prior);
        let mask = e.mask();
        let m = planner.choose(&problem, &e, &obs, &mask);
        if settings.verbose
            && let Some(c) = planner.considered()
        {
            writeln!(out, "  weighed for step {}: {}", e.step + 1, c.text())?;
        }
        let state = e.config.key();
        let target = e.target(m).filter(|_| m != Move::Stop && mask[m.index()]);
        let Some(next) = target else {
            let r = e.stop();
            if let (Some(s), Some(id)) = (store.as_deref_mut(), episode_id) {
                s.add_step(
                    &problem,
                    &planner.version,
                    &StepRecord {
                        episode: id,
                        step: e.step,
                        state,
                        observation: obs,
                        action: Move::Stop,
                        next_state: String::new(),
                        fragment_hash: String::new(),
                        code: String::new(),
                        outcome: String::new(),
                        diagnosis: None,
                        reward: r,
                        best_speedup: e.best_speedup(),
                        started_at: started,
                        reused: false,
                    },
                )?;
            }
            writeln!(out, "  step {}: stop", e.step)?;
            break;
        };
        let slots = j.judge.in_flight().min(e.max_steps - e.step);
        let round = look_ahead(planner, &problem, &e, &prior, (m, next, obs), slots);
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|(m, next, _)| (*m, next.clone(), format!("{} -> {}", m.label(), next.key())))
            .collect();
        let reuse = Reuse::of(store.as_deref(), settings.reuse, settings.rejudge_changed);
        let judged = match j.evaluate(reuse, &asked)? {
            Round::Judged(judged) => judged,
            Round::Dropped(n) => {
                (interrupted, dropped) = (true, n);
                break;
            }
        };
        for ((ev, (m, next, obs)), (_, _, label)) in judged.into_iter().zip(round).zip(&asked) {
            let text = ev.diagnosis.text();
            let r = e.record(m, next.clone(), ev.diagnosis.clone(), &reward);
            bests.push(e.best_speedup());
            writeln!(
                out,
                "  step {}: {label}: {text} (reward {r:+.3}, best {:.3}x)",
                e.step,
                e.best_speedup()
            )?;
            if settings.verbose && ev.diagnosis.status != Status::Correct {
                let why = match &ev.outcome {
                    Some(o) => o.why.as_deref().or(o.error.as_deref()),
                    None => ev.failure.as_deref(),
                };
                if let Some(line) = why.and_then(|w| w.lines().next()) {
                    writeln!(out, "    {line}")?;
                }
            }
            if let (Some(s), Some(id)) = (store.as_deref_mut(), episode_id) {
                s.add_step(
                    &problem,
                    &planner.version,
                    &ev.step(id, &e, state.clone(), obs, m, &next, r, started)?,
                )?;
            }
        }
        let near = e
            .best
            .as_ref()
            .and_then(|b| b.diagnosis.roofline)
            .is_some_and(|f| f * stop_scale >= settings.near_roofline);
        if near && !e.done {
            writeln!(
                out,
                "  the best program is within reach of the roofline: stop"
            )?;
            e.stop();
        }
    }
    if interrupted {
        writeln!(
            out,
            "  interrupted after {} evaluation(s){}",
            e.step,
            counted(dropped, |n| format!(
                "; the {n} program(s) in flight not kept"
            ))
        )?;
    }
    if let (Some(s), Some(id), false) = (store.as_deref(), episode_id, interrupted) {
        s.end_episode(id, e.best_speedup())?;
    }
    let rejudged = if settings.rejudge && !interrupted {
        j.rejudge_best()?
    } else {
        None
    };
    if let Some(again) = rejudged {
        writeln!(
            out,
            "  the best program judged again: {again:.3}x (found at {:.3}x)",
            e.best_speedup()
        )?;
    }
    let rewritten = rewritten_of(&j.rewritten, j.best_graph);
    j.found.interrupted = interrupted;
    let wrote = match out_dir {
        Some(dir) => {
            let graph = rewritten.map_or(g, |r| &r.graph);
            conclude(out, dir, &p.full_name(), j.found, graph, |program| {
                write_model_new(dir, graph, program, &p.code, rewritten.is_some())
            })?
        }
        None => j.found.best.is_some(),
    };
    Ok(EpisodeResult {
        best: e.best_speedup(),
        evaluations: e.step,
        bests,
        wrote,
        rejudged,
        changed: j.changed,
        interrupted,
    })
}

/// The best program of a finished episode of problem `p` (graph `g`),
/// built again: the episode is walked again move by move with its
/// recorded outcomes (`moves`, as [`Store::finished_moves`] reads them),
/// and the program it kept as its best (the correct one of the least mean
/// time, the one an episode judges again and writes) is built as the
/// episode built it. Returns that program's key and its ModelNew, or none
/// when nothing was correct and timed. A move that reaches another program
/// than the one recorded, or fragments whose hash is not the recorded one,
/// is an error: the search or the coder changed since the episode ran, and
/// the program built now would not be the one it judged.
pub(crate) fn rebuild_best(
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    moves: &[Taken],
) -> Result<Option<(String, String)>> {
    let j = Judging::new(p, g, judge)?;
    let name = p.full_name();
    let mut e = Episode::new(j.problem.shape, moves.len());
    let mut best: Option<(f64, Config, &str)> = None;
    for (i, t) in moves.iter().enumerate() {
        let m = Move::from_index(t.action);
        if m == Move::Stop {
            break;
        }
        let next = match e.target(m) {
            Some(c) if c.key() == t.next_state => c,
            reached => bail!(
                "{name}: the recorded move {} ({}) from {} reached `{}`; this build reaches {}: the episode ran on another build of the search, so its best program cannot be built again here",
                i + 1,
                m.label(),
                e.config.key(),
                t.next_state,
                reached.map_or("no program".to_string(), |c| format!("`{}`", c.key()))
            ),
        };
        let Some(d) = &t.diagnosis else {
            bail!(
                "{name}: the recorded move {} ({}) has no outcome",
                i + 1,
                m.label()
            );
        };
        if d.status == Status::Correct
            && let Some(ms) = t.mean_ms
            && best.as_ref().is_none_or(|b| ms < b.0)
        {
            best = Some((ms, next.clone(), &t.fragment_hash));
        }
        e.record(m, next, d.clone(), &Reward::default());
    }
    let Some((_, c, hash)) = best else {
        return Ok(None);
    };
    let (graph, regions) = j.graph(&c);
    let program = build_config(graph, regions, &c).map_err(|f| {
        anyhow::anyhow!(
            "{name}: its best program `{}` no longer builds ({:?}): {}",
            c.key(),
            f.stage,
            f.log.lines().next().unwrap_or("")
        )
    })?;
    let (now, _) = fragments(&program);
    if now != hash {
        bail!(
            "{name}: its best program `{}` builds other kernels now (fragments {} here, {} recorded): the coder changed since the episode ran",
            c.key(),
            short_hash(&now),
            short_hash(hash)
        );
    }
    let code =
        mtmc_coder::export::to_model_new(graph, &program, &p.code).map_err(anyhow::Error::msg)?;
    Ok(Some((c.key(), code)))
}

/// The first 12 characters of a hash (all of a shorter one).
fn short_hash(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}

/// Judges the ModelNew programs `codes` of problem `p` side
/// by side: `rounds` rounds, each judging every program once, the first
/// of a round being the second of the round before, so that the programs
/// meet the same states of the machine (the host's launch rate drifts
/// over seconds). Returns each program's speedups against eager (eager
/// timed beside each judging, as always), in the order of `codes`; 0 for
/// a judging that was not correct. Without a GPU, nothing is judged.
pub(crate) fn judge_side_by_side(
    p: &mtmc_actions::problem::Problem,
    judge: &mut ProblemJudge,
    codes: &[String],
    rounds: usize,
) -> Result<Vec<Vec<f64>>> {
    let mut speedups = vec![Vec::new(); codes.len()];
    if !judge.gpu || codes.is_empty() {
        return Ok(speedups);
    }
    let source = problem_source(p)?;
    for r in 0..rounds {
        for k in 0..codes.len() {
            let i = (r + k) % codes.len();
            let o = judge.judge_code(
                &source,
                format!("model_new side by side {}", i + 1),
                codes[i].clone(),
            )?;
            speedups[i].push(if o.status == Status::Correct {
                o.speedup_vs("eager").unwrap_or(0.0)
            } else {
                0.0
            });
        }
    }
    Ok(speedups)
}

/// A round of candidates in flight at once: `first` (the planner's move,
/// its program and observation), then, up to `slots` in all, the moves the
/// planner would make next if those before were already taken. All refine
/// the same best program; the round ends early where the planner stops.
fn look_ahead(
    planner: &mut Loaded,
    problem: &PlanProblem,
    e: &Episode,
    prior: &[f32; ACTIONS],
    first: (Move, Config, Vec<f32>),
    slots: usize,
) -> Vec<(Move, Config, Vec<f32>)> {
    let mut round = vec![first];
    let mut ahead = e.clone();
    while round.len() < slots {
        ahead.seen.insert(round[round.len() - 1].1.key());
        let obs = observe(problem, &ahead, prior);
        let mask = ahead.mask();
        let m = planner.choose(problem, &ahead, &obs, &mask);
        match ahead
            .target(m)
            .filter(|_| m != Move::Stop && mask[m.index()])
        {
            Some(next) => round.push((m, next, obs)),
            None => break,
        }
    }
    round
}

/// A judged (or recalled) configuration.
struct Evaluated {
    diagnosis: Diagnosis,
    /// The outcome, when it was judged now.
    outcome: Option<Outcome>,
    /// SHA-256 of its fragments (empty when nothing was built now).
    hash: String,
    /// Its fragments' code.
    code: String,
    /// Why it was not built (the first line of the coder's or compiler's
    /// log), when it was not.
    failure: Option<String>,
    /// Its diagnosis is the store's (nothing was built or judged now).
    reused: bool,
}

impl Evaluated {
    /// The store's row for the step that evaluated `next` from `state`,
    /// recorded in episode `e` (whose step count already includes it).
    #[allow(clippy::too_many_arguments)]
    fn step(
        self,
        episode: i64,
        e: &Episode,
        state: String,
        observation: Vec<f32>,
        action: Move,
        next: &Config,
        reward: f64,
        started_at: f64,
    ) -> Result<StepRecord> {
        Ok(StepRecord {
            episode,
            step: e.step - 1,
            state,
            observation,
            action,
            next_state: next.key(),
            fragment_hash: self.hash,
            code: self.code,
            outcome: self
                .outcome
                .as_ref()
                .map(serde_json::to_string)
                .transpose()?
                .unwrap_or_default(),
            diagnosis: Some(self.diagnosis),
            reward,
            best_speedup: e.best_speedup(),
            started_at,
            reused: self.reused,
        })
    }
}

/// A rewritten graph of a problem (`space::REWRITTEN`) and its regions.
struct Rewritten {
    graph: OpGraph,
    regions: Vec<Vec<u32>>,
    /// The rewrites that changed it.
    names: Vec<&'static str>,
}

/// One problem's judging: its setup (made once per episode), the judge,
/// and every attempt with the best program so far.
struct Judging<'a> {
    p: &'a mtmc_actions::problem::Problem,
    g: &'a OpGraph,
    /// Regions for kernels (none where an op has no family: every move is
    /// then a library call).
    regions: Vec<Vec<u32>>,
    /// The rewritten graphs of `space::REWRITTEN`, where they exist.
    rewritten: Vec<Option<Rewritten>>,
    /// The graph the best program so far is built from (`Config::graph`).
    best_graph: u8,
    problem: PlanProblem,
    source: mtmc_env::evaluator::ProblemSource,
    judge: &'a mut ProblemJudge,
    found: Found,
    /// Recorded programs judged again because their code changed.
    changed: usize,
    /// Judge again, rather than take, a recorded outcome that failed while
    /// the program ran ([`failed_running`]).
    retry_failed: bool,
    /// Programs built ahead ([`Judging::prebuild`]), by key, each taken
    /// by the first build of its configuration.
    built: std::collections::HashMap<String, Built>,
}

/// A configuration's program, or why the coder could not build it.
type Built = Result<Program, mtmc_coder::session::Failure>;

impl<'a> Judging<'a> {
    fn new(
        p: &'a mtmc_actions::problem::Problem,
        g: &'a OpGraph,
        judge: &'a mut ProblemJudge,
    ) -> Result<Judging<'a>> {
        let source = problem_source(p)?;
        let traced = regions(g, true, false).unwrap_or_default();
        // Each rewritten graph once: one whose rewrites an earlier graph
        // applied already does not exist.
        let mut rewritten: Vec<Option<Rewritten>> = Vec::new();
        for (_, skip) in REWRITTEN {
            let next =
                mtmc_actions::rewrite::rewrite_all_but(g, skip).and_then(|(graph, names)| {
                    let regions = regions(&graph, true, false).ok()?;
                    let known = rewritten.iter().flatten().any(|r| r.names == names);
                    (!known).then_some(Rewritten {
                        graph,
                        regions,
                        names,
                    })
                });
            rewritten.push(next);
        }
        let mut problem = PlanProblem::new(&p.full_name(), g, traced.len(), &h100());
        problem.shape.products = g.nodes().any(|(_, n)| product(&n.op));
        for (slot, r) in problem.shape.rewritten.iter_mut().zip(&rewritten) {
            *slot = r.as_ref().and_then(|r| u16::try_from(r.regions.len()).ok());
        }
        Ok(Judging {
            p,
            g,
            regions: traced,
            rewritten,
            best_graph: 0,
            problem,
            source,
            judge,
            found: Found::default(),
            changed: 0,
            retry_failed: false,
            built: std::collections::HashMap::new(),
        })
    }

    /// Builds `configs` ahead, on every core: building compiles each
    /// fragment with NVRTC, which on a walk over a problem's recorded
    /// programs would otherwise take as long as judging them.
    fn prebuild(&mut self, configs: &[Config]) {
        let threads = std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .min(configs.len());
        if threads < 2 {
            return;
        }
        let (g, regions, rewritten) = (self.g, &self.regions, &self.rewritten);
        let next = std::sync::atomic::AtomicUsize::new(0);
        let built: Vec<(String, Built)> = std::thread::scope(|scope| {
            let workers: Vec<_> = (0..threads)
                .map(|_| {
                    scope.spawn(|| {
                        let mut done = Vec::new();
                        loop {
                            let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                            let Some(c) = configs.get(i) else {
                                return done;
                            };
                            let (g, regions) = graph_of(g, regions, rewritten, c);
                            done.push((c.key(), build_config(g, regions, c)));
                        }
                    })
                })
                .collect();
            workers
                .into_iter()
                .flat_map(|w| w.join().expect("a build thread does not panic"))
                .collect()
        });
        self.built.extend(built);
    }

    /// Configuration `c`'s program: built ahead, or built now.
    fn build(&mut self, c: &Config) -> Built {
        self.built.remove(&c.key()).unwrap_or_else(|| {
            let (g, regions) = self.graph(c);
            build_config(g, regions, c)
        })
    }

    /// The graph configuration `c` is built from, and its regions.
    fn graph(&self, c: &Config) -> (&OpGraph, &[Vec<u32>]) {
        graph_of(self.g, &self.regions, &self.rewritten, c)
    }

    /// Builds `next` and says whether this build writes the code its
    /// recorded outcome `d` in `store` was judged with (a program that
    /// failed to build matches a recorded compile error without a hash).
    fn same_code(&mut self, store: &Store, next: &Config, d: &Diagnosis) -> Result<(bool, Built)> {
        let hash = store
            .evaluation_hash(&self.problem.name, &next.key())?
            .unwrap_or_default();
        let built = self.build(next);
        let same = match &built {
            Ok(program) => fragments(program).0 == hash,
            Err(_) => hash.is_empty() && d.status == Status::CompileError,
        };
        Ok((same, built))
    }

    /// The best program's speedup against eager, judged once more (none
    /// without a GPU or a correct program; 0 when it is not correct again).
    fn rejudge_best(&mut self) -> Result<Option<f64>> {
        let Some((_, program, _, _)) = &self.found.best else {
            return Ok(None);
        };
        if !self.judge.gpu {
            return Ok(None);
        }
        let g = rewritten_of(&self.rewritten, self.best_graph).map_or(self.g, |r| &r.graph);
        let o = judge_programs(
            self.judge,
            &self.source,
            &self.p.code,
            &[(g, program, "the best, again".into())],
            &builtin_devices(),
        )?
        .remove(0);
        Ok(Some(if o.status == Status::Correct {
            Diagnosis::of(&o, self.problem.bound())
                .speedup_eager
                .unwrap_or(0.0)
        } else {
            0.0
        }))
    }

    /// Builds and judges configurations (each `next` reached by its move
    /// `m`, with a label), or takes their recorded outcomes from `reuse`:
    /// diagnosis, outcome, fragment hash and code, in the order asked. The
    /// programs built are judged together, one per worker (GPU) at a time.
    /// Every attempt and (when best) the program are kept in `found`.
    /// Once the judge's stop is asked for, the round keeps nothing
    /// ([`Round::Dropped`]).
    fn evaluate(&mut self, reuse: Reuse<'_>, asked: &[(Move, Config, String)]) -> Result<Round> {
        if self.judge.stop_requested() {
            return Ok(Round::Dropped(0));
        }
        let mut known = Vec::new();
        for (_, next, _) in asked {
            let recorded = match reuse {
                Reuse::Recorded(s) | Reuse::Unchanged(s) => {
                    s.evaluation(&self.problem.name, &next.key())?
                }
                Reuse::Nothing => None,
            }
            .filter(|d| reusable(d, self.judge.gpu) && !(self.retry_failed && failed_running(d)));
            known.push(match (recorded, reuse) {
                (Some(d), Reuse::Unchanged(s)) => {
                    let (same, built) = self.same_code(s, next, &d)?;
                    if same {
                        Known::Recorded(d)
                    } else {
                        self.changed += 1;
                        Known::Built(built)
                    }
                }
                (Some(d), _) => Known::Recorded(d),
                (None, _) => Known::Built(self.build(next)),
            });
        }
        let to_judge: Vec<(&OpGraph, &Program, String)> = known
            .iter()
            .zip(asked)
            .filter_map(|(k, (_, next, label))| match k {
                Known::Built(Ok(program)) => Some((
                    graph_of(self.g, &self.regions, &self.rewritten, next).0,
                    program,
                    label.clone(),
                )),
                _ => None,
            })
            .collect();
        let specs = builtin_devices();
        let judged = judge_programs(self.judge, &self.source, &self.p.code, &to_judge, &specs);
        if self.judge.stop_requested() {
            // The signal reaches the workers too (one process group): what
            // this round judged may be their end, not the code's.
            let built = known
                .iter()
                .filter(|k| matches!(k, Known::Built(_)))
                .count();
            return Ok(Round::Dropped(built));
        }
        let mut outcomes = judged?.into_iter();
        let found = &mut self.found;
        let mut done = Vec::new();
        for (k, (m, next, _)) in known.into_iter().zip(asked) {
            done.push(match k {
                Known::Recorded(d) => {
                    found.attempts.push(
                        serde_json::json!({"move": m.label(), "config": next.key(), "recorded": d}),
                    );
                    Evaluated {
                        diagnosis: d,
                        outcome: None,
                        hash: String::new(),
                        code: String::new(),
                        failure: None,
                        reused: true,
                    }
                }
                Known::Built(Err(f)) => {
                    let d = Diagnosis::failed_to_build(&f.log, f.stage == Stage::Refused);
                    found.attempts.push(
                        serde_json::json!({"move": m.label(), "config": next.key(), "failure": f}),
                    );
                    Evaluated {
                        diagnosis: d,
                        outcome: None,
                        hash: String::new(),
                        code: f.fragment.clone().unwrap_or_default(),
                        failure: f.log.lines().find(|l| !l.trim().is_empty()).map(str::to_string),
                        reused: false,
                    }
                }
                Known::Built(Ok(program)) => {
                    let o = outcomes.next().expect("an outcome per program judged");
                    found.judged += 1;
                    found.correct += usize::from(o.status == Status::Correct);
                    let d = Diagnosis::of(&o, self.problem.bound());
                    let (hash, code) = fragments(&program);
                    if keep_best(found, &program, &o, next) {
                        self.best_graph = next.graph;
                    }
                    found.attempts.push(
                        serde_json::json!({"move": m.label(), "config": next.key(), "outcome": o, "critique": d.text()}),
                    );
                    Evaluated {
                        diagnosis: d,
                        outcome: Some(o),
                        hash,
                        code,
                        failure: None,
                        reused: false,
                    }
                }
            });
        }
        Ok(Round::Judged(done))
    }
}

/// What a round of [`Judging::evaluate`] gave.
enum Round {
    /// Each configuration's evaluation, in the order asked.
    Judged(Vec<Evaluated>),
    /// Nothing kept: a stop was asked for before or while the round was
    /// judged. Holds how many of its programs were built for judging (not
    /// taken from the store).
    Dropped(usize),
}

/// Exhaustive search within the budget: every program reachable from the
/// library one, in breadth-first order of the moves that reach it (nearest
/// first), up to `budget` of them, each recorded as a step from the
/// program it was reached from. It builds the complete trajectory tree of
/// small problems, against which the other planners are compared.
pub fn enumerate_problem(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    budget: usize,
    rec: &mut Recording<'_>,
) -> Result<EpisodeResult> {
    let mut j = Judging::new(p, g, judge)?;
    let open = rec.begin(&j, "exhaustive")?;
    let (problem, prior) = (&open.problem, &open.prior);
    let reward = Reward::default();
    let mut e = Episode::new(problem.shape, budget);
    let start = Config::library(problem.shape);
    let mut queue = std::collections::VecDeque::from([(
        start.clone(),
        Move::CallLibrary(mtmc_planner::space::Slot::All),
        start,
    )]);
    let mut queued: std::collections::BTreeSet<String> = ["library".to_string()].into();
    let mut bests = Vec::new();
    let mut interrupted = false;
    while e.step < budget && !queue.is_empty() && !interrupted {
        // Up to one program per worker, in breadth-first order.
        let take = j.judge.in_flight().min(budget - e.step).min(queue.len());
        let round: Vec<(Config, Move, Config)> = queue.drain(..take).collect();
        let started = now();
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|(_, m, next)| (*m, next.clone(), format!("{} -> {}", m.label(), next.key())))
            .collect();
        let judged = match j.evaluate(
            Reuse::of(Some(&*rec.store), true, rec.rejudge_changed),
            &asked,
        )? {
            Round::Judged(judged) => judged,
            Round::Dropped(_) => {
                interrupted = true;
                break;
            }
        };
        for ((ev, (parent, m, next)), (_, _, label)) in judged.into_iter().zip(round).zip(&asked) {
            e.config = parent.clone();
            let obs = observe(problem, &e, prior);
            let r = e.record(m, next.clone(), ev.diagnosis.clone(), &reward);
            bests.push(e.best_speedup());
            rec.step(
                out, &open, ev, &e, &parent, m, &next, label, r, obs, started,
            )?;
            for m in Move::all().filter(|&m| m != Move::Stop) {
                if let Some(c) = next.apply(m, problem.shape)
                    && queued.insert(c.key())
                {
                    queue.push_back((next.clone(), m, c));
                }
            }
        }
    }
    rec.end(&j, &open, e.best_speedup(), e.step, bests, interrupted)
}

/// The library program's configuration, then those of the recorded
/// programs (`recorded`'s keys) that moves through recorded programs reach
/// from it, breadth first, in the order of the moves; each with its depth
/// (the fewest moves that reach it from the library program, 0 for that
/// one).
fn recorded_walk<V>(
    recorded: &std::collections::BTreeMap<String, V>,
    shape: mtmc_planner::space::Shape,
) -> Vec<(Config, usize)> {
    let start = Config::library(shape);
    let mut seen: std::collections::BTreeSet<String> = [start.key()].into();
    let mut walk = vec![(start, 0)];
    let mut i = 0;
    while i < walk.len() {
        let (from, depth) = walk[i].clone();
        i += 1;
        for m in Move::all().filter(|&m| m != Move::Stop) {
            if let Some(c) = from.apply(m, shape)
                && recorded.contains_key(&c.key())
                && seen.insert(c.key())
            {
                walk.push((c, depth + 1));
            }
        }
    }
    walk
}

/// What [`rejudge_problem`] found on one problem.
pub struct Rejudged {
    /// Recorded programs the walk reached (each built once).
    pub reached: usize,
    /// Of those, the ones judged again: this build writes other code (on
    /// a GPU, also those recorded compiled only). In a dry run, those
    /// whose code changed.
    pub judged: usize,
    /// In a dry run, the programs whose code is unchanged but that were
    /// recorded compiled only: a rejudge on a GPU judges them too.
    pub untimed: usize,
    /// With `failed`, the programs whose recorded judging failed while
    /// they ran ([`failed_running`]): judged again, whether their code
    /// changed or not (in a dry run, those whose code is unchanged are
    /// counted here, the others as changed).
    pub failed: usize,
    /// Of those, the ones whose new outcome the store kept (a compile-only
    /// outcome never replaces a timed one).
    pub kept: usize,
    /// Of those judged again, the ones out of GPU memory beside the kept
    /// reference outputs and so judged with them recomputed for each
    /// check (`Outcome::references_recomputed`).
    pub recomputed: usize,
    /// Recorded programs no walk from the library program reaches through
    /// recorded programs (keys this build's moves no longer make).
    pub unreached: Vec<String>,
    /// The program judged again whose speedup moved most, with its
    /// recorded and new speedups (correct both times).
    pub moved: Option<(String, f64, f64)>,
    /// In a dry run, the keys of the programs whose code changed, in the
    /// walk's order.
    pub changed: Vec<String>,
    /// Whether a signal stopped the walk before its end.
    pub interrupted: bool,
    /// Programs in flight when the signal came, whose new outcomes were
    /// not kept: the signal may have ended their workers, so their
    /// outcome says nothing of their code. The next rejudge judges them.
    pub dropped: usize,
}

/// How many of a problem's changed programs a dry run names.
const NAMED: usize = 5;

/// `mtmc rejudge` on one problem: every recorded program of it, reached
/// from the library program by moves through recorded programs, breadth
/// first, is built; where its fragments' hash differs from the recorded
/// one (a coder change since it was judged) it is judged again, and its
/// new outcome replaces the recorded one in the store's evaluations. No
/// episode or step is recorded: the steps keep what their episodes saw.
/// Once the judge's stop is asked for it judges no further round, and
/// keeps nothing of the round in flight.
pub fn rejudge_problem(
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    store: &mut Store,
    bar: &ProgressBar,
    req: &RejudgeRequest<'_>,
) -> Result<Rejudged> {
    let (dry_run, failed) = (req.dry_run, req.failed);
    let mut j = Judging::new(p, g, judge)?;
    j.retry_failed = failed;
    let name = j.problem.name.clone();
    let recorded = store.evaluations(&name)?;
    let mut walk: Vec<Config> = recorded_walk(&recorded, j.problem.shape)
        .into_iter()
        .map(|(c, _)| c)
        .collect();
    let seen: std::collections::BTreeSet<String> = walk.iter().map(Config::key).collect();
    walk.retain(|c| recorded.contains_key(&c.key()));
    let mut out = Rejudged {
        reached: walk.len(),
        judged: 0,
        untimed: 0,
        failed: 0,
        kept: 0,
        recomputed: 0,
        unreached: recorded
            .keys()
            .filter(|k| !seen.contains(*k))
            .cloned()
            .collect(),
        moved: None,
        changed: Vec::new(),
        interrupted: false,
        dropped: 0,
    };
    bar.set_length(bar.length().unwrap_or(0) + walk.len() as u64);
    j.prebuild(&walk);
    if dry_run {
        // What a rejudge would judge: the programs whose code changed and,
        // on a GPU, those recorded where no GPU timed them.
        for c in &walk {
            if j.judge.stop_requested() {
                out.interrupted = true;
                break;
            }
            bar.inc(1);
            let d = &recorded[&c.key()];
            if !j.same_code(store, c, d)?.0 {
                out.judged += 1;
                out.changed.push(c.key());
            } else if !reusable(d, true) {
                out.untimed += 1;
            } else if failed && failed_running(d) {
                out.failed += 1;
            }
        }
        return Ok(out);
    }
    let per = j.judge.in_flight().max(1);
    for round in walk.chunks(per) {
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|c| (Move::Stop, c.clone(), c.key()))
            .collect();
        let evaluated = match j.evaluate(Reuse::Unchanged(&*store), &asked)? {
            Round::Judged(e) => e,
            Round::Dropped(n) => {
                out.interrupted = true;
                out.dropped = n;
                break;
            }
        };
        out.judged += evaluated.iter().filter(|e| !e.reused).count();
        for (ev, c) in evaluated.into_iter().zip(round) {
            bar.inc(1);
            if ev.reused {
                continue;
            }
            let key = c.key();
            out.failed += usize::from(failed && failed_running(&recorded[&key]));
            out.recomputed +=
                usize::from(ev.outcome.as_ref().is_some_and(|o| o.references_recomputed));
            if store.judged_again(&name, &key, &ev.diagnosis, &ev.hash)? {
                out.kept += 1;
            }
            let old = recorded.get(&key).and_then(correct_speedup);
            let new = correct_speedup(&ev.diagnosis);
            if let (Some(a), Some(b)) = (old, new) {
                let far = |x: f64, y: f64| (y / x).ln().abs();
                if out
                    .moved
                    .as_ref()
                    .is_none_or(|(_, x, y)| far(a, b) > far(*x, *y))
                {
                    out.moved = Some((key, a, b));
                }
            }
        }
    }
    Ok(out)
}

/// `; changed: KEY, KEY, …` for a dry run's changed programs (the first
/// `NAMED`, and how many more), or nothing.
fn named(changed: &[String]) -> String {
    if changed.is_empty() {
        return String::new();
    }
    let shown = changed[..changed.len().min(NAMED)].join(", ");
    match changed.len().saturating_sub(NAMED) {
        0 => format!("; changed: {shown}"),
        more => format!("; changed: {shown} and {more} more"),
    }
}

/// The problems `names` and `levels` choose of `problems`, on `split`'s
/// side; an error where that leaves none.
fn chosen<'p>(
    problems: &'p crate::source::Problems,
    names: &[String],
    levels: &[u32],
    split: Split,
) -> Result<Vec<&'p mtmc_actions::problem::Problem>> {
    problems.check_levels(levels)?;
    let mut chosen = problems.choose(names, |p| levels.contains(&p.level))?;
    chosen.retain(|p| split.keeps(&p.full_name()));
    if chosen.is_empty() {
        bail!("no problem chosen: name problems or pass --level N (and check --split)");
    }
    Ok(chosen)
}

/// What `mtmc rejudge` was asked to do.
pub struct RejudgeRequest<'a> {
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// Problems by name.
    pub names: &'a [String],
    /// Whole levels.
    pub levels: &'a [u32],
    /// Which side of the split.
    pub split: Split,
    /// The store.
    pub store: &'a Path,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Only count what would be judged again: build, judge nothing, write
    /// nothing.
    pub dry_run: bool,
    /// Also judge again the programs whose recorded judging failed while
    /// they ran ([`failed_running`]), their code unchanged.
    pub failed: bool,
}

/// `mtmc rejudge`: [`rejudge_problem`] on each chosen problem the store
/// holds programs of, a line per problem.
pub fn rejudge(out: &mut dyn std::io::Write, req: RejudgeRequest<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let mut chosen = chosen(&problems, req.names, req.levels, req.split)?;
    if !req.store.is_file() {
        return Err(mtmc_planner::store::StoreError::no_file(req.store).into());
    }
    // Judging needs each problem's code for its ModelNew: say so once.
    crate::source::require_code("rejudge", &chosen)?;
    if req.dry_run {
        // The coder compiles every fragment it writes and falls back where
        // one fails: without NVRTC it writes other programs than the ones
        // recorded, and every one would read as changed.
        let nvrtc = mtmc_env::probe::nvrtc(None);
        if !nvrtc.ok {
            bail!(
                "rejudge --dry-run builds every program as the coder does, compiling each fragment with NVRTC: {}; {}",
                nvrtc.detail,
                nvrtc.fix.unwrap_or_default()
            );
        }
    }
    let mut store = if req.dry_run {
        Store::open_to_read(req.store)?
    } else {
        Store::open(req.store)?
    };
    let held: std::collections::BTreeSet<String> =
        store.problems()?.into_iter().map(|p| p.name).collect();
    chosen.retain(|p| held.contains(&p.full_name()));
    let gpu = if req.dry_run {
        false
    } else {
        let gpus = Gpus::probe();
        gpus.claim(out, &store)?;
        gpus.any()
    };
    // Ctrl-C stops between rounds: the line of the problem it stopped on is
    // written, and what was judged is kept.
    let stop = Interrupt::catch().context("catching Ctrl-C")?;
    writeln!(
        out,
        "rejudge: {} problem(s) with recorded programs in {}; {}",
        chosen.len(),
        req.store.display(),
        if req.dry_run {
            "a dry run: programs built and counted, none judged, nothing written"
        } else if gpu {
            "judged on the GPU"
        } else {
            "no GPU: compile only (a compile-only outcome never replaces a timed one)"
        }
    )?;
    let mut judge =
        ProblemJudge::with_baselines(gpu, req.timeout, true, &["eager"], false).stopping_on(&stop);
    let graphs = problems.graphs(&chosen)?;
    let bar = crate::fmt::progress_bar(0);
    let (mut judged, mut kept, mut untimed, mut failed, mut with_work) = (0, 0, 0, 0, 0);
    let mut stopped: Option<(String, usize)> = None;
    let total = chosen.len();
    for (i, (p, traced)) in chosen.iter().zip(graphs).enumerate() {
        if stop.requested() {
            stopped.get_or_insert((format!("before {}", p.full_name()), total - i));
            break;
        }
        bar.set_message(p.full_name());
        let g = match traced.graph {
            Ok(g) => g,
            Err(e) => {
                bar.suspend(|| writeln!(out, "{}: no graph ({e}); skipped", p.full_name()))?;
                continue;
            }
        };
        match rejudge_problem(p, &g, &mut judge, &mut store, &bar, &req) {
            Ok(r) => {
                judged += r.judged;
                kept += r.kept;
                untimed += r.untimed;
                failed += r.failed;
                with_work += usize::from(r.judged > 0);
                if r.interrupted {
                    stopped = Some((format!("on {}", p.full_name()), total - i - 1));
                }
                bar.suspend(|| {
                    writeln!(
                        out,
                        "{}: {} recorded program(s) reached, {} {}{}{}{}{}{}",
                        p.full_name(),
                        r.reached,
                        r.judged,
                        if req.dry_run {
                            format!(
                                "to judge again (their code changed){}{}",
                                counted(r.untimed, |n| format!(
                                    ", {n} compiled only (judged too on a GPU)"
                                )),
                                counted(r.failed, |n| format!(
                                    ", {n} failed while running (judged too)"
                                ))
                            )
                        } else if r.failed > 0 {
                            format!(
                                "judged again ({} had failed while running), {} kept",
                                r.failed, r.kept
                            )
                        } else {
                            format!("judged again, {} kept", r.kept)
                        },
                        counted(r.recomputed, |n| format!(
                            " ({n} out of GPU memory beside the kept reference outputs, judged with them recomputed)"
                        )),
                        r.moved
                            .as_ref()
                            .map(|(k, a, b)| format!("; most moved: {k} {a:.3}x -> {b:.3}x"))
                            .unwrap_or_default(),
                        if r.unreached.is_empty() {
                            String::new()
                        } else {
                            format!(
                                "; {} recorded program(s) no move reaches now, left as recorded",
                                r.unreached.len()
                            )
                        },
                        named(&r.changed),
                        if r.interrupted {
                            format!(
                                "; interrupted{}",
                                counted(r.dropped, |n| format!(
                                    ": the {n} program(s) in flight not kept"
                                ))
                            )
                        } else {
                            String::new()
                        }
                    )
                })?;
            }
            Err(e) => bar.suspend(|| writeln!(out, "{}: failed: {e:#}", p.full_name()))?,
        }
    }
    bar.finish_and_clear();
    // What an interrupted run says after its summary, as the error.
    let interrupted = |(at, left): (String, usize), what: &str| {
        Interrupted(format!(
            "stopped {at}{}; {what}",
            counted(left, |n| format!(", {n} problem(s) after it not started"))
        ))
    };
    if req.dry_run {
        writeln!(
            out,
            "{judged} recorded program(s) on {with_work} problem(s) to judge again (this build writes other code for them){}{}; nothing judged or written: run without --dry-run to judge them",
            counted(untimed, |n| format!(
                ", and {n} recorded compiled only that a rejudge on a GPU judges too"
            )),
            counted(failed, |n| format!(
                ", and {n} whose judging failed while they ran (--failed)"
            ))
        )?;
        return match stopped {
            Some(s) => {
                Err(interrupted(s, "the counts above are partial: run again for whole ones").into())
            }
            None => Ok(()),
        };
    }
    writeln!(
        out,
        "{judged} recorded program(s) judged again (this build writes other code for them{}), {kept} new outcome(s) kept in {}",
        counted(failed, |n| format!(
            ", or their judging failed while they ran: {n}"
        )),
        req.store.display()
    )?;
    match stopped {
        Some(s) => Err(interrupted(s, "every outcome above is kept: run again to resume").into()),
        None => Ok(()),
    }
}

/// The names of the action kinds `explore --beyond` takes.
pub const KINDS: [&str; 8] = [
    "call_library",
    "custom_kernel",
    "fuse",
    "split",
    "retile",
    "vectorize",
    "rewrite",
    "cuda_graph",
];

/// The moves of the action kinds `kinds` (`KINDS`, named by the flag
/// `flag`), as a mask over the flat index ([`mtmc_planner::space::of_kinds`]);
/// an unknown kind is an error that lists the kinds.
pub fn kinds_mask(flag: &str, kinds: &[String]) -> Result<[bool; ACTIONS]> {
    if let Some(k) = kinds.iter().find(|k| !KINDS.contains(&k.as_str())) {
        bail!(
            "{flag} {k}: not an action kind; give one of {}",
            KINDS.join(", ")
        );
    }
    let kinds: Vec<&str> = kinds.iter().map(String::as_str).collect();
    Ok(mtmc_planner::space::of_kinds(&kinds))
}

/// The planner name `explore --beyond` records its episodes under.
pub const BEYOND: &str = "exhaustive-beyond";

/// Which unrecorded programs `explore --beyond` judges: the moves, and the
/// order of the parents they are made from.
#[derive(Clone, Copy)]
pub struct Beyond<'a> {
    /// Action kinds (`KINDS`) whose moves make the programs.
    pub kinds: &'a [String],
    /// The parents fewest moves from the library program first (the
    /// fastest first among those), instead of the fastest first.
    pub shallow_first: bool,
}

/// Evaluates up to `budget` programs that one move of `beyond.kinds` makes
/// from a recorded correct program of `p` and that the store has no
/// outcome for: the parents fastest first (or, `beyond.shallow_first`,
/// nearest the library program first, then fastest), each parent's moves
/// in index order. The recorded programs are those reached from the
/// library program through recorded programs. Each evaluation is one step
/// of a `BEYOND` episode, observed and rewarded as the second step of an
/// episode whose best so far is the parent, so that its reward is what the
/// move earned over the program it refined.
pub fn extend_problem(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    budget: usize,
    beyond: Beyond<'_>,
    rec: &mut Recording<'_>,
) -> Result<EpisodeResult> {
    let mut j = Judging::new(p, g, judge)?;
    let recorded = rec.store.evaluations(&j.problem.name)?;
    let open = rec.begin(&j, BEYOND)?;
    let (problem, prior) = (&open.problem, &open.prior);
    let shape = problem.shape;
    let moves = kinds_mask("--beyond", beyond.kinds)?;
    // The unrecorded programs a move of `kinds` makes from a correct
    // recorded one that the library program reaches, with the parent's
    // depth and speedup.
    let mut candidates: Vec<(usize, f64, Config, Move, Config)> = Vec::new();
    let mut queued: std::collections::BTreeSet<String> = Default::default();
    for (c, depth) in recorded_walk(&recorded, shape) {
        let Some(speedup) = recorded.get(&c.key()).and_then(correct_speedup) else {
            continue;
        };
        for m in Move::all().filter(|&m| m != Move::Stop && moves[m.index()]) {
            if let Some(next) = c.apply(m, shape)
                && !recorded.contains_key(&next.key())
                && queued.insert(next.key())
            {
                candidates.push((depth, speedup, c.clone(), m, next));
            }
        }
    }
    // Fastest parents first (shallowest first, if asked); a stable sort
    // keeps each parent's moves in index order.
    if beyond.shallow_first {
        candidates.sort_by(|a, b| a.0.cmp(&b.0).then(b.1.total_cmp(&a.1)));
    } else {
        candidates.sort_by(|a, b| b.1.total_cmp(&a.1));
    }
    candidates.truncate(budget);
    let ahead: Vec<Config> = candidates.iter().map(|(.., next)| next.clone()).collect();
    j.prebuild(&ahead);
    let reward = Reward::default();
    let mut best = recorded
        .values()
        .filter_map(correct_speedup)
        .fold(0.0, f64::max);
    let mut bests = Vec::new();
    let mut done = 0;
    let mut interrupted = false;
    while done < candidates.len() && !interrupted {
        let take = j.judge.in_flight().min(candidates.len() - done);
        let round = &candidates[done..done + take];
        done += take;
        let started = now();
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|(_, _, parent, m, next)| {
                (
                    *m,
                    next.clone(),
                    format!("{} -> {} -> {}", parent.key(), m.label(), next.key()),
                )
            })
            .collect();
        let judged = match j.evaluate(Reuse::Nothing, &asked)? {
            Round::Judged(judged) => judged,
            Round::Dropped(_) => {
                done -= take;
                interrupted = true;
                break;
            }
        };
        for (ev, ((_, _, parent, m, next), (_, _, label))) in
            judged.into_iter().zip(round.iter().zip(&asked))
        {
            // An episode at its second step, the parent its best so far.
            let mut e = Episode::new(shape, mtmc_planner::ppo::PpoConfig::default().max_steps);
            let parent_diagnosis = recorded[&parent.key()].clone();
            e.record(Move::Stop, parent.clone(), parent_diagnosis, &reward);
            let obs = observe(problem, &e, prior);
            let r = e.record(*m, next.clone(), ev.diagnosis.clone(), &reward);
            best = best.max(correct_speedup(&ev.diagnosis).unwrap_or(0.0));
            bests.push(best);
            rec.step(out, &open, ev, &e, parent, *m, next, label, r, obs, started)?;
        }
    }
    rec.end(&j, &open, best, done, bests, interrupted)
}

/// Where an enumerating episode (`enumerate_problem`, `extend_problem`)
/// is recorded.
pub struct Recording<'a> {
    /// The store.
    pub store: &'a mut Store,
    /// The planner version its rows carry.
    pub version: &'a str,
    /// The episode's seed.
    pub seed: u64,
    /// The problems whose recorded steps the priors read: those this
    /// split [`Split::knows`].
    pub knowledge: Split,
    /// Judge again the recorded programs whose code changed
    /// ([`Reuse::Unchanged`]) instead of taking every recorded outcome.
    pub rejudge_changed: bool,
}

/// An episode [`Recording::begin`] opened: the problem as the store holds
/// it, its knowledge-base priors, the episode's id.
struct Opened {
    problem: PlanProblem,
    prior: [f32; ACTIONS],
    id: i64,
}

impl Recording<'_> {
    /// Stores `j`'s problem and opens an episode of `planner` on it.
    fn begin(&mut self, j: &Judging<'_>, planner: &str) -> Result<Opened> {
        let problem = j.problem.clone();
        self.store.put_problem(&problem)?;
        let knowledge = self.knowledge;
        let prior = self
            .store
            .prior(&problem.pattern, &problem.name, &|n| knowledge.knows(n))?;
        let id = self
            .store
            .begin_episode(&problem.name, planner, self.version, self.seed)?;
        Ok(Opened { problem, prior, id })
    }

    /// Prints the step that judged `next` (reached from `parent` by `m`;
    /// `e` has recorded it) and records it.
    #[allow(clippy::too_many_arguments)]
    fn step(
        &mut self,
        out: &mut dyn std::io::Write,
        open: &Opened,
        ev: Evaluated,
        e: &Episode,
        parent: &Config,
        m: Move,
        next: &Config,
        label: &str,
        reward: f64,
        obs: Vec<f32>,
        started: f64,
    ) -> Result<()> {
        writeln!(
            out,
            "  {label}: {} (reward {reward:+.3})",
            ev.diagnosis.text()
        )?;
        let record = ev.step(open.id, e, parent.key(), obs, m, next, reward, started)?;
        self.store.add_step(&open.problem, self.version, &record)?;
        Ok(())
    }

    /// Ends the episode with `best` after `evaluations` steps; `bests`
    /// holds the best speedup after each. An episode a signal stopped
    /// (`interrupted`) is left unfinished: its steps are kept, and the
    /// next run of its planner runs it again.
    fn end(
        &mut self,
        j: &Judging<'_>,
        open: &Opened,
        best: f64,
        evaluations: usize,
        bests: Vec<f64>,
        interrupted: bool,
    ) -> Result<EpisodeResult> {
        if !interrupted {
            self.store.end_episode(open.id, best)?;
        }
        Ok(EpisodeResult {
            best,
            evaluations,
            bests,
            wrote: j.found.best.is_some(),
            rejudged: None,
            changed: j.changed,
            interrupted,
        })
    }
}

/// The graph (traced, or rewritten where `c` asks and one exists) a
/// configuration is built from, and its regions.
fn graph_of<'g>(
    g: &'g OpGraph,
    regions: &'g [Vec<u32>],
    rewritten: &'g [Option<Rewritten>],
    c: &Config,
) -> (&'g OpGraph, &'g [Vec<u32>]) {
    match rewritten_of(rewritten, c.graph) {
        Some(r) => (&r.graph, &r.regions),
        None => (g, regions),
    }
}

/// Rewritten graph `graph` (`Config::graph`; 0, the traced graph, is
/// none).
fn rewritten_of(rewritten: &[Option<Rewritten>], graph: u8) -> Option<&Rewritten> {
    (graph as usize)
        .checked_sub(1)
        .and_then(|k| rewritten.get(k))
        .and_then(Option::as_ref)
}

/// Keeps `program` as the best when it is the fastest correct one (or,
/// with nothing run, the first that compiled); says whether it did.
fn keep_best(found: &mut Found, program: &Program, o: &Outcome, c: &Config) -> bool {
    let params = Params {
        block: c.block,
        vector: c.vector,
    };
    match (o.status, &o.runtime) {
        (Status::Correct, Some(rt)) if found.best.as_ref().is_none_or(|b| rt.mean_ms < b.0) => {
            found.best = Some((rt.mean_ms, program.clone(), params, o.clone()));
            true
        }
        (Status::CompiledOnly, _) if found.best.is_none() => {
            found.best = Some((f64::INFINITY, program.clone(), params, o.clone()));
            true
        }
        _ => false,
    }
}

/// Whether the problem `name` (`L2/76_…`) is of one of `levels` (of any
/// level when `levels` is empty).
pub fn of_levels(name: &str, levels: &[u32]) -> bool {
    levels.is_empty()
        || name
            .strip_prefix('L')
            .and_then(|n| n.split_once('/'))
            .and_then(|(l, _)| l.parse().ok())
            .is_some_and(|l| levels.contains(&l))
}

/// Words for the levels a comparison was limited to (none when every
/// level counts): ", level 3" or ", levels 1, 2".
pub fn levels_words(levels: &[u32]) -> String {
    match levels {
        [] => String::new(),
        [l] => format!(", level {l}"),
        ls => format!(
            ", levels {}",
            ls.iter().map(u32::to_string).collect::<Vec<_>>().join(", ")
        ),
    }
}

/// The fixed train/test rule: a problem is held out for testing when the
/// first byte of the SHA-256 of its full name (`L2/76_…`) is a multiple of
/// 5 (about one problem in five).
pub fn held_out(name: &str) -> bool {
    first_byte(name).is_multiple_of(5)
}

/// The validation rule: a training problem whose first SHA-256 byte is 1
/// mod 5 (about one training problem in four). `train --validation` leaves
/// these out, so that settings can be chosen on them without looking at
/// the held-out problems.
pub fn validation(name: &str) -> bool {
    first_byte(name) % 5 == 1
}

fn first_byte(name: &str) -> u8 {
    let hex = crate::source::sha256_hex(name);
    u8::from_str_radix(&hex[..2], 16).expect("a SHA-256 in hex")
}

/// Which problems a command takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Split {
    /// Problems not held out.
    Train,
    /// Held-out problems.
    Test,
    /// The training problems `train --validation` leaves out.
    Validation,
    /// Every problem.
    All,
}

impl Split {
    pub(crate) fn keeps(self, name: &str) -> bool {
        match self {
            Split::Train => !held_out(name),
            Split::Test => held_out(name),
            Split::Validation => validation(name),
            Split::All => true,
        }
    }

    /// Whether the knowledge base reads `name`'s recorded steps for a
    /// search on this split: the training problems', less the validation
    /// problems' when those are searched. A held-out problem's outcomes
    /// never reach a planner's observations.
    pub fn knows(self, name: &str) -> bool {
        !(held_out(name) || self == Split::Validation && validation(name))
    }
}

/// What `mtmc explore` was asked to do.
pub struct ExploreRequest<'a> {
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// Problems by name.
    pub names: &'a [String],
    /// Whole levels.
    pub levels: &'a [u32],
    /// Which side of the split.
    pub split: Split,
    /// The planner that explores.
    pub planner: Choice,
    /// Episodes per problem.
    pub episodes: usize,
    /// Evaluations per episode.
    pub budget: usize,
    /// The store.
    pub store: &'a Path,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Seed.
    pub seed: u64,
    /// Action kinds (`KINDS`): with the exhaustive planner, evaluate the
    /// programs one such move beyond the recorded ones instead
    /// (`extend_problem`), in the order it says.
    pub beyond: Beyond<'a>,
    /// Judge again the recorded programs whose code changed
    /// ([`Reuse::Unchanged`]).
    pub rejudge_changed: bool,
}

/// `mtmc merge`: copies each store of `from`, in order, into `into`.
pub fn merge(out: &mut dyn std::io::Write, into: &Path, from: &[PathBuf]) -> Result<()> {
    // Every source must be there before the target is created.
    if let Some(missing) = from.iter().find(|f| !f.is_file()) {
        return Err(mtmc_planner::store::StoreError::no_file(missing).into());
    }
    let mut store = Store::open(into)?;
    for source in from {
        let m = store.merge(source)?;
        writeln!(
            out,
            "{}: {} episode(s), {} step(s) and {} newly judged program(s) merged; {} problem(s) new to {}{}{}{}{}",
            source.display(),
            m.episodes,
            m.steps,
            m.evaluations,
            m.problems,
            into.display(),
            counted(m.skipped, |n| format!(
                "; {n} episode(s) it already held skipped"
            )),
            counted(m.replaced, |n| format!(
                "; {n} program(s) it had judged with another outcome now hold this store's"
            )),
            counted(m.kept, |n| format!(
                "; {n} program(s) it compiled only (no GPU) keep the outcome {} had from a GPU",
                into.display()
            )),
            m.named_gpu
                .as_ref()
                .map(|g| format!(
                    "; {} named no GPU and now names the one {} names, the {g}",
                    into.display(),
                    source.display()
                ))
                .unwrap_or_default()
        )?;
    }
    Ok(())
}

/// Runs episodes on each chosen problem, recording them; problems with
/// enough finished episodes of this planner in the store are skipped, so a
/// stopped run resumes.
pub fn explore(out: &mut dyn std::io::Write, req: ExploreRequest<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let chosen = chosen(&problems, req.names, req.levels, req.split)?;
    crate::source::require_code("explore", &chosen)?;
    kinds_mask("--beyond", req.beyond.kinds)?;
    if req.beyond.shallow_first && req.beyond.kinds.is_empty() {
        bail!(
            "--shallow-first orders the parents of the programs --beyond judges: give --beyond KIND (with --planner exhaustive) too"
        );
    }
    if !req.beyond.kinds.is_empty() && !matches!(req.planner, Choice::Exhaustive) {
        bail!(
            "--beyond enumerates the programs beyond the recorded ones, which only the exhaustive planner does: add --planner exhaustive"
        );
    }
    let mut store = Store::open(req.store)?;
    let gpus = Gpus::probe();
    gpus.claim(out, &store)?;
    let mut loaded = req.planner.load(req.seed)?;
    let gpu = gpus.any();
    // Ctrl-C stops between rounds: every step finished is kept, the
    // episode in flight is left unfinished (run again to resume).
    let stop = Interrupt::catch().context("catching Ctrl-C")?;
    let mut judge =
        ProblemJudge::with_baselines(gpu, req.timeout, true, &["eager"], false).stopping_on(&stop);
    let name = if req.beyond.kinds.is_empty() {
        loaded.planner.name()
    } else {
        BEYOND
    };
    let done = store.finished_episodes(name)?;
    let work: Vec<(&mtmc_actions::problem::Problem, usize)> = chosen
        .iter()
        .map(|p| {
            (
                *p,
                req.episodes
                    .saturating_sub(done.get(&p.full_name()).copied().unwrap_or(0)),
            )
        })
        .filter(|(_, n)| *n > 0)
        .collect();
    let total: usize = work.iter().map(|w| w.1).sum();
    writeln!(
        out,
        "explore: {} problem(s), {} episode(s) to run ({} already in {}); planner {}, budget {}; {}",
        chosen.len(),
        total,
        chosen.len() * req.episodes - total,
        req.store.display(),
        if req.beyond.kinds.is_empty() {
            name.to_string()
        } else {
            format!(
                "{name} (one {} move beyond the recorded programs, {})",
                req.beyond.kinds.join(" or "),
                if req.beyond.shallow_first {
                    "the parents nearest the library program first"
                } else {
                    "the fastest parents first"
                }
            )
        },
        req.budget,
        if gpu {
            "judged on the GPU"
        } else {
            "no GPU: compile only, nothing is run or timed"
        }
    )?;
    let graphs = problems.graphs(&work.iter().map(|w| w.0).collect::<Vec<_>>())?;
    let bar = crate::fmt::progress_bar(total as u64);
    let settings = PlanSettings {
        budget: req.budget,
        near_roofline: f64::INFINITY,
        verbose: false,
        reuse: true,
        rejudge_changed: req.rejudge_changed,
        rejudge: false,
        knowledge: req.split,
    };
    let mut log = Vec::new();
    let mut changed = 0;
    // Where a signal stopped the run: the episode, and the episodes after
    // it not started.
    let mut stopped: Option<(String, usize)> = None;
    let mut started = 0;
    'problems: for ((p, n), traced) in work.iter().zip(graphs) {
        let g = match traced.graph {
            Ok(g) => g,
            Err(e) => {
                bar.suspend(|| writeln!(out, "{}: no graph ({e}); skipped", p.full_name()))?;
                bar.inc(*n as u64);
                started += n;
                continue;
            }
        };
        for k in 0..*n {
            if stop.requested() {
                stopped = Some((
                    format!("before {} episode {}", p.full_name(), k + 1),
                    total - started - 1,
                ));
                break 'problems;
            }
            started += 1;
            bar.set_message(format!("{} episode {}", p.full_name(), k + 1));
            log.clear();
            let seed = req.seed.wrapping_add(k as u64);
            let r = if !req.beyond.kinds.is_empty() {
                extend_problem(
                    &mut log,
                    p,
                    &g,
                    &mut judge,
                    req.budget,
                    req.beyond,
                    &mut Recording {
                        store: &mut store,
                        version: &loaded.version,
                        seed,
                        knowledge: req.split,
                        rejudge_changed: req.rejudge_changed,
                    },
                )
            } else if matches!(req.planner, Choice::Exhaustive) {
                enumerate_problem(
                    &mut log,
                    p,
                    &g,
                    &mut judge,
                    req.budget,
                    &mut Recording {
                        store: &mut store,
                        version: &loaded.version,
                        seed,
                        knowledge: req.split,
                        rejudge_changed: req.rejudge_changed,
                    },
                )
            } else {
                plan_problem(
                    &mut log,
                    p,
                    &g,
                    &mut judge,
                    &mut loaded,
                    &settings,
                    Some(&mut store),
                    None,
                    None,
                    seed,
                )
            };
            match r {
                Ok(r) => bar.suspend(|| {
                    changed += r.changed;
                    if r.interrupted {
                        stopped = Some((
                            format!("in {} episode {}", p.full_name(), k + 1),
                            total - started,
                        ));
                    }
                    writeln!(
                        out,
                        "{}: episode {}: best {:.3}x in {} evaluation(s){}{}",
                        p.full_name(),
                        k + 1,
                        r.best,
                        r.evaluations,
                        if req.rejudge_changed {
                            format!(", {} of them recorded programs judged again", r.changed)
                        } else {
                            String::new()
                        },
                        if r.interrupted {
                            "; interrupted: its steps are kept, the episode is left unfinished"
                        } else {
                            ""
                        }
                    )
                })?,
                Err(e) => {
                    bar.suspend(|| writeln!(out, "{}: episode failed: {e:#}", p.full_name()))?
                }
            }
            bar.inc(1);
            if stopped.is_some() {
                break 'problems;
            }
        }
    }
    bar.finish_and_clear();
    if req.rejudge_changed {
        writeln!(
            out,
            "{changed} recorded program(s) judged again: this build writes other code for them than the code judged, or the store kept no hash of that code"
        )?;
    }
    writeln!(
        out,
        "store: {} ({} steps in all)",
        req.store.display(),
        store.steps()?.len()
    )?;
    match stopped {
        Some((at, left)) => Err(Interrupted(format!(
            "stopped {at}{}; every finished step is kept: run again to resume",
            counted(left, |n| format!(", {n} episode(s) after it not started"))
        ))
        .into()),
        None => Ok(()),
    }
}

/// What `mtmc train` was asked to do.
pub struct TrainRequest<'a> {
    /// The store.
    pub store: &'a Path,
    /// The checkpoint folder.
    pub out_dir: &'a Path,
    /// Iterations in all.
    pub iterations: usize,
    /// PPO's settings.
    pub ppo: PpoConfig,
    /// Continue from the checkpoint in `out_dir`.
    pub resume: bool,
    /// Where PPO runs.
    pub device: mtmc_planner::policy::Device,
    /// Leave the validation problems out too.
    pub validation: bool,
    /// Policies in the committee (1: one policy).
    pub members: usize,
}

/// Trains the policy on the training problems' recorded tree, then the
/// reward-to-go model, and reports its ranking quality on the held-out
/// problems' steps.
pub fn train(out: &mut dyn std::io::Write, req: TrainRequest<'_>) -> Result<()> {
    if !req.device.available() {
        return Err(mtmc_planner::train::TrainError::NoCuda.into());
    }
    let cost = req.ppo.step_cost;
    if !(cost.is_finite() && cost >= 0.0) {
        bail!(
            "--step-cost {cost}: give a cost of 0 or more (0, the default, charges nothing per evaluation)"
        );
    }
    let store = Store::open_to_read(req.store)?;
    // The problems it trains on: those the knowledge base may read.
    let split = if req.validation {
        Split::Validation
    } else {
        Split::Train
    };
    let trains = |name: &str| split.knows(name);
    let all = tree::load(&store, &trains)?;
    let (train, test): (Vec<TreeProblem>, Vec<TreeProblem>) =
        all.into_iter().partition(|p| trains(&p.problem.name));
    if train.is_empty() {
        bail!(
            "`{}` has no recorded training problem: run `mtmc explore --split train` first",
            req.store.display()
        );
    }
    let checkpoint = Checkpoint::at(req.out_dir);
    if !req.resume && checkpoint.exists() {
        bail!(
            "`{}` already holds a checkpoint: pass --resume to continue it, or another --out",
            req.out_dir.display()
        );
    }
    let members = req.members.max(1);
    // A resumed committee goes on with every member it has: fewer would
    // leave trained members out of it without a word (more train the new
    // ones, as a run with that many from the start would).
    let resuming = req.resume && checkpoint.exists();
    let held = match resuming {
        true => checkpoint.meta()?.members.len() + 1,
        false => 1,
    };
    if members < held {
        bail!(
            "checkpoint `{}` is a committee of {held}: resume it with --members {held} (or more, to add members), or train another --out",
            req.out_dir.display()
        );
    }
    // Member k (1-based) trains with seed + k - 1; the first is the
    // folder itself.
    let member_name = |k: usize| format!("member-{k}");
    let member_dir = |k: usize| match k {
        1 => req.out_dir.to_path_buf(),
        _ => req.out_dir.join(member_name(k)),
    };
    let transitions: usize = train.iter().map(|p| p.evals.len()).sum();
    // Ctrl-C stops training after the iteration in flight, its checkpoint
    // and curves written: `--resume` continues it exactly.
    let stop = Interrupt::catch().context("catching Ctrl-C")?;
    writeln!(
        out,
        "train: {} training problem(s) ({} recorded programs{}), {} held out{}; {} iteration(s) of {} episodes on the {}, discount {}{}{}",
        train.len(),
        transitions,
        store
            .gpu()?
            .map_or(String::new(), |g| format!(", judged on the {g}")),
        test.len(),
        if req.validation {
            " (test and validation)"
        } else {
            ""
        },
        req.iterations,
        req.ppo.episodes,
        req.device.name(),
        req.ppo.gamma,
        if members > 1 {
            format!(
                "; a committee of {members} (seeds {}..={})",
                req.ppo.seed,
                req.ppo.seed + members as u64 - 1
            )
        } else {
            String::new()
        },
        match (resuming, members > held) {
            (true, true) => format!(", resuming (the committee of {held} grows to {members})"),
            (true, false) => ", resuming".to_string(),
            (false, _) => String::new(),
        }
    )?;
    let unflagged = store.problems_without_rewrite_flags()?;
    if let Some(first) = unflagged.first() {
        writeln!(
            out,
            "warning: {} problem(s) ({first}{}) were recorded by an mtmc before the graph features flagged the rewrites that apply; they read as if none applied. `mtmc explore` records a problem again when it runs an episode on it (`--episodes` one more than the store holds)",
            unflagged.len(),
            if unflagged.len() > 1 { ", …" } else { "" }
        )?;
    }
    if let Some(line) = compiled_only_warning(
        &train,
        "this checkpoint learns nothing of speed",
        "they teach the planner nothing of speed",
    ) {
        writeln!(out, "{line}")?;
    }
    let train = Arc::new(train);
    let t0 = Instant::now();
    let mut finals = Vec::new();
    let mut rows = Vec::new();
    for k in 1..=members {
        let dir = member_dir(k);
        let ppo = mtmc_planner::ppo::PpoConfig {
            seed: req.ppo.seed + k as u64 - 1,
            ..req.ppo.clone()
        };
        let bar = ProgressBar::new(req.iterations as u64);
        let prefix = if members > 1 {
            format!("member {k}/{members} ")
        } else {
            String::new()
        };
        bar.set_style(
            ProgressStyle::with_template(&format!(
                "{prefix}{{bar:30}} {{pos}}/{{len}} [{{elapsed}} < {{eta}}] {{msg}}"
            ))
            .expect("a valid template"),
        );
        let member_rows = mtmc_planner::train::train(
            req.device,
            mtmc_planner::train::Run {
                problems: train.clone(),
                config: &ppo,
                iterations: req.iterations,
                dir: &dir,
                resume: req.resume && Checkpoint::at(&dir).exists(),
                members: match k {
                    1 => (2..=members).map(member_name).collect(),
                    _ => Vec::new(),
                },
            },
            |r| {
                bar.set_position(r.iteration as u64);
                bar.set_message(format!(
                    "return {:.3}, best {:.3}x, entropy {:.3}",
                    r.mean_return, r.best_speedup, r.entropy
                ));
                match stop.requested() {
                    true => std::ops::ControlFlow::Break(()),
                    false => std::ops::ControlFlow::Continue(()),
                }
            },
        )?;
        bar.finish_and_clear();
        let done = member_rows.last().map_or(0, |r| r.iteration);
        if let (Some(first), Some(last)) = (member_rows.first(), member_rows.last()) {
            writeln!(
                out,
                "{prefix}iterations {}..{}: mean return {:.3} -> {:.3}, best speedup (geomean) {:.3}x -> {:.3}x, entropy {:.3} -> {:.3}, value loss {:.4} -> {:.4}",
                first.iteration,
                last.iteration,
                first.mean_return,
                last.mean_return,
                first.best_speedup,
                last.best_speedup,
                first.entropy,
                last.entropy,
                first.value_loss,
                last.value_loss
            )?;
        }
        finals.push(serde_json::json!({
            "folder": dir.display().to_string(),
            "seed": ppo.seed,
            "last": member_rows.last(),
        }));
        if k == 1 {
            rows = member_rows;
            // The first member's every meta names the others (a
            // committee cut short is refused until `--resume` finishes
            // it); one that trained no iteration more here, resumed with
            // more members, is named them now.
            if checkpoint.exists() {
                let mut meta = checkpoint.meta()?;
                meta.members = (2..=members).map(member_name).collect();
                checkpoint.write_meta(&meta)?;
            }
        }
        if stop.requested() {
            return Err(Interrupted(format!(
                "stopped {}after iteration {done} of {}; the checkpoint in {} holds every finished iteration: run the same command with --resume to finish it",
                if members > 1 {
                    format!("in member {k}/{members} ")
                } else {
                    String::new()
                },
                req.iterations,
                req.out_dir.display()
            ))
            .into());
        }
    }
    let seconds = t0.elapsed().as_secs_f64();
    // The reward-to-go model: fitted on the training problems' steps,
    // ranked on the held-out ones'. It reads the observations as recorded:
    // steps recorded by an mtmc whose observations had another length are
    // left out, and without any step to fit on no model is written (one
    // fitted on nothing would rerank the policy's moves by chance).
    let mut steps = store.steps()?;
    // A problem's graph features are those of every step of it: steps
    // recorded before a graph feature existed read it as this build does.
    let problems: std::collections::BTreeMap<String, PlanProblem> = store
        .problems()?
        .into_iter()
        .map(|p| (p.name.clone(), p))
        .collect();
    for s in &mut steps {
        if let Some(p) = problems.get(&s.problem) {
            p.restore(&mut s.observation);
        }
    }
    let samples = mtmc_planner::rtg::samples(&steps);
    let stop = Move::Stop.index();
    let stale: Vec<usize> = steps
        .iter()
        .filter(|s| s.action != stop && s.observation.len() != mtmc_planner::features::OBS)
        .map(|s| s.observation.len())
        .collect();
    let left_out = stale.len();
    let other: std::collections::BTreeSet<usize> = stale.into_iter().collect();
    let (fit, rest): (Vec<_>, Vec<_>) = samples.into_iter().partition(|s| trains(&s.problem));
    let held: Vec<_> = rest.into_iter().filter(|s| held_out(&s.problem)).collect();
    let ranking = if fit.is_empty() {
        for f in ["rtg.json", "rtg.mpk"] {
            let path = req.out_dir.join(f);
            if path.exists() {
                std::fs::remove_file(&path)
                    .with_context(|| format!("cannot remove `{}`", path.display()))?;
            }
        }
        writeln!(
            out,
            "reward-to-go: no model written: no training problem's recorded step holds an observation of this mtmc's {} numbers{}; the trained planner follows its policy alone (record steps with this mtmc's `explore` to fit one)",
            mtmc_planner::features::OBS,
            if other.is_empty() {
                String::new()
            } else {
                format!(
                    " ({left_out} step(s) recorded with {} numbers)",
                    other
                        .iter()
                        .map(usize::to_string)
                        .collect::<Vec<_>>()
                        .join(" or ")
                )
            }
        )?;
        None
    } else {
        let rtg = mtmc_planner::rtg::fit(&fit, 64, 60, req.ppo.seed);
        mtmc_planner::rtg::save(&rtg, req.out_dir, 64).map_err(anyhow::Error::msg)?;
        let ranking = mtmc_planner::rtg::ranking(&rtg, &held);
        writeln!(
            out,
            "reward-to-go: fitted on {} step(s); on {} held-out step(s): {}{}",
            fit.len(),
            ranking.samples,
            if ranking.pairs > 0 {
                format!(
                    "Spearman {:.3}, pairwise accuracy {:.3} over {} pair(s)",
                    ranking.spearman, ranking.pairwise, ranking.pairs
                )
            } else {
                "no pair to rank (record steps of the held-out problems to measure the ranking)"
                    .to_string()
            },
            if left_out > 0 {
                format!(
                    "; {left_out} step(s) with observations of another length (another mtmc's) left out"
                )
            } else {
                String::new()
            }
        )?;
        Some(ranking)
    };
    let summary = serde_json::json!({
        // The knowledge base the policy's observations were built from;
        // `optimize --planner` reads its priors there.
        "trajectories": std::fs::canonicalize(req.store)
            .unwrap_or_else(|_| req.store.to_path_buf())
            .display()
            .to_string(),
        "iterations": rows.len(),
        "seconds": seconds,
        // Whether the validation problems were left out too.
        "validation": req.validation,
        "ppo": req.ppo,
        "members": finals,
        "reward_to_go": ranking,
        "curves": rows,
    });
    let path = req.out_dir.join("train.json");
    std::fs::write(&path, serde_json::to_string_pretty(&summary)? + "\n")
        .with_context(|| format!("cannot write `{}`", path.display()))?;
    writeln!(
        out,
        "wrote {}: policy.mpk, optimizer.mpk, {}curves.csv, curves.svg, train.json{} ({seconds:.1} s)",
        req.out_dir.display(),
        if ranking.is_some() { "rtg.mpk, " } else { "" },
        match members {
            1 => String::new(),
            2 => format!(
                ", and member {} (its own policy and curves)",
                member_name(2)
            ),
            _ => format!(
                ", and members {}..{} (each its own policy and curves)",
                member_name(2),
                member_name(members)
            ),
        }
    )?;
    Ok(())
}

/// One planner's figures in `compare`.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Row {
    planner: String,
    problems: usize,
    geomean_speedup: f64,
    fast_1: f64,
    evaluations: f64,
    of_exhaustive: f64,
    /// Share of episodes whose best came within [`NEAR`] of the
    /// problem's exhaustive best.
    reached_90: f64,
    /// Evaluations until then, on average over those episodes.
    evaluations_to_90: f64,
}

/// How close to the exhaustive best counts as reaching it in `compare`
/// (the issue's "90 % of the exhaustive search's best").
pub(crate) const NEAR: f64 = 0.9;

/// One problem of the comparison: its recorded tree's best and what each
/// planner reached on it (the random planner: the geometric mean over its
/// seeds, and the mean evaluations). Speedups below 1 count as 1, as in
/// the table: eager PyTorch is always there to fall back on.
#[derive(serde::Serialize)]
pub(crate) struct ProblemRow {
    pub(crate) problem: String,
    /// The live pass (its folder) this row comes from, when passes are
    /// pooled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) pass: Option<String>,
    pub(crate) programs: usize,
    pub(crate) exhaustive: f64,
    /// Replay with moves left out (`--without`): the best of the recorded
    /// programs the other moves reach.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) exhaustive_without: Option<f64>,
    pub(crate) planners: std::collections::BTreeMap<String, PlannerResult>,
}

#[derive(serde::Serialize)]
pub(crate) struct PlannerResult {
    pub(crate) best: f64,
    pub(crate) evaluations: f64,
    /// Replay: the steps of the planner's first episode (random: seed 0),
    /// each `move -> program: outcome`.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) path: Vec<String>,
    /// Replay, the trained planner: for each step of `path`, what it
    /// weighed ([`Considered::text`]).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub(crate) considered: Vec<String>,
}

/// What `mtmc compare` was asked to do.
pub struct CompareRequest<'a> {
    /// The store.
    pub store: &'a Path,
    /// A checkpoint to compare, if any.
    pub checkpoint: Option<&'a Path>,
    /// Evaluations per problem.
    pub budget: usize,
    /// Which problems.
    pub split: Split,
    /// Only these levels' problems (every level when empty).
    pub levels: &'a [u32],
    /// Replay on the programs this planner's episodes reached alone.
    pub recorded_by: Option<&'a str>,
    /// Where the JSON goes, if anywhere.
    pub json: Option<&'a Path>,
    /// Let the trained policy's STOP end an episode early.
    pub policy_stops: bool,
    /// Action kinds (`KINDS`) left out of every planner's moves, and of
    /// the moves whose programs the exhaustive row counts: an ablation.
    pub without: &'a [String],
}

/// Replays each planner on the held-out problems' recorded tree with
/// `budget` evaluations (exhaustive: every recorded program), and prints
/// the comparison table.
pub fn compare(out: &mut dyn std::io::Write, req: CompareRequest<'_>) -> Result<()> {
    let CompareRequest {
        store: store_path,
        checkpoint,
        budget,
        split,
        levels,
        recorded_by,
        json,
        policy_stops,
        without,
    } = req;
    let left_out = kinds_mask("--without", without)?;
    let store = Store::open_to_read(store_path)?;
    let gpu = store.gpu()?;
    let problems: Vec<TreeProblem> = tree::load_by(&store, recorded_by, &|n| split.knows(n))?
        .into_iter()
        .filter(|p| split.keeps(&p.problem.name) && of_levels(&p.problem.name, levels))
        .collect();
    if problems.is_empty() {
        match recorded_by {
            Some(by) => {
                let names = store.problems()?.into_iter().map(|p| p.name);
                let present = planners_in(
                    &store,
                    names.filter(|n| split.keeps(n) && of_levels(n, levels)),
                )?;
                let present: Vec<String> = present.into_keys().collect();
                bail!(
                    "`{}` has no problem in this split{} with episodes of planner `{by}` (planners with episodes here: {}): name one of those, or leave out --recorded-by",
                    store_path.display(),
                    levels_words(levels),
                    if present.is_empty() {
                        "none".to_string()
                    } else {
                        present.join(", ")
                    }
                )
            }
            None => bail!(
                "`{}` has no recorded problem in this split{}: run `mtmc explore` on them first",
                store_path.display(),
                levels_words(levels)
            ),
        }
    }
    if recorded_by.is_none() {
        // Replay is fair only on trees no compared planner helped build:
        // a planner finds its own recorded path whole.
        let mut others = planners_in(&store, problems.iter().map(|p| p.problem.name.clone()))?;
        others.remove("exhaustive");
        if !others.is_empty() {
            let list: Vec<String> = others
                .iter()
                .map(|(by, n)| format!("{by} on {n}"))
                .collect();
            writeln!(
                out,
                "warning: these trees also hold episodes of other planners than exhaustive ({}); replay favours a planner on the trees its own episodes built: pass --recorded-by exhaustive to compare on the exhaustive episodes' programs only",
                list.join(", ")
            )?;
        }
    }
    if let Some(line) = compiled_only_warning(
        &problems,
        "this table measures no speed",
        "replay counts none of them as faster than eager",
    ) {
        writeln!(out, "{line}")?;
    }
    let problems = Arc::new(problems);
    let exhaustive: Vec<f64> = problems.iter().map(TreeProblem::best).collect();
    let planners = compared(checkpoint);
    let mut rows = Vec::new();
    let mut per_problem = problem_rows(&problems);
    for (name, choice) in &planners {
        // The random planner: the mean over 10 seeds.
        let seeds = if matches!(choice, Choice::Random) {
            10
        } else {
            1
        };
        let mut bests = vec![0.0f64; problems.len()];
        let mut used = vec![0usize; problems.len()];
        let mut paths = vec![Vec::new(); problems.len()];
        let mut weighed = vec![Vec::new(); problems.len()];
        // Episodes whose best reached 90 % of the exhaustive best, and the
        // evaluations that took.
        let (mut near, mut to_near) = (0usize, 0usize);
        for seed in 0..seeds {
            let mut loaded = choice.load(seed)?.policy_stops(policy_stops);
            for (k, b) in bests.iter_mut().enumerate() {
                let r = replay(
                    &mut loaded,
                    &problems,
                    k,
                    budget,
                    NEAR * exhaustive[k],
                    left_out,
                );
                *b += r.best.max(1.0).ln() / seeds as f64;
                used[k] += r.evaluations;
                if seed == 0 {
                    paths[k] = r.path;
                    weighed[k] = r.considered;
                }
                if let Some(r) = r.reached {
                    near += 1;
                    to_near += r;
                }
            }
        }
        let bests: Vec<f64> = bests.iter().map(|l| l.exp()).collect();
        for (((r, path), considered), (&best, &n)) in per_problem
            .iter_mut()
            .zip(paths)
            .zip(weighed)
            .zip(bests.iter().zip(&used))
        {
            r.planners.insert(
                name.clone(),
                PlannerResult {
                    best,
                    evaluations: n as f64 / seeds as f64,
                    path,
                    considered,
                },
            );
        }
        let evals: usize = used.iter().sum();
        let episodes = seeds as usize * problems.len();
        rows.push(row(
            name,
            &bests,
            evals as f64 / episodes as f64,
            &exhaustive,
            (
                near as f64 / episodes as f64,
                to_near as f64 / near.max(1) as f64,
            ),
        ));
    }
    let ablated = left_out.iter().any(|&l| l);
    // What the moves not left out reach on each problem: its best and how
    // many programs.
    let found: Vec<(f64, usize)> = if ablated {
        problems.iter().map(|p| p.best_without(&left_out)).collect()
    } else {
        Vec::new()
    };
    for (r, (best, _)) in per_problem.iter_mut().zip(&found) {
        r.exhaustive_without = Some(best.max(1.0));
    }
    rows.push(exhaustive_row(
        &problems,
        ablated.then_some(Ablation {
            left_out,
            found: &found,
        }),
    )?);
    writeln!(
        out,
        "{} problem(s) ({:?} split{}), budget {budget} evaluations (exhaustive: {}{}); outcomes replayed from {}{}{}",
        problems.len(),
        split,
        levels_words(levels),
        if ablated {
            "every recorded program the other moves reach"
        } else {
            "every recorded program"
        },
        stopping(checkpoint.is_some(), policy_stops),
        store_path.display(),
        gpu.as_ref()
            .map_or(String::new(), |g| format!(", judged on the {g}")),
        recorded_by.map_or(String::new(), |by| format!(
            " (the programs episodes of {by} reached)"
        ))
    )?;
    if ablated {
        writeln!(
            out,
            "without moves of kind {} (every planner, exhaustive too); `of exhaustive` and `reached 90%` still measure against the best of every recorded program",
            without.join(", ")
        )?;
    }
    let pairs = crate::cmd::paired::pairs(&per_problem);
    print_table(out, &rows, &pairs, true)?;
    if ablated {
        writeln!(out, "{}", ablation_losses(&per_problem))?;
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "split": format!("{split:?}").to_lowercase(),
            "levels": levels,
            "budget": budget,
            "store": store_path.display().to_string(),
            "gpu": gpu,
            "recorded_by": recorded_by,
            "policy_stops": policy_stops,
            "without": without,
            "planners": rows,
            "paired": pairs,
            "problems": per_problem,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}

/// How the trained planner's episodes end, for a comparison's heading.
pub(crate) fn stopping(trained: bool, policy_stops: bool) -> &'static str {
    match (trained, policy_stops) {
        (false, _) => "",
        (true, false) => "; trained: its STOP overruled until the budget is spent",
        (true, true) => "; trained: its STOP ends the episode",
    }
}

/// The planners a comparison runs, by name: the checkpoint's (when one is
/// given), random, greedy.
pub(crate) fn compared(checkpoint: Option<&Path>) -> Vec<(String, Choice)> {
    let mut planners: Vec<(String, Choice)> = Vec::new();
    if let Some(dir) = checkpoint {
        planners.push(("trained".into(), Choice::Trained(dir.to_path_buf())));
    }
    planners.push(("random".into(), Choice::Random));
    planners.push(("greedy".into(), Choice::Greedy));
    planners
}

/// Each problem's row of the comparison's JSON, with its recorded tree's
/// best and no planner's result yet.
pub(crate) fn problem_rows(problems: &[TreeProblem]) -> Vec<ProblemRow> {
    problems
        .iter()
        .map(|p| ProblemRow {
            problem: p.problem.name.clone(),
            pass: None,
            programs: p.evals.len(),
            exhaustive: p.best().max(1.0),
            exhaustive_without: None,
            planners: Default::default(),
        })
        .collect()
}

/// Moves left out of a replay, and what the others reach on each problem
/// ([`TreeProblem::best_without`]: its best and how many programs).
pub(crate) struct Ablation<'a> {
    left_out: [bool; ACTIONS],
    found: &'a [(f64, usize)],
}

/// The line under an ablation's table: the problems (up to three) whose
/// best the moves left out were most needed for, each the best the other
/// moves reach against every recorded program's best.
fn ablation_losses(rows: &[ProblemRow]) -> String {
    let mut lost: Vec<(&str, f64)> = rows
        .iter()
        .filter_map(|r| Some((r.problem.as_str(), r.exhaustive_without? / r.exhaustive)))
        .filter(|&(_, ratio)| ratio < 0.995)
        .collect();
    let n = lost.len();
    lost.sort_by(|a, b| a.1.total_cmp(&b.1));
    if lost.is_empty() {
        return "exhaustive without them: every problem's best is still reached (within 0.5 %)"
            .into();
    }
    let named: Vec<String> = lost
        .iter()
        .take(3)
        .map(|(p, ratio)| format!("{p} {ratio:.3}x"))
        .collect();
    format!(
        "exhaustive without them: below the problem's best on {n} of {} problems, most on {}",
        rows.len(),
        named.join(", ")
    )
}

/// The exhaustive search's row: every recorded program of each problem.
/// Its best is the reference, reached by definition; how soon is the
/// enumeration's order, replayed over every recorded program. With moves
/// `left_out` (an ablation) the row is the recorded programs the other
/// moves reach ([`TreeProblem::best_without`]): their best and their
/// number, against the best of every recorded program; how soon, the
/// enumeration's walk without those moves.
pub(crate) fn exhaustive_row(
    problems: &Arc<Vec<TreeProblem>>,
    ablation: Option<Ablation<'_>>,
) -> Result<Row> {
    let exhaustive: Vec<f64> = problems.iter().map(TreeProblem::best).collect();
    let mut walk = Choice::Exhaustive.load(0)?;
    let most = problems.iter().map(|p| p.evals.len()).max().unwrap_or(0);
    let walked: Vec<Replayed> = (0..problems.len())
        .map(|k| {
            replay(
                &mut walk,
                problems,
                k,
                most,
                NEAR * exhaustive[k],
                ablation.as_ref().map_or([false; ACTIONS], |a| a.left_out),
            )
        })
        .collect();
    let n = problems.len().max(1) as f64;
    let (bests, evaluations, near) = match ablation {
        None => (
            exhaustive.clone(),
            problems.iter().map(|p| p.evals.len()).sum::<usize>(),
            1.0,
        ),
        Some(Ablation { found, .. }) => {
            let near = found
                .iter()
                .zip(&exhaustive)
                .filter(|((b, _), e)| *b >= NEAR * **e)
                .count();
            (
                found.iter().map(|f| f.0).collect(),
                found.iter().map(|f| f.1).sum(),
                near as f64 / n,
            )
        }
    };
    let to_near: usize = walked
        .iter()
        .map(|r| r.reached.unwrap_or(r.evaluations))
        .sum();
    Ok(row(
        "exhaustive",
        &bests.iter().map(|b| b.max(1.0)).collect::<Vec<_>>(),
        evaluations as f64 / n,
        &exhaustive,
        (near, to_near as f64 / n),
    ))
}

/// Prints the comparison's table, one row per planner, then its ratios
/// ([`ratios`]) and the paired comparisons `pairs`
/// ([`crate::cmd::paired`]); `bound`: whether the exhaustive row was
/// replayed on the same outcomes as the others, so that it bounds them
/// (not so in a live comparison).
pub(crate) fn print_table(
    out: &mut dyn std::io::Write,
    rows: &[Row],
    pairs: &[Paired],
    bound: bool,
) -> Result<()> {
    writeln!(
        out,
        "{:<11} {:>9} {:>8} {:>12} {:>14} {:>12} {:>13}",
        "planner",
        "geomean",
        "fast_1",
        "evaluations",
        "of exhaustive",
        "reached 90%",
        "evals to 90%"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:<11} {:>8.3}x {:>7.1}% {:>12.1} {:>13.1}% {:>11.1}% {:>13.1}",
            r.planner,
            r.geomean_speedup,
            100.0 * r.fast_1,
            r.evaluations,
            100.0 * r.of_exhaustive,
            100.0 * r.reached_90,
            r.evaluations_to_90
        )?;
    }
    writeln!(
        out,
        "reached 90%: episodes whose best came within 90 % of the problem's exhaustive best; evals to 90%: the evaluations that took, on average over those"
    )?;
    if let Some(line) = ratios(rows, bound) {
        writeln!(out, "{line}")?;
    }
    if let Some(line) = crate::cmd::paired::line(pairs) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// The geomean ratios a comparison is read by: trained against random and
/// greedy, and (with `bound`) the exhaustive best against random, which
/// bounds what any planner can gain over random on the replayed programs.
/// `None` without a random row or with nothing to set against it.
fn ratios(rows: &[Row], bound: bool) -> Option<String> {
    let geomean = |name: &str| {
        rows.iter()
            .find(|r| r.planner == name)
            .map(|r| r.geomean_speedup)
            .filter(|g| *g > 0.0)
    };
    let random = geomean("random")?;
    let mut parts = Vec::new();
    if let Some(trained) = geomean("trained") {
        let mut part = format!("trained / random {:.3}x", trained / random);
        if let Some(greedy) = geomean("greedy") {
            part += &format!(", trained / greedy {:.3}x", trained / greedy);
        }
        parts.push(part);
    }
    if let Some(exhaustive) = geomean("exhaustive").filter(|_| bound) {
        parts.push(format!(
            "exhaustive / random {:.3}x (the best recorded program against random: no planner gains more over random on these programs)",
            exhaustive / random
        ));
    }
    (!parts.is_empty()).then(|| format!("ratios: {}", parts.join("; ")))
}

/// The planners with episodes of the problems `names`, each with how many
/// of those problems it has episodes of.
fn planners_in(
    store: &Store,
    names: impl Iterator<Item = String>,
) -> Result<std::collections::BTreeMap<String, usize>> {
    let mut count = std::collections::BTreeMap::new();
    for name in names {
        for by in store.planners_of(&name)? {
            *count.entry(by).or_default() += 1;
        }
    }
    Ok(count)
}

/// The geometric mean of speedups, those below 1 counted as 1 (the
/// library program is always there to fall back on).
pub(crate) fn geomean(speedups: &[f64]) -> f64 {
    let n = speedups.len().max(1) as f64;
    (speedups.iter().map(|b| b.max(1.0).ln()).sum::<f64>() / n).exp()
}

/// A planner's row: its bests per problem, mean evaluations, and
/// `(reached_90, evaluations_to_90)`.
pub(crate) fn row(
    name: &str,
    bests: &[f64],
    evaluations: f64,
    exhaustive: &[f64],
    (reached_90, evaluations_to_90): (f64, f64),
) -> Row {
    let n = bests.len().max(1) as f64;
    Row {
        planner: name.into(),
        problems: bests.len(),
        geomean_speedup: geomean(bests),
        fast_1: bests.iter().filter(|&&b| b > 1.0).count() as f64 / n,
        evaluations,
        of_exhaustive: geomean(bests) / geomean(exhaustive),
        reached_90,
        evaluations_to_90,
    }
}

/// One episode of `loaded` on recorded problem `k`.
struct Replayed {
    /// Its best speedup.
    best: f64,
    /// The evaluations it used.
    evaluations: usize,
    /// After how many of them its best first reached `near` (none if it
    /// never did).
    reached: Option<usize>,
    /// Its steps, each `move -> program: outcome`.
    path: Vec<String>,
    /// For each of them, what the trained planner weighed (empty for the
    /// other planners).
    considered: Vec<String>,
}

/// Replays one episode of `loaded` on recorded problem `k`, the moves
/// `left_out` never legal.
fn replay(
    loaded: &mut Loaded,
    problems: &Arc<Vec<TreeProblem>>,
    k: usize,
    budget: usize,
    near: f64,
    left_out: [bool; ACTIONS],
) -> Replayed {
    use mtmc_planner::tree::Environment;
    let mut env = TreeEnv::new(problems.clone(), budget, 0).without(left_out);
    env.start(k);
    let mut reached = None;
    let mut path = Vec::new();
    let mut considered = Vec::new();
    loop {
        let obs = env.state();
        let m = loaded.choose(
            &env.problem().problem,
            env.episode(),
            &obs.features,
            &obs.mask,
        );
        let weighed = loaded.considered().map(Considered::text);
        let m = if obs.mask[m.index()] { m } else { Move::Stop };
        let target = env.episode().target(m).map(|c| c.key());
        let done = env.step(m.index()).done;
        if let (Some(key), Some(d)) = (target, &env.episode().last) {
            let outcome = match (d.status, d.speedup_eager) {
                (Status::Correct, Some(s)) => format!("{s:.3}x"),
                (status, _) => status.name().replace('_', " "),
            };
            path.push(format!("{} -> {key}: {outcome}", m.label()));
            considered.extend(weighed);
        }
        if reached.is_none() && env.episode().best_speedup() >= near {
            reached = Some(env.episode().step);
        }
        if done {
            break;
        }
    }
    Replayed {
        best: env.episode().best_speedup(),
        evaluations: env.episode().step,
        reached,
        path,
        considered,
    }
}

/// What `mtmc optimize --planner` was asked to do.
pub struct OptimizeRequest<'a> {
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// The problem.
    pub name: &'a str,
    /// The planner.
    pub planner: Choice,
    /// The search's settings.
    pub settings: PlanSettings,
    /// Where the steps are recorded, if anywhere.
    pub store: Option<&'a Path>,
    /// Where the best program and the report go.
    pub out_dir: &'a Path,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Seed (the random planner).
    pub seed: u64,
    /// Let the trained policy's STOP end the search early.
    pub policy_stops: bool,
}

/// The store a checkpoint was trained on (`trajectories` in its
/// `train.json`), opened for its knowledge-base priors; none, with a
/// warning, when it is not there.
fn trained_knowledge(out: &mut dyn std::io::Write, dir: &Path) -> Result<Option<Store>> {
    let recorded = std::fs::read_to_string(dir.join("train.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v["trajectories"].as_str().map(PathBuf::from));
    match recorded {
        Some(path) if path.exists() => {
            writeln!(
                out,
                "knowledge base: {} (the store the planner was trained on)",
                path.display()
            )?;
            Ok(Some(Store::open_to_read(&path)?))
        }
        other => {
            writeln!(
                out,
                "warning: {}: the planner's moves are chosen without the knowledge base it learned with; pass --trajectories with that store",
                match other {
                    Some(path) => format!(
                        "the store it was trained on, `{}`, is not here",
                        path.display()
                    ),
                    None => format!(
                        "`{}` does not name the store it was trained on",
                        dir.join("train.json").display()
                    ),
                }
            )?;
            Ok(None)
        }
    }
}

/// A planner-guided search on one KernelBench problem.
pub fn optimize(out: &mut dyn std::io::Write, req: OptimizeRequest<'_>) -> Result<()> {
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let p = problems.find(req.name)?;
    let g = problems
        .graphs(&[p])?
        .remove(0)
        .graph
        .map_err(|e| anyhow::anyhow!("{p} has no graph: {e}"))?;
    let gpus = Gpus::probe();
    let gpu = gpus.any();
    if !gpu {
        writeln!(
            out,
            "no GPU: every program is judged by compile only (nothing is run or timed)"
        )?;
    }
    // Ctrl-C stops the search between rounds: the best program so far is
    // written, the round in flight is not kept.
    let stop = Interrupt::catch().context("catching Ctrl-C")?;
    let mut judge = ProblemJudge::new(gpu, req.timeout, true, false).stopping_on(&stop);
    let mut loaded = req.planner.load(req.seed)?.policy_stops(req.policy_stops);
    let mut store = req.store.map(Store::open).transpose()?;
    if let Some(s) = &store {
        gpus.claim(out, s)?;
    }
    let knowledge = match (&req.planner, req.store) {
        (Choice::Trained(dir), None) => trained_knowledge(out, dir)?,
        _ => None,
    };
    let r = plan_problem(
        out,
        p,
        &g,
        &mut judge,
        &mut loaded,
        &req.settings,
        store.as_mut(),
        knowledge.as_ref(),
        Some(req.out_dir),
        req.seed,
    )?;
    let report = req.out_dir.join("report.json");
    if r.interrupted {
        let spent = format!(
            "after {} of {} evaluation(s)",
            r.evaluations, req.settings.budget
        );
        return Err(Interrupted(if r.wrote {
            format!(
                "stopped {spent}; the best program so far ({}) is in {}",
                match r.best {
                    b if b > 0.0 => format!("{b:.3}x"),
                    _ => "compiled only: nothing was timed".into(),
                },
                req.out_dir.display()
            )
        } else {
            format!(
                "stopped {spent}, before any program was correct; the attempts are in {}",
                report.display()
            )
        })
        .into());
    }
    if !r.wrote {
        bail!(
            "no program was correct in {} evaluation(s); the attempts are in {}",
            r.evaluations,
            report.display()
        );
    }
    if let Some(again) = r.rejudged {
        add_rejudged(&report, r.best, again)?;
    }
    Ok(())
}

/// Adds to the search's report the best program's speedup as found and as
/// judged once more.
fn add_rejudged(path: &Path, found: f64, again: f64) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read `{}`", path.display()))?;
    let mut report: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("`{}` is not the report JSON", path.display()))?;
    report["best_speedup"] = serde_json::json!({ "found": found, "judged_again": again });
    std::fs::write(path, serde_json::to_string_pretty(&report)? + "\n")
        .with_context(|| format!("cannot write `{}`", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtmc_planner::features::GRAPH;
    use mtmc_planner::space::Shape;

    #[test]
    fn an_outcome_compiled_only_is_judged_again_on_a_gpu() {
        let mut d = Diagnosis::failed_to_build("", true);
        assert!(reusable(&d, true) && reusable(&d, false));
        d.status = Status::CompiledOnly;
        assert!(!reusable(&d, true) && reusable(&d, false));
        d.status = Status::Correct;
        assert!(reusable(&d, true));
    }

    #[test]
    fn the_report_gets_the_best_speedup_found_and_judged_again() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("report.json");
        std::fs::write(&path, r#"{"subject": "L2/97", "attempts": [1, 2]}"#).unwrap();
        add_rejudged(&path, 1.31, 1.18).unwrap();
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        assert_eq!(v["subject"], "L2/97");
        assert_eq!(v["attempts"], serde_json::json!([1, 2]));
        assert_eq!(
            v["best_speedup"],
            serde_json::json!({"found": 1.31, "judged_again": 1.18})
        );
        std::fs::write(&path, "not json").unwrap();
        let err = add_rejudged(&path, 1.0, 1.0).unwrap_err();
        assert!(
            format!("{err:#}").contains("is not the report JSON"),
            "{err:#}"
        );
    }

    #[test]
    fn a_cuda_graph_is_refused_where_the_forward_draws_random_numbers() {
        use mtmc_actions::dtype::{DType, TensorType};
        use mtmc_actions::graph::TensorRef;
        use mtmc_actions::op::Op;
        let t = || TensorType::new(vec![4, 8], DType::F32);
        let graph = |active: bool| {
            let mut g = OpGraph::new();
            let x = g
                .add("x", Op::Input { name: "x".into() }, &[], vec![t()])
                .unwrap();
            let d = g
                .add(
                    "drop",
                    Op::Dropout { p: 0.2, active },
                    &[TensorRef::first(x)],
                    vec![t()],
                )
                .unwrap();
            g.set_outputs(vec![TensorRef::first(d)]);
            g
        };
        let shape = Shape::plain(0, false);
        let replayed = Config::library(shape)
            .apply(Move::CudaGraph(true), shape)
            .unwrap();
        let f = build_config(&graph(true), &[], &replayed).unwrap_err();
        assert_eq!(f.stage, Stage::Refused);
        assert!(f.log.contains("`drop` draws random numbers"), "{}", f.log);
        // Dropout that changes nothing draws nothing; without the graph
        // the forward draws as torch does.
        assert!(
            build_config(&graph(false), &[], &replayed)
                .unwrap()
                .cuda_graph
        );
        let plain = build_config(&graph(true), &[], &Config::library(shape)).unwrap();
        assert!(!plain.cuda_graph);
        // The same kernels replayed are another program: another hash.
        assert_ne!(
            fragments(&build_config(&graph(false), &[], &replayed).unwrap()).0,
            fragments(&plain).0
        );
    }

    /// L2/76's graph, the problem (its code a stand-in: nothing runs it)
    /// and a judge without a GPU.
    fn l2_76() -> (OpGraph, mtmc_actions::problem::Problem, ProblemJudge) {
        let g = mtmc_actions::import::shared_graph(2, "76_Gemm_Add_ReLU").unwrap();
        let p = mtmc_actions::problem::Problem {
            level: 2,
            number: 76,
            name: "76_Gemm_Add_ReLU".into(),
            code: "class Model: pass\n".into(),
        };
        let judge = ProblemJudge::with_baselines(false, Duration::from_secs(5), true, &[], false);
        (g, p, judge)
    }

    /// An episode of L2/76 recorded by hand, as a live pass records it:
    /// each move's program, its outcome, its fragments' hash and its time.
    fn recorded_episode(
        p: &mtmc_actions::problem::Problem,
        g: &OpGraph,
        judge: &mut ProblemJudge,
        steps: &[(Move, Status, f64)],
    ) -> Vec<Taken> {
        let j = Judging::new(p, g, judge).unwrap();
        let mut e = Episode::new(j.problem.shape, 8);
        let mut taken = Vec::new();
        for &(m, status, ms) in steps {
            let next = e.target(m).unwrap();
            let (graph, regions) = j.graph(&next);
            let hash = fragments(&build_config(graph, regions, &next).unwrap()).0;
            let mut d = Diagnosis::failed_to_build("", false);
            d.status = status;
            d.speedup_eager = (status == Status::Correct).then_some(3.0 / ms);
            e.record(m, next.clone(), d.clone(), &Reward::default());
            taken.push(Taken {
                action: m.index(),
                next_state: next.key(),
                diagnosis: Some(d),
                fragment_hash: hash,
                mean_ms: (status == Status::Correct).then_some(ms),
            });
        }
        taken
    }

    #[test]
    fn an_episodes_best_program_is_built_again_from_its_recorded_moves() {
        use mtmc_planner::space::Slot;
        let (g, p, mut judge) = l2_76();
        let moves = recorded_episode(
            &p,
            &g,
            &mut judge,
            &[
                (Move::CustomKernel(Slot::All), Status::Correct, 2.0),
                (Move::Retile(512), Status::Correct, 1.5),
                (Move::Vectorize(4), Status::Incorrect, 1.0),
                (Move::Retile(128), Status::Correct, 1.8),
            ],
        );
        let (key, code) = rebuild_best(&p, &g, &mut judge, &moves).unwrap().unwrap();
        // The least time of the correct ones: the retile to 512 threads.
        assert_eq!(key, moves[1].next_state);
        assert!(key.contains("b512"), "{key}");
        assert!(code.contains("class ModelNew"), "{code}");
        // A STOP ends the walk; what follows it is not read.
        let mut stopped = moves[..1].to_vec();
        stopped.push(Taken {
            action: Move::Stop.index(),
            next_state: String::new(),
            diagnosis: None,
            fragment_hash: String::new(),
            mean_ms: None,
        });
        stopped.extend_from_slice(&moves[1..]);
        let (first, _) = rebuild_best(&p, &g, &mut judge, &stopped).unwrap().unwrap();
        assert_eq!(first, moves[0].next_state);
        // Another build that reached another program: refused.
        let mut elsewhere = moves.clone();
        elsewhere[1].next_state = "k11 b1024 v1".into();
        let err = rebuild_best(&p, &g, &mut judge, &elsewhere).unwrap_err();
        assert!(
            format!("{err:#}").contains("reached `k11 b1024 v1`; this build reaches"),
            "{err:#}"
        );
        // Other kernels for the same key (the coder changed): refused.
        let mut recoded = moves.clone();
        recoded[1].fragment_hash = "0".repeat(64);
        let err = rebuild_best(&p, &g, &mut judge, &recoded).unwrap_err();
        assert!(
            format!("{err:#}").contains("builds other kernels now"),
            "{err:#}"
        );
        // Nothing correct: no program.
        let wrong = recorded_episode(
            &p,
            &g,
            &mut judge,
            &[(Move::CustomKernel(Slot::All), Status::Incorrect, 1.0)],
        );
        assert!(rebuild_best(&p, &g, &mut judge, &wrong).unwrap().is_none());
    }

    #[test]
    fn side_by_side_rounds_judge_nothing_without_a_gpu() {
        let (_, p, mut judge) = l2_76();
        let codes = vec!["a".to_string(), "b".to_string()];
        let judged = judge_side_by_side(&p, &mut judge, &codes, 3).unwrap();
        assert_eq!(judged, vec![Vec::<f64>::new(), Vec::new()]);
    }

    fn problem() -> PlanProblem {
        PlanProblem {
            name: "L2/0".into(),
            pattern: "gemm+pointwise".into(),
            features: vec![0.0; GRAPH],
            shape: Shape::plain(3, true),
            memory_bound: true,
        }
    }

    /// The moves of one round from `e`, with `slots` in flight.
    fn round(planner: Choice, e: &Episode, slots: usize) -> Vec<(Move, Config)> {
        let p = problem();
        let prior = [0.0; ACTIONS];
        let mut loaded = planner.load(7).unwrap();
        let obs = observe(&p, e, &prior);
        let m = loaded.choose(&p, e, &obs, &e.mask());
        let next = e.target(m).unwrap();
        look_ahead(&mut loaded, &p, e, &prior, (m, next, obs), slots)
            .into_iter()
            .map(|(m, c, _)| (m, c))
            .collect()
    }

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

    #[test]
    fn the_early_stop_reads_products_against_the_split_tf32_roofline() {
        let graph = |text: &str, shapes: &str| {
            let bindings = mtmc_actions::intent::Bindings {
                shapes: mtmc_actions::intent::parse_shapes(shapes).unwrap(),
                dtype: None,
            };
            mtmc_actions::intent::compile(text, &bindings).unwrap()
        };
        // A large fp32 GEMM is compute-bound: the split-TF32 rate (164.9
        // TFLOP/s against 66.9) shortens its bound, so a program at 94 %
        // of the problem's roofline is at 38 % of this one.
        let gemm = split_tf32_scale(&graph("y = relu(x @ w)", "x=4096x4096,w=4096x4096"));
        assert!((gemm - 66.9 / (494.7 / 3.0)).abs() < 1e-3, "{gemm}");
        assert!(0.94 * gemm < 0.9);
        // Memory-bound work keeps its fraction.
        let pointwise = split_tf32_scale(&graph("y = relu(x) * 2.0", "x=4096x4096"));
        assert_eq!(pointwise, 1.0);
        // A small product is memory-bound under both rates.
        let small = split_tf32_scale(&graph("y = x @ w", "x=4096x8,w=8x8"));
        assert_eq!(small, 1.0);
    }

    #[test]
    fn a_level_filter_reads_the_level_from_the_name() {
        assert!(of_levels("L3/4_LeNet5", &[]));
        assert!(of_levels("L3/4_LeNet5", &[1, 3]));
        assert!(!of_levels("L3/4_LeNet5", &[1, 2]));
        assert!(!of_levels("L13/4_x", &[1, 3]));
        assert!(!of_levels("my_problem.py", &[1]));
        assert_eq!(levels_words(&[]), "");
        assert_eq!(levels_words(&[3]), ", level 3");
        assert_eq!(levels_words(&[1, 2]), ", levels 1, 2");
    }

    #[test]
    fn the_validation_problems_are_training_problems_set_apart_by_rule() {
        let names: Vec<String> = (1..=100)
            .flat_map(|i| [format!("L1/{i}_a"), format!("L2/{i}_b")])
            .collect();
        let test = names.iter().filter(|n| held_out(n)).count();
        let set_apart = names.iter().filter(|n| validation(n)).count();
        assert!(names.iter().all(|n| !(held_out(n) && validation(n))));
        // About a fifth each.
        assert!((20..=60).contains(&test), "{test}");
        assert!((20..=60).contains(&set_apart), "{set_apart}");
        // Validation problems are training problems: `--split train` (and
        // a training run without `--validation`) keeps them.
        let v = names.iter().find(|n| validation(n)).unwrap();
        assert!(Split::Train.keeps(v) && !Split::Test.keeps(v), "{v}");
        assert!(held_out("L2/76_Gemm_Add_ReLU") && !validation("L2/76_Gemm_Add_ReLU"));
        assert!(!held_out("L1/24_LogSoftmax") && !validation("L1/24_LogSoftmax"));
    }

    #[test]
    fn a_round_holds_distinct_legal_refinements_of_the_same_program() {
        let p = problem();
        for planner in [Choice::Random, Choice::Greedy, Choice::Exhaustive] {
            let mut e = Episode::new(p.shape, 8);
            let one = round(planner.clone(), &e, 1);
            assert_eq!(one.len(), 1);
            let four = round(planner.clone(), &e, 4);
            assert_eq!(
                four[0], one[0],
                "{planner:?}: the first move is the planner's own"
            );
            assert!(four.len() > 1, "{planner:?}: {four:?}");
            let keys: std::collections::BTreeSet<String> =
                four.iter().map(|(_, c)| c.key()).collect();
            assert_eq!(
                keys.len(),
                four.len(),
                "{planner:?}: a program twice: {four:?}"
            );
            let mask = e.mask();
            for (m, c) in &four {
                // Step 0: operator-level moves only, each legal from the start.
                assert!(mask[m.index()] && m.operator_level(), "{planner:?}: {m:?}");
                assert_eq!(e.target(*m).as_ref(), Some(c));
            }
            // Once the first program is recorded, the next round does not
            // repeat any program of this one that was recorded.
            let (m, c) = four[0].clone();
            e.record(
                m,
                c.clone(),
                Diagnosis::failed_to_build("", true),
                &Reward::default(),
            );
            let again = round(planner.clone(), &e, 4);
            assert!(again.iter().all(|(_, k)| k.key() != c.key()), "{planner:?}");
        }
    }
}

//! A planned search on one problem: an episode whose moves edit the
//! program's configuration, several candidates judged per round.

use std::path::Path;

use anyhow::{Result, bail};
use mtmc_actions::device::{builtin_devices, find_device};
use mtmc_actions::graph::OpGraph;
use mtmc_env::outcome::{Outcome, Status};
use mtmc_planner::episode::{Episode, Reward};
use mtmc_planner::features::{Problem as PlanProblem, observe};
use mtmc_planner::space::{ACTIONS, Config, Move, REWRITTEN};
use mtmc_planner::store::{StepRecord, Store, Taken, now};

use super::choice::Loaded;
use super::counted;
use super::judging::{
    Judging, Prepared, Reuse, ToJudge, build_config, fragments, judge_round, rewritten_of,
};
use super::split::Split;
use crate::optimize::{ProblemJudge, conclude, problem_source, write_model_new};
use crate::steps::{Found, Proposal};

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
fn split_tf32_scale(g: &OpGraph, spec: &mtmc_actions::device::DeviceSpec) -> f64 {
    use mtmc_actions::device::{MathMode, roofline};
    let problem = roofline(g, spec, MathMode::default()).time_s;
    let split = MathMode {
        split_tf32: true,
        ..MathMode::default()
    };
    let bound = roofline(g, spec, split).time_s;
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

/// This machine's GPUs as the driver reports them, probed once for a
/// command: whether there are any (else programs are compiled only), and
/// the names a store that records their outcomes is claimed for.
pub struct Gpus(Option<mtmc_env::probe::Driver>);

impl Gpus {
    /// Asks the driver; no driver, or one that does not start, is no GPU.
    /// On a cluster ([`crate::cluster`]), the GPU its workers judge on.
    pub fn probe() -> Gpus {
        match crate::cluster::gpu() {
            Some(name) => Gpus::named(&name),
            None => Gpus(mtmc_env::probe::driver().ok()),
        }
    }

    /// One GPU known by its driver's name alone (a cluster's workers').
    fn named(name: &str) -> Gpus {
        Gpus(Some(crate::cluster::driver_named(name)))
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
    let j = Judging::new(p, g, judge)?;
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
        match judge.in_flight() {
            1 => String::new(),
            n => format!(", {n} in flight (one per GPU)"),
        }
    )?;
    let source = j.source.clone();
    let mut episode = EpisodePlanner {
        e: Episode::new(problem.shape, settings.budget),
        j,
        planner,
        settings,
        store: store.as_deref_mut(),
        episode_id,
        prior,
        reward: Reward::default(),
        stop_scale: split_tf32_scale(g, &judge.spec),
        slots: judge.in_flight(),
        bests: Vec::new(),
        pending: None,
        dropped: 0,
    };
    let stopped = judge.stop_flag();
    let found = crate::steps::run(out, &mut episode, &stopped, |round| {
        judge_round(judge, &source, &p.code, round)
    })?;
    let EpisodePlanner {
        e,
        j,
        bests,
        dropped,
        ..
    } = episode;
    let interrupted = found.interrupted;
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
        j.rejudge_best(judge, &found)?
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
    let wrote = match out_dir {
        Some(dir) => {
            let graph = rewritten.map_or(g, |r| &*r.graph);
            conclude(out, dir, &p.full_name(), found, graph, |program| {
                write_model_new(dir, graph, program, &p.code, rewritten.is_some())
            })?
        }
        None => found.best.is_some(),
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

/// A planned episode as the search loop's planner: each round is the
/// planner's move and the moves it would make next (up to one per worker),
/// their programs built or their outcomes taken from the store; each step
/// is printed and recorded, and the episode stops near the roofline.
struct EpisodePlanner<'a, 'b> {
    j: Judging<'a>,
    e: Episode,
    planner: &'b mut Loaded,
    settings: &'b PlanSettings,
    store: Option<&'b mut Store>,
    episode_id: Option<i64>,
    prior: [f32; ACTIONS],
    reward: Reward,
    /// [`split_tf32_scale`] of the problem on the judge's GPU.
    stop_scale: f64,
    /// Programs in flight at once (one per worker).
    slots: usize,
    /// The best speedup after each evaluation.
    bests: Vec<f64>,
    /// The round in flight.
    pending: Option<Pending>,
    /// The programs of the round a signal dropped.
    dropped: usize,
}

/// A round in flight: its moves (with their observations), what was asked
/// of the judging, what it knew before judging, the state it left and when
/// it started.
struct Pending {
    round: Vec<(Move, Config, Vec<f32>)>,
    asked: Vec<(Move, Config, String)>,
    prepared: Prepared,
    state: String,
    started: f64,
}

impl crate::steps::Planner for EpisodePlanner<'_, '_> {
    type Candidate = ToJudge;

    fn done(&self) -> bool {
        self.e.done
    }

    fn propose(
        &mut self,
        out: &mut dyn std::io::Write,
        _found: &mut Found,
        _stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<ToJudge>> {
        let (j, e, settings) = (&mut self.j, &mut self.e, self.settings);
        let started = now();
        let obs = observe(&j.problem, e, &self.prior);
        let mask = e.mask();
        let m = self.planner.choose(&j.problem, e, &obs, &mask);
        if settings.verbose
            && let Some(c) = self.planner.considered()
        {
            writeln!(out, "  weighed for step {}: {}", e.step + 1, c.text())?;
        }
        let state = e.config.key();
        let target = e.target(m).filter(|_| m != Move::Stop && mask[m.index()]);
        let Some(next) = target else {
            let r = e.stop();
            if let (Some(s), Some(id)) = (self.store.as_deref_mut(), self.episode_id) {
                s.add_step(
                    &j.problem,
                    &self.planner.version,
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
            return Ok(Proposal::Done);
        };
        let slots = self.slots.min(e.max_steps - e.step);
        let round = look_ahead(
            self.planner,
            &j.problem,
            e,
            &self.prior,
            (m, next, obs),
            slots,
        );
        let asked: Vec<(Move, Config, String)> = round
            .iter()
            .map(|(m, next, _)| (*m, next.clone(), format!("{} -> {}", m.label(), next.key())))
            .collect();
        let reuse = Reuse::of(
            self.store.as_deref(),
            settings.reuse,
            settings.rejudge_changed,
        );
        let (prepared, to_judge) = j.prepare(reuse, &asked)?;
        self.pending = Some(Pending {
            round,
            asked,
            prepared,
            state,
            started,
        });
        Ok(Proposal::Judge(to_judge))
    }

    fn judged(
        &mut self,
        out: &mut dyn std::io::Write,
        found: &mut Found,
        round: Vec<(ToJudge, Outcome)>,
    ) -> Result<()> {
        let Pending {
            round: moves,
            asked,
            prepared,
            state,
            started,
        } = self
            .pending
            .take()
            .expect("an outcome follows a proposed round");
        let judged = self.j.finish(found, prepared, &asked, round);
        let e = &mut self.e;
        for ((ev, (m, next, obs)), (_, _, label)) in judged.into_iter().zip(moves).zip(&asked) {
            let text = ev.diagnosis.text();
            let r = e.record(m, next.clone(), ev.diagnosis.clone(), &self.reward);
            self.bests.push(e.best_speedup());
            writeln!(
                out,
                "  step {}: {label}: {text} (reward {r:+.3}, best {:.3}x)",
                e.step,
                e.best_speedup()
            )?;
            if self.settings.verbose && ev.diagnosis.status != Status::Correct {
                let why = match &ev.outcome {
                    Some(o) => o.why.as_deref().or(o.error.as_deref()),
                    None => ev.failure.as_deref(),
                };
                if let Some(line) = why.and_then(|w| w.lines().next()) {
                    writeln!(out, "    {line}")?;
                }
            }
            if let (Some(s), Some(id)) = (self.store.as_deref_mut(), self.episode_id) {
                s.add_step(
                    &self.j.problem,
                    &self.planner.version,
                    &ev.step(id, e, state.clone(), obs, m, &next, r, started)?,
                )?;
            }
        }
        let near = e
            .best
            .as_ref()
            .and_then(|b| b.diagnosis.roofline)
            .is_some_and(|f| f * self.stop_scale >= self.settings.near_roofline);
        if near && !e.done {
            writeln!(
                out,
                "  the best program is within reach of the roofline: stop"
            )?;
            e.stop();
        }
        Ok(())
    }

    fn dropped(
        &mut self,
        _out: &mut dyn std::io::Write,
        _found: &mut Found,
        _round: Vec<ToJudge>,
    ) -> Result<()> {
        if let Some(p) = self.pending.take() {
            self.dropped = p.prepared.built();
        }
        Ok(())
    }
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

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use mtmc_planner::critique::Diagnosis;
    use mtmc_planner::features::GRAPH;
    use mtmc_planner::space::Shape;

    use super::*;
    use crate::plan::Choice;

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
        let specs = builtin_devices();
        let h100 = find_device(&specs, "H100").unwrap().clone();
        let judge = ProblemJudge::with_baselines(false, Duration::from_secs(5), true, &[], false)
            .on_spec(h100);
        (g, p, judge)
    }

    /// The planner's view of a problem is computed for the GPU the judge
    /// judges on: L2/76 under the H100's spec and under the H200's, each
    /// the features that spec gives.
    #[test]
    fn the_planner_reads_the_spec_of_the_gpu_it_judges_on() {
        let (g, p, _) = l2_76();
        let specs = builtin_devices();
        let mut seen = Vec::new();
        for name in ["H100", "H200"] {
            let spec = find_device(&specs, name).unwrap().clone();
            let judge =
                ProblemJudge::with_baselines(false, Duration::from_secs(5), true, &[], false)
                    .on_spec(spec.clone());
            let j = Judging::new(&p, &g, &judge).unwrap();
            let own = PlanProblem::new(&p.full_name(), &g, j.regions.len(), &spec);
            assert_eq!(j.problem.features, own.features, "{name}");
            assert_eq!(j.problem.memory_bound, own.memory_bound, "{name}");
            seen.push(judge.spec.name.clone());
        }
        assert_eq!(seen, ["H100", "H200"]);
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
        let specs = builtin_devices();
        let h100 = find_device(&specs, "H100").unwrap();
        let gemm = split_tf32_scale(&graph("y = relu(x @ w)", "x=4096x4096,w=4096x4096"), h100);
        assert!((gemm - 66.9 / (494.7 / 3.0)).abs() < 1e-3, "{gemm}");
        assert!(0.94 * gemm < 0.9);
        // Memory-bound work keeps its fraction.
        let pointwise = split_tf32_scale(&graph("y = relu(x) * 2.0", "x=4096x4096"), h100);
        assert_eq!(pointwise, 1.0);
        // A small product is memory-bound under both rates.
        let small = split_tf32_scale(&graph("y = x @ w", "x=4096x8,w=8x8"), h100);
        assert_eq!(small, 1.0);
        // The scale is the GPU's own: the H200's FLOP rates are the
        // H100's, so a compute-bound product scales alike.
        let h200 = find_device(&specs, "H200").unwrap();
        let gemm_h200 =
            split_tf32_scale(&graph("y = relu(x @ w)", "x=4096x4096,w=4096x4096"), h200);
        assert!((gemm_h200 - gemm).abs() < 1e-9, "{gemm_h200}");
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

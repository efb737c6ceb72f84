//! Building a configuration's program fragment by fragment and judging
//! it, a round of candidates at a time, with recorded outcomes reused.

use anyhow::Result;
use mtmc_actions::device::builtin_devices;
use mtmc_actions::graph::OpGraph;
use mtmc_coder::action::Params;
use mtmc_coder::program::Program;
use mtmc_coder::session::Stage;
use mtmc_coder::template::{TemplateCoder, product};
use mtmc_env::outcome::{Outcome, Status};
use mtmc_planner::critique::Diagnosis;
use mtmc_planner::episode::Episode;
use mtmc_planner::features::Problem as PlanProblem;
use mtmc_planner::space::{Config, Move, REWRITTEN};
use mtmc_planner::store::{StepRecord, Store};

use crate::optimize::{Gemm, ProblemJudge, build, judge_programs, problem_source, regions};
use crate::steps::Found;

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
    pub(super) fn of(store: Option<&'s Store>, reuse: bool, changed: bool) -> Reuse<'s> {
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
pub(super) fn reusable(recorded: &Diagnosis, gpu: bool) -> bool {
    !(gpu && recorded.status == Status::CompiledOnly)
}

/// Whether a recorded outcome is a failure while the program ran (a
/// runtime error, a timeout, a crashed worker) rather than a verdict on
/// its code: what `rejudge --failed` judges again.
pub(super) fn failed_running(recorded: &Diagnosis) -> bool {
    matches!(
        recorded.status,
        Status::RuntimeError | Status::Timeout | Status::Crashed
    )
}

/// A step's program: judged before (its recorded diagnosis) or built now.
pub(super) enum Known {
    Recorded(Diagnosis),
    Built(Result<Program, mtmc_coder::session::Failure>),
    /// Built, its program handed to the judge (the round's next
    /// [`ToJudge`]).
    Judging,
}

/// A program of a round for the judge: the graph it is built from and the
/// label its line gives.
pub(crate) struct ToJudge {
    pub(super) graph: std::sync::Arc<OpGraph>,
    pub(super) program: Program,
    pub(super) label: String,
}

/// A round as [`Judging::prepare`] leaves it: per configuration asked,
/// what the store gave, why it did not build, or that it is being judged.
pub(super) struct Prepared {
    known: Vec<Known>,
}

impl Prepared {
    /// The configurations built now (judged, or failed to build).
    pub(super) fn built(&self) -> usize {
        self.known
            .iter()
            .filter(|k| !matches!(k, Known::Recorded(_)))
            .count()
    }
}

/// Judges the programs of a round together, one per worker (GPU) at a
/// time: an outcome each, in order.
pub(crate) fn judge_round(
    judge: &mut ProblemJudge,
    source: &mtmc_env::evaluator::ProblemSource,
    code: &str,
    round: &[ToJudge],
) -> Result<Vec<Outcome>> {
    let programs: Vec<(&OpGraph, &Program, String)> = round
        .iter()
        .map(|t| (&*t.graph, &t.program, t.label.clone()))
        .collect();
    judge_programs(judge, source, code, &programs, &builtin_devices())
}

/// Builds configuration `c` of graph `g` cut into `regions`.
pub(super) fn build_config(
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
    // A replay runs the captured kernels again and nothing else.
    let no_replay = |n: &mtmc_actions::graph::Node| {
        if n.op.draws_random() {
            Some(
                "draws random numbers, and the warm-up run before a capture would draw before the forward does (its numbers would differ from torch's for the same seed)",
            )
        } else if n.op.is_untraced() {
            Some(
                "is a submodule run as its own Python forward (the trace could not follow it), and a replay would not run its Python again",
            )
        } else {
            None
        }
    };
    if c.cuda_graph
        && let Some((n, why)) = g
            .nodes()
            .find_map(|(_, n)| no_replay(n).map(|why| (n, why)))
    {
        return Err(mtmc_coder::session::Failure {
            action: mtmc_coder::action::Action::kernel_for(Vec::new(), params),
            stage: Stage::Refused,
            fragment: None,
            log: format!("no CUDA graph: `{}` {why}", n.name),
        });
    }
    build(g, &chosen, params, c.fuse, gemm, TemplateCoder, false).map(|(mut p, _)| {
        p.cuda_graph = c.cuda_graph;
        p
    })
}

/// The SHA-256 of a program's fragments and their concatenated code.
pub(super) fn fragments(program: &Program) -> (String, String) {
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

/// A judged (or recalled) configuration.
pub(super) struct Evaluated {
    pub(super) diagnosis: Diagnosis,
    /// The outcome, when it was judged now.
    pub(super) outcome: Option<Outcome>,
    /// SHA-256 of its fragments (empty when nothing was built now).
    pub(super) hash: String,
    /// Its fragments' code.
    code: String,
    /// Why it was not built (the first line of the coder's or compiler's
    /// log), when it was not.
    pub(super) failure: Option<String>,
    /// Its diagnosis is the store's (nothing was built or judged now).
    pub(super) reused: bool,
}

impl Evaluated {
    /// The store's row for the step that evaluated `next` from `state`,
    /// recorded in episode `e` (whose step count already includes it).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn step(
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
pub(super) struct Rewritten {
    pub(super) graph: std::sync::Arc<OpGraph>,
    regions: Vec<Vec<u32>>,
    /// The rewrites that changed it.
    pub(super) names: Vec<&'static str>,
}

/// One problem's judging: its setup (made once per episode), and every
/// attempt with the best program so far for the searches that judge a round
/// at a time themselves ([`Judging::evaluate`], `rejudge`).
pub(super) struct Judging<'a> {
    p: &'a mtmc_actions::problem::Problem,
    g: std::sync::Arc<OpGraph>,
    /// Regions for kernels (none where an op has no family: every move is
    /// then a library call).
    pub(super) regions: Vec<Vec<u32>>,
    /// The rewritten graphs of `space::REWRITTEN`, where they exist.
    pub(super) rewritten: Vec<Option<Rewritten>>,
    /// The graph the best program so far is built from (`Config::graph`).
    pub(super) best_graph: u8,
    pub(super) problem: PlanProblem,
    pub(super) source: mtmc_env::evaluator::ProblemSource,
    /// Whether the judge runs programs on a GPU (else it compiles them).
    gpu: bool,
    pub(super) found: Found,
    /// Recorded programs judged again because their code changed.
    pub(super) changed: usize,
    /// Judge again, rather than take, a recorded outcome that failed while
    /// the program ran ([`failed_running`]).
    pub(super) retry_failed: bool,
    /// Programs built ahead ([`Judging::prebuild`]), by key, each taken
    /// by the first build of its configuration.
    built: std::collections::HashMap<String, Built>,
}

/// A configuration's program, or why the coder could not build it.
type Built = Result<Program, mtmc_coder::session::Failure>;

impl<'a> Judging<'a> {
    pub(super) fn new(
        p: &'a mtmc_actions::problem::Problem,
        g: &OpGraph,
        judge: &ProblemJudge,
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
                        graph: std::sync::Arc::new(graph),
                        regions,
                        names,
                    })
                });
            rewritten.push(next);
        }
        let mut problem = PlanProblem::new(&p.full_name(), g, traced.len(), &judge.spec);
        problem.shape.products = g.nodes().any(|(_, n)| product(&n.op));
        for (slot, r) in problem.shape.rewritten.iter_mut().zip(&rewritten) {
            *slot = r.as_ref().and_then(|r| u16::try_from(r.regions.len()).ok());
        }
        Ok(Judging {
            p,
            g: std::sync::Arc::new(g.clone()),
            regions: traced,
            rewritten,
            best_graph: 0,
            problem,
            source,
            gpu: judge.gpu,
            found: Found::default(),
            changed: 0,
            retry_failed: false,
            built: std::collections::HashMap::new(),
        })
    }

    /// Builds `configs` ahead, on every core: building compiles each
    /// fragment with NVRTC, which on a walk over a problem's recorded
    /// programs would otherwise take as long as judging them.
    pub(super) fn prebuild(&mut self, configs: &[Config]) {
        let threads = std::thread::available_parallelism()
            .map_or(1, std::num::NonZeroUsize::get)
            .min(configs.len());
        if threads < 2 {
            return;
        }
        let (g, regions, rewritten) = (&*self.g, &self.regions, &self.rewritten);
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
    pub(super) fn graph(&self, c: &Config) -> (&OpGraph, &[Vec<u32>]) {
        graph_of(&self.g, &self.regions, &self.rewritten, c)
    }

    /// The graph configuration `c` is built from, shared.
    fn graph_shared(&self, c: &Config) -> std::sync::Arc<OpGraph> {
        rewritten_of(&self.rewritten, c.graph).map_or_else(|| self.g.clone(), |r| r.graph.clone())
    }

    /// The graph the best program so far is built from.
    pub(super) fn best_graph(&self) -> &OpGraph {
        rewritten_of(&self.rewritten, self.best_graph).map_or(&self.g, |r| &r.graph)
    }

    /// Builds `next` and says whether this build writes the code its
    /// recorded outcome `d` in `store` was judged with (a program that
    /// failed to build matches a recorded compile error without a hash).
    pub(super) fn same_code(
        &mut self,
        store: &Store,
        next: &Config,
        d: &Diagnosis,
    ) -> Result<(bool, Built)> {
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

    /// The best program of `found` (this problem's) judged once more: its
    /// speedup against eager (none without a GPU or a correct program; 0
    /// when it is not correct again).
    pub(super) fn rejudge_best(
        &self,
        judge: &mut ProblemJudge,
        found: &Found,
    ) -> Result<Option<f64>> {
        let Some((_, program, _, _)) = &found.best else {
            return Ok(None);
        };
        if !self.gpu {
            return Ok(None);
        }
        let o = judge_programs(
            judge,
            &self.source,
            &self.p.code,
            &[(self.best_graph(), program, "the best, again".into())],
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

    /// Builds configurations (each `next` reached by its move `m`, with a
    /// label), or takes their recorded outcomes from `reuse`: what the
    /// round knows, and the programs to judge, in the order asked.
    pub(super) fn prepare(
        &mut self,
        reuse: Reuse<'_>,
        asked: &[(Move, Config, String)],
    ) -> Result<(Prepared, Vec<ToJudge>)> {
        let mut known = Vec::new();
        for (_, next, _) in asked {
            let recorded = match reuse {
                Reuse::Recorded(s) | Reuse::Unchanged(s) => {
                    s.evaluation(&self.problem.name, &next.key())?
                }
                Reuse::Nothing => None,
            }
            .filter(|d| reusable(d, self.gpu) && !(self.retry_failed && failed_running(d)));
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
        let mut round = Vec::new();
        for (k, (_, next, label)) in known.iter_mut().zip(asked) {
            if matches!(k, Known::Built(Ok(_))) {
                let Known::Built(Ok(program)) = std::mem::replace(k, Known::Judging) else {
                    unreachable!("a built program")
                };
                round.push(ToJudge {
                    graph: self.graph_shared(next),
                    program,
                    label: label.clone(),
                });
            }
        }
        Ok((Prepared { known }, round))
    }

    /// The round's evaluations, in the order asked, from what
    /// [`Judging::prepare`] knew and the outcomes of the programs it gave
    /// the judge (already counted in `found.judged` and `found.correct`).
    /// Every attempt and (when best) the program are kept in `found`.
    pub(super) fn finish(
        &mut self,
        found: &mut Found,
        prepared: Prepared,
        asked: &[(Move, Config, String)],
        judged: Vec<(ToJudge, Outcome)>,
    ) -> Vec<Evaluated> {
        let mut outcomes = judged.into_iter();
        let mut done = Vec::new();
        for (k, (m, next, _)) in prepared.known.into_iter().zip(asked) {
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
                Known::Built(Ok(_)) => unreachable!("a built program is handed to the judge"),
                Known::Judging => {
                    let (t, o) = outcomes.next().expect("an outcome per program judged");
                    let d = Diagnosis::of(&o, self.problem.bound());
                    let (hash, code) = fragments(&t.program);
                    if keep_best(found, &t.program, &o, next) {
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
        done
    }

    /// A round judged here, for `rejudge`, which walks recorded programs
    /// itself: [`Judging::prepare`], the programs judged
    /// together, [`Judging::finish`] into `self.found`. Once the judge's
    /// stop is asked for, the round keeps nothing ([`Round::Dropped`]).
    pub(super) fn evaluate(
        &mut self,
        judge: &mut ProblemJudge,
        reuse: Reuse<'_>,
        asked: &[(Move, Config, String)],
    ) -> Result<Round> {
        if judge.stop_requested() {
            return Ok(Round::Dropped(0));
        }
        let (prepared, round) = self.prepare(reuse, asked)?;
        let judged = judge_round(judge, &self.source, &self.p.code, &round);
        if judge.stop_requested() {
            // The signal reaches the workers too (one process group): what
            // this round judged may be their end, not the code's.
            return Ok(Round::Dropped(prepared.built()));
        }
        let outcomes = judged?;
        let mut found = std::mem::take(&mut self.found);
        for o in &outcomes {
            found.judged += 1;
            found.correct += usize::from(o.status == Status::Correct);
        }
        let done = self.finish(
            &mut found,
            prepared,
            asked,
            round.into_iter().zip(outcomes).collect(),
        );
        self.found = found;
        Ok(Round::Judged(done))
    }
}

/// What a round of [`Judging::evaluate`] gave.
pub(super) enum Round {
    /// Each configuration's evaluation, in the order asked.
    Judged(Vec<Evaluated>),
    /// Nothing kept: a stop was asked for before or while the round was
    /// judged. Holds how many of its programs were built for judging (not
    /// taken from the store).
    Dropped(usize),
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
pub(super) fn rewritten_of(rewritten: &[Option<Rewritten>], graph: u8) -> Option<&Rewritten> {
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

#[cfg(test)]
mod tests {
    use super::*;
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

    #[test]
    fn a_cuda_graph_is_refused_where_a_submodule_runs_as_its_own_python() {
        use mtmc_actions::dtype::{DType, TensorType};
        use mtmc_actions::graph::TensorRef;
        use mtmc_actions::op::{CallArg, CallKind, Op, OpaqueCall};
        let t = || TensorType::new(vec![4, 8], DType::F32);
        let graph = |untraced: bool| {
            let mut g = OpGraph::new();
            let x = g
                .add("x", Op::Input { name: "x".into() }, &[], vec![t()])
                .unwrap();
            let call = OpaqueCall {
                kind: CallKind::Module,
                target: "gate".into(),
                args: vec![CallArg::Input(0)],
                kwargs: vec![],
                untraced,
            };
            let op = Op::Opaque {
                target: "Gate `gate`".into(),
                reason: "its forward branches on a value".into(),
                call: Some(Box::new(call)),
            };
            let o = g
                .add("gate", op, &[TensorRef::first(x)], vec![t()])
                .unwrap();
            g.set_outputs(vec![TensorRef::first(o)]);
            g
        };
        let shape = Shape::plain(0, false);
        let replayed = Config::library(shape)
            .apply(Move::CudaGraph(true), shape)
            .unwrap();
        let f = build_config(&graph(true), &[], &replayed).unwrap_err();
        assert_eq!(f.stage, Stage::Refused);
        assert!(
            f.log
                .contains("`gate` is a submodule run as its own Python forward"),
            "{}",
            f.log
        );
        // A library call the trace followed is captured like any kernel.
        assert!(
            build_config(&graph(false), &[], &replayed)
                .unwrap()
                .cuda_graph
        );
        assert!(
            !build_config(&graph(true), &[], &Config::library(shape))
                .unwrap()
                .cuda_graph
        );
    }
}

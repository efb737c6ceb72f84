//! Judging a KernelBench problem's programs: exported as `ModelNew` files
//! and run by the worker (the pool across GPUs), or compiled only without
//! a GPU.

use std::path::Path;
use std::time::Duration;

use anyhow::Result;
use mtmc_actions::device::{DeviceSpec, builtin_devices, find_device};
use mtmc_actions::graph::OpGraph;
use mtmc_coder::program::Program;
use mtmc_env::evaluator::{Candidate, ProblemSource, WorkerSettings};
use mtmc_env::outcome::{EvaluatorKind, Outcome, Status};
use mtmc_env::pool::WorkerPool;

use super::write;
use crate::interrupt::Interrupt;
use crate::screen::{Screening, promoted, screened_out};

/// Judges a KernelBench problem's programs: as exported `ModelNew` files by
/// persistent workers (kept across problems; one per GPU when the machine
/// has several, so that several candidates are in flight at once), or by
/// compile only when the machine has no GPU.
pub struct ProblemJudge {
    pub(crate) gpu: bool,
    /// Strict mode: every op in a custom kernel, and the worker fails a
    /// candidate whose forward computes with torch.
    pub(crate) strict: bool,
    runtime: tokio::runtime::Runtime,
    pool: WorkerPool,
    /// A stop asked for by a signal: the searches read it between rounds
    /// (a planner's) or variants (the template coder's) and keep nothing
    /// of the one it came during.
    stop: Option<Interrupt>,
    /// The GPU it judges on ([`spec_of`]): what the planner's features,
    /// the critique's bound and the early stop read.
    pub(crate) spec: DeviceSpec,
    /// Screen the programs of a round before the full protocol
    /// ([`crate::screen`]).
    screening: Option<Screening>,
    /// The fastest screen of each problem so far, ms a call, by name.
    fastest_screen: std::collections::HashMap<String, f64>,
    /// Programs screened, and of them given the full protocol.
    pub(crate) screened: usize,
    pub(crate) promoted: usize,
}

/// The spec of the GPU a run judges on, from the driver it probed (`None`:
/// none answered): GPU 0's built-in table entry, by the driver's name for
/// it. Where there is no GPU (programs are only compiled; the shipped tree
/// is the H100's) or the table has no entry for it, the H100's, with a line
/// on stderr for the second.
pub(crate) fn spec_of(driver: Option<&mtmc_env::probe::Driver>) -> DeviceSpec {
    let specs = builtin_devices();
    let h100 = || {
        find_device(&specs, "H100")
            .cloned()
            .unwrap_or_else(|| specs[0].clone())
    };
    match driver.and_then(|d| d.gpus.first()) {
        Some(g) => find_device(&specs, &g.name).cloned().unwrap_or_else(|| {
            eprintln!(
                "mtmc: no built-in spec for the GPU `{}`: the planner reads the H100's",
                g.name
            );
            h100()
        }),
        None => h100(),
    }
}

/// The spec of the GPU this run judges on: the cluster's workers' where it
/// judges on a cluster, else [`spec_of`] this machine's `driver`.
pub(crate) fn run_spec(driver: Option<&mtmc_env::probe::Driver>) -> DeviceSpec {
    match crate::cluster::gpu() {
        Some(g) => spec_of(Some(&crate::cluster::driver_named(&g))),
        None => spec_of(driver),
    }
}

impl ProblemJudge {
    /// A judge; `cache_baselines` reads eager and torch.compile timings from
    /// the cache instead of timing them in this run.
    /// `strict` keeps every op in a custom kernel (see [`ProblemJudge::strict`]).
    pub fn new(gpu: bool, timeout: Duration, cache_baselines: bool, strict: bool) -> ProblemJudge {
        ProblemJudge::with_baselines(gpu, timeout, cache_baselines, &["eager", "compile"], strict)
    }

    /// A judge timing only `baselines` (exploration needs eager alone).
    pub fn with_baselines(
        gpu: bool,
        timeout: Duration,
        cache_baselines: bool,
        baselines: &[&str],
        strict: bool,
    ) -> ProblemJudge {
        let settings = WorkerSettings {
            strict,
            baselines: baselines.iter().map(|b| b.to_string()).collect(),
            baseline_cache: if cache_baselines {
                crate::source::cache_dir().map(|d| d.join("baselines"))
            } else {
                None
            },
            limit: timeout,
            ..WorkerSettings::default()
        };
        // On a cluster, its workers judge, and their GPU is the run's.
        if let Some(cluster) = crate::cluster::shared() {
            return ProblemJudge::over(
                true,
                strict,
                WorkerPool::on_cluster(cluster, &settings),
                run_spec(None),
            );
        }
        // One worker per GPU when there are several; otherwise one worker
        // that sees what the machine has.
        let driver = mtmc_env::probe::driver().ok();
        let gpus = match &driver {
            Some(d) if gpu && d.gpus.len() > 1 => (0..d.gpus.len() as u32).collect(),
            _ => Vec::new(),
        };
        ProblemJudge::over(
            gpu,
            strict,
            WorkerPool::new(&gpus, &settings),
            spec_of(driver.as_ref()),
        )
    }

    /// A judge over `pool`, reading `spec` as its GPU's.
    fn over(gpu: bool, strict: bool, pool: WorkerPool, spec: DeviceSpec) -> ProblemJudge {
        ProblemJudge {
            gpu,
            strict,
            runtime: tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a current-thread runtime starts"),
            pool,
            stop: None,
            spec,
            screening: None,
            fastest_screen: std::collections::HashMap::new(),
            screened: 0,
            promoted: 0,
        }
    }

    /// A judge whose one worker runs on the CPU with `python` (tests: the
    /// real judge, timed by the host clock), judging as on a GPU.
    #[cfg(test)]
    pub(crate) fn on_cpu_worker(
        python: std::ffi::OsString,
        settings: WorkerSettings,
    ) -> ProblemJudge {
        let settings = WorkerSettings {
            cpu: true,
            ..settings
        };
        let slot = mtmc_env::worker::WorkerSlot::with_interpreter(python, None);
        let pool = WorkerPool::from_slots(vec![slot], &settings);
        ProblemJudge::over(true, false, pool, builtin_devices()[0].clone())
    }

    /// The judge, screening the programs of each round first (none: the
    /// full protocol for every one). Only judging on a GPU screens.
    pub fn screening(mut self, screening: Option<Screening>) -> ProblemJudge {
        self.screening = screening;
        self
    }

    /// Screens `candidates`, then gives the full protocol to those within
    /// the margin of their problem's fastest screen: each one's outcome,
    /// the full protocol's or its screen's ([`screened_out`] where it passed
    /// and was not promoted), in order.
    fn judge_screened(
        &mut self,
        problem: &ProblemSource,
        candidates: Vec<Candidate>,
        s: Screening,
    ) -> Result<Vec<Outcome>> {
        self.pool.set_screen(Some(s.calls));
        let screens = self.judge_python(problem, candidates.clone());
        self.pool.set_screen(None);
        let screens = screens?;
        let before = self.fastest_screen.get(&problem.name).copied();
        let (chosen, fastest) = promoted(&screens, before, s.margin);
        if let Some(f) = fastest {
            self.fastest_screen.insert(problem.name.clone(), f);
        }
        let again: Vec<Candidate> = candidates
            .into_iter()
            .zip(&chosen)
            .filter_map(|(c, &go)| go.then_some(c))
            .collect();
        self.screened += screens.len();
        self.promoted += again.len();
        let mut full = self.judge_python(problem, again)?.into_iter();
        Ok(screens
            .into_iter()
            .zip(chosen)
            .map(|(o, go)| {
                if go {
                    let mut f = full.next().expect("an outcome per promoted screen");
                    f.wall_seconds += o.wall_seconds;
                    f
                } else {
                    match fastest {
                        Some(fastest) => screened_out(o, fastest, s.margin),
                        None => o,
                    }
                }
            })
            .collect())
    }

    /// The judge, reading `spec` as the GPU it judges on (where a run
    /// names one, and in tests).
    pub fn on_spec(mut self, spec: DeviceSpec) -> ProblemJudge {
        self.spec = spec;
        self
    }

    /// The judge, stopping the searches it judges for on `stop`.
    pub fn stopping_on(mut self, stop: &Interrupt) -> ProblemJudge {
        self.stop = Some(stop.clone());
        self
    }

    /// Whether a stop was asked for.
    pub(crate) fn stop_requested(&self) -> bool {
        self.stop.as_ref().is_some_and(Interrupt::requested)
    }

    /// Whether a stop was asked for, read apart from the judge (for a
    /// search that lends the judge to its judging closure).
    pub(crate) fn stop_flag(&self) -> impl Fn() -> bool + 'static {
        let stop = self.stop.clone();
        move || stop.as_ref().is_some_and(Interrupt::requested)
    }

    /// Judges one candidate of `problem`: the Python program `code`
    /// (a `ModelNew`), labelled `name` in the worker's messages.
    pub(crate) fn judge_code(
        &mut self,
        problem: &ProblemSource,
        name: String,
        code: String,
    ) -> Result<Outcome> {
        let candidate = Candidate::Python { name, code };
        let mut results = self
            .runtime
            .block_on(self.pool.evaluate_all(problem, vec![candidate]));
        Ok(results.remove(0).result?)
    }

    /// Judges Python `ModelNew`s at once, each on whichever worker (GPU)
    /// is free first: their outcomes, in their order.
    pub(crate) fn judge_python(
        &mut self,
        problem: &ProblemSource,
        candidates: Vec<Candidate>,
    ) -> Result<Vec<Outcome>> {
        self.runtime
            .block_on(self.pool.evaluate_all(problem, candidates))
            .into_iter()
            .map(|d| Ok(d.result?))
            .collect()
    }

    /// Candidates judged at once: one per worker (GPU).
    pub fn in_flight(&self) -> usize {
        if self.gpu { self.pool.slots() } else { 1 }
    }
}

/// Writes `program` of graph `g` (the rewritten one when `rewritten`) as
/// the `ModelNew` of the problem with PyTorch code `code`, to
/// `dir/model_new.py`; names what it wrote.
pub(crate) fn write_model_new(
    dir: &Path,
    g: &OpGraph,
    program: &Program,
    code: &str,
    rewritten: bool,
) -> Result<&'static str> {
    let text = mtmc_coder::export::to_model_new(g, program, code).map_err(anyhow::Error::msg)?;
    write(dir, "model_new.py", &text)?;
    Ok(if rewritten {
        "model_new.py (rewritten graph)"
    } else {
        "model_new.py"
    })
}

/// The problem as the worker takes it; an error when its code is missing
/// (a built-in trace only), which a ModelNew needs. Every command but
/// `optimize` checks its problems before it starts.
pub(crate) fn problem_source(p: &mtmc_actions::problem::Problem) -> Result<ProblemSource> {
    crate::source::require_code("optimize", &[p])?;
    Ok(ProblemSource {
        name: format!("{}.py", p.name),
        code: p.code.clone(),
        graph: None,
    })
}

/// Judges one program of problem `code`'s graph `g`: as an exported
/// `ModelNew` by the worker, or (no GPU) as compiled, since every fragment
/// compiled when it was proposed.
pub(crate) fn judge_program(
    judge: &mut ProblemJudge,
    problem: &ProblemSource,
    g: &OpGraph,
    code: &str,
    program: &Program,
    label: &str,
    specs: &[mtmc_actions::device::DeviceSpec],
) -> Result<Outcome> {
    let mut all = judge_programs(
        judge,
        problem,
        code,
        &[(g, program, label.to_string())],
        specs,
    )?;
    Ok(all.remove(0))
}

/// Judges several programs (each of its graph) at once, each on whichever
/// worker (GPU) is free first; the outcomes come back in the programs'
/// order.
pub(crate) fn judge_programs(
    judge: &mut ProblemJudge,
    problem: &ProblemSource,
    code: &str,
    programs: &[(&OpGraph, &Program, String)],
    specs: &[mtmc_actions::device::DeviceSpec],
) -> Result<Vec<Outcome>> {
    let mut candidates = Vec::new();
    for (g, program, label) in programs {
        let code =
            mtmc_coder::export::to_model_new(g, program, code).map_err(anyhow::Error::msg)?;
        candidates.push(Candidate::Python {
            name: format!("model_new {label}"),
            code,
        });
    }
    if !judge.gpu {
        return Ok(programs
            .iter()
            .map(|_| Outcome::new(EvaluatorKind::CompileOnly, Status::CompiledOnly))
            .collect());
    }
    let mut outcomes = match judge.screening {
        Some(s) => judge.judge_screened(problem, candidates, s)?,
        None => judge.judge_python(problem, candidates)?,
    };
    for (o, (g, _, _)) in outcomes.iter_mut().zip(programs) {
        add_roofline(o, g, specs);
    }
    Ok(outcomes)
}

/// A Python with torch for the worker's CPU mode (`$MTMC_TEST_PYTHON`); a
/// missing one fails where `MTMC_EXPECT_TORCH` asks for it (scripts/test),
/// else skips.
#[cfg(test)]
pub(crate) fn test_python() -> Option<std::ffi::OsString> {
    let python = std::env::var_os("MTMC_TEST_PYTHON");
    assert!(
        python.is_some() || std::env::var_os("MTMC_EXPECT_TORCH").is_none(),
        "MTMC_EXPECT_TORCH is set but MTMC_TEST_PYTHON is not"
    );
    python
}

/// The roofline of the graph on the outcome's GPU, under the math the
/// problem allows (convolutions at TF32 only where the reference's were).
pub(super) fn add_roofline(
    o: &mut Outcome,
    g: &OpGraph,
    specs: &[mtmc_actions::device::DeviceSpec],
) {
    if let Some(spec) = find_device(specs, o.device.as_deref().unwrap_or("")) {
        o.add_roofline(g, spec);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtmc_env::worker::Protocol;

    const CHEATS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../env/tests/cheats");

    fn file(name: &str) -> String {
        std::fs::read_to_string(format!("{CHEATS}/{name}")).unwrap()
    }

    /// A round screened by the real judge (on the CPU, with torch): the
    /// fast program gets the full protocol, the one slower than the margin
    /// is screened out with its time, the wrong one keeps its screen's
    /// verdict; the problem's fastest screen stays for the next round.
    #[test]
    fn a_round_is_screened_and_only_the_fast_are_judged_in_full() {
        let Some(python) = test_python() else { return };
        let settings = WorkerSettings {
            protocol: Protocol {
                trials: 20,
                ..Protocol::KERNELBENCH_FP32
            },
            cpu: true,
            baselines: vec!["eager".into()],
            ..WorkerSettings::default()
        };
        let mut judge = ProblemJudge::on_cpu_worker(python, settings).screening(Some(Screening {
            calls: 4,
            margin: 0.10,
        }));
        let problem = ProblemSource {
            name: "problem_relu.py".into(),
            code: file("problem_relu.py"),
            graph: None,
        };
        let candidates = ["honest.py", "honest_slow.py", "zeros.py"]
            .iter()
            .map(|f| Candidate::Python {
                name: f.to_string(),
                code: file(f),
            })
            .collect();
        let s = judge.screening.unwrap();
        let o = judge.judge_screened(&problem, candidates, s).unwrap();
        assert_eq!(o[0].status, Status::Correct, "{:?}", o[0]);
        assert!(o[0].is_full(), "{:?}", o[0]);
        assert!(o[0].integrity.as_ref().unwrap().calls.unwrap() > 20);
        assert_eq!(o[1].status, Status::Screened, "{:?}", o[1]);
        assert!(
            o[1].why.as_deref().unwrap().starts_with("screened out: "),
            "{:?}",
            o[1].why
        );
        assert_eq!(o[1].speedup_vs("eager"), None);
        assert_eq!(o[2].status, Status::Incorrect, "{:?}", o[2]);
        assert_eq!(o[2].screen, Some(4));
        assert_eq!((judge.screened, judge.promoted), (3, 1));
        // The next round meets the bar the first set: the slow program
        // alone is screened out again.
        let slow = vec![Candidate::Python {
            name: "honest_slow.py".into(),
            code: file("honest_slow.py"),
        }];
        let o = judge.judge_screened(&problem, slow, s).unwrap();
        assert_eq!(o[0].status, Status::Screened, "{:?}", o[0]);
        assert_eq!((judge.screened, judge.promoted), (4, 1));
    }
}

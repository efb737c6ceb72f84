//! `optimize --coder llm`: the LLM coder writes each region as one step,
//! with repair steps and the critique of each outcome.

use std::path::Path;

use anyhow::Result;
use mtmc_actions::device::builtin_devices;
use mtmc_actions::graph::OpGraph;
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::program::Program;
use mtmc_coder::session::{Session, Stage};
use mtmc_env::nvrtc::Arch;
use mtmc_env::outcome::{Outcome, Status};

use super::build::regions;
use super::judge::{ProblemJudge, judge_program, problem_source, write_model_new};
use super::variants::{conclude, library_ops};
use super::{Critic, LlmRun, Summary};
use crate::steps::{self, Found, OneAtATime, Proposal, Proposed};
use mtmc_coder::critique::{LlmCritic, rules};
use mtmc_coder::llm::{LlmCoder, program_text};

/// Optimizes one KernelBench problem with the LLM coder, a step at a time
/// (see `llm_search`); the report and the best `ModelNew` go to `out_dir`.
pub fn optimize_problem_llm(
    out: &mut dyn std::io::Write,
    p: &mtmc_actions::problem::Problem,
    g: &OpGraph,
    judge: &mut ProblemJudge,
    out_dir: &Path,
    llm: &LlmRun,
) -> Result<Summary> {
    let problem = problem_source(p)?;
    let specs = builtin_devices();
    let regions = regions(g, true, true)?;
    writeln!(
        out,
        "{p}: {} region(s) for the LLM coder ({}), {} repair(s) each; {}",
        regions.len(),
        llm.client.config().model,
        llm.repairs,
        if judge.gpu {
            "each step judged by the worker against the PyTorch model"
        } else {
            "judged by compile only (no GPU: nothing is run or timed)"
        }
    )?;
    let stopped = judge.stop_flag();
    let spec = judge.spec.clone();
    let mut found = llm_search(
        out,
        g,
        &regions,
        llm,
        false,
        &spec,
        &stopped,
        |program, label| judge_program(judge, &problem, g, &p.code, program, label, &specs),
    )?;
    if found.best.is_none() && !found.interrupted {
        // No kernel program was correct: every op a torch call.
        let o = judge_program(
            judge,
            &problem,
            g,
            &p.code,
            &Program::default(),
            "call-library",
            &specs,
        )?;
        found.judged += 1;
        if o.status == Status::Correct || o.status == Status::CompiledOnly {
            found.correct += usize::from(o.status == Status::Correct);
            let ms = o.runtime.as_ref().map_or(f64::INFINITY, |r| r.mean_ms);
            writeln!(
                out,
                "  call-library (every op a torch call): {}",
                mtmc_coder::critique::rules(&o)
            )?;
            found.best = Some((ms, Program::default(), Params::default(), o.clone()));
        }
        found
            .attempts
            .push(serde_json::json!({"call_library": true, "outcome": o}));
    }
    let summary = Summary {
        kernels: found.best.as_ref().map_or(0, |b| b.1.fragments.len()),
        library_calls: found
            .best
            .as_ref()
            .map_or(0, |b| library_ops(g, &b.1).len()),
        variants: 1,
        judged: found.judged,
        correct: found.correct,
        best: found.best.as_ref().map(|b| b.3.clone()),
        params: found.best.as_ref().map(|b| b.2),
        interrupted: found.interrupted,
        whole_forward: false,
    };
    conclude(out, out_dir, &p.full_name(), found, g, |program| {
        write_model_new(out_dir, g, program, &p.code, false)
    })?;
    Ok(summary)
}

/// The LLM coder's search: each region in turn, as one step (a custom
/// kernel, or a fused one); a step that does not compile gets up to
/// `repairs` fix-compile steps with the compiler log, one judged wrong up
/// to `repairs` fix-correctness steps with the verdict; a region that
/// stays without a kernel stays torch calls. Each step's program is judged
/// (with `whole`, only once every region has a kernel: a program judged
/// natively has no torch to fall back on) and the critique of its outcome
/// goes back to the coder with the best program so far. A coder that halts
/// (the endpoint is down) ends the search with what it found; so does
/// `stopped` (a signal), between two steps, keeping nothing of the step in
/// flight (`Found::interrupted`). The reply of that step's call is in the
/// LLM store all the same, so that running the search again reuses it.
#[allow(clippy::too_many_arguments)]
pub(super) fn llm_search(
    out: &mut dyn std::io::Write,
    g: &OpGraph,
    regions: &[Vec<u32>],
    llm: &LlmRun,
    whole: bool,
    spec: &mtmc_actions::device::DeviceSpec,
    stopped: &dyn Fn() -> bool,
    judge: impl FnMut(&Program, &str) -> Result<Outcome>,
) -> Result<Found> {
    let coder = LlmCoder::new(llm.client.clone());
    let mut planner = LlmPlanner::new(g, regions, llm, whole, spec, &coder);
    steps::run(out, &mut planner, stopped, steps::each(judge))
}

/// The LLM coder's steps as a planner: a step per region (a kernel for
/// it), with up to `repairs` repair steps after a failure, each step's
/// critique heard by the coder.
struct LlmPlanner<'a> {
    g: &'a OpGraph,
    regions: &'a [Vec<u32>],
    llm: &'a LlmRun,
    whole: bool,
    session: Session<'a, &'a LlmCoder>,
    /// What bounds the problem on the run's GPU (the diagnosis reads it).
    bound: mtmc_actions::device::Bound,
    /// The region being written, its action and the repairs left.
    region: usize,
    action: Action,
    repairs: u32,
    step: usize,
    /// The coder halted: no more steps.
    halted: bool,
}

impl<'a> LlmPlanner<'a> {
    fn new(
        g: &'a OpGraph,
        regions: &'a [Vec<u32>],
        llm: &'a LlmRun,
        whole: bool,
        spec: &mtmc_actions::device::DeviceSpec,
        coder: &'a LlmCoder,
    ) -> LlmPlanner<'a> {
        // The planner's structured diagnosis goes to the coder with the
        // critique.
        let bound = mtmc_planner::features::Problem::new("", g, regions.len(), spec).bound();
        let mut planner = LlmPlanner {
            g,
            regions,
            llm,
            whole,
            session: Session::new(g, coder, Arch::SM90),
            bound,
            region: 0,
            action: Action::kernel_for(Vec::new(), Params::default()),
            repairs: 0,
            step: 0,
            halted: false,
        };
        planner.start_region(0);
        planner
    }

    /// Moves on to region `k` (past the last: done).
    fn start_region(&mut self, k: usize) {
        self.region = k;
        if let Some(region) = self.regions.get(k) {
            self.action = Action::kernel_for(region.clone(), Params::default());
            self.repairs = self.llm.repairs;
        }
    }

    /// The region stays torch calls; the next one.
    fn give_up(&mut self, out: &mut dyn std::io::Write) -> Result<()> {
        writeln!(out, "  region {:?} stays torch calls", self.action.region)?;
        self.start_region(self.region + 1);
        Ok(())
    }
}

impl OneAtATime for LlmPlanner<'_> {
    fn done(&self) -> bool {
        self.halted || self.region >= self.regions.len()
    }

    fn propose(
        &mut self,
        out: &mut dyn std::io::Write,
        found: &mut Found,
        stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<Proposed>> {
        self.step += 1;
        let step = self.step;
        let label = format!(
            "step {step}: {:?} {:?}",
            self.action.kind, self.action.region
        );
        let proposed = self.session.propose(&self.action);
        if stopped() {
            // Not judged: a program that only compiled (with `whole`) is
            // not kept either.
            return Ok(Proposal::Interrupted { label });
        }
        let program = match proposed {
            Ok(p) => p,
            Err(f) => {
                let stage = match f.stage {
                    Stage::Refused => "no kernel",
                    Stage::Compile => "does not compile, rolled back",
                    Stage::Outcome => "wrong, rolled back",
                };
                let first = f.log.lines().next().unwrap_or("");
                writeln!(out, "  {label}: {stage}: {first}")?;
                let compile = f.stage == Stage::Compile;
                found
                    .attempts
                    .push(serde_json::json!({"step": step, "failure": f}));
                if let Some(why) = self.session.coder().halted() {
                    writeln!(out, "  the LLM coder stopped: {why}")?;
                    self.halted = true;
                    return Ok(Proposal::Done);
                }
                if compile && self.repairs > 0 {
                    self.repairs -= 1;
                    self.action.kind = ActionKind::FixCompile;
                    return Ok(Proposal::Next);
                }
                self.give_up(out)?;
                return Ok(Proposal::Next);
            }
        };
        if self.whole && !program.missing(self.g).is_empty() {
            // Not judgeable yet: kept as compiled.
            writeln!(out, "  {label}: compiled")?;
            self.session.accept(program);
            self.start_region(self.region + 1);
            return Ok(Proposal::Next);
        }
        Ok(Proposal::Judge(vec![Proposed {
            program,
            label,
            params: Params::default(),
        }]))
    }

    fn judged(
        &mut self,
        out: &mut dyn std::io::Write,
        found: &mut Found,
        (program, _, label): (Program, Params, String),
        o: Outcome,
    ) -> Result<()> {
        let (g, llm) = (self.g, self.llm);
        let ruled = rules(&o);
        // The program as prompt text, for the model's critique and the
        // best-so-far context only.
        let code = || program_text(g, &program);
        let by_model = match llm.critic {
            Critic::Rules => None,
            Critic::Llm | Critic::Both => match LlmCritic::new(&llm.client).critique(&o, &code()) {
                Ok(t) => Some(t),
                Err(e) => {
                    writeln!(
                        out,
                        "  the LLM critic failed ({e}); the rule-based critique stands"
                    )?;
                    None
                }
            },
        };
        let diagnosis = mtmc_planner::critique::Diagnosis::of(&o, self.bound);
        let critique = format!(
            "{}\ndiagnosis: {}",
            match (&by_model, llm.critic) {
                (Some(m), Critic::Llm | Critic::Both) => m,
                _ => &ruled,
            },
            diagnosis.text()
        );
        writeln!(out, "  {label}: {ruled}")?;
        if llm.verbose {
            writeln!(out, "    critique: {}", critique.replace('\n', "\n    "))?;
        }
        found.attempts.push(serde_json::json!({
            "step": self.step,
            "action": self.action,
            "outcome": o,
            "critique_rules": ruled,
            "critique_llm": by_model,
            "diagnosis": diagnosis,
        }));
        let good = matches!(o.status, Status::Correct | Status::CompiledOnly);
        if good {
            let ms = o.runtime.as_ref().map_or(f64::INFINITY, |r| r.mean_ms);
            // Without a GPU nothing is timed: the latest program that
            // compiled (the one with most kernels) stands.
            let better = found
                .best
                .as_ref()
                .is_none_or(|b| ms < b.0 || !b.0.is_finite());
            let best_text = better.then(|| format!("{ruled}\n{}", code()));
            self.session.coder().observe(&mtmc_coder::Note::Judged {
                action: &self.action,
                critique: &critique,
                best: best_text.as_deref(),
            });
            if better {
                found.best = Some((ms, program.clone(), Params::default(), o.clone()));
            }
            self.session.accept(program);
            self.start_region(self.region + 1);
            return Ok(());
        }
        self.session.coder().observe(&mtmc_coder::Note::Judged {
            action: &self.action,
            critique: &critique,
            best: None,
        });
        self.session.reject(&self.action, &program, ruled);
        if self.repairs > 0 && o.status != Status::Timeout {
            self.repairs -= 1;
            self.action.kind = ActionKind::FixCorrectness;
            return Ok(());
        }
        self.give_up(out)
    }

    fn finish(&mut self, out: &mut dyn std::io::Write, found: &mut Found) -> Result<()> {
        let s = self.llm.client.stats();
        writeln!(
            out,
            "llm: {} call(s), {} request(s) ({} retried), {} from the cache, {} failed; {} prompt + {} reply tokens{}",
            s.calls,
            s.requests,
            s.retries,
            s.cache_hits,
            s.failures,
            s.tokens_in,
            s.tokens_out,
            if s.cost_usd > 0.0 {
                format!(", ${:.4}", s.cost_usd)
            } else {
                String::new()
            }
        )?;
        found.attempts.push(serde_json::json!({"llm": s}));
        Ok(())
    }
}

//! The judge on the CPU, with real torch: every cheat that can be shown
//! without a GPU is caught (each candidate in `tests/cheats/` says what it
//! tries), honest work passes, and nothing a candidate does reaches the
//! judge, the reference, the baselines or the next candidate. Needs a Python
//! with torch: `$MTMC_TEST_PYTHON` (scripts/test installs one and sets
//! `MTMC_EXPECT_TORCH=1`, which turns a missing torch into a failure instead
//! of a skip).

use std::ffi::OsString;

mod common;
use common::torch_python;
use std::time::Duration;

use mtmc_env::evaluator::{Candidate, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings};
use mtmc_env::outcome::{Outcome, Status};
use mtmc_env::worker::{Protocol, WorkerSlot};

const CHEATS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cheats");

/// The tests that compare times hold it alone; the others share it. On a
/// two-core host another judge beside a timed run moves the times it
/// compares by more than the bounds they are checked against.
static HOST: tokio::sync::RwLock<()> = tokio::sync::RwLock::const_new(());

fn file(name: &str) -> String {
    std::fs::read_to_string(format!("{CHEATS}/{name}")).unwrap()
}

fn problem(name: &str) -> ProblemSource {
    ProblemSource {
        name: name.into(),
        code: file(name),
        graph: None,
    }
}

fn candidate(name: &str) -> Candidate {
    Candidate::Python {
        name: name.into(),
        code: file(name),
    }
}

fn evaluator(python: OsString, strict: bool, limit: Duration) -> WorkerEvaluator {
    evaluator_with(python, strict, false, limit)
}

fn evaluator_with(
    python: OsString,
    strict: bool,
    recompute_references: bool,
    limit: Duration,
) -> WorkerEvaluator {
    let settings = WorkerSettings {
        protocol: Protocol {
            trials: 5,
            ..Protocol::KERNELBENCH_FP32
        },
        cpu: true,
        strict,
        recompute_references,
        limit,
        ..WorkerSettings::default()
    };
    WorkerEvaluator::new(WorkerSlot::with_interpreter(python, None), settings)
}

async fn eval(ev: &mut WorkerEvaluator, problem_file: &str, candidate_file: &str) -> Outcome {
    judge(ev, problem_file, &candidate(candidate_file)).await
}

async fn judge(ev: &mut WorkerEvaluator, problem_file: &str, c: &Candidate) -> Outcome {
    ev.evaluate(&problem(problem_file), c)
        .await
        .unwrap_or_else(|e| panic!("{}: {e}", c.name()))
}

/// Every cheat, with the check that must catch it and a piece of the
/// reason the judge gives.
const CAUGHT: &[(&str, &str, &str, &str)] = &[
    (
        "problem_relu.py",
        "mutates_input.py",
        "mutation",
        "modified input 0",
    ),
    (
        "problem_relu.py",
        "caches_output.py",
        "",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "keys_on_identity.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "lazy_tensor.py",
        "correctness_trial",
        "returned _Lazy, not a plain torch.Tensor",
    ),
    (
        "problem_relu.py",
        "half_precision.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "falls_back.py",
        "fallback",
        "caught an exception and went on (RuntimeError: kernel launch failed",
    ),
    (
        "problem_relu.py",
        "falls_back_elsewhere.py",
        "fallback",
        "(in fast_relu, line 6)",
    ),
    (
        "problem_relu.py",
        "patches_reference.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "patches_judge.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "copies_expected.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "returns_empty.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "defers_to_thread.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "defers_to_process.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "forges_reply.py",
        "correctness_trial",
        "values differ beyond tolerance",
    ),
    (
        "problem_relu.py",
        "counts_calls.py",
        "timed_call",
        "the judge chose at random and compared after it returned",
    ),
    (
        "problem_relu.py",
        "caches_by_address.py",
        "timed_call",
        "the judge chose at random and compared after it returned",
    ),
    (
        "problem_relu_positive.py",
        "returns_input.py",
        "second_distribution",
        "on inputs drawn from a normal distribution",
    ),
    (
        "problem_tiny_outputs.py",
        "zeros.py",
        "correctness_trial",
        "of the output's scale: within atol only because the outputs are small",
    ),
    (
        "problem_linear.py",
        "freezes_weights.py",
        "scaled_parameters",
        "after its parameters were scaled in place by 0.5",
    ),
];

#[tokio::test]
async fn every_cpu_cheat_is_caught_and_honest_work_passes() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    every_cheat_is_caught(evaluator(python, false, Duration::from_secs(120))).await;
}

/// The same checks when the reference outputs are recomputed for every
/// check (what the judge does when they do not fit on the GPU).
#[tokio::test]
async fn every_cpu_cheat_is_caught_with_recomputed_references() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator_with(python, false, true, Duration::from_secs(120));
    let report = ev.prepare(&problem("problem_relu.py")).await.unwrap();
    assert_eq!(report["refs_kept"], "recomputed", "{report}");
    every_cheat_is_caught(ev).await;
}

async fn every_cheat_is_caught(mut ev: WorkerEvaluator) {
    for &(p, c, check, why) in CAUGHT {
        let o = eval(&mut ev, p, c).await;
        assert_eq!(o.status, Status::Incorrect, "{c}: {o:?}");
        let got = o.why.clone().unwrap_or_default();
        assert!(got.contains(why), "{c}: expected `{why}` in `{got}`");
        if !check.is_empty() {
            assert_eq!(o.failed_check.as_deref(), Some(check), "{c}: {o:?}");
        }
        assert!(
            o.runtime.is_none(),
            "{c}: an incorrect candidate has no timing"
        );
        let confinement = &o
            .integrity
            .as_ref()
            .expect("an integrity report")
            .confinement;
        assert!(
            confinement.iter().any(|c| c == "a process of its own"),
            "{c}: {confinement:?}"
        );
    }
    // None of them cost the judge: it is the one it started with, and an
    // honest candidate after them is judged as ever.
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(ev.slot.starts, 1, "the judge was never replaced");
    let c = o.correctness.as_ref().unwrap();
    // KernelBench's five trials and the one on normal inputs.
    assert_eq!(c.trials, 6);
    assert_eq!(c.max_abs_err, Some(0.0));
    let runtime = o.runtime.as_ref().unwrap();
    assert_eq!(runtime.trials, 5);
    assert_eq!(runtime.clock, "host");
    assert!(o.baselines["eager"].timing.is_some());
    assert!(o.torch_ops.contains_key("aten.clamp"), "{:?}", o.torch_ops);
    let integrity = o.integrity.as_ref().unwrap();
    assert_eq!(integrity.second_distribution.as_deref(), Some("passed"));
    let (calls, checked, warmup) = (
        integrity.calls.unwrap(),
        integrity.checked.unwrap(),
        integrity.warmup.unwrap(),
    );
    assert!((3..=6).contains(&warmup), "{integrity:?}");
    // Every timed call is checked here (five), and one warm-up; three more
    // calls run with the watchers on.
    assert_eq!(checked, 6, "{integrity:?}");
    assert_eq!(
        calls,
        warmup + 5 + integrity.watched.unwrap(),
        "{integrity:?}"
    );
    // Weights derived from the parameters and kept until a parameter's
    // version counter moves pass the check that catches frozen ones.
    let o = eval(&mut ev, "problem_linear.py", "folds_weights.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
}

/// A candidate whose clocks and synchronization are all replaced in its own
/// process is timed by the judge all the same: 30 ms a call.
#[tokio::test]
async fn patched_clocks_do_not_change_the_time() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.write().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    let o = eval(&mut ev, "problem_relu.py", "patches_timer.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let runtime = o.runtime.unwrap();
    assert!(runtime.min_ms > 25.0, "{runtime:?}");
}

/// Honest, then every exploit, then honest again: the two honest verdicts
/// and speedups agree (a candidate that wraps whatever writes replies, or
/// slows the reference, reaches neither).
#[tokio::test]
async fn an_honest_candidate_is_judged_the_same_before_and_after_every_exploit() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.write().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    // Twenty timed calls, not five: on a host busy with other tests one
    // sleep that overruns moves a mean of five by a fifth.
    ev.settings.protocol.trials = 20;
    let before = eval(&mut ev, "problem_slow_relu.py", "honest_slow.py").await;
    assert_eq!(before.status, Status::Correct, "{before:?}");
    for c in [
        "wraps_reply.py",
        "slows_reference.py",
        "patches_judge.py",
        "patches_timer.py",
        "forges_reply.py",
        "copies_expected.py",
        "defers_to_thread.py",
        "mutates_input.py",
    ] {
        eval(&mut ev, "problem_slow_relu.py", c).await;
    }
    let after = eval(&mut ev, "problem_slow_relu.py", "honest_slow.py").await;
    assert_eq!(after.status, Status::Correct, "{after:?}");
    let (a, b) = (
        before.speedup_vs("eager").unwrap(),
        after.speedup_vs("eager").unwrap(),
    );
    // Both a 20 ms sleep against eager's 20 ms sleep: about 1 each.
    assert!((0.8..1.25).contains(&a), "before: {a}");
    assert!((0.8..1.25).contains(&b), "after: {b}");
    assert_eq!(ev.slot.starts, 1);
}

/// The baseline cache is the judge's: a candidate that tries to rewrite it
/// or plant a file beside it changes nothing there.
#[tokio::test]
async fn a_candidate_cannot_write_the_baseline_cache() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let cache = tempfile::tempdir().unwrap();
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    ev.settings.baseline_cache = Some(cache.path().to_path_buf());
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let files = || {
        let mut v: Vec<(String, String)> = std::fs::read_dir(cache.path())
            .unwrap()
            .map(|e| {
                let p = e.unwrap().path();
                (
                    p.file_name().unwrap().to_string_lossy().into_owned(),
                    std::fs::read_to_string(&p).unwrap(),
                )
            })
            .collect();
        v.sort();
        v
    };
    let kept = files();
    assert_eq!(kept.len(), 1, "{kept:?}");
    let code = file("writes_cache.py")
        .replace("BASELINE_CACHE_FOLDER", &cache.path().display().to_string());
    let writer = Candidate::Python {
        name: "writes_cache.py".into(),
        code,
    };
    let o = judge(&mut ev, "problem_relu.py", &writer).await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(files(), kept, "the cache changed");
}

#[tokio::test]
async fn strict_mode_fails_torch_compute_on_any_watched_call() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, true, Duration::from_secs(120));
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Incorrect);
    assert_eq!(
        o.why.as_deref(),
        Some(
            "strict mode: the forward computes with torch (aten.clamp) on KernelBench's correctness trials"
        )
    );
    // Torch only after the first call: the later watched calls see it.
    let o = eval(&mut ev, "problem_relu.py", "torch_after_first.py").await;
    assert_eq!(o.status, Status::Incorrect, "{o:?}");
    assert_eq!(o.failed_check.as_deref(), Some("strict"), "{o:?}");
    assert!(
        o.why.as_deref().unwrap_or_default().contains("aten.relu"),
        "{o:?}"
    );
}

#[tokio::test]
async fn a_hang_an_exit_and_a_segfault_each_cost_one_candidate() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(20));
    let hang = Candidate::Python {
        name: "hangs.py".into(),
        code: "import time, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        time.sleep(600)\n".into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &hang).await;
    assert_eq!(o.status, Status::Timeout, "{o:?}");
    assert!(
        o.error
            .unwrap()
            .contains("did not return in time (limit 20 s)"),
        "timeout"
    );
    let crash = Candidate::Python {
        name: "crashes.py".into(),
        code: "import os, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        os._exit(9)\n".into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &crash).await;
    assert_eq!(o.status, Status::Crashed, "{o:?}");
    let error = o.error.unwrap();
    assert!(error.contains("exited with status 9"), "{error}");
    let segfault = Candidate::Python {
        name: "segfaults.py".into(),
        code: "import ctypes, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return ctypes.string_at(0)\n".into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &segfault).await;
    assert_eq!(o.status, Status::Crashed, "{o:?}");
    let error = o.error.unwrap();
    assert!(error.contains("killed by SIGSEGV"), "{error}");
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct);
    assert_eq!(
        ev.slot.starts, 1,
        "faults cost the candidate, not the judge"
    );
}

#[tokio::test]
async fn candidate_errors_at_load_are_compile_errors_and_keep_their_error_line() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(60));
    let raises = Candidate::Python {
        name: "raises.py".into(),
        code: "print('noise on stdout')\nraise ValueError('boom')\n".into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &raises).await;
    assert_eq!(o.status, Status::CompileError, "{o:?}");
    assert_eq!(o.error.as_deref(), Some("ValueError: boom"));
    let empty = Candidate::Python {
        name: "empty.py".into(),
        code: "y = 2\n".into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &empty).await;
    assert_eq!(
        o.error.as_deref(),
        Some("NameError: the candidate defines no ModelNew class")
    );
    // A compiler's log where warnings before and after the error fill more
    // than the 2,000 characters an error keeps: the error line (and the
    // critique's line number and kind with it) must survive the cut.
    let log = Candidate::Python {
        name: "log.py".into(),
        code: r#"
warn = 'k.cu(40): warning #177-D: variable "b_off" was declared but never referenced\n    const long long b_off = 0;\n    ^\n'
log = warn * 40 + 'k.cu(343): error: declaration is incompatible with previous "smem" (declared at line 29)\n    extern __shared__ unsigned char smem[];\n    ^\n' + warn * 40 + '1 error detected in the compilation of "k.cu".'
raise RuntimeError(log)
"#
        .into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &log).await;
    assert_eq!(o.status, Status::CompileError);
    let error = o.error.unwrap();
    assert!(error.chars().count() <= 2000, "{} chars", error.len());
    assert!(
        error.starts_with("RuntimeError: k.cu(40): warning"),
        "{error}"
    );
    assert!(
        error.contains("k.cu(343): error: declaration is incompatible with previous \"smem\""),
        "{error}"
    );
    assert!(
        error.ends_with("1 error detected in the compilation of \"k.cu\"."),
        "{error}"
    );
    assert_eq!(ev.slot.starts, 1);
}

/// A fault of the judge itself (here the problem's own code, which the
/// judge runs, exits or hangs) costs a worker, and the next request gets a
/// fresh one.
#[tokio::test]
async fn a_judge_that_dies_or_hangs_is_replaced() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(60));
    ev.settings.prepare_limit = Duration::from_secs(30);
    let dies = ProblemSource {
        name: "dies.py".into(),
        code: file("problem_relu.py")
            + "\nimport os, sys\nprint('about to die', file=sys.stderr)\nos._exit(7)\n",
        graph: None,
    };
    let e = ev
        .evaluate(&dies, &candidate("honest.py"))
        .await
        .unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("exit status: 7") && text.contains("about to die"),
        "{text}"
    );
    let hangs = ProblemSource {
        name: "hangs.py".into(),
        code: file("problem_relu.py") + "\nimport time\ntime.sleep(600)\n",
        graph: None,
    };
    ev.settings.prepare_limit = Duration::from_secs(5);
    let e = ev
        .evaluate(&hangs, &candidate("honest.py"))
        .await
        .unwrap_err();
    assert!(e.to_string().contains("no reply within 5s"), "{e}");
    ev.settings.prepare_limit = Duration::from_secs(120);
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(ev.slot.starts, 3);
}

/// A candidate that runs out of GPU memory beside the reference outputs
/// the judge keeps is judged once more with them recomputed for each
/// check; the next candidate is judged with them kept again.
#[tokio::test]
async fn out_of_memory_beside_kept_references_is_judged_again_with_them_recomputed() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    let o = eval(&mut ev, "problem_relu.py", "needs_memory.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(o.references_recomputed, "{o:?}");
    assert!(!ev.settings.recompute_references);
    assert_eq!(ev.slot.starts, 2, "judged again by a fresh judge");
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(!o.references_recomputed, "{o:?}");
    // With the references recomputed from the start it is correct at
    // once, judged one time.
    let Some(python) = torch_python() else { return };
    let mut ev = evaluator_with(python, false, true, Duration::from_secs(120));
    let report = ev.prepare(&problem("problem_relu.py")).await.unwrap();
    assert_eq!(report["refs_kept"], "recomputed", "{report}");
    let o = eval(&mut ev, "problem_relu.py", "needs_memory.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(!o.references_recomputed, "{o:?}");
}

/// A problem whose model keeps state across calls is judged in lockstep:
/// each call the candidate gets is mirrored, in order, on a fresh model of
/// the judge's. A candidate with the same state is correct; one that
/// forgets it fails on the second correctness trial, and one that stops
/// updating it once the trials are over fails on a timed call. Problems
/// without state on the same worker are judged as before, one that writes
/// to its input among them (each call gets inputs of its own). State that
/// repeats an output for a repeated input (a running mean) is found by
/// the same input again after another.
#[tokio::test]
async fn a_problem_whose_model_keeps_state_is_judged_in_lockstep() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    ev.settings.protocol.trials = 40;
    let o = eval(&mut ev, "problem_stateful.py", "keeps_state.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let i = o.integrity.as_ref().unwrap();
    assert!(i.lockstep, "{i:?}");
    assert_eq!(i.second_distribution.as_deref(), Some("passed"), "{i:?}");
    let o = eval(&mut ev, "problem_stateful.py", "forgets_state.py").await;
    assert_eq!(o.status, Status::Incorrect, "{o:?}");
    assert_eq!(o.failed_check.as_deref(), Some("correctness_trial"));
    // The first call is right (the state starts at zero), the second not.
    assert_eq!(o.correctness.as_ref().unwrap().trials, 2, "{o:?}");
    let o = eval(&mut ev, "problem_stateful.py", "keeps_state_until_timed.py").await;
    assert_eq!(o.status, Status::Incorrect, "{o:?}");
    assert_eq!(o.failed_check.as_deref(), Some("timed_call"), "{o:?}");
    // With parameters: every check passes in step, the one with the
    // parameters scaled last.
    let o = eval(
        &mut ev,
        "problem_stateful_linear.py",
        "keeps_state_linear.py",
    )
    .await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(
        o.integrity.as_ref().unwrap().second_distribution.as_deref(),
        Some("passed")
    );
    // State that gives the same output for the same input twice in a row
    // (a running mean kept in buffers updated in place) is found too.
    let o = eval(&mut ev, "problem_running_mean.py", "keeps_running_mean.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(o.integrity.as_ref().unwrap().lockstep, "{o:?}");
    // A screen keeps the lockstep too.
    ev.settings.screen = Some(8);
    let o = eval(&mut ev, "problem_stateful.py", "keeps_state.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    ev.settings.screen = None;
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(!o.integrity.as_ref().unwrap().lockstep);
    let o = eval(&mut ev, "problem_writes_input.py", "honest.py").await;
    assert_eq!(o.status, Status::Incorrect, "{o:?}");
}

/// A product over a long K added in another order (as split-K adds its
/// parts) is correct on normal inputs too: there each element may also
/// differ by rtol times the output's scale, where the sums cancel to near
/// zero. A cheat that only holds on KernelBench's inputs still fails there
/// (`returns_input.py`, `caches_output.py` in `CAUGHT`).
#[tokio::test]
async fn another_order_of_a_long_sum_is_correct_on_normal_inputs() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    let o = eval(&mut ev, "problem_long_sum.py", "honest_split_k.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(
        o.integrity.unwrap().second_distribution.as_deref(),
        Some("passed")
    );
}

#[tokio::test]
async fn a_nan_in_the_output_is_the_first_bad_element() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    let nan = Candidate::Python {
        name: "nan.py".into(),
        code: "import torch, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        y = torch.relu(x)\n        y[3, 5] = float('nan')\n        return y\n".into(),
    };
    let o = judge(&mut ev, "problem_relu.py", &nan).await;
    assert_eq!(o.status, Status::Incorrect);
    let c = o.correctness.unwrap();
    let bad = c.first_bad.unwrap();
    assert_eq!(bad.index, [3, 5]);
    assert!(bad.got.is_nan());
    assert_eq!(c.max_abs_err, Some(f64::INFINITY));
}

#[tokio::test]
async fn eager_is_timed_beside_the_candidate_and_a_candidate_cannot_slow_it() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.write().await;
    let mut ev = evaluator(python.clone(), false, Duration::from_secs(120));
    // Beside an honest candidate: eager's paired timing is the baseline,
    // within 5 % of its time alone (a 20 ms forward: the host's jitter is
    // far below that on an idle host; on one busy with other tests a
    // sleep can overrun by more, so up to three tries, any of them
    // paired).
    let mut o = eval(&mut ev, "problem_slow_relu.py", "honest.py").await;
    for _ in 0..2 {
        if o.baselines["eager"].paired {
            break;
        }
        o = eval(&mut ev, "problem_slow_relu.py", "honest.py").await;
    }
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let eager = &o.baselines["eager"];
    assert!(eager.paired, "{eager:?}");
    let (paired, alone) = (
        eager.timing.as_ref().unwrap().mean_ms,
        eager.alone_mean_ms.unwrap(),
    );
    assert!(alone > 19.0 && paired <= alone * 1.05, "{eager:?}");
    assert_eq!(eager.timing.as_ref().unwrap().trials, 5);
    // A candidate whose code makes every `Model` it finds sleep 20 ms finds
    // none: the reference runs in a process of its own, and eager beside
    // it takes what it takes alone.
    let mut o = eval(&mut ev, "problem_slow_relu.py", "slows_reference.py").await;
    for _ in 0..2 {
        if o.baselines["eager"].paired {
            break;
        }
        o = eval(&mut ev, "problem_slow_relu.py", "slows_reference.py").await;
    }
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let eager = &o.baselines["eager"];
    assert!(eager.paired, "{eager:?}");
    let paired = eager.timing.as_ref().unwrap().mean_ms;
    assert!(paired < 30.0, "{eager:?}");
    // Without pairing (`mtmc eval --eager-alone`), eager's time alone.
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    ev.settings.paired_eager = false;
    let o = eval(&mut ev, "problem_slow_relu.py", "honest.py").await;
    assert!(!o.baselines["eager"].paired && o.baselines["eager"].why.is_none());
}

/// A timed call's output larger than the judge copies whole is compared
/// at positions drawn after it returned: a candidate wrong on a hundredth
/// of it is caught there, and an honest one whose output has strides of its
/// own passes.
#[tokio::test]
async fn large_outputs_are_checked_at_positions_drawn_after_the_call() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    ev.settings.protocol.trials = 20;
    let o = eval(&mut ev, "problem_relu_large.py", "wrong_in_a_corner.py").await;
    assert_eq!(o.status, Status::Incorrect, "{o:?}");
    assert_eq!(o.failed_check.as_deref(), Some("timed_call"), "{o:?}");
    let why = o.why.as_deref().unwrap_or("");
    assert!(why.contains("values differ beyond tolerance"), "{o:?}");
    let o = eval(&mut ev, "problem_relu_large.py", "honest_transposed.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let o = eval(&mut ev, "problem_relu_large.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
}

/// A screen judges a candidate on KernelBench's first correctness trial and
/// a few timed calls, says it is one, and still fails wrong work; the full
/// protocol after it on the same judge reuses the problem's reference side
/// (a screen and a judgement share it) and runs every check again.
#[tokio::test]
async fn a_screen_is_short_says_so_and_shares_the_reference_side() {
    let Some(python) = torch_python() else { return };
    let _host = HOST.read().await;
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    ev.settings.protocol.trials = 100;
    ev.settings.screen = Some(8);
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(o.screen, Some(8), "{o:?}");
    assert!(!o.is_full());
    // Its times rank candidates and are never a reported speedup.
    assert_eq!(o.speedup_vs("eager"), None);
    assert_eq!(o.correctness.as_ref().unwrap().trials, 1, "{o:?}");
    let i = o.integrity.as_ref().unwrap();
    // Eight timed calls, one watched, one or two warm-ups.
    assert!((10..=11).contains(&i.calls.unwrap()), "{:?} calls", i.calls);
    assert_eq!(i.eager_beside, Some(0));
    assert!(i.checked.unwrap() >= 2, "{i:?}");
    assert_eq!(
        i.second_distribution.as_deref(),
        Some("not run: a screen"),
        "{i:?}"
    );
    let o = eval(&mut ev, "problem_relu.py", "zeros.py").await;
    assert_eq!(o.status, Status::Incorrect, "{o:?}");
    assert_eq!(o.failed_check.as_deref(), Some("correctness_trial"));
    assert_eq!(o.screen, Some(8), "a failed screen says it was one");

    ev.settings.screen = None;
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(o.is_full());
    assert_eq!(o.correctness.as_ref().unwrap().trials, 6, "{o:?}");
    assert!(o.integrity.as_ref().unwrap().calls.unwrap() > 100);
    // The reference side was not built again.
    assert!(o.phases["reference"] < 0.01, "{:?}", o.phases);
    assert_eq!(ev.slot.starts, 1);
}

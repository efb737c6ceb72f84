//! The worker's checks on the CPU, with real torch: every cheat that can be
//! shown without a GPU is caught, an honest candidate passes, and a patched
//! process is replaced. Needs a Python with torch: `$MTMC_TEST_PYTHON`
//! (scripts/test installs one and sets `MTMC_EXPECT_TORCH=1`, which turns a
//! missing torch into a failure instead of a skip).

use std::ffi::OsString;

mod common;
use common::torch_python;
use std::time::Duration;

use mtmc_env::evaluator::{Candidate, Evaluator, ProblemSource, WorkerEvaluator, WorkerSettings};
use mtmc_env::outcome::{Outcome, Status};
use mtmc_env::worker::{Protocol, WorkerSlot};

const CHEATS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/cheats");

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
    ev.evaluate(&problem(problem_file), &candidate(candidate_file))
        .await
        .unwrap_or_else(|e| panic!("{candidate_file}: {e}"))
}

#[tokio::test]
async fn every_cpu_cheat_is_caught_and_honest_work_passes() {
    let Some(python) = torch_python() else { return };
    every_cheat_is_caught(evaluator(python, false, Duration::from_secs(120))).await;
}

/// The same checks when the reference outputs are recomputed for every
/// check (what the worker does when they do not fit on the GPU).
#[tokio::test]
async fn every_cpu_cheat_is_caught_with_recomputed_references() {
    let Some(python) = torch_python() else { return };
    let mut ev = evaluator_with(python, false, true, Duration::from_secs(120));
    let report = ev.prepare(&problem("problem_relu.py")).await.unwrap();
    assert_eq!(report["refs_kept"], "recomputed", "{report}");
    every_cheat_is_caught(ev).await;
}

async fn every_cheat_is_caught(mut ev: WorkerEvaluator) {
    let cases = [
        ("problem_relu.py", "mutates_input.py", "modified input 0"),
        (
            "problem_relu.py",
            "caches_output.py",
            "after timing, on new values in the same input buffers",
        ),
        (
            "problem_relu.py",
            "lazy_tensor.py",
            "returned _Lazy, not a plain torch.Tensor",
        ),
        (
            "problem_relu.py",
            "half_precision.py",
            "values differ beyond tolerance",
        ),
        (
            "problem_relu.py",
            "falls_back.py",
            "caught an exception and went on (RuntimeError: kernel launch failed",
        ),
        (
            "problem_relu.py",
            "patches_reference.py",
            "replaced torch.relu",
        ),
        (
            "problem_relu.py",
            "patches_timer.py",
            "replaced time.perf_counter, torch.cuda.Event",
        ),
        (
            "problem_tiny_outputs.py",
            "zeros.py",
            "of the output's scale: within atol only because the outputs are small",
        ),
        (
            "problem_linear.py",
            "freezes_weights.py",
            "after its parameters were scaled in place by 0.5",
        ),
    ];
    for (p, c, why) in cases {
        let o = eval(&mut ev, p, c).await;
        assert_eq!(o.status, Status::Incorrect, "{c}: {o:?}");
        let got = o.why.clone().unwrap_or_default();
        assert!(got.contains(why), "{c}: expected `{why}` in `{got}`");
        assert!(
            o.runtime.is_none(),
            "{c}: an incorrect candidate has no timing"
        );
    }
    // Both patches cost a worker; the honest candidate after them runs in a
    // clean process, and its reference is unaffected by the patched relu.
    let starts = ev.slot.starts;
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert_eq!(
        ev.slot.starts, starts,
        "the honest candidate reused the worker"
    );
    let c = o.correctness.as_ref().unwrap();
    assert_eq!(c.trials, 5);
    assert_eq!(c.max_abs_err, Some(0.0));
    assert_eq!(o.runtime.as_ref().unwrap().trials, 5);
    assert_eq!(o.runtime.as_ref().unwrap().clock, "host");
    assert!(o.baselines["eager"].timing.is_some());
    assert_eq!(o.torch_ops.get("aten.clamp"), Some(&1), "{:?}", o.torch_ops);
    assert!(
        ev.slot.starts >= 3,
        "two patches, two replaced workers: {}",
        ev.slot.starts
    );
    // Weights derived from the parameters and kept until a parameter's
    // version counter moves pass the check that catches frozen ones.
    let o = eval(&mut ev, "problem_linear.py", "folds_weights.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
}

/// A candidate that runs out of GPU memory beside the reference outputs
/// the worker keeps is judged once more with them recomputed for each
/// check; the next candidate is judged with them kept again.
#[tokio::test]
async fn out_of_memory_beside_kept_references_is_judged_again_with_them_recomputed() {
    let Some(python) = torch_python() else { return };
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    let o = eval(&mut ev, "problem_relu.py", "needs_memory.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    assert!(o.references_recomputed, "{o:?}");
    assert!(!ev.settings.recompute_references);
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

#[tokio::test]
async fn strict_mode_fails_torch_compute() {
    let Some(python) = torch_python() else { return };
    let mut ev = evaluator(python, true, Duration::from_secs(120));
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Incorrect);
    assert_eq!(
        o.why.as_deref(),
        Some("strict mode: the forward computes with torch (aten.clamp)")
    );
}

#[tokio::test]
async fn a_hang_an_exit_and_a_segfault_each_cost_one_candidate() {
    let Some(python) = torch_python() else { return };
    let mut ev = evaluator(python, false, Duration::from_secs(20));
    let hang = Candidate::Python {
        name: "hangs.py".into(),
        code: "import time, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        time.sleep(600)\n".into(),
    };
    let p = problem("problem_relu.py");
    let o = ev.evaluate(&p, &hang).await.unwrap();
    assert_eq!(o.status, Status::Timeout, "{o:?}");
    assert!(o.error.unwrap().contains("no reply within 20s"));
    let crash = Candidate::Python {
        name: "crashes.py".into(),
        code: "import os, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        os._exit(9)\n".into(),
    };
    let o = ev.evaluate(&p, &crash).await.unwrap();
    assert_eq!(o.status, Status::Crashed, "{o:?}");
    assert!(o.error.unwrap().contains("exit status: 9"));
    let segfault = Candidate::Python {
        name: "segfaults.py".into(),
        code: "import ctypes, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        return ctypes.string_at(0)\n".into(),
    };
    let o = ev.evaluate(&p, &segfault).await.unwrap();
    assert_eq!(o.status, Status::Crashed, "{o:?}");
    assert!(o.error.unwrap().contains("signal: 11"));
    let o = eval(&mut ev, "problem_relu.py", "honest.py").await;
    assert_eq!(o.status, Status::Correct);
    assert_eq!(ev.slot.starts, 4);
}

#[tokio::test]
async fn a_nan_in_the_output_is_the_first_bad_element() {
    let Some(python) = torch_python() else { return };
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    let nan = Candidate::Python {
        name: "nan.py".into(),
        code: "import torch, torch.nn as nn\nclass ModelNew(nn.Module):\n    def forward(self, x):\n        y = torch.relu(x)\n        y[3, 5] = float('nan')\n        return y\n".into(),
    };
    let o = ev
        .evaluate(&problem("problem_relu.py"), &nan)
        .await
        .unwrap();
    assert_eq!(o.status, Status::Incorrect);
    let c = o.correctness.unwrap();
    let bad = c.first_bad.unwrap();
    assert_eq!(bad.index, [3, 5]);
    assert!(bad.got.is_nan());
    assert_eq!(c.max_abs_err, Some(f64::INFINITY));
}

#[tokio::test]
async fn eager_is_timed_beside_the_candidate_and_a_reference_slowed_by_it_is_not_believed() {
    let Some(python) = torch_python() else { return };
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
    // A candidate whose code made the reference's forward sleep: eager
    // beside it is 20 ms slower, so its time alone is the baseline, and
    // the speedup is the honest one (about 1), not hundreds.
    let o = eval(&mut ev, "problem_relu.py", "slows_reference.py").await;
    assert_eq!(o.status, Status::Correct, "{o:?}");
    let eager = &o.baselines["eager"];
    assert!(!eager.paired, "{eager:?}");
    let why = eager.why.as_deref().unwrap_or_default();
    assert!(
        why.contains("beside the candidate") && why.contains("its time alone is the baseline"),
        "{why}"
    );
    let speedup = o.speedup_vs("eager").unwrap();
    assert!(speedup < 20.0, "speedup {speedup} from a slowed reference");
    // Without pairing (`mtmc eval --eager-alone`), eager's time alone.
    let mut ev = evaluator(python, false, Duration::from_secs(120));
    ev.settings.paired_eager = false;
    let o = eval(&mut ev, "problem_slow_relu.py", "honest.py").await;
    assert!(!o.baselines["eager"].paired && o.baselines["eager"].why.is_none());
}

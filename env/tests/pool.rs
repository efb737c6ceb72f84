//! The worker pool dispatches candidates to several workers at once and
//! returns the outcomes in order. Runs on the CPU with real torch
//! (`$MTMC_TEST_PYTHON`).

use std::time::Duration;

use mtmc_env::evaluator::{Candidate, ProblemSource, WorkerSettings};
use mtmc_env::outcome::Status;
use mtmc_env::pool::WorkerPool;
use mtmc_env::worker::{Protocol, WorkerSlot};

mod common;
use common::torch_python;

#[tokio::test]
async fn two_workers_judge_candidates_at_the_same_time() {
    let Some(python) = torch_python() else { return };
    // In /dev/shm: a candidate's process may write under /dev and its own
    // scratch folder only (Landlock), as any user (the file is open to all).
    let log = tempfile::Builder::new().tempfile_in("/dev/shm").unwrap();
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(log.path(), std::fs::Permissions::from_mode(0o666)).unwrap();
    }
    let problem = ProblemSource {
        name: "problem_relu.py".into(),
        code: std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/cheats/problem_relu.py"
        ))
        .unwrap(),
        graph: None,
    };
    // Each candidate's first forward logs its process and its span, and
    // takes a while; the third is wrong on purpose.
    let candidate = |k: usize| Candidate::Python {
        name: format!("c{k}.py"),
        code: format!(
            "import os, time, torch, torch.nn as nn\n\
             class ModelNew(nn.Module):\n\
             \x20   calls = 0\n\
             \x20   def forward(self, x):\n\
             \x20       ModelNew.calls += 1\n\
             \x20       if ModelNew.calls == 1:\n\
             \x20           began = time.time(); time.sleep(1.5)\n\
             \x20           with open({log:?}, 'a') as f: f.write(f'{{os.getpid()}} {{began}} {{time.time()}}\\n')\n\
             \x20       return torch.relu(x){wrong}\n",
            log = log.path().to_str().unwrap(),
            wrong = if k == 2 { " + 1.0" } else { "" },
        ),
    };
    let settings = WorkerSettings {
        protocol: Protocol {
            trials: 3,
            ..Protocol::KERNELBENCH_FP32
        },
        cpu: true,
        limit: Duration::from_secs(60),
        ..WorkerSettings::default()
    };
    let slots = (0..2)
        .map(|_| WorkerSlot::with_interpreter(python.clone(), None))
        .collect();
    let mut pool = WorkerPool::from_slots(slots, &settings);
    let results = pool
        .evaluate_all(&problem, (0..4).map(candidate).collect())
        .await;
    let statuses: Vec<Status> = results
        .iter()
        .map(|d| d.result.as_ref().unwrap().status)
        .collect();
    assert_eq!(
        statuses,
        [
            Status::Correct,
            Status::Correct,
            Status::Incorrect,
            Status::Correct
        ]
    );
    let mut used: Vec<usize> = results.iter().map(|d| d.slot).collect();
    used.sort();
    used.dedup();
    assert_eq!(used, [0, 1], "both workers took candidates");
    assert!(pool.evaluators().iter().all(|e| e.slot.starts == 1));
    // Spans from the two processes overlap: they ran at the same time.
    let spans: Vec<(String, f64, f64)> = std::fs::read_to_string(log.path())
        .unwrap()
        .lines()
        .map(|l| {
            let f: Vec<&str> = l.split(' ').collect();
            (
                f[0].to_string(),
                f[1].parse().unwrap(),
                f[2].parse().unwrap(),
            )
        })
        .collect();
    assert_eq!(spans.len(), 4, "{spans:?}");
    let overlap = spans
        .iter()
        .any(|a| spans.iter().any(|b| a.0 != b.0 && a.1 < b.2 && b.1 < a.2));
    assert!(overlap, "no two workers ran at once: {spans:?}");
}

//! The cluster backend on a real local Dask cluster started by the test: a
//! scheduler and two workers (each with its nanny), candidates judged on
//! the workers' CPUs by the real judge. Needs `distributed` in
//! `$MTMC_TEST_PYTHON` (scripts/test installs it).

use std::time::Duration;

use mtmc_env::cluster::Cluster;
use mtmc_env::evaluator::{Candidate, ProblemSource, WorkerSettings};
use mtmc_env::outcome::Status;
use mtmc_env::pool::WorkerPool;
use mtmc_env::worker::Protocol;

mod common;
use common::{local_cluster, torch_python};

fn problem() -> ProblemSource {
    ProblemSource {
        name: "problem_relu.py".into(),
        code: std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/cheats/problem_relu.py"
        ))
        .unwrap(),
        graph: None,
    }
}

/// A candidate whose first forward takes `seconds`; `wrong` adds one, and
/// `abort` ends its process in the middle of the call.
fn candidate(k: usize, seconds: f64, wrong: bool, abort: bool) -> Candidate {
    Candidate::Python {
        name: format!("c{k}.py"),
        code: format!(
            "import os, time, torch, torch.nn as nn\n\
             class ModelNew(nn.Module):\n\
             \x20   calls = 0\n\
             \x20   def forward(self, x):\n\
             \x20       ModelNew.calls += 1\n\
             \x20       if ModelNew.calls == 1:\n\
             \x20           time.sleep({seconds})\n\
             \x20       if {abort}:\n\
             \x20           os.abort()\n\
             \x20       return torch.relu(x){wrong}\n",
            abort = if abort { "True" } else { "False" },
            wrong = if wrong { " + 1.0" } else { "" },
        ),
    }
}

fn settings() -> WorkerSettings {
    WorkerSettings {
        protocol: Protocol {
            trials: 3,
            ..Protocol::KERNELBENCH_FP32
        },
        limit: Duration::from_secs(120),
        ..WorkerSettings::default()
    }
}

#[tokio::test(flavor = "current_thread")]
async fn a_worker_lost_mid_batch_costs_only_its_candidates_in_flight() {
    let Some(python) = torch_python() else { return };
    let Some(mut cluster) = local_cluster(&python, 2) else {
        return;
    };
    let c = Cluster::connect(
        &cluster.address,
        python.clone(),
        None,
        Duration::from_secs(120),
    )
    .unwrap();
    assert_eq!(c.gpu, "cpu");
    assert_eq!(c.workers.len(), 2, "{:?}", c.workers);
    assert!(c.refused.is_empty());
    let kill = cluster.killer(&c.workers[0].address);
    let mut pool =
        WorkerPool::on_cluster(std::sync::Arc::new(std::sync::Mutex::new(c)), &settings());
    assert_eq!(pool.slots(), 2);
    // A worker is killed (its nanny and its process, as a host is lost)
    // as soon as the first outcome is in: the other worker's candidate in
    // flight then is judged again by the worker left.
    let killed = std::rc::Rc::new(std::cell::Cell::new(false));
    let flag = std::rc::Rc::clone(&killed);
    pool.on_each(Box::new(move |_| {
        if !flag.get() {
            kill();
            flag.set(true);
        }
    }));
    let candidates: Vec<Candidate> = (0..6).map(|k| candidate(k, 2.0, k == 2, k == 4)).collect();
    let results = pool.evaluate_all(&problem(), candidates).await;
    assert!(killed.get());
    let statuses: Vec<Status> = results
        .iter()
        .map(|d| d.result.as_ref().map(|o| o.status).unwrap())
        .collect();
    // Every candidate has its own verdict, once: the one that ends its
    // process mid-call costs itself alone.
    assert_eq!(
        statuses,
        [
            Status::Correct,
            Status::Correct,
            Status::Incorrect,
            Status::Correct,
            Status::Crashed,
            Status::Correct
        ],
        "{:?}",
        results
            .iter()
            .map(|d| d.result.as_ref().map(|o| o.error.clone()).ok())
            .collect::<Vec<_>>()
    );
    let survivor = pool.cluster().unwrap().workers[1].address.clone();
    let slots: Vec<usize> = results.iter().map(|d| d.slot).collect();
    // The killed worker judged at most the first candidate to finish (it
    // was killed as that one came in); what it had in flight then was
    // judged again by the worker left, which judged all the rest.
    assert!(
        slots.iter().filter(|&&s| s == 0).count() <= 1 && slots.iter().all(|&s| s < 2),
        "{slots:?} (the worker left is {survivor})"
    );
    // The next batch goes to the worker left, with its prepared judge.
    let again = pool
        .evaluate_all(&problem(), vec![candidate(9, 0.0, false, false)])
        .await;
    let o = again[0].result.as_ref().unwrap();
    assert_eq!(o.status, Status::Correct);
    assert_eq!(again[0].slot, 1);
    assert!(o.phases.get("reference").is_none_or(|&s| s < 0.5), "{o:?}");
    cluster.stop();
}

#[test]
fn a_cluster_without_the_named_gpu_is_refused_in_one_line() {
    let Some(python) = torch_python() else { return };
    let Some(cluster) = local_cluster(&python, 1) else {
        return;
    };
    let e = Cluster::connect(
        &cluster.address,
        python.clone(),
        Some("H200"),
        Duration::from_secs(120),
    )
    .err()
    .expect("no worker has an H200");
    let text = e.to_string();
    assert!(text.contains("has the H200: they have cpu"), "{text}");
    // Nothing listens there: a clear error, not a hang.
    let e = Cluster::connect("tcp://127.0.0.1:9", python, None, Duration::from_secs(5))
        .err()
        .expect("no scheduler");
    assert!(e.to_string().contains("tcp://127.0.0.1:9"), "{e}");
}

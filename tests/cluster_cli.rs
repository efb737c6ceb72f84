//! The commands on a real local Dask cluster (a scheduler and two
//! workers, started by the test), judging on the workers' CPUs. Needs
//! `$MTMC_TEST_PYTHON` with torch and Dask's `distributed` (scripts/test
//! installs both).

mod common;
use common::{Run, mtmc, run_until, torch_python};

fn local_cluster(python: &str, n: usize) -> Option<mtmc_env::cluster::LocalCluster> {
    match mtmc_env::cluster::LocalCluster::start(&python.into(), n) {
        Ok(c) => Some(c),
        Err(e) if std::env::var_os("MTMC_EXPECT_DASK").is_none() => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("MTMC_EXPECT_DASK is set, and {e}"),
    }
}

/// A small `Model` or `ModelNew` file computing `expr` of `x`.
fn module(class: &str, expr: &str) -> String {
    format!(
        "import torch\nimport torch.nn as nn\n\n\nclass {class}(nn.Module):\n    def forward(self, x):\n        return {expr}\n"
    )
}

/// A KernelBench checkout with two small problems (a ReLU, a tanh), sized
/// for the CPU.
fn small_checkout() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let level = dir.path().join("level1");
    std::fs::create_dir_all(&level).unwrap();
    for (file, op) in [("1_SmallReLU.py", "relu"), ("2_SmallTanh.py", "tanh")] {
        let code = module("Model", &format!("torch.{op}(x)"))
            + "\n\ndef get_inputs():\n    return [torch.randn(64, 1024)]\n\n\ndef get_init_inputs():\n    return []\n";
        std::fs::write(level.join(file), code).unwrap();
    }
    dir
}

/// `explore` of both small problems on the cluster at `address`, into
/// `store`, with `episodes` random episodes of budget 3 each.
fn explore(
    python: &str,
    dir: &std::path::Path,
    store: &std::path::Path,
    address: &str,
    episodes: &str,
) -> Run {
    mtmc(&[
        "explore",
        "L1/1",
        "L1/2",
        "--kernelbench",
        dir.to_str().unwrap(),
        "--planner",
        "random",
        "--episodes",
        episodes,
        "--budget",
        "3",
        "--screen",
        "0",
        "--trajectories",
        store.to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", python)
    .env("MTMC_CLUSTER", address)
    .env("MTMC_CACHE_DIR", store.parent().unwrap())
}

/// The store's answer to a query of one number.
fn one(store: &std::path::Path, sql: &str) -> i64 {
    rusqlite::Connection::open(store)
        .unwrap()
        .query_row(sql, [], |r| r.get(0))
        .unwrap()
}

/// Every step but a stop has its verdict, and each program judged has one
/// step with its outcome (later steps to it reuse it) and one evaluation.
fn each_program_recorded_once(store: &std::path::Path) -> i64 {
    let once = "SELECT COUNT(*) FROM (SELECT episode, step FROM steps GROUP BY episode, step HAVING COUNT(*) > 1)";
    assert_eq!(one(store, once), 0);
    let gaps = "SELECT COUNT(*) FROM (SELECT episode FROM steps GROUP BY episode HAVING MAX(step) + 1 != COUNT(*))";
    assert_eq!(one(store, gaps), 0);
    let no_verdict = "SELECT COUNT(*) FROM steps WHERE status IS NULL AND action_name != 'stop'";
    assert_eq!(one(store, no_verdict), 0);
    let judged = one(store, "SELECT COUNT(*) FROM steps WHERE outcome LIKE '{%'");
    assert_eq!(judged, one(store, "SELECT COUNT(*) FROM evaluations"));
    judged
}

#[test]
fn eval_judges_each_candidate_once_on_the_cluster_s_workers() {
    let Some(python) = torch_python() else { return };
    let Some(cluster) = local_cluster(&python, 2) else {
        return;
    };
    let dir = small_checkout();
    let files = tempfile::tempdir().unwrap();
    let honest = files.path().join("honest.py");
    std::fs::write(&honest, module("ModelNew", "torch.clamp(x, min=0.0)")).unwrap();
    let wrong = files.path().join("wrong.py");
    std::fs::write(&wrong, module("ModelNew", "torch.relu(x) + 1.0")).unwrap();
    let json = files.path().join("outcomes.json");
    let out = mtmc(&[
        "eval",
        "L1/1",
        "--kernelbench",
        dir.path().to_str().unwrap(),
        "--candidate",
        honest.to_str().unwrap(),
        "--candidate",
        wrong.to_str().unwrap(),
        "--candidate",
        honest.to_str().unwrap(),
        "--baselines",
        "none",
        "--json",
        json.to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", &python)
    .env("MTMC_CLUSTER", &cluster.address)
    .success();
    let said = format!(
        "cluster {}: 2 worker(s) with the cpu judge the candidates",
        cluster.address
    );
    assert!(out.stdout.contains(&said), "{}", out.stdout);
    let on = "3 candidate(s) on the cluster's 2 worker(s)";
    assert!(out.stdout.contains(on), "{}", out.stdout);
    let v = common::read_json(&json);
    let statuses: Vec<&str> = v
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["outcome"]["status"].as_str().unwrap())
        .collect();
    assert_eq!(statuses, ["correct", "incorrect", "correct"], "{v}");
    // A command that judges nothing refuses the flag in one line.
    let out = mtmc(&["problems", "--cluster", &cluster.address]).failure();
    assert!(
        out.error.contains("this command judges nothing"),
        "{}",
        out.error
    );
}

#[test]
fn explore_on_a_cluster_that_loses_a_worker_records_every_step_once() {
    let Some(python) = torch_python() else { return };
    let Some(cluster) = local_cluster(&python, 2) else {
        return;
    };
    let dir = small_checkout();
    let store_dir = tempfile::tempdir().unwrap();
    let store = store_dir.path().join("tree.sqlite");
    // A worker (with its nanny, as a host) is lost once the first
    // problem's first episode is in: the rest, the second problem's
    // programs among them, is judged by the worker left.
    let kill = cluster.killer(&cluster.workers()[0]);
    let (stdout, stderr, status) = run_until(
        explore(&python, dir.path(), &store, &cluster.address, "3"),
        |l| l.contains("L1/1_SmallReLU: episode 1:"),
        |_| kill(),
    );
    assert!(status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("L1/2_SmallTanh: episode 3:"), "{stdout}");
    let finished = "SELECT COUNT(*) FROM episodes WHERE finished_at IS NOT NULL";
    assert_eq!(one(&store, finished), 6);
    let later = "SELECT COUNT(*) FROM steps WHERE problem LIKE '%SmallTanh' AND outcome LIKE '{%'";
    assert!(one(&store, later) >= 2, "judged after the loss");
    each_program_recorded_once(&store);
}

#[test]
fn ctrl_c_on_a_cluster_keeps_what_the_workers_finished_and_explore_resumes() {
    let Some(python) = torch_python() else { return };
    let Some(cluster) = local_cluster(&python, 2) else {
        return;
    };
    let dir = small_checkout();
    let store_dir = tempfile::tempdir().unwrap();
    let store = store_dir.path().join("tree.sqlite");
    // The signal comes while the first round is judged (the scheduler has
    // a candidate's task on a worker): the bridge and the workers go on,
    // and what they finish is recorded.
    let in_flight = "import sys, time\nfrom distributed import Client\n\
                     c = Client(sys.argv[1], timeout=60)\nend = time.time() + 300\n\
                     while not any(str(k).startswith('mtmc-judge-') for ks in c.processing().values() for k in ks):\n\
                     \x20   assert time.time() < end, 'no candidate in flight within 300 s'\n\
                     \x20   time.sleep(0.02)\n";
    let (stdout, stderr, status) = run_until(
        explore(&python, dir.path(), &store, &cluster.address, "2"),
        |l| l.starts_with("explore: 2 problem(s)"),
        |pid| {
            let seen = std::process::Command::new(&python)
                .args(["-c", in_flight, &cluster.address])
                .status()
                .unwrap();
            assert!(seen.success());
            let kill = std::process::Command::new("kill")
                .args(["-INT", &pid.to_string()])
                .status()
                .unwrap();
            assert!(kill.success());
        },
    );
    assert_eq!(status.code(), Some(130), "{stdout}\n{stderr}");
    assert!(stderr.contains("interrupted: stopped "), "{stderr}");
    assert!(!stdout.contains("L1/2_SmallTanh: episode"), "{stdout}");
    let judged = each_program_recorded_once(&store);
    assert!(
        judged >= 1,
        "the round in flight was not kept\n{stdout}\n{stderr}"
    );
    // Run again: it resumes and finishes every episode, judging none of
    // the programs already judged again.
    let out = explore(&python, dir.path(), &store, &cluster.address, "2").success();
    assert!(
        out.stdout.contains("L1/2_SmallTanh: episode 2:"),
        "{}",
        out.stdout
    );
    let both = "SELECT COUNT(*) FROM (SELECT problem FROM episodes WHERE finished_at IS NOT NULL GROUP BY problem HAVING COUNT(*) >= 2)";
    assert_eq!(one(&store, both), 2);
    each_program_recorded_once(&store);
}

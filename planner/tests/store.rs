//! The trajectory store: a writer killed mid-run keeps every step it
//! finished; the knowledge base reads what worked on similar problems.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};

use mtmc_env::outcome::Status;
use mtmc_planner::critique::Diagnosis;
use mtmc_planner::features::{GRAPH, Problem};
use mtmc_planner::space::{Move, Shape, Slot};
use mtmc_planner::store::{StepRecord, Store, now};

fn problem(name: &str, pattern: &str) -> Problem {
    Problem {
        name: name.into(),
        pattern: pattern.into(),
        features: vec![0.5; GRAPH],
        shape: Shape::plain(2, true),
        memory_bound: false,
    }
}

fn step(episode: i64, k: usize, action: Move, reward: f64) -> StepRecord {
    let mut d = Diagnosis::failed_to_build("", true);
    d.status = Status::Correct;
    d.compile_kind = None;
    d.speedup_eager = Some(1.0 + k as f64 / 10.0);
    StepRecord {
        episode,
        step: k,
        state: "library".into(),
        observation: vec![k as f32; 16],
        action,
        next_state: format!("k{k}"),
        fragment_hash: format!("{k:064x}"),
        code: "__global__ void k0(float* x) {}\n".repeat(50),
        outcome: "{}".into(),
        diagnosis: Some(d),
        reward,
        best_speedup: 1.0,
        started_at: now(),
        reused: false,
    }
}

/// A store at `path` holding one finished random episode of L1/1: three
/// steps, programs `k0`, `k1`, `k2` at 1.0x, 1.1x and 1.2x.
fn three_steps(path: &std::path::Path) -> Store {
    let mut store = Store::open(path).unwrap();
    let p = problem("L1/1", "pointwise");
    store.put_problem(&p).unwrap();
    let e = store.begin_episode("L1/1", "random", "test", 0).unwrap();
    for k in 0..3 {
        store
            .add_step(&p, "test", &step(e, k, Move::Vectorize(4), 0.5))
            .unwrap();
    }
    store.end_episode(e, 1.2).unwrap();
    store
}

/// Writes `path.gz`, a gzip of the store at `path`.
fn gzip(path: &std::path::Path) -> std::path::PathBuf {
    use std::io::Write;
    let gz = path.with_extension("sqlite.gz");
    let mut enc = flate2::write::GzEncoder::new(
        std::fs::File::create(&gz).unwrap(),
        flate2::Compression::default(),
    );
    enc.write_all(&std::fs::read(path).unwrap()).unwrap();
    enc.finish().unwrap();
    gz
}

/// The child: writes steps until killed, saying each one it committed.
#[test]
fn writer_child() {
    let Ok(path) = std::env::var("MTMC_STORE_WRITER") else {
        return;
    };
    let mut store = Store::open(path.as_ref()).unwrap();
    let p = problem("L1/1", "matmul");
    store.put_problem(&p).unwrap();
    let episode = store.begin_episode(&p.name, "random", "test", 0).unwrap();
    for k in 0..200_000 {
        store
            .add_step(&p, "test", &step(episode, k, Move::Retile(512), 0.1))
            .unwrap();
        println!("committed {k}");
    }
}

#[test]
fn a_killed_writer_keeps_every_step_it_finished() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store.sqlite");
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "writer_child", "--nocapture", "--test-threads=1"])
        .env("MTMC_STORE_WRITER", &path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut last = None;
    while let Some(Ok(line)) = lines.next() {
        if let Some(k) = line.strip_prefix("committed ") {
            last = Some(k.parse::<usize>().unwrap());
            if last == Some(300) {
                break;
            }
        }
    }
    // SIGKILL: no destructor, no checkpoint of the WAL.
    child.kill().unwrap();
    child.wait().unwrap();
    let last = last.expect("the writer committed nothing");
    assert!(
        path.with_extension("sqlite-wal").exists(),
        "written in WAL mode"
    );

    let store = Store::open(&path).unwrap();
    assert_eq!(store.integrity().unwrap(), "ok");
    let steps = store.steps().unwrap();
    assert!(
        steps.len() > last,
        "{} steps kept, {} were committed",
        steps.len(),
        last + 1
    );
    // Rows are whole: each step has its observation and its evaluation.
    for (k, s) in steps.iter().enumerate() {
        assert_eq!(s.step, k);
        assert_eq!(s.observation, vec![k as f32; 16]);
    }
    let evals = store.evaluations("L1/1").unwrap();
    assert_eq!(evals.len(), steps.len());
    assert_eq!(
        store
            .evaluation("L1/1", "k7")
            .unwrap()
            .unwrap()
            .speedup_eager,
        Some(1.7)
    );
}

#[test]
fn the_knowledge_base_offers_what_worked_on_similar_problems() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&dir.path().join("kb.sqlite")).unwrap();
    let similar = problem("L2/1", "conv+pointwise*2");
    let other = problem("L1/9", "reduce");
    let new = problem("L2/2", "conv+pointwise*2");
    for p in [&similar, &other, &new] {
        store.put_problem(p).unwrap();
    }
    let e = store.begin_episode("L2/1", "random", "test", 0).unwrap();
    let kernel = Move::CustomKernel(Slot::All);
    for (k, (m, r)) in [(kernel, 0.8), (kernel, 0.6), (Move::Split, -0.4)]
        .into_iter()
        .enumerate()
    {
        store.add_step(&similar, "test", &step(e, k, m, r)).unwrap();
    }
    let e = store.begin_episode("L1/9", "random", "test", 0).unwrap();
    for k in 0..10 {
        store
            .add_step(&other, "test", &step(e, k, Move::Vectorize(4), 0.9))
            .unwrap();
    }
    // Too few steps of the same pattern: problems starting with `conv`
    // count too; the reduction does not.
    let all = |_: &str| true;
    let prior = store.prior(&new.pattern, &new.name, &all).unwrap();
    assert!((prior[kernel.index()] - 0.7).abs() < 1e-6, "{prior:?}");
    assert!((prior[Move::Split.index()] + 0.4).abs() < 1e-6);
    assert_eq!(prior[Move::Vectorize(4).index()], 0.0);
    // A problem's own steps are not its prior.
    let own = store.prior(&similar.pattern, &similar.name, &all).unwrap();
    assert_eq!(own[kernel.index()], 0.0);
    // Nor are the steps of a problem the knowledge base may not read (a
    // held-out one): with L2/1 unknown, nothing is left of its pattern.
    let but_l2_1 = |name: &str| name != "L2/1";
    let prior = store.prior(&new.pattern, &new.name, &but_l2_1).unwrap();
    assert_eq!(prior, [0.0; mtmc_planner::space::ACTIONS], "{prior:?}");
    // The known problems' steps are averaged step by step, across problems.
    let e = store.begin_episode("L2/3", "random", "test", 0).unwrap();
    let third = problem("L2/3", "conv+pointwise*2");
    store.put_problem(&third).unwrap();
    for k in 0..6 {
        store
            .add_step(&third, "test", &step(e, k, kernel, 0.1))
            .unwrap();
    }
    let prior = store.prior(&new.pattern, &new.name, &all).unwrap();
    assert!(
        (prior[kernel.index()] - (0.8 + 0.6 + 6.0 * 0.1) / 8.0).abs() < 1e-6,
        "{prior:?}"
    );
    let prior = store.prior(&new.pattern, &new.name, &but_l2_1).unwrap();
    assert!((prior[kernel.index()] - 0.1).abs() < 1e-6, "{prior:?}");
}

/// A gzipped store is read as it is (unpacked into a temporary folder) and
/// refused for writing; a damaged one is named in the error.
#[test]
fn a_gzipped_store_is_read_in_place_and_never_written() {
    let dir = tempfile::tempdir().unwrap();
    let plain = dir.path().join("s.sqlite");
    drop(three_steps(&plain));
    let gz = gzip(&plain);
    let packed = std::fs::read(&gz).unwrap();

    let store = Store::open_to_read(&gz).unwrap();
    assert_eq!(store.steps().unwrap().len(), 3);
    assert_eq!(
        store
            .evaluation("L1/1", "k2")
            .unwrap()
            .unwrap()
            .speedup_eager,
        Some(1.2)
    );
    drop(store);
    assert_eq!(std::fs::read(&gz).unwrap(), packed, "the file was written");

    let err = Store::open(&gz).err().expect("refused").to_string();
    assert!(err.contains("is compressed"), "{err}");

    let cut = dir.path().join("cut.sqlite.gz");
    std::fs::write(&cut, &packed[..packed.len() / 2]).unwrap();
    let err = Store::open_to_read(&cut)
        .err()
        .expect("refused")
        .to_string();
    assert!(
        err.contains("cut.sqlite.gz") && err.contains("cannot unpack"),
        "{err}"
    );

    let err = Store::open_to_read(&dir.path().join("none.sqlite"))
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
    // A folder is named as one, to read or to write.
    for err in [
        Store::open_to_read(dir.path()).err(),
        Store::open(dir.path()).err(),
    ] {
        let err = err.expect("refused").to_string();
        assert!(
            err.contains("is a folder: a store is one SQLite file"),
            "{err}"
        );
    }
}

/// Merging stores (say, recorded on two machines): every episode and step
/// of the source is copied under new episode ids, a program judged in both
/// takes the source's outcome, the source is left unchanged, merging it a
/// second time changes nothing, and a store is not merged into itself.
#[test]
fn a_merged_store_holds_both_recordings_once() {
    use std::collections::BTreeMap;
    let dir = tempfile::tempdir().unwrap();
    let (b1, b2) = (problem("L1/1", "pointwise"), problem("L1/2", "reduce"));
    let into = dir.path().join("into.sqlite");
    let mut store = three_steps(&into);

    let other = dir.path().join("other.sqlite");
    {
        let mut o = Store::open(&other).unwrap();
        for p in [&b1, &b2] {
            o.put_problem(p).unwrap();
            let e = o.begin_episode(&p.name, "greedy", "test", 7).unwrap();
            for k in 0..2 {
                // L1/1's programs k0 and k1 judged again, 1.0 faster.
                let mut s = step(e, k, Move::Split, 0.2);
                if let Some(d) = s.diagnosis.as_mut() {
                    d.speedup_eager = Some(2.0 + k as f64 / 10.0);
                }
                o.add_step(p, "test", &s).unwrap();
            }
            o.end_episode(e, 2.1).unwrap();
        }
    }
    let gz = gzip(&other);
    let packed = std::fs::read(&gz).unwrap();

    let m = store.merge(&gz).unwrap();
    assert_eq!(
        (m.problems, m.episodes, m.skipped, m.steps),
        (1, 2, 0, 4),
        "{m:?}"
    );
    // L1/2's two programs are new; L1/1's k0 and k1 now hold 2.0 and 2.1.
    assert_eq!((m.evaluations, m.replaced), (2, 2), "{m:?}");
    assert_eq!(
        std::fs::read(&gz).unwrap(),
        packed,
        "the source was written"
    );
    let speedup = |p: &str, k: &str| store.evaluation(p, k).unwrap().unwrap().speedup_eager;
    assert_eq!(speedup("L1/1", "k1"), Some(2.1));
    assert_eq!(speedup("L1/1", "k2"), Some(1.2));
    assert_eq!(speedup("L1/2", "k0"), Some(2.0));
    assert_eq!(store.problems().unwrap().len(), 2);
    // Each episode's steps stay together, in order, under their own id.
    let steps = store.steps().unwrap();
    let mut episodes: BTreeMap<i64, Vec<(String, usize)>> = BTreeMap::new();
    for s in &steps {
        episodes
            .entry(s.episode)
            .or_default()
            .push((s.problem.clone(), s.step));
    }
    let l11 = |k| ("L1/1".to_string(), k);
    let l12 = |k| ("L1/2".to_string(), k);
    assert_eq!(
        episodes.into_values().collect::<Vec<_>>(),
        vec![
            vec![l11(0), l11(1), l11(2)],
            vec![l11(0), l11(1)],
            vec![l12(0), l12(1)]
        ]
    );
    assert_eq!(store.finished_episodes("greedy").unwrap().len(), 2);

    // The plain file a second time: its episodes are already here.
    let again = store.merge(&other).unwrap();
    assert_eq!(
        (
            again.episodes,
            again.skipped,
            again.steps,
            again.evaluations,
            again.replaced
        ),
        (0, 2, 0, 0, 0),
        "{again:?}"
    );
    assert_eq!(store.steps().unwrap().len(), 7);

    let err = store.merge(&into).expect_err("refused").to_string();
    assert!(err.contains("into itself"), "{err}");
    let err = store
        .merge(&dir.path().join("none.sqlite"))
        .expect_err("refused")
        .to_string();
    assert!(err.contains("does not exist"), "{err}");
    assert_eq!(store.steps().unwrap().len(), 7);
}

/// Outcomes recorded before diagnoses carried the TF32-reference flag, or
/// shapes before they carried the convolutions flag, read as a run today
/// writes them.
#[test]
fn older_records_read_with_the_tf32_reference_and_convolution_flags() {
    let dir = tempfile::tempdir().unwrap();
    let mut store = Store::open(&dir.path().join("tf32.sqlite")).unwrap();
    let conv = problem("L3/9", "conv+pointwise");
    let mut plain = problem("L1/1", "pointwise");
    plain.features[1] = 0.0;
    for p in [&conv, &plain] {
        assert!(!p.shape.convolutions, "recorded without the flag");
        store.put_problem(p).unwrap();
    }
    let read = store.problems().unwrap();
    let flag = |name: &str| {
        read.iter()
            .find(|p| p.name == name)
            .unwrap()
            .shape
            .convolutions
    };
    assert!(flag("L3/9"), "the graph features count convolutions");
    assert!(!flag("L1/1"));
    for p in [&conv, &plain] {
        let e = store.begin_episode(&p.name, "random", "test", 0).unwrap();
        let mut first = step(e, 0, Move::CustomKernel(Slot::All), 0.1);
        // Only the outcome says that the reference was TF32-rounded, and
        // only for the convolutional problem.
        if p.name == "L3/9" {
            first.outcome = r#"{"status":"correct","reference_tf32":true}"#.into();
        }
        store.add_step(p, "test", &first).unwrap();
        let mut wrong = step(e, 1, Move::GemmKernel, -0.3);
        wrong.diagnosis.as_mut().unwrap().status = Status::Incorrect;
        store.add_step(p, "test", &wrong).unwrap();
        let built = step(e, 2, Move::Vectorize(4), -0.5);
        let mut failed = built;
        failed.diagnosis = Some(Diagnosis::failed_to_build("k.cu(1): error: x", false));
        store.add_step(p, "test", &failed).unwrap();
    }
    assert!(store.reference_tf32("L3/9").unwrap());
    assert!(!store.reference_tf32("L1/1").unwrap());
    let evals = store.evaluations("L3/9").unwrap();
    assert_eq!(evals.len(), 3);
    for d in evals.values() {
        // A run that checked values knows the reference; a build failure
        // ran nothing.
        let checked = matches!(d.status, Status::Correct | Status::Incorrect);
        assert_eq!(d.reference_tf32, checked, "{d:?}");
    }
    assert!(
        store
            .evaluations("L1/1")
            .unwrap()
            .values()
            .all(|d| !d.reference_tf32)
    );
    assert!(
        store
            .evaluations_by("L3/9", "random")
            .unwrap()
            .values()
            .any(|d| d.reference_tf32)
    );
    // One program read alone (a live search reusing a recorded outcome)
    // reads the same.
    for (key, d) in &evals {
        assert_eq!(store.evaluation("L3/9", key).unwrap().as_ref(), Some(d));
    }
    assert!(store.evaluation("L3/9", "nothing").unwrap().is_none());
}

/// An outcome compiled only (recorded where no GPU was found) never
/// replaces one judged on a GPU, in a step or a merge; a GPU's outcome
/// replaces one compiled only.
#[test]
fn an_outcome_compiled_only_never_replaces_a_timed_one() {
    let dir = tempfile::tempdir().unwrap();
    let into = dir.path().join("into.sqlite");
    // k0, k1, k2 judged on a GPU: 1.0x, 1.1x, 1.2x.
    let mut store = three_steps(&into);
    let p = problem("L1/1", "pointwise");
    let compiled = |e: i64, k: usize| {
        let mut s = step(e, k, Move::Vectorize(2), 0.045);
        let d = s.diagnosis.as_mut().unwrap();
        d.status = Status::CompiledOnly;
        d.speedup_eager = None;
        s
    };
    let status = |store: &Store, k: &str| store.evaluation("L1/1", k).unwrap().unwrap();

    // A compile-only run on k0 and on a program new to the store, k3.
    let e = store.begin_episode("L1/1", "greedy", "test", 1).unwrap();
    store.add_step(&p, "test", &compiled(e, 0)).unwrap();
    store.add_step(&p, "test", &compiled(e, 3)).unwrap();
    store.end_episode(e, 0.0).unwrap();
    assert_eq!(status(&store, "k0").status, Status::Correct);
    assert_eq!(status(&store, "k0").speedup_eager, Some(1.0));
    assert_eq!(status(&store, "k3").status, Status::CompiledOnly);
    // Judged on a GPU afterwards, k3 holds its timing.
    let e = store.begin_episode("L1/1", "greedy", "test", 2).unwrap();
    store
        .add_step(&p, "test", &step(e, 3, Move::Split, 0.3))
        .unwrap();
    store.end_episode(e, 1.3).unwrap();
    assert_eq!(status(&store, "k3").speedup_eager, Some(1.3));

    // A store recorded without a GPU, merged: k1 and k2 keep their
    // timings, k4 (new) comes in compiled only.
    let other = dir.path().join("compiled.sqlite");
    {
        let mut o = Store::open(&other).unwrap();
        o.put_problem(&p).unwrap();
        let e = o.begin_episode("L1/1", "random", "test", 9).unwrap();
        for k in [1, 2, 4] {
            o.add_step(&p, "test", &compiled(e, k)).unwrap();
        }
        o.end_episode(e, 0.0).unwrap();
    }
    let m = store.merge(&other).unwrap();
    assert_eq!((m.evaluations, m.replaced, m.kept), (1, 0, 2), "{m:?}");
    assert_eq!(status(&store, "k1").speedup_eager, Some(1.1));
    assert_eq!(status(&store, "k2").status, Status::Correct);
    assert_eq!(status(&store, "k4").status, Status::CompiledOnly);

    // The other way round: the GPU's outcomes replace those compiled only
    // (k1, k2; k0 and k3 are new there, k4 the same in both).
    let mut o = Store::open(&other).unwrap();
    let m = o.merge(&into).unwrap();
    assert_eq!((m.evaluations, m.replaced, m.kept), (2, 2, 0), "{m:?}");
    assert_eq!(status(&o, "k1").speedup_eager, Some(1.1));
}

/// A problem recorded before the graph features flagged the rewrites that
/// apply reads with them cleared, so that its observations have this
/// build's length, and is named as such; one recorded now keeps its flags.
#[test]
fn problems_recorded_before_the_rewrites_flags_read_them_cleared() {
    let dir = tempfile::tempdir().unwrap();
    let store = Store::open(&dir.path().join("flags.sqlite")).unwrap();
    let now = problem("L2/34", "conv+norm+pointwise*2");
    let mut old = problem("L2/26", "conv+pointwise*2");
    let flags = mtmc_actions::rewrite::REWRITES.len();
    old.features.truncate(GRAPH - flags);
    for p in [&now, &old] {
        store.put_problem(p).unwrap();
    }
    assert_eq!(
        store.problems_without_rewrite_flags().unwrap(),
        ["L2/26".to_string()]
    );
    let read = store.problems().unwrap();
    let of = |name: &str| read.iter().find(|p| p.name == name).unwrap().clone();
    assert_eq!(of("L2/34").features, now.features);
    let upgraded = of("L2/26").features;
    assert_eq!(upgraded.len(), GRAPH);
    assert_eq!(upgraded[..GRAPH - flags], old.features[..]);
    assert!(upgraded[GRAPH - flags..].iter().all(|&f| f == 0.0));
}

#[test]
fn an_episodes_moves_read_back_in_order_with_their_outcomes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.sqlite");
    let mut store = three_steps(&path);
    // An episode that never finished (a killed run) is not read.
    let p = problem("L1/1", "pointwise");
    let open = store.begin_episode("L1/1", "random", "test", 1).unwrap();
    store
        .add_step(&p, "test", &step(open, 0, Move::Retile(512), 0.1))
        .unwrap();
    // Neither is another planner's.
    let greedy = store.begin_episode("L1/1", "greedy", "test", 0).unwrap();
    let mut timed = step(greedy, 0, Move::Retile(128), 0.1);
    timed.outcome = r#"{"status":"correct","runtime":{"mean_ms":0.25}}"#.into();
    store.add_step(&p, "test", &timed).unwrap();
    store.end_episode(greedy, 1.0).unwrap();

    let random = store.finished_moves("L1/1", "random").unwrap();
    assert_eq!(random.len(), 1);
    let (best, moves) = &random[0];
    assert_eq!(*best, 1.2);
    assert_eq!(
        moves
            .iter()
            .map(|t| t.next_state.as_str())
            .collect::<Vec<_>>(),
        ["k0", "k1", "k2"]
    );
    assert!(moves.iter().all(|t| t.action == Move::Vectorize(4).index()));
    assert_eq!(moves[2].fragment_hash, format!("{:064x}", 2));
    let d = moves[1].diagnosis.as_ref().unwrap();
    assert_eq!((d.status, d.speedup_eager), (Status::Correct, Some(1.1)));
    // No time where the outcome holds none.
    assert!(moves.iter().all(|t| t.mean_ms.is_none()));
    let greedy = store.finished_moves("L1/1", "greedy").unwrap();
    assert_eq!(greedy[0].1[0].mean_ms, Some(0.25));
    assert!(store.finished_moves("L1/2", "random").unwrap().is_empty());
}

/// A store names the GPU its outcomes were judged on once a command
/// claims it; outcomes of another GPU are refused, and so is a merge of
/// two GPUs' stores.
#[test]
fn a_store_names_its_gpu_and_refuses_another_s_outcomes() {
    use mtmc_planner::store::{Claim, StoreError};
    let dir = tempfile::tempdir().unwrap();
    // An empty store names nothing until it is claimed.
    let fresh = Store::open(&dir.path().join("fresh.sqlite")).unwrap();
    assert_eq!(fresh.gpu().unwrap(), None);
    assert_eq!(fresh.claim_gpu("H200").unwrap(), Claim::New);
    assert_eq!(fresh.claim_gpu("H200").unwrap(), Claim::Same);
    assert_eq!(fresh.gpu().unwrap().as_deref(), Some("H200"));
    match fresh.claim_gpu("H100") {
        Err(e @ StoreError::OtherGpu { .. }) => {
            let says = e.to_string();
            assert!(
                says.contains("judged on the H200")
                    && says.contains("H100 is the GPU here")
                    && says.contains("--trajectories NEW.sqlite"),
                "{says}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(fresh.gpu().unwrap().as_deref(), Some("H200"));

    // Outcomes judged on a GPU that no record names (an earlier mtmc's):
    // claimed, the store takes this GPU as theirs and says so. A store of
    // compile-only outcomes holds nothing of a GPU.
    let old = dir.path().join("old.sqlite");
    let old_store = three_steps(&old);
    assert_eq!(old_store.gpu().unwrap(), None);
    let compiled = dir.path().join("compiled.sqlite");
    {
        let mut o = Store::open(&compiled).unwrap();
        let p = problem("L1/2", "pointwise");
        o.put_problem(&p).unwrap();
        let e = o.begin_episode("L1/2", "random", "test", 0).unwrap();
        let mut s = step(e, 0, Move::Split, 0.045);
        let d = s.diagnosis.as_mut().unwrap();
        d.status = Status::CompiledOnly;
        d.speedup_eager = None;
        o.add_step(&p, "test", &s).unwrap();
        o.end_episode(e, 0.0).unwrap();
        assert_eq!(o.evaluations("L1/2").unwrap().len(), 1);
    }
    assert_eq!(
        Store::open(&compiled).unwrap().claim_gpu("H100").unwrap(),
        Claim::New
    );

    // Merged: a store of the H100 into one of the H200 is refused, and
    // nothing of it comes in.
    let h100 = dir.path().join("h100.sqlite");
    three_steps(&h100).claim_gpu("H100").unwrap();
    let mut h200 = Store::open(&dir.path().join("fresh.sqlite")).unwrap();
    match h200.merge(&h100) {
        Err(e @ StoreError::MergeGpus { .. }) => {
            let says = e.to_string();
            assert!(
                says.contains("judged on the H100") && says.contains("(on the H200)"),
                "{says}"
            );
        }
        other => panic!("{other:?}"),
    }
    assert!(h200.evaluations("L1/1").unwrap().is_empty());
    // A store that named no GPU takes the merged store's; the unclaimed
    // store of an earlier mtmc stays as it was.
    let mut into = Store::open(&dir.path().join("into.sqlite")).unwrap();
    let m = into.merge(&h100).unwrap();
    assert_eq!(m.named_gpu.as_deref(), Some("H100"), "{m:?}");
    assert_eq!(into.gpu().unwrap().as_deref(), Some("H100"));
    let m = into.merge(&old).unwrap();
    assert_eq!(m.named_gpu, None, "{m:?}");
    assert_eq!(into.gpu().unwrap().as_deref(), Some("H100"));
    assert_eq!(old_store.gpu().unwrap(), None);
    assert_eq!(old_store.claim_gpu("H100").unwrap(), Claim::Unnamed);
    assert_eq!(old_store.gpu().unwrap().as_deref(), Some("H100"));
}

/// What `train`, `compare` and `rejudge` read a store as: its GPU by
/// default, `--gpu NAME` only where the store is that GPU's, and never a
/// store whose outcomes name two GPUs.
#[test]
fn a_store_is_read_as_its_gpu_s_and_a_mix_is_refused() {
    use mtmc_planner::store::StoreError;
    let dir = tempfile::tempdir().unwrap();
    let judged_on = |path: &std::path::Path, devices: &[&str]| {
        let mut store = Store::open(path).unwrap();
        let p = problem("L1/1", "pointwise");
        store.put_problem(&p).unwrap();
        let e = store.begin_episode("L1/1", "random", "test", 0).unwrap();
        for (k, device) in devices.iter().enumerate() {
            let mut s = step(e, k, Move::Vectorize(4), 0.5);
            s.outcome =
                format!(r#"{{"evaluator":"worker","status":"correct","device":"{device}"}}"#);
            store.add_step(&p, "test", &s).unwrap();
        }
        store.end_episode(e, 1.2).unwrap();
        store
    };
    // Outcomes of one GPU in a store that names none: read as theirs.
    let one = judged_on(
        &dir.path().join("one.sqlite"),
        &["NVIDIA H200", "NVIDIA H200"],
    );
    assert_eq!(
        one.outcome_gpus().unwrap(),
        [("NVIDIA H200".to_string(), 2)]
    );
    assert_eq!(one.gpu_for(None).unwrap().as_deref(), Some("NVIDIA H200"));
    assert_eq!(
        one.gpu_for(Some("h200")).unwrap().as_deref(),
        Some("NVIDIA H200")
    );
    match one.gpu_for(Some("H100")) {
        Err(e @ StoreError::NotThatGpu { .. }) => {
            let says = e.to_string();
            assert!(
                says.contains("judged on the NVIDIA H200, not the H100 (--gpu H100)"),
                "{says}"
            );
        }
        other => panic!("{other:?}"),
    }
    // The name the store was claimed under comes first.
    one.claim_gpu("H200").unwrap();
    assert_eq!(one.gpu_for(Some("H200")).unwrap().as_deref(), Some("H200"));
    // Two GPUs' outcomes in one store: refused in one line, with each.
    let mixed = judged_on(
        &dir.path().join("mixed.sqlite"),
        &["NVIDIA H100 80GB HBM3", "NVIDIA H200", "NVIDIA H200"],
    );
    match mixed.gpu_for(None) {
        Err(e @ StoreError::MixedGpus { .. }) => {
            let says = e.to_string();
            assert!(
                says.contains("NVIDIA H200 (2) and NVIDIA H100 80GB HBM3 (1)")
                    && !says.contains('\n'),
                "{says}"
            );
        }
        other => panic!("{other:?}"),
    }
    // A store of compile-only outcomes names no GPU: --gpu names it.
    let none = three_steps(&dir.path().join("none.sqlite"));
    assert_eq!(none.gpu_for(None).unwrap(), None);
    assert_eq!(none.gpu_for(Some("H200")).unwrap().as_deref(), Some("H200"));
}

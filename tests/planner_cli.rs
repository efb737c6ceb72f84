//! The planner's commands end to end on the CPU (compile-only: real NVRTC,
//! nothing run): `explore` fills a real SQLite store and resumes, `train`
//! writes a checkpoint and curves and refuses to overwrite one, `compare`
//! prints the table, and `optimize --planner` uses the checkpoint.

mod common;

use std::path::Path;

use common::{Output, Run, interrupted, interrupted_report, mtmc, read_json, shared_jsonl, walk};

/// `mtmc explore` of L2/76 (a GEMM and a pointwise region) and L1/24 (a
/// softmax row) into `store`: `episodes` of `planner` each, at budget 6.
fn explore_two<'a>(
    kb: &'a str,
    planner: &'a str,
    episodes: &'a str,
    store: &'a str,
) -> Vec<&'a str> {
    vec![
        "--kernelbench",
        kb,
        "explore",
        "L2/76",
        "L1/24",
        "--split",
        "all",
        "--planner",
        planner,
        "--episodes",
        episodes,
        "--budget",
        "6",
        "--trajectories",
        store,
    ]
}

/// The recorded H100 tree that comes with mtmc.
fn recorded_h100() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(mtmc_planner::store::RECORDED_H100)
}

/// A small `train` on the recorded H100 tree (4 episodes an iteration,
/// 16 hidden units) into `out`: its arguments, to run or to stop.
fn small_train(out: &Path, iterations: &str, members: &str) -> Vec<String> {
    let tree = recorded_h100();
    [
        "train",
        "--trajectories",
        tree.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--iterations",
        iterations,
        "--episodes",
        "4",
        "--hidden",
        "16",
        "--members",
        members,
    ]
    .map(String::from)
    .to_vec()
}

/// `mtmc` with arguments held as strings.
fn mtmc_owned(args: &[String]) -> Run {
    mtmc(&args.iter().map(String::as_str).collect::<Vec<_>>())
}

/// `mtmc compare --live` on every problem of `store` (`--split all`) with
/// the checkpoint `ck`, at `budget`, into `out`.
fn live_args<'a>(store: &'a str, ck: &'a str, budget: &'a str, out: &'a str) -> Vec<&'a str> {
    vec![
        "compare",
        "--live",
        "--trajectories",
        store,
        "--checkpoint",
        ck,
        "--split",
        "all",
        "--budget",
        budget,
        "--out",
        out,
    ]
}

/// `mtmc train` of two small iterations (a tiny policy): enough to write a
/// checkpoint and say what it trained on.
fn train_briefly(store: &str, out: &str, extra: &[&str]) -> Run {
    let mut args = vec![
        "train",
        "--trajectories",
        store,
        "--out",
        out,
        "--iterations",
        "2",
        "--episodes",
        "4",
        "--hidden",
        "16",
    ];
    args.extend_from_slice(extra);
    mtmc(&args)
}

#[test]
fn explore_train_compare_and_a_planned_optimize() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("traj.sqlite");
    let ck = dir.path().join("ck");
    let kb = shared_jsonl();
    let store_s = store.to_string_lossy().into_owned();
    let ck_s = ck.to_string_lossy().into_owned();

    let explore = |planner: &str, episodes: &str| {
        mtmc(&explore_two(&kb, planner, episodes, &store_s)).success()
    };
    // Without the problems' code (the built-in traces hold graphs only) it
    // stops before any episode, and no store is made.
    let no_code = mtmc(&explore_two(&kb, "random", "1", &store_s)[2..]).failure();
    assert!(
        no_code
            .stderr
            .contains("explore builds each problem's ModelNew from its code")
            && no_code.stderr.contains("pass --kernelbench PATH")
            && no_code.stdout.is_empty()
            && !store.exists(),
        "{}\n{}",
        no_code.stdout,
        no_code.stderr
    );
    let run = explore("exhaustive", "1");
    assert!(
        run.stdout.contains("no GPU: compile only"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains("L2/76_Gemm_Add_ReLU: episode 1: best 0.000x in 6 evaluation(s)"),
        "{}",
        run.stdout
    );
    let run = explore("random", "2");
    assert!(run.stdout.contains("4 episode(s) to run"), "{}", run.stdout);
    // Run again: nothing left to do.
    let again = explore("random", "2");
    assert!(
        again.stdout.contains("0 episode(s) to run (4 already in"),
        "{}",
        again.stdout
    );

    let conn = mtmc_planner::store::Store::open(&store).unwrap();
    assert_eq!(conn.integrity().unwrap(), "ok");
    let evals = conn.evaluations("L2/76_Gemm_Add_ReLU").unwrap();
    assert!(
        evals.contains_key("library") && evals.contains_key("k1 gemm b256 v1"),
        "{:?}",
        evals.keys()
    );
    // Compile-only outcomes are reused, not judged again: the random
    // episodes add no program the exhaustive one had.
    assert!(conn.steps().unwrap().len() >= 12);

    let train = |iterations: &str, extra: &[&str]| {
        let mut args = vec![
            "train",
            "--trajectories",
            &store_s,
            "--out",
            &ck_s,
            "--iterations",
            iterations,
            "--episodes",
            "8",
            "--hidden",
            "32",
            "--members",
            "2",
        ];
        args.extend_from_slice(extra);
        mtmc(&args)
    };
    let run = train("3", &[]).success();
    assert!(run.stdout.contains("iterations 1..3"), "{}", run.stdout);
    // Recorded without a GPU, no program was timed, and train says so.
    assert!(
        run.stdout
            .contains("recorded programs were compiled only (recorded where no GPU was found)"),
        "{}",
        run.stdout
    );
    // A committee of two: the second member trains with the next seed in
    // its own folder, and the checkpoint's meta names it.
    assert!(
        run.stdout.contains("a committee of 2 (seeds 1..=2)")
            && run.stdout.contains("member 2/2 iterations 1..3"),
        "{}",
        run.stdout
    );
    assert!(ck.join("member-2").join("policy.mpk").is_file());
    assert_eq!(
        read_json(&ck.join("meta.json"))["members"],
        serde_json::json!(["member-2"])
    );
    for f in [
        "meta.json",
        "policy.mpk",
        "optimizer.mpk",
        "rtg.mpk",
        "curves.csv",
        "curves.svg",
        "train.json",
    ] {
        assert!(ck.join(f).is_file(), "{f} missing");
    }
    let csv = std::fs::read_to_string(ck.join("curves.csv")).unwrap();
    assert_eq!(csv.lines().count(), 4, "{csv}");
    let svg = std::fs::read_to_string(ck.join("curves.svg")).unwrap();
    assert!(svg.starts_with("<svg") && svg.matches("<polyline").count() == 4);
    // An evaluation costs nothing in the reward unless asked; a negative
    // cost is refused before anything is read or written.
    let meta = read_json(&ck.join("train.json"));
    assert_eq!(meta["ppo"]["step_cost"], 0.0, "{meta}");
    assert_eq!(meta["ppo"]["gamma"], 0.6, "{meta}");
    assert_eq!(meta["validation"], false, "{meta}");
    assert_eq!(meta["members"][1]["seed"], 2, "{meta}");
    let err = train("3", &["--gamma", "0"]).failure();
    assert!(err.error.contains("outside (0, 1]"), "{}", err.error);
    let err = train("3", &["--lr", "0"]).failure();
    assert!(
        err.error.contains("0 is not a learning rate"),
        "{}",
        err.error
    );
    // An --out that names a file is refused before training, said once.
    let file = dir.path().join("a-file");
    std::fs::write(&file, "").unwrap();
    let err = train_briefly(&store_s, &file.to_string_lossy(), &[]).failure();
    assert!(
        err.error
            .contains("is a file: --out names the folder to write to")
            && err.error.matches("File exists").count() == 0
            && !err.stdout.contains("member 1/"),
        "{}",
        err.error
    );
    // A policy of 0 hidden units panicked in burn; it is refused now.
    let err = mtmc(&[
        "train",
        "--trajectories",
        &store_s,
        "--out",
        &ck_s,
        "--hidden",
        "0",
    ])
    .failure();
    assert!(
        err.error
            .contains("'0' for '--hidden <HIDDEN>': 0 is too few"),
        "{}",
        err.error
    );
    let err = train("3", &["--budget", "0"]).failure();
    assert!(
        err.error
            .contains("a budget of 0 evaluations judges nothing"),
        "{}",
        err.error
    );
    let err = train("3", &["--step-cost=-1"]).failure();
    assert!(
        err.error
            .contains("--step-cost -1: give a cost of 0 or more"),
        "{}",
        err.error
    );
    // A checkpoint is never overwritten by accident; --resume continues it.
    let err = train("3", &[]).failure();
    assert!(err.error.contains("pass --resume"), "{}", err.error);
    let run = train("5", &["--resume"]).success();
    assert!(
        run.stdout.contains("resuming") && run.stdout.contains("iterations 1..5"),
        "{}",
        run.stdout
    );
    let csv = std::fs::read_to_string(ck.join("curves.csv")).unwrap();
    assert_eq!(csv.lines().count(), 6, "{csv}");
    // Training on the GPU needs a build with burn's CUDA backend; one
    // without it says how to get one, and the checkpoint is untouched.
    if !cfg!(feature = "cuda") {
        let err = train("7", &["--resume", "--device", "cuda"]).failure();
        assert!(err.error.contains("--features cuda"), "{}", err.error);
        let csv = std::fs::read_to_string(ck.join("curves.csv")).unwrap();
        assert_eq!(csv.lines().count(), 6, "{csv}");
    }

    // `compare` on this store, with more flags.
    let compare = |more: &[&str]| {
        let mut args = vec!["compare", "--trajectories", &store_s];
        args.extend_from_slice(more);
        mtmc(&args)
    };
    let json = dir.path().join("compare.json");
    let json_s = json.to_string_lossy().into_owned();
    // A file named as the live comparison's default folder stops neither
    // a comparison in replay nor anything but a live one.
    std::fs::write(dir.path().join("mtmc-compare-live"), "").unwrap();
    let mut args = vec!["compare", "--trajectories", &store_s, "--checkpoint", &ck_s];
    mtmc(&args).current_dir(dir.path()).success();
    args.extend(["--live", "--kernelbench", &kb]);
    let err = mtmc(&args).current_dir(dir.path()).failure();
    assert!(
        err.error
            .contains("`mtmc-compare-live` is a file: --out names the folder to write to"),
        "{}",
        err.error
    );
    // A --json it could not write is refused before the comparison.
    let lost = dir.path().join("no-such-folder").join("compare.json");
    let err = compare(&["--checkpoint", &ck_s, "--json", &lost.to_string_lossy()]).failure();
    assert!(
        err.error
            .contains("no-such-folder` does not exist: make it first")
            && err.stdout.is_empty(),
        "{}",
        err.error
    );
    let run = compare(&["--checkpoint", &ck_s, "--split", "all", "--json", &json_s]).success();
    for planner in ["trained", "random", "greedy", "exhaustive"] {
        assert!(
            run.stdout.lines().any(|l| l.starts_with(planner)),
            "{}",
            run.stdout
        );
    }
    assert!(run.stdout.contains("evals to 90%"), "{}", run.stdout);
    // Nothing here was timed, and the table says so.
    assert!(
        run.stdout.contains("were compiled only")
            && run.stdout.contains("this table measures no speed"),
        "{}",
        run.stdout
    );
    // A committee copied without its members is refused, naming the one
    // missing and what to do.
    let lone = dir.path().join("lone");
    std::fs::create_dir(&lone).unwrap();
    for f in ["meta.json", "policy.mpk", "rtg.mpk"] {
        std::fs::copy(ck.join(f), lone.join(f)).unwrap();
    }
    let err = compare(&["--checkpoint", &lone.to_string_lossy()]).failure();
    assert!(
        err.error.contains("member `member-2` is missing")
            && err.error.contains("copy the whole folder"),
        "{}",
        err.error
    );
    // The random episodes helped build these trees: compare says so.
    assert!(
        run.stdout
            .contains("other planners than exhaustive (random on 2)"),
        "{}",
        run.stdout
    );
    // On the exhaustive episodes' programs alone: L2/76's tree is the six
    // programs its exhaustive episode evaluated, and no other planner's
    // episodes are warned of (only that nothing was timed).
    let json_x = dir.path().join("compare-exhaustive.json");
    let json_x_s = json_x.to_string_lossy().into_owned();
    let run = compare(&[
        "--split",
        "all",
        "--recorded-by",
        "exhaustive",
        "--json",
        &json_x_s,
    ])
    .success();
    let warnings: Vec<&str> = run
        .stdout
        .lines()
        .filter(|l| l.starts_with("warning"))
        .collect();
    assert!(
        warnings.len() == 1 && warnings[0].contains("were compiled only"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout
            .contains("(the programs episodes of exhaustive reached)"),
        "{}",
        run.stdout
    );
    let doc_x = read_json(&json_x);
    assert_eq!(doc_x["recorded_by"], "exhaustive", "{doc_x}");
    let programs = |doc: &serde_json::Value, name: &str| {
        doc["problems"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["problem"].as_str().unwrap().starts_with(name))
            .map(|p| p["programs"].as_u64().unwrap())
            .unwrap()
    };
    let err = compare(&["--split", "all", "--recorded-by", "greedy"]).failure();
    assert!(
        err.error
            .contains("(planners with episodes here: exhaustive, random)"),
        "{}",
        err.error
    );
    // The JSON holds the table and each problem's result per planner.
    let doc = read_json(&json);
    let rows = doc["planners"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{doc}");
    assert!(rows.iter().all(|r| r["reached_90"].is_number()), "{doc}");
    let problems = doc["problems"].as_array().unwrap();
    assert_eq!(problems.len(), 2, "{doc}");
    assert_eq!(programs(&doc_x, "L2/76"), 6, "{doc_x}");
    // (the seeded random episodes reached programs the exhaustive one did
    // not, so the unfiltered tree is larger)
    assert!(programs(&doc, "L2/76") > 6, "{doc}");
    for p in problems {
        assert!(p["programs"].as_u64().unwrap() >= 1, "{p}");
        for planner in ["trained", "random", "greedy"] {
            let used = p["planners"][planner]["evaluations"].as_f64().unwrap();
            assert!((1.0..=8.0).contains(&used), "{planner}: {p}");
            // The path of its first episode: a step per evaluation, each
            // `move -> program: outcome`.
            let path = p["planners"][planner]["path"].as_array().unwrap();
            assert!(!path.is_empty(), "{planner}: {p}");
            for s in path {
                let (step, outcome) = s.as_str().unwrap().split_once(": ").unwrap();
                assert!(step.contains(" -> "), "{s}");
                assert!(!outcome.is_empty(), "{s}");
            }
            if planner != "random" {
                assert_eq!(path.len() as f64, used, "{planner}: {p}");
            }
            // The trained planner's path says what it weighed at each step:
            // the policy's likeliest legal moves with their odds, and the
            // move it took (the one of that step of the path).
            let weighed = p["planners"][planner]["considered"].as_array();
            if planner == "trained" {
                let weighed = weighed.unwrap_or_else(|| panic!("{p}"));
                assert_eq!(weighed.len(), path.len(), "{p}");
                for (w, s) in weighed.iter().zip(path) {
                    let w = w.as_str().unwrap();
                    let took = s.as_str().unwrap().split(" -> ").next().unwrap();
                    assert!(w.starts_with("policy: "), "{w}");
                    assert!(w.ends_with(&format!("; took {took}")), "{w} / {s}");
                    assert!(
                        w.contains(&format!("{took} 0.")) || w.contains(&format!("{took} 1.")),
                        "{w}"
                    );
                }
            } else {
                assert!(weighed.is_none(), "{planner}: {p}");
            }
        }
    }

    // `compare --live` runs each planner's search now (here compile only:
    // nothing is timed), writes its folder as it goes, and resumes.
    let live = dir.path().join("live");
    let live_s = live.to_string_lossy().into_owned();
    let live_of = |ck: &str, out: &str, budget: &str, more: &[&str]| {
        let mut args = vec!["--kernelbench", &kb];
        args.extend(live_args(&store_s, ck, budget, out));
        args.extend_from_slice(more);
        mtmc(&args)
    };
    let live_in = |out: &str, budget: &str, more: &[&str]| live_of(&ck_s, out, budget, more);
    let live_run_with = |budget: &str, more: &[&str]| live_in(&live_s, budget, more);
    let live_run = |budget: &str| live_run_with(budget, &[]);
    // Without the problems' code (the built-in traces hold graphs only)
    // nothing runs, and nothing is written.
    let nowhere = dir.path().join("no-code");
    let err = mtmc(&live_args(&store_s, &ck_s, "2", &nowhere.to_string_lossy())).failure();
    assert!(
        err.error.contains("has none here")
            && err.error.contains("pass --kernelbench")
            && !nowhere.exists(),
        "{}",
        err.error
    );
    let run = live_run("2").success();
    assert!(
        run.stdout.contains("6 episode(s) to run (0 already in")
            && run.stdout.contains("no GPU: compile only"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("judged live (compile only)"),
        "{}",
        run.stdout
    );
    for planner in ["trained", "random", "greedy", "exhaustive"] {
        assert!(
            run.stdout.lines().any(|l| l.starts_with(planner)),
            "{}",
            run.stdout
        );
    }
    let episodes = live.join("episodes.jsonl");
    let lines = |path: &std::path::Path| -> Vec<serde_json::Value> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    };
    let first = lines(&episodes);
    assert_eq!(first.len(), 6);
    for e in &first {
        let n = e["evaluations"].as_u64().unwrap();
        assert!((1..=2).contains(&n), "{e}");
        assert_eq!(e["bests"].as_array().unwrap().len() as u64, n, "{e}");
        // Without --policy-stops the trained planner spends the budget.
        if e["planner"] == "trained" {
            assert_eq!(n, 2, "{e}");
        }
    }
    assert_eq!(std::fs::read_dir(live.join("logs")).unwrap().count(), 6);
    let steps = mtmc_planner::store::Store::open(&live.join("trajectories.sqlite")).unwrap();
    let by = steps.planners_of("L2/76_Gemm_Add_ReLU").unwrap();
    assert_eq!(by.len(), 3, "{by:?}");
    let doc = read_json(&live.join("compare.json"));
    assert_eq!(doc["live"], true, "{doc}");
    // Without a GPU nothing is timed, so no best program is judged again.
    assert_eq!(read_json(&live.join("settings.json"))["rejudge"], true);
    assert!(first.iter().all(|e| e["rejudged"].is_null()), "{first:?}");
    assert!(doc["as_found"]["trained"].is_number(), "{doc}");
    assert_eq!(doc["planners"].as_array().unwrap().len(), 4, "{doc}");
    // A kill cuts the last line short: that episode alone runs again, and
    // the file is whole afterwards.
    let text = std::fs::read_to_string(&episodes).unwrap();
    std::fs::write(&episodes, &text[..text.len() - 10]).unwrap();
    // `--table-only` prints what the stopped pass found, on the problems
    // every planner finished, and runs and rewrites nothing.
    let table = live_run_with("2", &["--table-only"]).success();
    assert!(
        table.stdout.contains("5 episode(s) in")
            && table.stdout.contains("1 not run")
            && table.stdout.contains("1 problem(s) left out")
            && table.stdout.lines().any(|l| l.starts_with("trained")),
        "{}",
        table.stdout
    );
    assert_eq!(
        std::fs::read_to_string(&episodes).unwrap(),
        text[..text.len() - 10]
    );
    let nowhere = dir.path().join("no-pass");
    let err = live_in(&nowhere.to_string_lossy(), "2", &["--table-only"]).failure();
    assert!(
        err.error.contains("holds no live comparison") && !nowhere.exists(),
        "{}",
        err.error
    );
    let run = live_run("2").success();
    assert!(
        run.stdout.contains("1 episode(s) to run (5 already in"),
        "{}",
        run.stdout
    );
    assert_eq!(lines(&episodes).len(), 6);
    // Ctrl-C as soon as a pass says what it will run: the episode in
    // flight is not kept, and the same command resumes.
    let cut = dir.path().join("live-stopped");
    let cut_s = cut.to_string_lossy().into_owned();
    let mut args = vec!["--kernelbench", &kb];
    args.extend(live_args(&store_s, &ck_s, "2", &cut_s));
    let (out, err) = interrupted(&args, |l| l.starts_with("compare --live: "));
    let cut_episodes = cut.join("episodes.jsonl");
    assert!(
        err.contains(&format!(
            "every finished episode is in {}: run the same command again to resume",
            cut_episodes.display()
        )),
        "{err}"
    );
    let kept = match cut_episodes.exists() {
        true => lines(&cut_episodes).len(),
        false => 0,
    };
    let printed = out
        .lines()
        .filter(|l| l.contains(" evaluation(s) ("))
        .count();
    assert!(kept == printed && kept < 6, "{out}");
    let run = live_in(&cut_s, "2", &[]).success();
    assert!(
        run.stdout.contains(&format!(
            "{} episode(s) to run ({kept} already in",
            6 - kept
        )),
        "{}",
        run.stdout
    );
    assert_eq!(lines(&cut_episodes).len(), 6);
    // Other settings into the same folder are refused.
    let err = live_run("3").failure();
    assert!(
        err.error.contains("other settings") && err.error.contains("another --out"),
        "{}",
        err.error
    );
    let err = live_run_with("2", &["--policy-stops"]).failure();
    assert!(err.error.contains("other settings"), "{}", err.error);
    // A folder written before the setting existed let the policy stop.
    let settings = live.join("settings.json");
    let mut old = read_json(&settings);
    old.as_object_mut().unwrap().remove("policy_stops");
    std::fs::write(&settings, old.to_string()).unwrap();
    assert!(live_run("2").failure().error.contains("other settings"));
    let run = live_run_with("2", &["--policy-stops"]).success();
    assert!(
        run.stdout.contains("0 episode(s) to run (6 already in")
            && run.stdout.contains("trained: its STOP ends the episode")
            && run.stdout.contains("nothing to run"),
        "{}",
        run.stdout
    );
    // The folder says its pass was compiled only. One that says it was
    // timed on a GPU is not resumed where there is none, and its table
    // does not call it compiled only.
    let compiled = read_json(&settings);
    assert_eq!(compiled["timed"], false, "{compiled}");
    let mut timed = compiled.clone();
    timed["timed"] = true.into();
    std::fs::write(&settings, timed.to_string()).unwrap();
    let err = live_run_with("2", &["--policy-stops"]).failure();
    assert!(
        err.error
            .contains("timed on a GPU, and this machine has none")
            && err.error.contains("--table-only"),
        "{}",
        err.error
    );
    let table = live_run_with("2", &["--policy-stops", "--table-only"]).success();
    assert!(
        table.stdout.contains("judged live") && !table.stdout.contains("compile only"),
        "{}",
        table.stdout
    );
    std::fs::write(&settings, compiled.to_string()).unwrap();
    // A checkpoint copied elsewhere is the same input (its digest), so the
    // pass resumes from the copy.
    let moved = dir.path().join("ck-moved");
    std::fs::create_dir(&moved).unwrap();
    for entry in walk(&ck) {
        let to = moved.join(entry.strip_prefix(&ck).unwrap());
        std::fs::create_dir_all(to.parent().unwrap()).unwrap();
        std::fs::copy(&entry, &to).unwrap();
    }
    let run = live_of(&moved.to_string_lossy(), &live_s, "2", &["--policy-stops"]).success();
    assert!(
        run.stdout.contains("0 episode(s) to run (6 already in"),
        "{}",
        run.stdout
    );

    // `--side-by-side` judges each problem's best programs again in
    // rounds once every planner has finished it: without a GPU nothing is
    // judged. The table reads the folder's judgings where there are some:
    // each program's median over its rounds.
    let run = live_run_with("2", &["--policy-stops", "--side-by-side", "3"]).success();
    assert!(
        run.stdout
            .contains("side by side: no GPU here, nothing judged"),
        "{}",
        run.stdout
    );
    let judged = live.join("side_by_side.jsonl");
    assert!(!judged.exists());
    let err = live_run_with("2", &["--side-by-side", "3", "--table-only"]).failure();
    assert!(err.error.contains("cannot be used with"), "{}", err.error);
    let line = serde_json::json!({
        "problem": "L2/76_Gemm_Add_ReLU",
        "rounds": 3,
        "planners": {
            "trained": {"key": "k11 b512 v1", "speedups": [1.5, 0.9, 1.3]},
            "random": {"key": null, "speedups": []},
            "greedy": {"key": "k11 b256 v1", "speedups": [2.0, 2.25, 1.75]},
        },
        "build": "test",
    });
    // A last line cut short by a kill is left out.
    std::fs::write(&judged, format!("{line}\n{{\"problem\": \"L1/2")).unwrap();
    let table = live_run_with("2", &["--policy-stops", "--table-only"]).success();
    assert!(
        table.stdout.contains(
            "judged again side by side with the other planners' in rounds, the median of its rounds (2 of 6 episodes; the others as found)"
        ),
        "{}",
        table.stdout
    );
    let doc = read_json(&live.join("compare.json"));
    let of = |planner: &str| {
        doc["problems"]
            .as_array()
            .unwrap()
            .iter()
            .find(|p| p["problem"] == "L2/76_Gemm_Add_ReLU")
            .unwrap()["planners"][planner]["best"]
            .as_f64()
            .unwrap()
    };
    assert_eq!(
        (of("trained"), of("greedy"), of("random")),
        (1.3, 2.0, 1.0),
        "{doc}"
    );
    std::fs::write(&judged, "not json\n").unwrap();
    let err = live_run_with("2", &["--policy-stops", "--table-only"]).failure();
    assert!(
        err.error.contains("side_by_side.jsonl` line 1"),
        "{}",
        err.error
    );
    std::fs::remove_file(&judged).unwrap();

    // A second pass into another folder pools the first one's episodes:
    // one entry per problem and pass. Passes of another comparison, a
    // folder pooled twice, or one `compare --live` did not write are
    // refused before anything is written.
    let live2 = dir.path().join("live2");
    let live2_s = live2.to_string_lossy().into_owned();
    let live_into = |out: &str, more: &[&str]| live_in(out, "2", more);
    let err = live_into(&live2_s, &["--pool", &live_s]).failure();
    assert!(
        err.error.contains("ran with other settings") && !live2.exists(),
        "{}",
        err.error
    );
    let err = live_into(&live_s, &["--policy-stops", "--pool", &live_s]).failure();
    assert!(err.error.contains("pooled twice"), "{}", err.error);
    let not_live = dir.path().to_string_lossy().into_owned();
    let err = live_into(&live2_s, &["--policy-stops", "--pool", &not_live]).failure();
    assert!(
        err.error
            .contains("--pool takes a folder that `compare --live` wrote"),
        "{}",
        err.error
    );
    let run = live_into(&live2_s, &["--policy-stops", "--pool", &live_s]).success();
    assert!(
        run.stdout.contains("6 episode(s) to run (0 already in")
            && run.stdout.contains("4 problem run(s) in 2 passes pooled"),
        "{}",
        run.stdout
    );
    let doc = read_json(&live2.join("compare.json"));
    assert_eq!(doc["passes"].as_array().unwrap().len(), 2, "{doc}");
    let rows = doc["problems"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "{doc}");
    for pass in [&live2_s, &live_s] {
        assert_eq!(
            rows.iter().filter(|r| r["pass"] == pass.as_str()).count(),
            2,
            "{doc}"
        );
    }
    // The paired comparisons draw each problem's runs of both passes
    // together.
    let pairs = doc["paired"].as_array().unwrap();
    assert_eq!(pairs.len(), 2, "{doc}");
    for p in pairs {
        assert_eq!((&p["problems"], &p["runs"]), (&2.into(), &4.into()), "{p}");
    }
    assert!(
        run.stdout.contains("paired over 2 problems, 4 runs"),
        "{}",
        run.stdout
    );
    // Passes on other levels, with the same checkpoint, tree and
    // settings, pool into one table of all their problems; one with
    // other settings, or whose digest is not its levels' tree's and the
    // checkpoint's, is refused.
    let l1 = dir.path().join("live-l1");
    let l2 = dir.path().join("live-l2");
    let (l1_s, l2_s) = (
        l1.to_string_lossy().into_owned(),
        l2.to_string_lossy().into_owned(),
    );
    let run = live_into(&l1_s, &["--policy-stops", "--level", "1"]).success();
    assert!(
        run.stdout.contains("1 problem(s) (all split, level 1)"),
        "{}",
        run.stdout
    );
    let err = live_into(&l2_s, &["--level", "2", "--pool", &l1_s]).failure();
    assert!(
        err.error.contains("ran with other settings") && !l2.exists(),
        "{}",
        err.error
    );
    let pooled_l2 = &["--policy-stops", "--level", "2", "--pool", &l1_s];
    let run = live_into(&l2_s, pooled_l2).success();
    assert!(
        run.stdout.contains("2 problem run(s) in 2 passes pooled")
            && run.stdout.contains("(all split, levels 1, 2)"),
        "{}",
        run.stdout
    );
    let doc = read_json(&l2.join("compare.json"));
    assert_eq!(doc["levels"], serde_json::json!([1, 2]), "{doc}");
    let rows = doc["problems"].as_array().unwrap();
    for (pass, level) in [(&l1_s, "L1/"), (&l2_s, "L2/")] {
        let of_pass: Vec<_> = rows.iter().filter(|r| r["pass"] == pass.as_str()).collect();
        assert_eq!(of_pass.len(), 1, "{doc}");
        assert!(
            of_pass[0]["problem"].as_str().unwrap().starts_with(level),
            "{doc}"
        );
    }
    let l1_settings = l1.join("settings.json");
    let kept = std::fs::read_to_string(&l1_settings).unwrap();
    let mut forged = read_json(&l1_settings);
    forged["inputs"] = serde_json::json!("0".repeat(64));
    std::fs::write(&l1_settings, forged.to_string()).unwrap();
    let err = live_into(&l2_s, pooled_l2).failure();
    assert!(
        err.error.contains("ran with other settings"),
        "{}",
        err.error
    );
    std::fs::write(&l1_settings, kept).unwrap();
    // Every episode names the build that ran it; the table warns when the
    // pooled episodes ran on several.
    let build = |e: &serde_json::Value| e["build"].as_str().map(str::to_string);
    let ours = build(&lines(&episodes)[0]).unwrap();
    assert!(ours.starts_with(env!("CARGO_PKG_VERSION")), "{ours}");
    assert!(
        lines(&live2.join("episodes.jsonl"))
            .iter()
            .all(|e| build(e).as_ref() == Some(&ours))
    );
    assert!(!run.stdout.contains("builds of mtmc"), "{}", run.stdout);
    let text = std::fs::read_to_string(&episodes).unwrap();
    std::fs::write(&episodes, text.replace(&ours, "0.0.0+000000000000")).unwrap();
    let run = live_into(&live2_s, &["--policy-stops", "--pool", &live_s]).success();
    assert!(
        run.stdout.contains(
            "warning: these episodes ran on 2 builds of mtmc (episodes each: 0.0.0+000000000000 6, "
        ) && run.stdout.contains(&format!("{ours} 6)")),
        "{}",
        run.stdout
    );
    let doc = read_json(&live2.join("compare.json"));
    assert_eq!(doc["builds"][&ours], 6, "{doc}");
    std::fs::write(&episodes, text).unwrap();
    // The settings hold a digest of the checkpoint and the tree: a pass
    // run with other contents under the same paths is not resumed.
    let settings2 = live2.join("settings.json");
    let mut s2 = read_json(&settings2);
    let digest = s2["inputs"].as_str().unwrap().to_string();
    assert_eq!(digest.len(), 64, "{s2}");
    assert_eq!(
        read_json(&live.join("settings.json"))["inputs"],
        digest.as_str()
    );
    s2["inputs"] = serde_json::json!("0".repeat(64));
    std::fs::write(&settings2, s2.to_string()).unwrap();
    let err = live_into(&live2_s, &["--policy-stops"]).failure();
    assert!(
        err.error.contains("other settings") && err.error.contains(&digest),
        "{}",
        err.error
    );

    // A pass of another checkpoint on the same tree, build and settings
    // takes the random and greedy episodes of an earlier pass (those
    // planners never read the checkpoint) and runs the trained ones.
    let ck2 = dir.path().join("ck2");
    let ck2_s = ck2.to_string_lossy().into_owned();
    train_briefly(&store_s, &ck2_s, &["--seed", "7"]).success();
    let live_ck2_budget = |out: &str, budget: &str, more: &[&str]| {
        let mut args = vec!["--policy-stops"];
        args.extend_from_slice(more);
        live_of(&ck2_s, out, budget, &args)
    };
    let live_ck2 = |out: &str, more: &[&str]| live_ck2_budget(out, "2", more);
    let live3 = dir.path().join("live3");
    let live3_s = live3.to_string_lossy().into_owned();
    let run = live_ck2(&live3_s, &["--reuse-baselines", &live_s]).success();
    assert!(
        run.stdout.contains(&format!(
            "reused 4 random and greedy episode(s) from {live_s} (this build"
        )) && run.stdout.contains("2 episode(s) to run (4 already in"),
        "{}",
        run.stdout
    );
    let ours3 = lines(&live3.join("episodes.jsonl"));
    assert_eq!(ours3.len(), 6, "{ours3:?}");
    let theirs = lines(&episodes);
    for e in &ours3 {
        let twin = theirs
            .iter()
            .find(|t| t["problem"] == e["problem"] && t["planner"] == e["planner"])
            .unwrap();
        if e["planner"] == "trained" {
            assert!(e["reused_from"].is_null(), "{e}");
        } else {
            assert_eq!(e["reused_from"], live_s.as_str(), "{e}");
            assert_eq!((&e["best"], &e["bests"]), (&twin["best"], &twin["bests"]));
        }
    }
    assert_eq!(std::fs::read_dir(live3.join("logs")).unwrap().count(), 6);
    // Resumed, it reuses nothing more and runs nothing.
    let run = live_ck2(&live3_s, &["--reuse-baselines", &live_s]).success();
    assert!(
        run.stdout.contains("reused 0 random and greedy") && run.stdout.contains("nothing to run"),
        "{}",
        run.stdout
    );
    // Episodes of another build run again; a pass with other settings, or
    // one that kept no digest of its tree, is refused.
    let text = std::fs::read_to_string(&episodes).unwrap();
    let forged: Vec<String> = text
        .lines()
        .map(|l| {
            if l.contains("\"planner\":\"greedy\"") {
                l.replace(&ours, "0.0.0+000000000000")
            } else {
                l.to_string()
            }
        })
        .collect();
    std::fs::write(&episodes, forged.join("\n") + "\n").unwrap();
    let live4 = dir.path().join("live4");
    let run = live_ck2(&live4.to_string_lossy(), &["--reuse-baselines", &live_s]).success();
    assert!(
        run.stdout.contains("reused 2 random and greedy")
            && run
                .stdout
                .contains("2 more ran on another build of mtmc and run again here")
            && run.stdout.contains("4 episode(s) to run (2 already in"),
        "{}",
        run.stdout
    );
    std::fs::write(&episodes, text).unwrap();
    let live5 = dir.path().join("live5");
    let err = live_ck2_budget(
        &live5.to_string_lossy(),
        "3",
        &["--reuse-baselines", &live_s],
    )
    .failure();
    assert!(
        err.error.contains("differs in its checkpoint only") && !live5.exists(),
        "{}",
        err.error
    );
    let settings1 = live.join("settings.json");
    let kept = std::fs::read_to_string(&settings1).unwrap();
    let mut old = read_json(&settings1);
    old.as_object_mut().unwrap().remove("tree");
    std::fs::write(&settings1, old.to_string()).unwrap();
    let err = live_ck2(&live5.to_string_lossy(), &["--reuse-baselines", &live_s]).failure();
    assert!(
        err.error.contains("names no digest of its tree") && !live5.exists(),
        "{}",
        err.error
    );
    // (a folder written before the digest still resumes)
    assert!(
        live_into(&live_s, &["--policy-stops"])
            .success()
            .stdout
            .contains("nothing to run")
    );
    std::fs::write(&settings1, kept).unwrap();

    // Settings are chosen on the validation problems, which
    // `train --validation` leaves out: L1/24 trains, L2/76 is held out.
    let ck_v = dir.path().join("ck-validation");
    let run = train_briefly(
        &store_s,
        &ck_v.to_string_lossy(),
        &["--validation", "--step-cost", "0.005"],
    )
    .success();
    let meta = read_json(&ck_v.join("train.json"));
    assert_eq!(meta["ppo"]["step_cost"], 0.005, "{meta}");
    assert_eq!(meta["validation"], true, "{meta}");
    assert!(
        run.stdout.contains("1 training problem(s) (")
            && run.stdout.contains("1 held out (test and validation)"),
        "{}",
        run.stdout
    );
    let err = compare(&["--split", "validation"]).failure();
    assert!(
        err.error.contains("no recorded problem in this split"),
        "{}",
        err.error
    );

    let out = dir.path().join("out");
    let run = mtmc(&[
        "--kernelbench",
        &kb,
        "optimize",
        "L1/24",
        "--planner",
        &ck_s,
        "--budget",
        "3",
        "-v",
        "--out",
        &out.to_string_lossy(),
    ])
    .success();
    // With -v, the moves the policy weighed before each step.
    assert!(
        run.stdout.contains("  weighed for step 1: policy: ") && run.stdout.contains("; took "),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("planner trained, budget 3"),
        "{}",
        run.stdout
    );
    // Its priors come from the store it was trained on, which train.json
    // names.
    assert!(
        run.stdout.contains("knowledge base: ")
            && run
                .stdout
                .contains("(the store the planner was trained on)"),
        "{}",
        run.stdout
    );
    assert!(run.stdout.contains("step 1: "), "{}", run.stdout);
    assert!(out.join("model_new.py").is_file());
    // On a GPU the best program would be judged again; here nothing was
    // timed, so the report has no second speedup.
    assert!(!run.stdout.contains("judged again"), "{}", run.stdout);
    assert!(read_json(&out.join("report.json"))["best_speedup"].is_null());
    // The planner's settings without a planner are refused: they were
    // ignored, and a store named to record in was left unwritten.
    for (flag, value) in [
        ("--trajectories", "t.sqlite"),
        ("--budget", "3"),
        ("--seed", "1"),
    ] {
        let err = mtmc(&["--kernelbench", &kb, "optimize", "L1/24", flag, value]).failure();
        assert!(
            err.error.contains("required arguments were not provided")
                && err.stderr.contains("--planner <PLANNER>"),
            "{flag}: {}",
            err.stderr
        );
    }

    let bad = mtmc(&[
        "--kernelbench",
        &kb,
        "optimize",
        "L1/24",
        "--planner",
        "nowhere",
    ])
    .failure();
    assert!(bad.error.contains("checkpoint folder"), "{}", bad.error);

    // A store whose observations another mtmc recorded (another length):
    // the policy trains on the tree as before, but no reward-to-go model
    // is fitted on nothing; the checkpoint still compares.
    let stale = dir.path().join("stale.sqlite");
    std::fs::copy(&store, &stale).unwrap();
    let n = rusqlite::Connection::open(&stale)
        .unwrap()
        .execute(
            "UPDATE steps SET observation = '[0.5, 0.5]' WHERE action_name != 'stop'",
            [],
        )
        .unwrap();
    assert!(n >= 12, "{n}");
    let stale_s = stale.to_string_lossy().into_owned();
    let ck_stale = dir.path().join("ck-stale");
    let ck_stale_s = ck_stale.to_string_lossy().into_owned();
    let run = train_briefly(&stale_s, &ck_stale_s, &["--members", "1"]).success();
    assert!(
        run.stdout.contains("reward-to-go: no model written")
            && run
                .stdout
                .contains(&format!("({n} step(s) recorded with 2 numbers)"))
            && !run.stdout.contains("rtg.mpk"),
        "{}",
        run.stdout
    );
    assert!(ck_stale.join("policy.mpk").is_file());
    assert!(!ck_stale.join("rtg.json").exists() && !ck_stale.join("rtg.mpk").exists());
    assert!(read_json(&ck_stale.join("train.json"))["reward_to_go"].is_null());
    let run = mtmc(&[
        "compare",
        "--trajectories",
        &stale_s,
        "--checkpoint",
        &ck_stale_s,
        "--split",
        "all",
    ])
    .success();
    assert!(
        run.stdout.lines().any(|l| l.starts_with("trained")),
        "{}",
        run.stdout
    );
}

#[test]
fn a_planned_search_can_build_from_the_rewritten_graph() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("out");
    let kb = shared_jsonl();
    // L2/31: a convolution whose bias and layout the rewrites change.
    let run = mtmc(&[
        "--kernelbench",
        &kb,
        "optimize",
        "L2/31",
        "--planner",
        "greedy",
        "--budget",
        "3",
        "--out",
        out.to_str().unwrap(),
    ])
    .success();
    let s = &run.stdout;
    // Two rewritten graphs: every rewrite, and all but channels-last.
    assert!(
        s.contains("; rw = conv_bias_in_epilogue + channels_last; rw-cl = conv_bias_in_epilogue;"),
        "{s}"
    );
    // Greedy: kernels first, then the same program from the rewritten graph.
    assert!(
        s.contains("step 1: custom_kernel(all) -> k1 b256 v1: compiled only"),
        "{s}"
    );
    assert!(
        s.contains("step 2: rewrite(on) -> k1 b256 v1 rw: compiled only"),
        "{s}"
    );
    assert!(out.join("model_new.py").is_file());
    // Breadth-first, every operator-level move from the library program
    // comes first: the convolution as an implicit-GEMM kernel and both
    // rewritten graphs among them.
    let store = dir.path().join("traj.sqlite");
    mtmc(&[
        "--kernelbench",
        &kb,
        "explore",
        "L2/31",
        "--split",
        "all",
        "--planner",
        "exhaustive",
        "--budget",
        "5",
        "--trajectories",
        store.to_str().unwrap(),
    ])
    .success();
    let evals = mtmc_planner::store::Store::open(&store)
        .unwrap()
        .evaluations("L2/31_Conv2d_Min_Add_Multiply")
        .unwrap();
    let keys: Vec<&str> = evals.keys().map(String::as_str).collect();
    assert_eq!(
        keys,
        [
            "gemm",
            "k1 b256 v1",
            "library",
            "library rw",
            "library rw-cl"
        ],
    );
}

/// The geomean speedup of planner `name`'s row in a `compare --json` table.
fn geomean_row(table: &serde_json::Value, name: &str) -> f64 {
    table["planners"]
        .as_array()
        .and_then(|rows| rows.iter().find(|r| r["planner"] == name))
        .and_then(|r| r["geomean_speedup"].as_f64())
        .unwrap_or_else(|| panic!("no {name} row in {table}"))
}

/// The recorded H100 tree that comes with mtmc: `train` and `compare` read
/// the gzipped store as it is, on the CPU, and leave it unchanged; writing
/// into it, or reading a store that is not there, is refused with the way
/// out.
#[test]
fn the_recorded_h100_tree_trains_and_compares_without_a_gpu() {
    let dir = tempfile::tempdir().unwrap();
    let tree = recorded_h100();
    let tree_s = tree.to_string_lossy().into_owned();
    let before = std::fs::read(&tree).unwrap();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_string_lossy().into_owned();

    let run = train_briefly(&tree_s, &ck_s, &[]).success();
    // Every test problem was recorded (39 of levels 1, 2 and 3 under the
    // split rule), and enough training problems to learn from.
    assert!(run.stdout.contains(", 39 held out;"), "{}", run.stdout);
    let trained: usize = run
        .stdout
        .split("train: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no problem count in {}", run.stdout));
    assert!(trained >= 90, "{}", run.stdout);
    assert!(!run.stdout.contains("compiled only"), "{}", run.stdout);
    assert!(ck.join("policy.mpk").is_file());

    // `compare` of the committee on the shipped tree, with `extra` flags,
    // its table into `json`.
    let compare = |extra: &[&str], json: &std::path::Path| {
        let json_s = json.to_string_lossy();
        let mut args = vec![
            "compare",
            "--trajectories",
            &tree_s,
            "--checkpoint",
            &ck_s,
            "--json",
            &json_s,
        ];
        args.extend_from_slice(extra);
        mtmc(&args).success()
    };
    let json = dir.path().join("compare.json");
    let run = compare(&[], &json);
    assert!(!run.stdout.contains("compiled only"), "{}", run.stdout);
    // The tree names the GPU its outcomes were judged on.
    assert!(
        run.stdout
            .contains("kernelbench-h100.sqlite.gz, judged on the H100"),
        "{}",
        run.stdout
    );
    let table = read_json(&json);
    assert_eq!(table["gpu"], "H100");
    // --gpu reads the store as that GPU's only where it is: the H100's
    // tree is not the H200's, for a replay nor for training.
    let err = mtmc(&["compare", "--trajectories", &tree_s, "--gpu", "H200"]).failure();
    assert!(
        err.error
            .contains("holds outcomes judged on the H100, not the H200 (--gpu H200)"),
        "{}",
        err.error
    );
    let err = mtmc(&[
        "train",
        "--trajectories",
        &tree_s,
        "--gpu",
        "H200",
        "--iterations",
        "1",
    ])
    .failure();
    assert!(err.error.contains("not the H200"), "{}", err.error);
    assert!(
        compare(&["--gpu", "h100"], &json)
            .stdout
            .contains("judged on the H100")
    );
    let geomean = |name: &str| geomean_row(&table, name);
    // Exhaustive search of the recorded tree bounds every planner, and on
    // these outcomes it is well above the library's 1.0x.
    let best = geomean("exhaustive");
    assert!(best > 1.3, "{}", run.stdout);
    for p in ["trained", "random", "greedy"] {
        assert!(geomean(p) <= best + 1e-9, "{p}: {}", run.stdout);
    }
    // The ratios line reads the table: trained against random and greedy,
    // and the bound exhaustive search puts on any gain over random.
    let ratios = format!(
        "ratios: trained / random {:.3}x, trained / greedy {:.3}x; exhaustive / random {:.3}x",
        geomean("trained") / geomean("random"),
        geomean("trained") / geomean("greedy"),
        best / geomean("random"),
    );
    assert!(run.stdout.contains(&ratios), "{ratios}\n{}", run.stdout);
    // The paired comparisons: the same ratios, each inside its bootstrap
    // interval, with the runs ahead and behind.
    let pairs = table["paired"]
        .as_array()
        .unwrap_or_else(|| panic!("{table}"));
    assert_eq!(pairs.len(), 2, "{table}");
    for (p, against) in pairs.iter().zip(["random", "greedy"]) {
        assert_eq!(p["planner"], "trained");
        assert_eq!(p["against"], against);
        let f = |k: &str| p[k].as_f64().unwrap_or_else(|| panic!("{p}"));
        let ratio = geomean("trained") / geomean(against);
        assert!((f("ratio") - ratio).abs() < 1e-9, "{p}");
        assert!(
            f("low") <= ratio && ratio <= f("high") && f("low") < f("high"),
            "{p}"
        );
        assert!(f("ahead") + f("behind") <= f("runs"), "{p}");
        let text = format!(
            "trained / {against} {:.3}x [{:.3}, {:.3}], ahead on {}, behind on {}",
            ratio,
            f("low"),
            f("high"),
            p["ahead"],
            p["behind"]
        );
        assert!(run.stdout.contains(&text), "{text}\n{}", run.stdout);
    }
    assert!(
        run.stdout.contains(&format!(
            "paired over {} problems (95 % interval",
            pairs[0]["problems"]
        )),
        "{}",
        run.stdout
    );
    // --level keeps the split's problems of those levels: level 3's 6 and
    // the other 33.
    for (levels, words, n) in [
        (&["--level", "3"][..], "level 3", 6),
        (&["--level", "1", "--level", "2"][..], "levels 1, 2", 33),
    ] {
        let json = dir.path().join("levels.json");
        let mut args = vec![
            "compare",
            "--trajectories",
            &tree_s,
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend_from_slice(levels);
        let run = mtmc(&args).success();
        let head = format!("{n} problem(s) (Test split, {words}), budget 8");
        assert!(run.stdout.contains(&head), "{head}\n{}", run.stdout);
        let table = read_json(&json);
        let names: Vec<&str> = table["problems"]
            .as_array()
            .unwrap_or_else(|| panic!("{table}"))
            .iter()
            .filter_map(|p| p["problem"].as_str())
            .collect();
        assert_eq!(names.len(), n, "{table}");
        assert!(
            names.iter().all(|p| p.starts_with("L3/") == (n == 6)),
            "{names:?}"
        );
    }
    // --without KIND (an ablation): no planner's path takes a move of the
    // kind, exhaustive finds no more than with every move, and without
    // custom kernels (every kernel a library call) it finds less.
    for kind in ["cuda_graph", "custom_kernel"] {
        let json = dir.path().join(format!("without-{kind}.json"));
        let run = compare(&["--without", kind], &json);
        let line = format!("without moves of kind {kind} (every planner, exhaustive too)");
        assert!(run.stdout.contains(&line), "{line}\n{}", run.stdout);
        let table = read_json(&json);
        assert_eq!(table["without"][0], kind, "{table}");
        let found = geomean_row(&table, "exhaustive");
        assert!(found <= best + 1e-9, "{}", run.stdout);
        if kind == "custom_kernel" {
            assert!(found < best / 1.2, "{}", run.stdout);
        }
        // Each problem's best without those moves, and the line naming
        // the problems that needed them most.
        let mut below = 0;
        for p in table["problems"]
            .as_array()
            .unwrap_or_else(|| panic!("{table}"))
        {
            let with = p["exhaustive"].as_f64().unwrap_or_else(|| panic!("{p}"));
            let without = p["exhaustive_without"]
                .as_f64()
                .unwrap_or_else(|| panic!("{p}"));
            assert!(without <= with + 1e-9, "{p}");
            if without / with < 0.995 {
                below += 1;
            }
            for (name, r) in p["planners"].as_object().unwrap() {
                for step in r["path"].as_array().unwrap() {
                    let step = step.as_str().unwrap();
                    assert!(!step.starts_with(&format!("{kind}(")), "{name}: {step}");
                }
            }
        }
        let line = format!(
            "exhaustive without them: below the problem's best on {below} of 39 problems, most on "
        );
        assert!(
            below > 0 && run.stdout.contains(&line),
            "{line}\n{}",
            run.stdout
        );
    }
    let err = mtmc(&["compare", "--trajectories", &tree_s, "--without", "tile"]).failure();
    assert!(
        err.error.contains("--without tile: not an action kind")
            && err.error.contains("retile, vectorize, rewrite, cuda_graph"),
        "{}",
        err.error
    );
    let err = mtmc(&[
        "compare",
        "--live",
        "--trajectories",
        &tree_s,
        "--without",
        "rewrite",
    ])
    .failure();
    assert!(
        err.error.contains("drop one of --live and --without"),
        "{}",
        err.error
    );
    assert_eq!(
        std::fs::read(&tree).unwrap(),
        before,
        "the shipped tree changed"
    );

    let err = mtmc(&[
        "--kernelbench",
        &shared_jsonl(),
        "explore",
        "L1/24",
        "--split",
        "all",
        "--trajectories",
        &tree_s,
    ])
    .failure();
    assert!(
        err.error.contains("is compressed")
            && err.error.contains("gunzip -c ")
            && err.error.contains("> mtmc-trajectories.sqlite"),
        "{}",
        err.error
    );
    let missing = dir.path().join("none.sqlite");
    let err = mtmc(&["train", "--trajectories", &missing.to_string_lossy()]).failure();
    assert!(
        err.error.contains("does not exist")
            && err.error.contains(mtmc_planner::store::RECORDED_H100),
        "{}",
        err.error
    );
    assert!(!missing.exists());
}

/// `explore --planner exhaustive --beyond KIND` judges the programs one
/// such move past the recorded correct ones: on a copy of the shipped
/// tree, two rewrite moves from L2/19's recorded programs, each a new
/// program recorded as a second step; a finished problem is skipped, and
/// other planners or kinds are refused.
#[test]
fn explore_beyond_judges_the_programs_one_move_past_the_recorded_ones() {
    use mtmc_planner::space::Move;
    use std::io::Read as _;
    let dir = tempfile::tempdir().unwrap();
    let tree = recorded_h100();
    let mut plain = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(&tree).unwrap())
        .read_to_end(&mut plain)
        .unwrap();
    let store = dir.path().join("traj.sqlite");
    std::fs::write(&store, plain).unwrap();
    let store_s = store.to_string_lossy().into_owned();
    let problem = "L2/19_ConvTranspose2d_GELU_GroupNorm";
    let (before, steps_before, done_before) = {
        let s = mtmc_planner::store::Store::open(&store).unwrap();
        let done = s.finished_episodes("exhaustive-beyond").unwrap();
        (
            s.evaluations(problem).unwrap(),
            s.steps().unwrap().len(),
            done.get(problem).copied().unwrap_or(0),
        )
    };
    let kb = shared_jsonl();
    // `explore L2/19` into the copy, with `args` after it.
    let explore_with = |args: &[&str]| {
        let mut all = vec![
            "--kernelbench",
            &kb,
            "explore",
            "L2/19",
            "--split",
            "all",
            "--trajectories",
            &store_s,
        ];
        all.extend_from_slice(args);
        mtmc(&all)
    };
    let episodes = (done_before + 1).to_string();
    let explore = |planner: &str, kind: &str| {
        explore_with(&[
            "--planner",
            planner,
            "--beyond",
            kind,
            "--episodes",
            &episodes,
            "--budget",
            "2",
        ])
    };
    let run = explore("exhaustive", "rewrite").success();
    assert!(
        run.stdout.contains(
            "planner exhaustive-beyond (one rewrite move beyond the recorded programs, the fastest parents first), budget 2"
        ) && run.stdout.contains("in 2 evaluation(s)"),
        "{}",
        run.stdout
    );
    let s = mtmc_planner::store::Store::open(&store).unwrap();
    let after = s.evaluations(problem).unwrap();
    let new: Vec<&String> = after.keys().filter(|k| !before.contains_key(*k)).collect();
    assert_eq!(new.len(), 2, "{new:?}");
    // Each new program is a recorded program's configuration on another
    // graph: the same launch settings, another graph suffix.
    for key in &new {
        let launch = |k: &str| {
            k.split(' ')
                .filter(|w| w.starts_with('b') || w.starts_with('v'))
                .collect::<Vec<_>>()
                .join(" ")
        };
        let graph = |k: &str| k.split_once(" rw").map(|(_, g)| g.to_string());
        assert!(
            before
                .iter()
                .any(|(k, d)| d.status == mtmc_env::outcome::Status::Correct
                    && launch(k) == launch(key)
                    && graph(k) != graph(key)),
            "{key} is no rewrite of a recorded correct program"
        );
        assert_eq!(
            after[*key].status,
            mtmc_env::outcome::Status::CompiledOnly,
            "{key}"
        );
    }
    let steps = s.steps().unwrap();
    assert_eq!(steps.len(), steps_before + 2);
    for st in &steps[steps_before..] {
        assert_eq!(st.problem, problem);
        assert_eq!(Move::from_index(st.action).kind(), "rewrite");
        assert_eq!(st.step, 1, "observed as the step after the parent");
    }
    assert_eq!(
        s.finished_episodes("exhaustive-beyond").unwrap()[problem],
        done_before + 1
    );
    drop(s);
    let again = explore("exhaustive", "rewrite").success();
    assert!(
        again.stdout.contains("0 episode(s) to run"),
        "{}",
        again.stdout
    );

    // Nearest the library program first: its own CUDA graph (its
    // outcome taken out of the store here), though faster parents lack
    // theirs too.
    rusqlite::Connection::open(&store)
        .unwrap()
        .execute(
            "DELETE FROM evaluations WHERE problem = ?1 AND key = 'library cuda-graph'",
            [problem],
        )
        .unwrap();
    let after = mtmc_planner::store::Store::open(&store)
        .unwrap()
        .evaluations(problem)
        .unwrap();
    assert!(!after.contains_key("library cuda-graph"));
    let speedup = |k: &str| mtmc_planner::store::correct_speedup(&after[k]).unwrap_or(0.0);
    assert!(
        after.keys().any(|k| speedup(k) > speedup("library")
            && !k.contains("cuda-graph")
            && !after.contains_key(&format!("{k} cuda-graph"))),
        "no faster parent without its CUDA graph: the order is not shown"
    );
    let episodes = (done_before + 2).to_string();
    let mut args = vec![
        "--planner",
        "exhaustive",
        "--beyond",
        "cuda_graph",
        "--shallow-first",
        "--episodes",
        &episodes,
        "--budget",
        "1",
    ];
    let run = explore_with(&args).success();
    assert!(
        run.stdout.contains("(one cuda_graph move beyond the recorded programs, the parents nearest the library program first), budget 1"),
        "{}",
        run.stdout
    );
    let s = mtmc_planner::store::Store::open(&store).unwrap();
    let shallow = s.evaluations(problem).unwrap();
    let new: Vec<&String> = shallow.keys().filter(|k| !after.contains_key(*k)).collect();
    assert_eq!(new, ["library cuda-graph"]);
    drop(s);
    // --shallow-first orders --beyond's parents: alone it is refused.
    args.retain(|a| *a != "--beyond" && *a != "cuda_graph");
    let err = explore_with(&args).failure();
    assert!(
        err.error.contains("--shallow-first") && err.error.contains("give --beyond KIND"),
        "{}",
        err.error
    );

    let err = explore("random", "rewrite").failure();
    assert!(
        err.error.contains("add --planner exhaustive"),
        "{}",
        err.error
    );
    let err = explore("exhaustive", "tile").failure();
    assert!(
        err.error.contains("--beyond tile: not an action kind") && err.error.contains("rewrite"),
        "{}",
        err.error
    );
}

/// Runs `explore L2/76 --planner exhaustive` into `store` with `episodes`
/// and `budget`, and `extra` flags.
fn explore_l2_76(kb: &str, store: &str, episodes: &str, budget: &str, extra: &[&str]) -> Output {
    let mut args = vec![
        "--kernelbench",
        kb,
        "explore",
        "L2/76",
        "--split",
        "all",
        "--planner",
        "exhaustive",
        "--episodes",
        episodes,
        "--budget",
        budget,
        "--trajectories",
        store,
    ];
    args.extend_from_slice(extra);
    mtmc(&args).success()
}

/// The recorded hash of each program of `problem` in `store`, by key.
fn recorded_hashes(store: &Path, problem: &str) -> std::collections::BTreeMap<String, String> {
    let s = mtmc_planner::store::Store::open(store).unwrap();
    s.evaluations(problem)
        .unwrap()
        .keys()
        .map(|k| (k.clone(), s.evaluation_hash(problem, k).unwrap().unwrap()))
        .collect()
}

#[test]
fn explore_keeps_the_judged_code_s_hash_and_rejudges_what_changed() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("traj.sqlite");
    let store_s = store.to_string_lossy().into_owned();
    let problem = "L2/76_Gemm_Add_ReLU";
    let kb = shared_jsonl();
    let explore =
        |episodes: &str, extra: &[&str]| explore_l2_76(&kb, &store_s, episodes, "4", extra);
    let hashes = || recorded_hashes(&store, problem);
    // Writes `hash` over the recorded hashes of the programs `keys` (SQL).
    let overwrite = |hash: &str, keys: &str| {
        rusqlite::Connection::open(&store)
            .unwrap()
            .execute(
                &format!("UPDATE evaluations SET fragment_hash = ?1 WHERE problem = ?2 AND {keys}"),
                [hash, problem],
            )
            .unwrap();
    };
    explore("1", &[]);
    let first = hashes();
    assert_eq!(first.len(), 4, "{first:?}");
    // The GEMM program's fragments were built; the library program has none.
    assert_eq!(first["gemm"].len(), 64, "{first:?}");
    assert_eq!(first["library"], "", "{first:?}");
    // A second episode reaches the same programs and takes their recorded
    // outcomes: the hashes of the code judged stay.
    let run = explore("2", &[]);
    assert!(!run.stdout.contains("judged again"), "{}", run.stdout);
    assert_eq!(hashes(), first);
    // A program recorded with other code than this build writes (as after
    // a coder change) is judged again, and only that one.
    overwrite("earlier", "key = 'gemm'");
    let run = explore("3", &["--rejudge-changed"]);
    assert!(
        run.stdout.contains(
            "episode 1: best 0.000x in 4 evaluation(s), 1 of them recorded programs judged again"
        ) && run.stdout.contains("1 recorded program(s) judged again"),
        "{}",
        run.stdout
    );
    // The program judged again keeps the hash of the code it judged now,
    // so the next pass takes every recorded outcome.
    assert_eq!(hashes(), first);
    // A store whose reused steps wrote empty hashes over the evaluations'
    // (before they kept them): the last step that built the program says
    // what code was judged.
    overwrite("", "1");
    assert_eq!(hashes(), first);
    let run = explore("4", &["--rejudge-changed"]);
    assert!(
        run.stdout.contains("0 recorded program(s) judged again"),
        "{}",
        run.stdout
    );
}

/// A temporary store holding one exhaustive episode of L2/76 (budget 6,
/// compile only): the folder, the store's path as a path and as text, and
/// the shared problems file.
fn l2_76_store() -> (tempfile::TempDir, std::path::PathBuf, String, String) {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("traj.sqlite");
    let store_s = store.to_string_lossy().into_owned();
    let kb = shared_jsonl();
    explore_l2_76(&kb, &store_s, "1", "6", &[]);
    (dir, store, store_s, kb)
}

/// `mtmc rejudge L2/76` on `store`'s text, with `extra` after it.
fn rejudge_l2_76<'a>(kb: &'a str, store: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = vec![
        "--kernelbench",
        kb,
        "rejudge",
        "L2/76",
        "--trajectories",
        store,
    ];
    args.extend_from_slice(extra);
    args
}

#[test]
fn rejudge_judges_every_recorded_program_whose_code_changed_and_records_no_episode() {
    let (dir, store, store_s, kb) = l2_76_store();
    let problem = "L2/76_Gemm_Add_ReLU";
    let sql = || rusqlite::Connection::open(&store).unwrap();
    let hashes = || recorded_hashes(&store, problem);
    let steps = || -> i64 {
        sql()
            .query_row("SELECT COUNT(*) FROM steps", [], |r| r.get(0))
            .unwrap()
    };
    let first = hashes();
    assert_eq!(first.len(), 6, "{first:?}");
    // As after a coder change: the GEMM programs were judged with other
    // code than this build writes.
    let stale = sql()
        .execute(
            "UPDATE evaluations SET fragment_hash = 'earlier' WHERE problem = ?1 AND key LIKE '%gemm%'",
            [problem],
        )
        .unwrap();
    assert!(stale >= 1, "{first:?}");
    // A recorded program no move makes any more.
    sql()
        .execute(
            "INSERT INTO evaluations (problem, key, status, speedup, diagnosis, fragment_hash)
             SELECT problem, 'k1 gone', status, speedup, diagnosis, 'earlier' FROM evaluations
             WHERE problem = ?1 AND key = 'library'",
            [problem],
        )
        .unwrap();
    let (episodes, before) = (store.clone(), steps());
    // A dry run counts what a rejudge would judge, and writes nothing:
    // on the store, and on a gzipped copy of it.
    let stale_hashes = hashes();
    let packed = dir.path().join("packed.sqlite.gz");
    {
        let mut gz = flate2::write::GzEncoder::new(
            std::fs::File::create(&packed).unwrap(),
            flate2::Compression::fast(),
        );
        std::io::copy(&mut std::fs::File::open(&store).unwrap(), &mut gz).unwrap();
        gz.finish().unwrap();
    }
    for path in [store_s.clone(), packed.to_string_lossy().into_owned()] {
        let run = mtmc(&[
            "--kernelbench",
            &kb,
            "rejudge",
            "L2/76",
            "--dry-run",
            "--trajectories",
            &path,
        ])
        .success();
        // Recorded without a GPU, the unchanged programs are compiled only.
        let line = format!(
            "{problem}: 6 recorded program(s) reached, {stale} to judge again (their code changed), {} compiled only (judged too on a GPU); 1 recorded program(s) no move reaches now, left as recorded",
            6 - stale
        );
        assert!(run.stdout.contains(&line), "{line}\n{}", run.stdout);
        // It names the changed programs: the GEMM ones, up to five.
        let named = run
            .stdout
            .lines()
            .find(|l| l.starts_with(&line))
            .and_then(|l| l.split_once("; changed: "))
            .map(|(_, keys)| keys.to_string())
            .unwrap_or_default();
        let keys: Vec<&str> = named.split(" and ").next().unwrap().split(", ").collect();
        assert_eq!(keys.len(), stale.min(5), "{named}");
        assert!(keys.iter().all(|k| k.contains("gemm")), "{named}");
        assert!(
            run.stdout.contains(&format!(
                "{stale} recorded program(s) on 1 problem(s) to judge again"
            )),
            "{}",
            run.stdout
        );
    }
    assert_eq!(hashes(), stale_hashes);
    // `rejudge L2/76` on the store, with `extra` after it: its output.
    let rejudge = |extra: &[&str]| mtmc(&rejudge_l2_76(&kb, &store_s, extra)).success().stdout;
    let run = rejudge(&[]);
    let line = format!(
        "{problem}: 6 recorded program(s) reached, {stale} judged again, {stale} kept; 1 recorded program(s) no move reaches now, left as recorded"
    );
    assert!(run.contains(&line), "{line}\n{run}");
    assert!(
        run.contains(&format!("{stale} recorded program(s) judged again")),
        "{run}"
    );
    // Each program judged again holds the hash of the code it judged now;
    // the one no move reaches keeps its record; no step was recorded.
    let mut now = hashes();
    assert_eq!(now.remove("k1 gone").as_deref(), Some("earlier"));
    assert_eq!(now, first);
    assert_eq!(steps(), before, "{}", episodes.display());
    // A second pass finds nothing changed.
    let run = rejudge(&[]);
    assert!(run.contains("0 recorded program(s) judged again"), "{run}");
    // A program whose judging failed while it ran, its code unchanged, is
    // judged again only with --failed (here compile only, which never
    // replaces the recorded outcome).
    let failed = sql()
        .execute(
            "UPDATE evaluations SET status = 'runtime_error',
                 diagnosis = json_set(diagnosis, '$.status', 'runtime_error')
             WHERE problem = ?1 AND key = 'library'",
            [problem],
        )
        .unwrap();
    assert_eq!(failed, 1);
    let dry = rejudge(&["--dry-run"]);
    assert!(
        dry.contains("0 recorded program(s) on 0 problem(s) to judge again")
            && !dry.contains("failed while"),
        "{dry}"
    );
    let dry = rejudge(&["--dry-run", "--failed"]);
    assert!(
        dry.contains("1 failed while running (judged too)")
            && dry.contains("0 recorded program(s) on 0 problem(s) to judge again")
            && dry.contains("and 1 whose judging failed while they ran (--failed); nothing judged"),
        "{dry}"
    );
    assert!(rejudge(&[]).contains("0 recorded program(s) judged again"));
    let again = rejudge(&["--failed"]);
    assert!(
        again.contains("1 judged again (1 had failed while running), 0 kept")
            && again.contains("or their judging failed while they ran: 1"),
        "{again}"
    );
    let status: String = sql()
        .query_row(
            "SELECT status FROM evaluations WHERE problem = ?1 AND key = 'library'",
            [problem],
            |r| r.get(0),
        )
        .unwrap();
    assert_eq!(status, "runtime_error");
    // A gzipped store is not written; a missing one is named.
    let gz = dir.path().join("traj.sqlite.gz");
    std::fs::write(&gz, b"").unwrap();
    for (path, says) in [
        (gz.to_string_lossy().into_owned(), "is compressed"),
        (
            dir.path()
                .join("none.sqlite")
                .to_string_lossy()
                .into_owned(),
            "does not exist",
        ),
    ] {
        let run = mtmc(&[
            "--kernelbench",
            &kb,
            "rejudge",
            "L2/76",
            "--trajectories",
            &path,
        ])
        .failure();
        assert!(run.stderr.contains(says), "{}", run.stderr);
    }
    // Without the problems' code (built-in traces only), it says what to
    // pass, dry run or not.
    for dry in [false, true] {
        let mut args = vec!["rejudge", "L2/76", "--trajectories", &store_s];
        if dry {
            args.push("--dry-run");
        }
        let run = mtmc(&args).failure();
        assert!(
            run.stderr.contains(&format!("{problem} has none here"))
                && run.stderr.contains("--kernelbench"),
            "{}",
            run.stderr
        );
    }
}

#[test]
fn a_planned_search_stopped_by_ctrl_c_writes_its_best_so_far_and_leaves_its_episode_unfinished() {
    let dir = tempfile::tempdir().unwrap();
    let kb = shared_jsonl();
    let out = dir.path().join("out");
    let store = dir.path().join("traj.sqlite");
    let (out_s, store_s) = (out.to_string_lossy(), store.to_string_lossy());
    let args = [
        "--kernelbench",
        &kb,
        "optimize",
        "L2/76",
        "--planner",
        "exhaustive",
        "--budget",
        "8",
        "--out",
        &out_s,
        "--trajectories",
        &store_s,
    ];
    // Ctrl-C once the first program is judged: the round in flight is not
    // kept.
    let (stdout, stderr) = interrupted(&args, |l| l.starts_with("  step 1: "));
    let steps = stdout.lines().filter(|l| l.starts_with("  step ")).count();
    assert!((1..8).contains(&steps), "{stdout}");
    assert!(
        stdout.contains(&format!("  interrupted after {steps} evaluation(s)")),
        "{stdout}"
    );
    assert!(
        stderr.contains(&format!(
            "interrupted: stopped after {steps} of 8 evaluation(s); the best program so far (compiled only: nothing was timed) is in {out_s}"
        )),
        "{stderr}"
    );
    // The best so far and the report of what was judged are written.
    assert!(out.join("model_new.py").is_file());
    assert_eq!(interrupted_report(&out).len(), steps);
    // The store keeps each step printed; the episode is left unfinished.
    let sql = rusqlite::Connection::open(&store).unwrap();
    let count = |q: &str| -> i64 { sql.query_row(q, [], |r| r.get(0)).unwrap() };
    assert_eq!(count("SELECT COUNT(*) FROM steps"), steps as i64);
    assert_eq!(
        count("SELECT COUNT(*) FROM episodes WHERE finished_at IS NULL"),
        1
    );
    assert_eq!(count("SELECT COUNT(*) FROM episodes"), 1);
}

#[test]
fn explore_stopped_by_ctrl_c_keeps_every_finished_step_and_resumes() {
    let dir = tempfile::tempdir().unwrap();
    let kb = shared_jsonl();
    let store = dir.path().join("traj.sqlite");
    let store_s = store.to_string_lossy();
    let args = explore_two(&kb, "random", "3", &store_s);
    // Ctrl-C once the first episode is finished.
    let (stdout, stderr) = interrupted(&args, |l| l.contains(": episode 1: best "));
    let episodes: Vec<&str> = stdout
        .lines()
        .filter(|l| l.contains(": episode "))
        .collect();
    let cut: Vec<&&str> = episodes
        .iter()
        .filter(|l| {
            l.ends_with("; interrupted: its steps are kept, the episode is left unfinished")
        })
        .collect();
    let finished = episodes.len() - cut.len();
    assert!(finished < 6 && cut.len() <= 1, "{stdout}");
    assert!(
        stdout.contains("store: ")
            && stderr.contains("every finished step is kept: run again to resume"),
        "{stdout}\n{stderr}"
    );
    // Stopped in an episode, its line says so and the error names it;
    // else the error names the episode it stopped before.
    let after = 6 - finished - 1;
    let left = if after > 0 {
        format!(", {after} episode(s) after it not started")
    } else {
        String::new()
    };
    match cut.first() {
        Some(l) => {
            let at = l
                .split(": best ")
                .next()
                .unwrap()
                .replace(": episode", " episode");
            assert!(
                stderr.contains(&format!("stopped in {at}{left};")),
                "{stderr}"
            );
        }
        None => assert!(
            stderr.contains("stopped before ") && stderr.contains(&format!("{left};")),
            "{stderr}"
        ),
    }
    let sql = rusqlite::Connection::open(&*store).unwrap();
    let count = |q: &str| -> i64 { sql.query_row(q, [], |r| r.get(0)).unwrap() };
    assert_eq!(
        count("SELECT COUNT(*) FROM episodes WHERE finished_at IS NOT NULL"),
        finished as i64
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM episodes WHERE finished_at IS NULL"),
        cut.len() as i64
    );
    // Run again: the episodes left are run, and every problem has three.
    let run = mtmc(&args).success();
    assert!(
        run.stdout.contains(&format!(
            "{} episode(s) to run ({finished} already in",
            6 - finished
        )),
        "{}",
        run.stdout
    );
    assert_eq!(
        count("SELECT COUNT(*) FROM episodes WHERE finished_at IS NOT NULL"),
        6
    );
}

#[test]
fn rejudge_stopped_by_ctrl_c_says_where_keeps_what_it_judged_and_resumes() {
    let (_dir, store, store_s, kb) = l2_76_store();
    let problem = "L2/76_Gemm_Add_ReLU";
    let first = recorded_hashes(&store, problem);
    // Every program as judged by an earlier coder: all six to judge again.
    let stale = rusqlite::Connection::open(&store)
        .unwrap()
        .execute(
            "UPDATE evaluations SET fragment_hash = 'earlier' WHERE problem = ?1",
            [problem],
        )
        .unwrap();
    assert_eq!(stale, 6);
    let args = rejudge_l2_76(&kb, &store_s, &[]);
    // Ctrl-C as soon as it said what it will do, long before the six
    // programs are built and judged.
    let (rest, stderr) = interrupted(&args, |l| l.starts_with("rejudge: 1 problem(s)"));
    assert!(stderr.contains("run again to resume"), "{stderr}");
    // Stopped on the problem, its line ends so; stopped before it, the
    // error names it.
    let line = rest.lines().find(|l| l.starts_with(problem));
    match line {
        Some(l) => assert!(l.ends_with("; interrupted"), "{rest}"),
        None => assert!(stderr.contains("stopped before L2/76"), "{stderr}"),
    }
    // What it says it judged is what the store holds, and the summary is
    // still written.
    let judged: usize = rest
        .lines()
        .find_map(|l| l.split_once(" recorded program(s) judged again"))
        .map(|(n, _)| n.parse().unwrap())
        .unwrap_or_else(|| panic!("no summary:\n{rest}"));
    let now = recorded_hashes(&store, problem);
    assert_eq!(now.values().filter(|h| *h != "earlier").count(), judged);
    assert!(judged < 6, "{rest}");
    // Run again: it judges the rest and ends where an uninterrupted run
    // would have.
    let run = mtmc(&args).success().stdout;
    assert!(
        run.contains(&format!("{} recorded program(s) judged again", 6 - judged)),
        "{run}"
    );
    assert_eq!(recorded_hashes(&store, problem), first);
}

#[test]
fn train_stopped_by_ctrl_c_keeps_every_finished_iteration_and_resumes_exactly() {
    let dir = tempfile::tempdir().unwrap();
    let (ck, whole) = (dir.path().join("ck"), dir.path().join("whole"));
    let args = |out: &Path, iterations: &str| small_train(out, iterations, "2");
    let run = mtmc_owned;
    // Far more iterations than it has time for: stopped in the first member.
    let long = args(&ck, "20000");
    let long: Vec<&str> = long.iter().map(String::as_str).collect();
    let (stdout, stderr) = interrupted(&long, |l| l.starts_with("train: "));
    let done: usize = stderr
        .split("interrupted: stopped in member 1/2 after iteration ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("{stderr}"));
    assert!(
        stderr.contains(&format!(
            "after iteration {done} of 20000; the checkpoint in {} holds every finished iteration: run the same command with --resume to finish it",
            ck.display()
        )),
        "{stderr}"
    );
    assert!(
        stdout.contains(&format!("member 1/2 iterations 1..{done}:")),
        "{stdout}"
    );
    // The checkpoint and its curves hold every finished iteration; the
    // committee is not usable until the second member is trained.
    let meta = read_json(&ck.join("meta.json"));
    assert_eq!(meta["iteration"], done, "{meta}");
    assert_eq!(meta["members"], serde_json::json!(["member-2"]));
    let curves = |dir: &Path| -> Vec<String> {
        let csv = std::fs::read_to_string(dir.join("curves.csv")).unwrap();
        // Every column but the seconds an iteration took.
        csv.lines()
            .map(|l| l.rsplit_once(',').unwrap().0.to_string())
            .collect()
    };
    assert_eq!(curves(&ck).len(), done + 1);
    assert!(!ck.join("member-2").exists() && !ck.join("train.json").exists());
    // Resumed two iterations further, it is the run that was never
    // stopped, member by member; not with fewer members than it has.
    let to = (done + 2).to_string();
    let mut resume = args(&ck, &to);
    resume.push("--resume".into());
    let mut fewer = small_train(&ck, &to, "1");
    fewer.push("--resume".into());
    let refused = run(&fewer).failure();
    assert!(
        refused.error.contains(&format!(
            "checkpoint `{}` is a committee of 2: resume it with --members 2 (or more, to add members)",
            ck.display()
        )),
        "{}",
        refused.error
    );
    assert_eq!(read_json(&ck.join("meta.json")), meta);
    let resumed = run(&resume).success();
    assert!(resumed.stdout.contains("resuming"), "{}", resumed.stdout);
    run(&args(&whole, &to)).success();
    for member in ["", "member-2"] {
        let (a, b) = (curves(&ck.join(member)), curves(&whole.join(member)));
        assert_eq!(a.len(), done + 3);
        assert_eq!(a, b, "{member}");
    }
    // More members train the new ones only.
    let mut more = small_train(&whole, &to, "3");
    more.push("--resume".into());
    let grown = run(&more).success();
    assert!(
        grown
            .stdout
            .contains("resuming (the committee of 2 grows to 3)"),
        "{}",
        grown.stdout
    );
    assert_eq!(
        read_json(&whole.join("meta.json"))["members"],
        serde_json::json!(["member-2", "member-3"])
    );
    assert_eq!(curves(&whole), curves(&ck));
    assert_eq!(curves(&whole.join("member-3")).len(), done + 3);
}

/// A committee killed in its first member, before the others exist, is
/// refused as a committee cut short (not taken for its first member
/// alone), and resuming it with fewer members is refused.
#[test]
fn a_committee_killed_in_its_first_member_is_refused_until_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let tree = recorded_h100();
    let tree_s = tree.to_string_lossy().into_owned();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_string_lossy().into_owned();
    let args = |members: &str| small_train(&ck, "20000", members);
    let first = args("2");
    let mut child = mtmc_owned(&first).spawn();
    let t0 = std::time::Instant::now();
    while !ck.join("meta.json").exists() {
        assert!(t0.elapsed().as_secs() < 300, "no checkpoint was written");
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let meta = read_json(&ck.join("meta.json"));
    assert_eq!(meta["members"], serde_json::json!(["member-2"]), "{meta}");
    assert!(!ck.join("member-2").exists());
    let compare = mtmc(&["compare", "--trajectories", &tree_s, "--checkpoint", &ck_s]).failure();
    assert!(
        compare.error.contains("its member `member-2` is missing"),
        "{}",
        compare.error
    );
    let mut fewer = args("1");
    fewer.push("--resume".into());
    let fewer = mtmc_owned(&fewer).failure();
    assert!(
        fewer
            .error
            .contains("is a committee of 2: resume it with --members 2"),
        "{}",
        fewer.error
    );
}

/// A checkpoint whose `train` stopped before writing train.json (the
/// last file, after the reward-to-go model), or that was resumed to more
/// iterations and stopped, is refused until a resume finishes it.
#[test]
fn a_checkpoint_whose_training_did_not_finish_is_refused_until_resumed() {
    let dir = tempfile::tempdir().unwrap();
    let tree = recorded_h100();
    let tree_s = tree.to_string_lossy().into_owned();
    let ck = dir.path().join("ck");
    let ck_s = ck.to_string_lossy().into_owned();
    let train = |iterations: &str, resume: bool| {
        let mut a = small_train(&ck, iterations, "1");
        if resume {
            a.push("--resume".into());
        }
        a
    };
    let stopped = |args: Vec<String>| {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        interrupted(&args, |l| l.starts_with("train: "));
        read_json(&ck.join("meta.json"))["iteration"]
            .as_u64()
            .unwrap()
    };
    let compare = || mtmc(&["compare", "--trajectories", &tree_s, "--checkpoint", &ck_s]);
    let done = stopped(train("20000", false));
    let refused = compare().failure();
    assert!(
        refused.error.contains(&format!(
            "checkpoint `{ck_s}` is not finished: it has no train.json, which `mtmc train` writes last"
        )),
        "{}",
        refused.error
    );
    let to = done.to_string();
    mtmc_owned(&train(&to, true)).success();
    assert!(compare().success().stdout.contains("\ntrained "));
    let further = stopped(train("20000", true));
    assert!(further > done);
    let refused = compare().failure();
    assert!(
        refused.error.contains(&format!(
            "checkpoint `{ck_s}` is not finished: its policy has trained {further} iterations, and the run that wrote its train.json trained {done}: run the `mtmc train` that wrote it again with --resume"
        )),
        "{}",
        refused.error
    );
}

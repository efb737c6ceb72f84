//! `mtmc optimize --coder llm`, `--intent-text` and `mtmc llm-check` end to
//! end against a real HTTP server on loopback replaying scripted replies
//! (compile-only without a GPU: real NVRTC, nothing run).

mod common;

use common::{interrupted_report, interrupted_run, mtmc, read_json, shared_jsonl, walk};
use mtmc_llm::replay::{Server, Step};
use mtmc_llm::{Provider, Store};

const KEY: &str = "sk-mtmc-cli-test-5e0d";

fn reply(name: &str) -> String {
    let path = format!("{}/tests/llm/{name}", env!("CARGO_MANIFEST_DIR"));
    std::fs::read_to_string(path).unwrap()
}

fn dead_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

#[track_caller]
fn no_key_in(dir: &std::path::Path, texts: &[&str]) {
    for t in texts {
        assert!(!t.contains(KEY), "the key was printed");
    }
    for entry in walk(dir) {
        let bytes = std::fs::read(&entry).unwrap();
        assert!(
            !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
            "the key is in {}",
            entry.display()
        );
    }
}

#[test]
fn optimize_with_the_llm_coder_runs_end_to_end_and_replays_offline() {
    let server = Server::start(
        0,
        vec![],
        Some(Step::text(Provider::Openai, &reply("l1_19_relu.md"))),
        "replay",
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store.sqlite");
    let out_dir = dir.path().join("out");
    let args = |out: &std::path::Path, url: &str| {
        vec![
            "optimize".to_string(),
            "L1/19".into(),
            "--kernelbench".into(),
            shared_jsonl(),
            "--coder".into(),
            "llm".into(),
            "--base-url".into(),
            url.to_string(),
            "--model".into(),
            "replay".into(),
            "--store".into(),
            store.to_string_lossy().into_owned(),
            "--out".into(),
            out.to_string_lossy().into_owned(),
            "-v".into(),
        ]
    };
    let a = args(&out_dir, &server.url());
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let run = mtmc(&a).env("OPENAI_API_KEY", KEY).success();
    assert!(
        run.stdout
            .contains("step 1: CustomKernel [1]: compiled, not run (no GPU)"),
        "{}",
        run.stdout
    );
    // The critique the coder gets carries the planner's diagnosis.
    assert!(
        run.stdout.contains("    diagnosis: compiled only"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("llm: 1 call(s), 1 request(s)"),
        "{}",
        run.stdout
    );
    let model_new = std::fs::read_to_string(out_dir.join("model_new.py")).unwrap();
    assert!(model_new.contains("void k1_llm("), "{model_new}");
    assert!(model_new.contains("_KERNELS[\"k1_llm\"]"), "{model_new}");
    let report = read_json(&out_dir.join("report.json"));
    let attempts = report["attempts"].as_array().unwrap();
    assert!(attempts.iter().any(|a| a["llm"]["calls"] == 1), "{report}");
    assert!(
        attempts
            .iter()
            .any(|a| a["diagnosis"]["status"] == "compiled_only"),
        "{report}"
    );
    // The endpoint got the key, in the header only.
    let seen = server.requests();
    assert_eq!(seen.len(), 1);
    assert_eq!(
        seen[0].header("authorization"),
        Some(&*format!("Bearer {KEY}"))
    );
    assert!(seen[0].body.contains("k1_llm(const float* __restrict__ x0"));
    no_key_in(dir.path(), &[&run.stdout, &run.stderr]);
    // Offline, with the endpoint gone: the same program from the cache.
    drop(server);
    let again_dir = dir.path().join("again");
    let mut a = args(&again_dir, &format!("http://127.0.0.1:{}/v1", dead_port()));
    a.push("--offline".into());
    let a: Vec<&str> = a.iter().map(String::as_str).collect();
    let again = mtmc(&a).success();
    assert!(
        again.stdout.contains("1 from the cache"),
        "{}",
        again.stdout
    );
    assert_eq!(
        std::fs::read_to_string(again_dir.join("model_new.py")).unwrap(),
        model_new
    );
    let store = Store::open(&store).unwrap();
    assert_eq!(store.integrity().unwrap(), "ok");
    let statuses: Vec<String> = store
        .calls()
        .unwrap()
        .into_iter()
        .map(|c| c.status)
        .collect();
    assert_eq!(statuses, ["ok", "cached"]);
}

#[test]
fn the_llm_coder_stopped_by_ctrl_c_keeps_its_attempts_and_the_reply_in_flight() {
    // Step 1's kernel lacks a semicolon; step 2, the repair, comes slowly
    // enough for the signal to arrive while its call is in flight.
    let good = reply("l1_19_relu.md");
    let broken = good.replacen("v.x = fmaxf(v.x, 0.f);", "v.x = fmaxf(v.x, 0.f)", 1);
    assert_ne!(broken, good);
    let server = Server::start(
        0,
        vec![
            Step::text(Provider::Openai, &broken),
            Step::text(Provider::Openai, &good).after(std::time::Duration::from_secs(2)),
        ],
        None,
        "replay",
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store.sqlite");
    let out_dir = dir.path().join("out");
    let (kb, url) = (shared_jsonl(), server.url());
    let args = [
        "optimize",
        "L1/19",
        "--kernelbench",
        &kb,
        "--coder",
        "llm",
        "--base-url",
        &url,
        "--model",
        "replay",
        "--store",
        store.to_str().unwrap(),
        "--out",
        out_dir.to_str().unwrap(),
    ];
    let run = mtmc(&args).env("OPENAI_API_KEY", KEY);
    let (stdout, stderr) = interrupted_run(run, |l| {
        if !l.starts_with("  step 1: ") {
            return false;
        }
        while server.requests().len() < 2 {
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        true
    });
    assert!(
        stdout.contains("  step 1: CustomKernel [1]: does not compile, rolled back"),
        "{stdout}"
    );
    assert!(
        stdout.contains("  step 2: FixCompile [1]: interrupted, not kept"),
        "{stdout}"
    );
    // Nothing after the signal: no torch-calls fallback either.
    assert!(!stdout.contains("call-library"), "{stdout}");
    assert!(stdout.contains("llm: 2 call(s)"), "{stdout}");
    let report_path = out_dir.join("report.json");
    assert!(
        stderr.contains(&format!(
            "interrupted: stopped after 0 step(s) judged, before any was correct; the attempts are in {}",
            report_path.display()
        )),
        "{stderr}"
    );
    let attempts = interrupted_report(&out_dir);
    assert_eq!(attempts[0]["step"], 1, "{attempts:?}");
    assert_eq!(attempts[0]["failure"]["stage"], "compile", "{attempts:?}");
    assert!(!out_dir.join("model_new.py").exists());
    // Run again, both replies come from the store: the one that arrived
    // after the signal was kept, and the endpoint is asked nothing more.
    let again = mtmc(&args).env("OPENAI_API_KEY", KEY).success();
    assert!(
        again.stdout.contains("2 from the cache"),
        "{}",
        again.stdout
    );
    assert!(
        again
            .stdout
            .contains("  step 2: FixCompile [1]: compiled, not run (no GPU)"),
        "{}",
        again.stdout
    );
    assert!(out_dir.join("model_new.py").is_file());
    assert_eq!(server.requests().len(), 2);
    no_key_in(dir.path(), &[&stdout, &stderr, &again.stdout]);
}

#[test]
fn a_dead_endpoint_stops_the_llm_coder_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("mtmc.toml");
    std::fs::write(
        &config,
        format!(
            "[llm]\nbase_url = \"http://127.0.0.1:{}/v1\"\nmodel = \"replay\"\nretries = 5\nbackoff_ms = 10\nbreaker_after = 2\n",
            dead_port()
        ),
    )
    .unwrap();
    let store = dir.path().join("store.sqlite");
    let run = mtmc(&[
        "optimize",
        "L1/19",
        "--kernelbench",
        &shared_jsonl(),
        "--coder",
        "llm",
        "--llm-config",
        config.to_str().unwrap(),
        "--store",
        store.to_str().unwrap(),
        "--out",
        dir.path().join("out").to_str().unwrap(),
    ])
    .env("OPENAI_API_KEY", KEY)
    .success();
    assert!(
        run.stdout.contains("the LLM coder stopped"),
        "{}",
        run.stdout
    );
    assert!(
        run.stdout.contains("is down (2 failed attempts in a row"),
        "{}",
        run.stdout
    );
    // What it has is written: every op a torch call.
    assert!(run.stdout.contains("call-library"), "{}", run.stdout);
    let s = Store::open(&store).unwrap();
    assert_eq!(s.integrity().unwrap(), "ok");
    assert_eq!(s.calls().unwrap()[0].status, "endpoint_down");
    no_key_in(dir.path(), &[&run.stdout, &run.stderr]);
}

#[test]
fn intent_text_becomes_an_intent_that_runs_the_pipeline() {
    let server = Server::start(
        0,
        vec![Step::text(Provider::Anthropic, &reply("intent_reply.md"))],
        None,
        "replay",
    )
    .unwrap();
    let dir = tempfile::tempdir().unwrap();
    let saved = dir.path().join("intent.mtmc");
    let run = mtmc(&[
        "optimize",
        "--intent-text",
        "batched matmul 32x512x512 then softmax over the last dim",
        "--save-intent",
        saved.to_str().unwrap(),
        "--provider",
        "anthropic",
        "--base-url",
        &server.url(),
        "--model",
        "replay",
        "--store",
        dir.path().join("store.sqlite").to_str().unwrap(),
        "--out",
        dir.path().join("out").to_str().unwrap(),
    ])
    .env("ANTHROPIC_API_KEY", KEY)
    .success();
    assert!(
        run.stdout.contains("intent written from the text:"),
        "{}",
        run.stdout
    );
    let intent = std::fs::read_to_string(&saved).unwrap();
    assert!(intent.contains("y = softmax(a @ w, dim=n)"), "{intent}");
    assert!(
        dir.path().join("out/program.json").is_file(),
        "{}",
        run.stdout
    );
    let seen = server.requests();
    assert_eq!(seen[0].header("x-api-key"), Some(KEY));
    assert!(seen[0].body.contains("batched matmul 32x512x512"));
    no_key_in(dir.path(), &[&run.stdout, &run.stderr]);
    // --save-intent saves what --intent-text wrote: with an intent of its
    // own, or a problem, it is refused (it was silently ignored).
    for subject in [&["--intent", "y = relu(x)"][..], &["L1/19"][..]] {
        let mut args = subject.to_vec();
        args.extend(["--save-intent", saved.to_str().unwrap()]);
        let err = mtmc(&[&["optimize"][..], &args].concat()).failure();
        assert!(
            err.error
                .contains("cannot be used with '--save-intent <FILE>'"),
            "{}",
            err.error
        );
    }
}

#[test]
fn llm_check_says_what_works_or_one_line_of_what_does_not() {
    let server =
        Server::start(0, vec![Step::text(Provider::Openai, "ok")], None, "replay").unwrap();
    let ok = mtmc(&[
        "llm-check",
        "--base-url",
        &server.url(),
        "--model",
        "replay",
    ])
    .success();
    for part in [
        "reachable:",
        "`replay` is listed",
        "reply: \"ok\"",
        "JSON as expected",
    ] {
        assert!(ok.stdout.contains(part), "{part}: {}", ok.stdout);
    }
    let down = mtmc(&[
        "llm-check",
        "--base-url",
        &format!("http://127.0.0.1:{}/v1", dead_port()),
        "--model",
        "replay",
    ])
    .failure();
    assert!(
        down.error.contains("cannot reach the LLM endpoint"),
        "{}",
        down.error
    );
    let missing = mtmc(&["llm-check", "--base-url", &server.url()]).failure();
    assert!(missing.error.contains("no model"), "{}", missing.error);
}

//! The evaluation worker's protocol and supervision, with a real Python
//! process (no torch or GPU needed for these).

use std::time::Duration;

use mtmc_env::worker::{WorkerError, WorkerSlot};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);

fn eval(problem: &str, candidate: &str) -> Value {
    json!({
        "op": "eval",
        "problem": {"name": "problem.py", "code": problem},
        "candidate": {"name": "candidate.py", "code": candidate},
    })
}

async fn hello(slot: &mut WorkerSlot) -> Value {
    slot.request(json!({"op": "hello"}), LIMIT).await.unwrap()
}

#[tokio::test]
async fn hello_reports_the_interpreter() {
    let mut slot = WorkerSlot::new(None);
    let h = hello(&mut slot).await;
    assert!(h["python"].as_str().unwrap().starts_with("3."), "{h}");
    assert!(h["pid"].as_u64().is_some());
    assert_eq!(slot.starts, 1);
}

#[tokio::test]
async fn a_failed_request_keeps_the_worker() {
    let mut slot = WorkerSlot::new(None);
    let pid = hello(&mut slot).await["pid"].clone();
    let e = slot
        .request(json!({"op": "nope"}), LIMIT)
        .await
        .unwrap_err();
    assert_eq!(e.to_string(), "unknown op 'nope'");
    assert!(!e.lost_worker());
    assert_eq!(hello(&mut slot).await["pid"], pid);
    assert_eq!(slot.starts, 1);
}

#[tokio::test]
async fn a_hang_costs_one_request_and_a_new_worker() {
    let mut slot = WorkerSlot::new(None);
    let pid = hello(&mut slot).await["pid"].clone();
    let started = std::time::Instant::now();
    let e = slot
        .request(
            eval("", "import time\ntime.sleep(60)\n"),
            Duration::from_secs(1),
        )
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::Timeout(_)), "{e}");
    assert!(started.elapsed() < Duration::from_secs(10));
    let fresh = hello(&mut slot).await;
    assert_ne!(fresh["pid"], pid);
    assert_eq!(slot.starts, 2);
}

#[tokio::test]
async fn a_crash_is_reported_with_its_status_and_the_next_request_works() {
    let mut slot = WorkerSlot::new(None);
    let candidate = "import os, sys\nprint('about to die', file=sys.stderr)\nos._exit(7)\n";
    let e = slot.request(eval("", candidate), LIMIT).await.unwrap_err();
    match &e {
        WorkerError::Died { status, stderr } => {
            assert!(status.contains('7'), "{status}");
            assert!(stderr.iter().any(|l| l == "about to die"), "{stderr:?}");
        }
        other => panic!("expected a death, got {other}"),
    }
    assert!(e.lost_worker());
    assert!(hello(&mut slot).await["python"].is_string());
    assert_eq!(slot.starts, 2);
}

#[tokio::test]
async fn candidate_errors_at_load_are_compile_errors() {
    let mut slot = WorkerSlot::new(None);
    let r = slot
        .request(
            eval(
                "x = 1\n",
                "print('noise on stdout')\nraise ValueError('boom')\n",
            ),
            LIMIT,
        )
        .await
        .unwrap();
    assert_eq!(r["status"], "compile_error");
    assert_eq!(r["error"], "ValueError: boom");
    // The candidate's print did not reach the protocol stream.
    let r = slot
        .request(eval("x = 1\n", "y = 2\n"), LIMIT)
        .await
        .unwrap();
    assert_eq!(r["status"], "compile_error");
    assert_eq!(
        r["error"],
        "NameError: the candidate defines no ModelNew class"
    );
    assert_eq!(slot.starts, 1);
}

#[tokio::test]
async fn a_long_compile_log_keeps_its_error_line() {
    // A compiler's log where warnings before and after the error fill more
    // than the 2,000 characters an error keeps: the error line (and the
    // critique's line number and kind with it) must survive the cut.
    let mut slot = WorkerSlot::new(None);
    let candidate = r#"
warn = 'k.cu(40): warning #177-D: variable "b_off" was declared but never referenced\n    const long long b_off = 0;\n    ^\n'
log = warn * 40 + 'k.cu(343): error: declaration is incompatible with previous "smem" (declared at line 29)\n    extern __shared__ unsigned char smem[];\n    ^\n' + warn * 40 + '1 error detected in the compilation of "k.cu".'
raise RuntimeError(log)
"#;
    let r = slot
        .request(eval("x = 1\n", candidate), LIMIT)
        .await
        .unwrap();
    assert_eq!(r["status"], "compile_error");
    let error = r["error"].as_str().unwrap();
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
}

#[tokio::test]
async fn a_missing_interpreter_is_a_clear_error() {
    let mut slot = WorkerSlot::with_interpreter("/nonexistent/python3".into(), None);
    let e = slot
        .request(json!({"op": "hello"}), LIMIT)
        .await
        .unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/python3 could not be started"),
        "{e}"
    );
    assert_eq!(slot.starts, 0);
}

#[tokio::test]
async fn workers_have_no_network_where_the_os_allows_it() {
    let mut slot = WorkerSlot::new(None);
    let h = hello(&mut slot).await;
    match mtmc_env::worker::network_isolation() {
        mtmc_env::worker::Isolation::Unshare(_) => assert_eq!(h["network"], "none", "{h}"),
        mtmc_env::worker::Isolation::None(why) => {
            eprintln!("not isolated here: {why}");
            assert_eq!(h["network"], "present", "{h}");
        }
    }
}

//! The evaluation worker's protocol and supervision, with a real Python
//! process (no torch or GPU needed for these; `cheats.rs` judges
//! candidates, with torch).

use std::time::Duration;

use mtmc_env::worker::{WorkerError, WorkerSlot};
use serde_json::{Value, json};

const LIMIT: Duration = Duration::from_secs(30);

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

/// A reply line that does not carry the worker's token (written by
/// anything but the judge) is refused, and the worker stopped.
#[tokio::test]
async fn a_reply_without_the_token_is_refused() {
    let forger = "import json, sys\nfor line in sys.stdin:\n    print(json.dumps({'id': json.loads(line)['id'], 'ok': True, 'result': {'status': 'correct'}}), flush=True)\n";
    let launcher = mtmc_env::worker::Launcher::program(
        "python3".into(),
        vec!["-c".into(), forger.into()],
        "python3 is needed",
    );
    let mut slot = WorkerSlot::with_launcher(launcher, None);
    let e = slot
        .request(json!({"op": "hello"}), LIMIT)
        .await
        .unwrap_err();
    assert!(matches!(e, WorkerError::Protocol(_)), "{e}");
    assert!(e.to_string().contains("without this worker's token"), "{e}");
    assert!(slot.is_idle(), "the worker was stopped");
}

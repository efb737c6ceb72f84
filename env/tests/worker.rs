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

/// The cell's counters are read and written whole. A runner spinning on
/// `go` while the judge moves it from 255 to 256 must never see a number in
/// between (it would serve a call it was not given, or stop): one process
/// moves `go` across byte boundaries while another reads it, through the
/// runner's own `Words`.
#[test]
fn the_cells_counters_are_never_read_half_written() {
    let script = r#"
import mmap, os, struct, sys, time
ns = {"__name__": "mtmc_runner_definitions"}
exec(compile(sys.stdin.read(), "runner.py", "exec"), ns)
pairs = [(255, 256), (65535, 65536), ((1 << 32) - 1, 1 << 32)]
def run(write, read):
    cell = mmap.mmap(-1, ns["CELL_BYTES"])
    write(cell, 255)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        allowed = {v for p in pairs for v in p}
        torn, reads = 0, 0
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            for _ in range(20000):
                if read(cell) not in allowed:
                    torn += 1
            reads += 20000
        os.write(w, f"{torn} {reads}".encode())
        os._exit(0)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        for a, b in pairs:
            for _ in range(200):
                write(cell, b)
                write(cell, a)
    os.waitpid(pid, 0)
    return os.read(r, 100).decode()
words = {}
def w_words(cell, v):
    if id(cell) not in words:
        words[id(cell)] = ns["Words"](cell)
    words[id(cell)].q[ns["GO_W"]] = v
def r_words(cell):
    if id(cell) not in words:
        words[id(cell)] = ns["Words"](cell)
    return words[id(cell)].q[ns["GO_W"]]
print("words", run(w_words, r_words))
print("struct", run(lambda c, v: struct.pack_into("<Q", c, ns["GO"], v), lambda c: struct.unpack_from("<Q", c, ns["GO"])[0]))
"#;
    let mut child = std::process::Command::new("python3")
        .args(["-c", script])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 is needed");
    use std::io::Write;
    child
        .stdin
        .take()
        .unwrap()
        .write_all(mtmc_env::worker::RUNNER_SCRIPT.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // For comparison: a word written with struct.pack_into (a byte at a
    // time) is read torn wherever the two processes ran at once.
    eprintln!("{text}");
    let line = text.lines().find(|l| l.starts_with("words ")).unwrap();
    let torn: u64 = line.split(' ').nth(1).unwrap().parse().unwrap();
    let reads: u64 = line.split(' ').nth(2).unwrap().parse().unwrap();
    assert!(reads > 0, "{text}");
    assert_eq!(torn, 0, "a counter was read half-written: {text}");
}

//! The evaluation worker: a persistent Python process (one per GPU) that
//! keeps torch loaded and runs the KernelBench protocol on candidates.
//!
//! Requests and replies are JSON lines over the process's stdin and stdout.
//! Every request has a wall-clock limit. A worker that overruns it or dies (a
//! hanging kernel, an illegal address, a segfault) is killed, and that
//! request alone fails; [`WorkerSlot`] starts a fresh worker for the next one.

use std::collections::{BTreeMap, VecDeque};
use std::ffi::{OsStr, OsString};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde::Deserialize as _;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::outcome::{
    BadElement, Baseline, Correctness, EvaluatorKind, Integrity, KernelReport, Outcome, Status,
    Timing,
};
use crate::python;

/// The judge's script, shipped inside the binary.
pub const JUDGE_SCRIPT: &str = include_str!("../python/judge.py");

/// The runner's script (the only place candidate code runs), shipped inside
/// the binary and handed to the judge as its first argument.
pub const RUNNER_SCRIPT: &str = include_str!("../python/runner.py");

/// Lines of the worker's stderr kept for error messages.
const STDERR_TAIL: usize = 20;

/// Why a request got no reply.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The worker program could not be started.
    #[error("{program} could not be started ({source}); {hint}")]
    Spawn {
        /// The program tried.
        program: String,
        /// The OS error.
        source: std::io::Error,
        /// What to do about it.
        hint: String,
    },
    /// No reply within the limit; the worker was killed.
    #[error("no reply within {0:?}; the worker was stopped")]
    Timeout(Duration),
    /// The worker exited before replying.
    #[error("the worker died ({status}){}", tail_text(.stderr))]
    Died {
        /// How it exited.
        status: String,
        /// The end of its stderr.
        stderr: Vec<String>,
    },
    /// The worker answered that the request failed.
    #[error("{0}")]
    Failed(String),
    /// The reply was not what the protocol says.
    #[error("protocol error: {0}")]
    Protocol(String),
}

fn tail_text(lines: &[String]) -> String {
    match lines.last() {
        Some(last) => format!(": {last}"),
        None => String::new(),
    }
}

impl WorkerError {
    /// Whether the worker process is gone (the next request needs a new one).
    pub fn lost_worker(&self) -> bool {
        matches!(
            self,
            WorkerError::Timeout(_) | WorkerError::Died { .. } | WorkerError::Protocol(_)
        )
    }
}

/// How workers are cut off from the network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Isolation {
    /// Started through `unshare` with these flags: a network namespace of
    /// their own, with only a loopback interface.
    Unshare(&'static [&'static str]),
    /// Not isolated, and why.
    None(String),
}

/// Set to `allow` to start workers without network isolation.
pub const NETWORK_ENV: &str = "MTMC_WORKER_NETWORK";

/// Whether this machine lets workers run without a network: tries
/// `unshare --net` as root (no user namespace, so that the judge can give a
/// candidate's process a user id of its own), then as an unprivileged user
/// (with a user namespace). Probed once per process.
pub fn network_isolation() -> Isolation {
    static PROBE: std::sync::OnceLock<Isolation> = std::sync::OnceLock::new();
    PROBE
        .get_or_init(|| {
            if std::env::var(NETWORK_ENV).is_ok_and(|v| v == "allow") {
                return Isolation::None(format!("{NETWORK_ENV}=allow"));
            }
            let candidates: [&'static [&'static str]; 2] =
                [&["--net"], &["--net", "--map-root-user"]];
            let mut last = String::from("unshare is not installed");
            for flags in candidates {
                match std::process::Command::new("unshare")
                    .args(flags)
                    .arg("true")
                    .stderr(Stdio::piped())
                    .output()
                {
                    Ok(o) if o.status.success() => return Isolation::Unshare(flags),
                    Ok(o) => {
                        last = format!(
                            "unshare {} failed: {}",
                            flags.join(" "),
                            String::from_utf8_lossy(&o.stderr).trim()
                        )
                    }
                    Err(e) => last = format!("unshare cannot run: {e}"),
                }
            }
            Isolation::None(last)
        })
        .clone()
}

/// What `CUDA_VISIBLE_DEVICES` names the `ordinal`-th GPU this process
/// sees: the entry of the caller's own list when it has one, so that a
/// restricted set of GPUs stays restricted.
pub fn visible_device(ordinal: u32) -> String {
    match std::env::var("CUDA_VISIBLE_DEVICES") {
        Ok(list) if !list.trim().is_empty() => list
            .split(',')
            .nth(ordinal as usize)
            .map_or_else(|| ordinal.to_string(), |d| d.trim().to_string()),
        _ => ordinal.to_string(),
    }
}

/// Whether `program` names an executable file, directly or on `$PATH`.
fn on_path(program: &OsStr) -> bool {
    let path = std::path::Path::new(program);
    if path.components().count() > 1 {
        return path.is_file();
    }
    std::env::var_os("PATH")
        .is_some_and(|dirs| std::env::split_paths(&dirs).any(|d| d.join(program).is_file()))
}

/// One running worker process.
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    next_id: u64,
    token: String,
}

/// 128 random bits, as hex: the token a worker's replies must echo.
fn new_token() -> String {
    use std::io::Read as _;
    let mut bytes = [0u8; 16];
    let read = std::fs::File::open("/dev/urandom").and_then(|mut f| f.read_exact(&mut bytes));
    if read.is_err() {
        // No /dev/urandom: the clock and the process id, which nothing in a
        // candidate's process can read back either.
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        bytes = (now ^ (u128::from(std::process::id()) << 64)).to_le_bytes();
    }
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl Worker {
    /// Starts a worker process; with `gpu`, it sees only that GPU.
    pub fn start(launcher: &Launcher, gpu: Option<u32>) -> Result<Worker, WorkerError> {
        let spawn_error = |source| WorkerError::Spawn {
            program: launcher.program.to_string_lossy().into_owned(),
            source,
            hint: launcher.hint.clone(),
        };
        // Through unshare, a missing program would show up only as an early
        // exit: look for it first.
        if !on_path(&launcher.program) {
            return Err(spawn_error(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "not found",
            )));
        }
        let mut cmd = match network_isolation() {
            Isolation::Unshare(flags) => {
                let mut c = Command::new("unshare");
                c.args(flags).arg("--").arg(&launcher.program);
                c
            }
            Isolation::None(_) => Command::new(&launcher.program),
        };
        cmd.args(&launcher.args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(gpu) = gpu {
            cmd.env("CUDA_VISIBLE_DEVICES", visible_device(gpu));
        }
        let mut child = cmd.spawn().map_err(spawn_error)?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let mut err_lines = BufReader::new(child.stderr.take().expect("stderr is piped")).lines();
        let tail = Arc::clone(&stderr);
        // With MTMC_JUDGE_DEBUG the judge says what it is doing on stderr:
        // those lines reach this process's stderr too.
        let echo = std::env::var("MTMC_JUDGE_DEBUG").is_ok_and(|v| v == "1");
        tokio::spawn(async move {
            while let Ok(Some(line)) = err_lines.next_line().await {
                if echo {
                    eprintln!("{line}");
                }
                let mut t = tail.lock().expect("stderr tail lock");
                if t.len() == STDERR_TAIL {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        Ok(Worker {
            child,
            stdin,
            stdout,
            stderr,
            next_id: 1,
            token: new_token(),
        })
    }

    /// The worker's process id.
    pub fn pid(&self) -> Option<u32> {
        self.child.id()
    }

    /// Sends `request` (an object; its `id` is set here) and waits at most
    /// `limit` for the reply's `result`.
    pub async fn request(
        &mut self,
        mut request: Value,
        limit: Duration,
    ) -> Result<Value, WorkerError> {
        let id = self.next_id;
        self.next_id += 1;
        request["id"] = json!(id);
        request["token"] = json!(self.token);
        let line = serde_json::to_string(&request).expect("a JSON value serializes") + "\n";
        let exchange = async {
            if self.stdin.write_all(line.as_bytes()).await.is_err()
                || self.stdin.flush().await.is_err()
            {
                return Err(self.died().await);
            }
            match self.stdout.next_line().await {
                Ok(Some(reply)) => Ok(reply),
                _ => Err(self.died().await),
            }
        };
        let reply = match tokio::time::timeout(limit, exchange).await {
            Ok(r) => r?,
            Err(_) => {
                let _ = self.child.kill().await;
                return Err(WorkerError::Timeout(limit));
            }
        };
        let reply: Value = serde_json::from_str(&reply)
            .map_err(|e| WorkerError::Protocol(format!("reply is not JSON: {e}")))?;
        if reply["token"] != json!(self.token) {
            let _ = self.child.kill().await;
            return Err(WorkerError::Protocol(
                "a reply without this worker's token (a line written into its channel by something else); the worker was stopped".into(),
            ));
        }
        if reply["id"] != json!(id) {
            return Err(WorkerError::Protocol(format!(
                "reply to request {} while waiting for {id}",
                reply["id"]
            )));
        }
        if reply["ok"] == json!(true) {
            Ok(reply["result"].clone())
        } else {
            Err(WorkerError::Failed(
                reply["error"]
                    .as_str()
                    .unwrap_or("the worker reported a failure")
                    .to_string(),
            ))
        }
    }

    async fn died(&mut self) -> WorkerError {
        let status = match tokio::time::timeout(Duration::from_secs(5), self.child.wait()).await {
            Ok(Ok(s)) => s.to_string(),
            _ => "no exit status".to_string(),
        };
        // Give the stderr reader a moment to drain the last lines.
        tokio::time::sleep(Duration::from_millis(50)).await;
        let stderr = self
            .stderr
            .lock()
            .expect("stderr tail lock")
            .iter()
            .cloned()
            .collect();
        WorkerError::Died { status, stderr }
    }
}

/// How to start a worker process.
#[derive(Clone, Debug)]
pub struct Launcher {
    /// The program.
    pub program: OsString,
    /// Its arguments.
    pub args: Vec<OsString>,
    /// What to do when it cannot be started.
    pub hint: String,
}

impl Launcher {
    /// The judge (`judge.py`, shipped inside the binary, with the runner's
    /// source as its argument) run by `python`.
    pub fn python(python: OsString) -> Launcher {
        Launcher {
            program: python,
            args: ["-u", "-c", JUDGE_SCRIPT, RUNNER_SCRIPT]
                .map(OsString::from)
                .to_vec(),
            hint: format!("set {} to a Python with torch", python::PYTHON_ENV),
        }
    }

    /// Any program that speaks the same JSON lines (the native runner).
    pub fn program(program: OsString, args: Vec<OsString>, hint: &str) -> Launcher {
        Launcher {
            program,
            args,
            hint: hint.to_string(),
        }
    }
}

/// A worker that is started on first use and replaced after it is lost.
pub struct WorkerSlot {
    launcher: Launcher,
    gpu: Option<u32>,
    worker: Option<Worker>,
    /// How many workers this slot has started.
    pub starts: u32,
}

impl WorkerSlot {
    /// A slot for one GPU (or none), run by `$MTMC_PYTHON` or `python3`.
    pub fn new(gpu: Option<u32>) -> WorkerSlot {
        WorkerSlot::with_interpreter(python::interpreter(), gpu)
    }

    /// A slot whose workers run with the interpreter `python`.
    pub fn with_interpreter(python: OsString, gpu: Option<u32>) -> WorkerSlot {
        WorkerSlot::with_launcher(Launcher::python(python), gpu)
    }

    /// A slot whose workers `launcher` starts.
    pub fn with_launcher(launcher: Launcher, gpu: Option<u32>) -> WorkerSlot {
        WorkerSlot {
            launcher,
            gpu,
            worker: None,
            starts: 0,
        }
    }

    /// Whether no worker is running (the next request starts one).
    pub fn is_idle(&self) -> bool {
        self.worker.is_none()
    }

    /// Stops the current worker, if any; the next request starts a new one.
    pub fn discard(&mut self) {
        self.worker = None;
    }

    /// Runs one request, starting a worker if needed. When the worker is
    /// lost (timeout, death), it is dropped (and so killed) and the next
    /// call starts a new one.
    pub async fn request(&mut self, request: Value, limit: Duration) -> Result<Value, WorkerError> {
        if self.worker.is_none() {
            self.worker = Some(Worker::start(&self.launcher, self.gpu)?);
            self.starts += 1;
        }
        let worker = self.worker.as_mut().expect("started above");
        let result = worker.request(request, limit).await;
        if let Err(e) = &result
            && e.lost_worker()
        {
            self.worker = None;
        }
        result
    }
}

/// The KernelBench protocol's parameters.
#[derive(Clone, Debug)]
pub struct Protocol {
    /// Seed of the correctness trials' seeds.
    pub seed: u64,
    /// Correctness trials, each with fresh inputs.
    pub correctness_trials: u32,
    /// Untimed calls before timing.
    pub warmup: u32,
    /// Timed calls.
    pub trials: u32,
    /// Absolute tolerance.
    pub atol: f64,
    /// Relative tolerance.
    pub rtol: f64,
}

impl Protocol {
    /// KernelBench's fp32 settings.
    pub const KERNELBENCH_FP32: Protocol = Protocol {
        seed: 42,
        correctness_trials: 5,
        warmup: 3,
        trials: 100,
        atol: 1e-4,
        rtol: 1e-4,
    };
}

/// The worker's `eval` reply, as it is on the wire.
#[derive(Debug, serde::Deserialize)]
struct Reply {
    status: String,
    #[serde(default)]
    device: Option<String>,
    #[serde(default)]
    error: Option<String>,
    #[serde(default)]
    why: Option<String>,
    #[serde(default)]
    load_seconds: Option<f64>,
    #[serde(default)]
    trials_run: Option<u32>,
    #[serde(default, deserialize_with = "lenient_f64")]
    max_abs_err: Option<f64>,
    #[serde(default, deserialize_with = "lenient_f64")]
    rel_to_scale: Option<f64>,
    #[serde(default)]
    first_bad_index: Option<Vec<u64>>,
    #[serde(default, deserialize_with = "lenient_f64")]
    expected: Option<f64>,
    #[serde(default, deserialize_with = "lenient_f64")]
    got: Option<f64>,
    #[serde(default)]
    runtime: Option<Timing>,
    #[serde(default)]
    baselines: BTreeMap<String, Baseline>,
    #[serde(default)]
    kernels: Vec<KernelReport>,
    #[serde(default)]
    torch_ops: BTreeMap<String, u32>,
    #[serde(default)]
    reference_seconds: Option<f64>,
    #[serde(default)]
    check_seconds: Option<f64>,
    #[serde(default)]
    timing_seconds: Option<f64>,
    #[serde(default)]
    reference_tf32: bool,
    #[serde(default)]
    failed_check: Option<String>,
    #[serde(default)]
    integrity: Option<Integrity>,
    #[serde(default)]
    screen: Option<u32>,
}

/// A float, or the worker's spelling of a non-finite one (`"inf"`,
/// `"-inf"`, `"nan"`: JSON has no literal for them).
fn lenient_f64<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<f64>, D::Error> {
    #[derive(serde::Deserialize)]
    #[serde(untagged)]
    enum Float {
        Number(f64),
        Text(String),
    }
    Ok(match Option::<Float>::deserialize(d)? {
        None => None,
        Some(Float::Number(x)) => Some(x),
        Some(Float::Text(t)) => Some(t.parse().map_err(serde::de::Error::custom)?),
    })
}

impl Reply {
    fn into_outcome(self) -> Result<Outcome, WorkerError> {
        let status = match self.status.as_str() {
            "correct" => Status::Correct,
            "incorrect" => Status::Incorrect,
            "compile_error" => Status::CompileError,
            "runtime_error" => Status::RuntimeError,
            "not_run" => Status::CompiledOnly,
            "timeout" => Status::Timeout,
            "crashed" => Status::Crashed,
            other => return Err(WorkerError::Protocol(format!("unknown status `{other}`"))),
        };
        let mut o = Outcome::new(EvaluatorKind::Worker, status);
        o.device = self.device;
        o.error = self.error;
        o.why = self.why;
        o.load_seconds = self.load_seconds;
        if let Some(trials) = self.trials_run {
            o.correctness = Some(Correctness {
                trials,
                max_abs_err: self.max_abs_err,
                rel_to_scale: self.rel_to_scale,
                first_bad: self.first_bad_index.map(|index| BadElement {
                    index,
                    expected: self.expected.unwrap_or(f64::NAN),
                    got: self.got.unwrap_or(f64::NAN),
                }),
                elements_checked: None,
            });
        }
        o.runtime = self.runtime;
        o.baselines = self.baselines;
        o.reference_tf32 = self.reference_tf32;
        o.failed_check = self.failed_check;
        o.integrity = self.integrity;
        o.screen = self.screen;
        o.kernels = self.kernels;
        // Triton kernels say their block (num_warps × 32): their occupancy
        // follows from registers and shared memory. cupy's do not (the block
        // is chosen at each launch), so theirs stays unknown.
        for k in &mut o.kernels {
            if let (None, Some(block), Some(registers)) =
                (k.occupancy, k.block_threads, k.registers)
            {
                let r = crate::nvrtc::KernelResources {
                    name: k.name.clone(),
                    registers,
                    shared_bytes: k.shared_bytes.unwrap_or(0),
                    ..Default::default()
                };
                k.occupancy = Some(crate::nvrtc::occupancy(
                    &r,
                    block,
                    0,
                    crate::nvrtc::SmLimits::SM90,
                ));
            }
        }
        o.torch_ops = self.torch_ops;
        for (phase, seconds) in [
            ("reference", self.reference_seconds),
            ("load", self.load_seconds),
            ("check", self.check_seconds),
            ("timing", self.timing_seconds),
        ] {
            if let Some(s) = seconds {
                o.phases.insert(phase.to_string(), s);
            }
        }
        Ok(o)
    }
}

/// The outcome an `eval` request's `result` gives.
pub(crate) fn outcome_of_result(result: Value) -> Result<Outcome, WorkerError> {
    let reply: Reply = serde_json::from_value(result)
        .map_err(|e| WorkerError::Protocol(format!("unreadable outcome: {e}")))?;
    reply.into_outcome()
}

/// Runs one `eval` request. A timeout or a crash of the worker itself becomes
/// an outcome (`timeout`, `crashed`), and the slot starts a fresh worker for
/// the next candidate.
pub async fn run_eval(
    slot: &mut WorkerSlot,
    request: Value,
    limit: Duration,
) -> Result<Outcome, WorkerError> {
    let lost = |status, e: &WorkerError| {
        let mut o = Outcome::new(EvaluatorKind::Worker, status);
        o.error = Some(e.to_string());
        o
    };
    match slot.request(request, limit).await {
        Ok(result) => outcome_of_result(result),
        Err(e @ WorkerError::Timeout(_)) => Ok(lost(Status::Timeout, &e)),
        Err(e @ WorkerError::Died { .. }) => Ok(lost(Status::Crashed, &e)),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_reply_becomes_an_outcome_with_triton_occupancy_and_non_finite_errors() {
        let reply: Reply = serde_json::from_value(json!({
            "status": "incorrect",
            "device": "NVIDIA H100 80GB HBM3",
            "why": "values differ beyond tolerance",
            "trials_run": 1,
            "max_abs_err": "inf",
            "first_bad_index": [0, 7],
            "expected": 0.5,
            "got": "nan",
            "kernels": [
                {"name": "_relu", "source": "triton", "registers": 64, "shared_bytes": 0, "num_warps": 4, "block_threads": 128},
                {"name": "relu", "source": "cupy", "registers": 32}
            ],
            "check_seconds": 0.25
        }))
        .unwrap();
        let o = reply.into_outcome().unwrap();
        assert_eq!(o.status, Status::Incorrect);
        let c = o.correctness.unwrap();
        assert_eq!(c.max_abs_err, Some(f64::INFINITY));
        let bad = c.first_bad.unwrap();
        assert_eq!(bad.index, [0, 7]);
        assert!(bad.got.is_nan());
        // 64 registers × 128 threads: 8 blocks of 4 warps, half the SM's 64 warps.
        assert_eq!(o.kernels[0].occupancy, Some(0.5));
        assert_eq!(o.kernels[1].occupancy, None);
        assert_eq!(o.phases["check"], 0.25);
    }

    #[test]
    fn an_unknown_status_is_a_protocol_error() {
        let reply: Reply = serde_json::from_value(json!({"status": "great"})).unwrap();
        assert!(matches!(
            reply.into_outcome(),
            Err(WorkerError::Protocol(_))
        ));
    }
}

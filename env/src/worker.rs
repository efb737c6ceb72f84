//! The evaluation worker: a persistent Python process (one per GPU) that
//! keeps torch loaded and runs the KernelBench protocol on candidates.
//!
//! Requests and replies are JSON lines over the process's stdin and stdout.
//! Every request has a wall-clock limit. A worker that overruns it or dies (a
//! hanging kernel, an illegal address, a segfault) is killed, and that
//! request alone fails; [`WorkerSlot`] starts a fresh worker for the next one.

use std::collections::VecDeque;
use std::ffi::{OsStr, OsString};
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader, Lines};
use tokio::process::{Child, ChildStdin, ChildStdout, Command};

use crate::python;

/// The worker script, shipped inside the binary.
pub const WORKER_SCRIPT: &str = include_str!("../python/worker.py");

/// Lines of the worker's stderr kept for error messages.
const STDERR_TAIL: usize = 20;

/// Why a request got no reply.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    /// The interpreter could not be started.
    #[error("{python} could not be started ({source}); set {env} to a Python with torch")]
    Spawn {
        /// The interpreter tried.
        python: String,
        /// The OS error.
        source: std::io::Error,
        /// The variable that selects the interpreter.
        env: &'static str,
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

/// One running worker process.
pub struct Worker {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    next_id: u64,
}

impl Worker {
    /// Starts a worker with interpreter `py`; with `gpu`, it sees only that GPU.
    pub fn start(py: &OsStr, gpu: Option<u32>) -> Result<Worker, WorkerError> {
        let mut cmd = Command::new(py);
        cmd.args(["-u", "-c", WORKER_SCRIPT])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true);
        if let Some(gpu) = gpu {
            cmd.env("CUDA_VISIBLE_DEVICES", gpu.to_string());
        }
        let mut child = cmd.spawn().map_err(|source| WorkerError::Spawn {
            python: py.to_string_lossy().into_owned(),
            source,
            env: python::PYTHON_ENV,
        })?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let mut err_lines = BufReader::new(child.stderr.take().expect("stderr is piped")).lines();
        let tail = Arc::clone(&stderr);
        tokio::spawn(async move {
            while let Ok(Some(line)) = err_lines.next_line().await {
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

/// A worker that is started on first use and replaced after it is lost.
pub struct WorkerSlot {
    python: OsString,
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
        WorkerSlot {
            python,
            gpu,
            worker: None,
            starts: 0,
        }
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
            self.worker = Some(Worker::start(&self.python, self.gpu)?);
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

/// Timing statistics of one callable, milliseconds per call.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct Timing {
    /// Mean.
    pub mean_ms: f64,
    /// Median.
    pub median_ms: f64,
    /// Sample standard deviation.
    pub std_ms: f64,
    /// Fastest trial.
    pub min_ms: f64,
    /// Slowest trial.
    pub max_ms: f64,
    /// Timed trials.
    pub trials: u32,
}

/// What the worker's `eval` found, or why it found nothing.
#[derive(Clone, Debug, serde::Deserialize, serde::Serialize)]
pub struct EvalOutcome {
    /// `correct`, `incorrect`, `compile_error`, `runtime_error`, `not_run`;
    /// the caller adds `timeout` and `crashed`.
    pub status: String,
    /// The error or traceback's last line.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// Why it is incorrect or was not run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub why: Option<String>,
    /// Seconds to load the candidate (its kernels' compile included).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_seconds: Option<f64>,
    /// Correctness trials run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trials_run: Option<u32>,
    /// Largest absolute error over the trials.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_abs_err: Option<f64>,
    /// Largest absolute error over the largest reference magnitude.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub rel_to_scale: Option<f64>,
    /// First element outside tolerance.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub first_bad_index: Option<Vec<u64>>,
    /// The reference's value there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expected: Option<f64>,
    /// The candidate's value there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub got: Option<f64>,
    /// The candidate's timing.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub runtime: Option<Timing>,
    /// The problem's eager PyTorch timing, measured in the same run.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub baseline_eager: Option<Timing>,
}

impl EvalOutcome {
    /// An outcome for a request that got no reply.
    pub fn lost(status: &str, error: &WorkerError) -> EvalOutcome {
        EvalOutcome {
            status: status.to_string(),
            error: Some(error.to_string()),
            why: None,
            load_seconds: None,
            trials_run: None,
            max_abs_err: None,
            rel_to_scale: None,
            first_bad_index: None,
            expected: None,
            got: None,
            runtime: None,
            baseline_eager: None,
        }
    }

    /// Eager mean over the candidate's mean, when both were timed.
    pub fn speedup_vs_eager(&self) -> Option<f64> {
        Some(self.baseline_eager.as_ref()?.mean_ms / self.runtime.as_ref()?.mean_ms)
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

/// Evaluates a `ModelNew` source against a problem's `Model` source. A
/// timeout or a crash becomes an outcome (`timeout`, `crashed`), and the slot
/// starts a fresh worker for the next candidate.
pub async fn evaluate(
    slot: &mut WorkerSlot,
    problem: (&str, &str),
    candidate: (&str, &str),
    protocol: &Protocol,
    limit: Duration,
) -> Result<EvalOutcome, WorkerError> {
    let request = json!({
        "op": "eval",
        "problem": {"name": problem.0, "code": problem.1},
        "candidate": {"name": candidate.0, "code": candidate.1},
        "seed": protocol.seed,
        "correctness_trials": protocol.correctness_trials,
        "warmup": protocol.warmup,
        "trials": protocol.trials,
        "atol": protocol.atol,
        "rtol": protocol.rtol,
        "baseline": true,
    });
    match slot.request(request, limit).await {
        Ok(result) => {
            if result["replace_worker"] == json!(true) {
                slot.discard();
            }
            serde_json::from_value(result)
                .map_err(|e| WorkerError::Protocol(format!("unreadable outcome: {e}")))
        }
        Err(e @ WorkerError::Timeout(_)) => Ok(EvalOutcome::lost("timeout", &e)),
        Err(e @ WorkerError::Died { .. }) => Ok(EvalOutcome::lost("crashed", &e)),
        Err(e) => Err(e),
    }
}

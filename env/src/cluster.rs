//! Judging on a Dask cluster: the candidates of a batch become tasks of
//! the cluster's scheduler, each judged on a worker with the resource
//! `judge` (one worker per GPU) by the same judge a local run starts.
//!
//! mtmc speaks JSON lines with a bridge (`python/cluster.py`, shipped
//! inside the binary) run by the driver's Python, which holds the Dask
//! client. Outcomes come back as they finish. A worker lost mid-batch
//! costs only its candidates in flight, which the scheduler judges again
//! on another worker; a candidate that kills its judge costs that
//! candidate; a worker whose GPU is not the run's takes none.
//!
//! Start a cluster with one worker per GPU, each seeing its GPU alone:
//! `dask scheduler` on one host, then on each GPU host, per GPU,
//! `CUDA_VISIBLE_DEVICES=N dask worker tcp://HOST:8786 --nthreads 1
//! --resources judge=1`.

use std::collections::VecDeque;
use std::ffi::OsString;
use std::io::{BufRead, BufReader, Lines, Write};
use std::process::{Child, ChildStdin, ChildStdout, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use serde_json::{Value, json};

use crate::error::EvalError;
use crate::outcome::{EvaluatorKind, Outcome, Status};
use crate::worker::{self, WorkerError};

/// The bridge's script, shipped inside the binary.
pub const CLUSTER_SCRIPT: &str = include_str!("../python/cluster.py");

/// The environment variable naming the cluster's scheduler (what
/// `--cluster` sets).
pub const CLUSTER_ENV: &str = "MTMC_CLUSTER";

/// Lines of the bridge's stderr kept for error messages.
const STDERR_TAIL: usize = 20;

/// Why the cluster could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The bridge could not be started.
    #[error(
        "{program} could not be started for the cluster backend ({source}); set MTMC_PYTHON to a Python with Dask's `distributed`"
    )]
    Spawn {
        /// The interpreter tried.
        program: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// The driver's Python has no Dask.
    #[error(
        "the cluster backend needs Dask's `distributed` in {0}: `{0} -m pip install 'distributed==2026.8.*'`, or set MTMC_PYTHON to a Python that has it"
    )]
    NoDask(String),
    /// The bridge answered that it could not connect, or did not answer.
    #[error("the cluster at {address}: {why}")]
    Connect {
        /// The scheduler's address.
        address: String,
        /// What went wrong.
        why: String,
    },
    /// The bridge stopped in the middle of a batch.
    #[error("the cluster bridge stopped ({0})")]
    Lost(String),
}

/// A worker of the cluster that judges the run's candidates.
#[derive(Clone, Debug)]
pub struct ClusterWorker {
    /// Its address, as the scheduler knows it.
    pub address: String,
    /// The GPU it sees (`cpu` where it has none).
    pub gpu: String,
    /// Its host.
    pub host: String,
}

/// A connection to a Dask cluster's scheduler.
pub struct Cluster {
    child: Child,
    stdin: ChildStdin,
    stdout: Lines<BufReader<ChildStdout>>,
    stderr: Arc<Mutex<VecDeque<String>>>,
    /// The scheduler's address.
    pub address: String,
    /// The run's GPU: the one named, or the one most workers have.
    pub gpu: String,
    /// The workers that judge (their GPU is the run's), when connected.
    pub workers: Vec<ClusterWorker>,
    /// Workers refused, with their GPU.
    pub refused: Vec<ClusterWorker>,
    wait: Duration,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// One candidate's result from the cluster, and the worker that judged it.
pub struct Judged {
    /// The outcome, or why there is none.
    pub result: Result<Outcome, EvalError>,
    /// The worker's address (empty when the candidate was lost).
    pub worker: String,
}

impl Cluster {
    /// Starts the bridge with `python` and connects to the scheduler at
    /// `address`, waiting up to `wait` for a worker with the resource
    /// `judge`. With `gpu`, only workers with that GPU judge (a table name
    /// as `H200` matches the driver's `NVIDIA H200`); without, the GPU
    /// most workers have.
    pub fn connect(
        address: &str,
        python: OsString,
        gpu: Option<&str>,
        wait: Duration,
    ) -> Result<Cluster, ClusterError> {
        let program = python.to_string_lossy().into_owned();
        let mut child = Command::new(&python)
            .args(["-u", "-c", CLUSTER_SCRIPT])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .map_err(|source| ClusterError::Spawn {
                program: program.clone(),
                source,
            })?;
        let stdin = child.stdin.take().expect("stdin is piped");
        let stdout = BufReader::new(child.stdout.take().expect("stdout is piped")).lines();
        let stderr = Arc::new(Mutex::new(VecDeque::new()));
        let err = BufReader::new(child.stderr.take().expect("stderr is piped"));
        let tail = Arc::clone(&stderr);
        std::thread::spawn(move || {
            for line in err.lines().map_while(Result::ok) {
                // What the bridge says of refused workers reaches the user.
                if line.starts_with("mtmc cluster:") {
                    eprintln!("{line}");
                }
                let mut t = tail.lock().expect("stderr tail lock");
                if t.len() == STDERR_TAIL {
                    t.pop_front();
                }
                t.push_back(line);
            }
        });
        let mut cluster = Cluster {
            child,
            stdin,
            stdout,
            stderr,
            address: address.to_string(),
            gpu: String::new(),
            workers: Vec::new(),
            refused: Vec::new(),
            wait,
        };
        let connect = json!({
            "op": "connect",
            "address": address,
            "judge": worker::JUDGE_SCRIPT,
            "runner": worker::RUNNER_SCRIPT,
            "gpu": gpu,
            "wait_seconds": wait.as_secs_f64(),
        });
        let reply = cluster.send(&connect).and_then(|()| cluster.read());
        let reply = match reply {
            Ok(r) => r,
            Err(e) => {
                let tail = cluster.tail();
                if tail.iter().any(|l| {
                    l.contains("No module named 'distributed'")
                        || l.contains("No module named 'dask'")
                }) {
                    return Err(ClusterError::NoDask(program));
                }
                return Err(ClusterError::Connect {
                    address: address.to_string(),
                    why: format!(
                        "{e}{}",
                        tail.last().map(|l| format!(": {l}")).unwrap_or_default()
                    ),
                });
            }
        };
        if reply["ok"] != json!(true) {
            return Err(ClusterError::Connect {
                address: address.to_string(),
                why: reply["error"]
                    .as_str()
                    .unwrap_or("no reason given")
                    .to_string(),
            });
        }
        cluster.workers = workers_of(&reply["workers"]);
        cluster.refused = workers_of(&reply["refused"]);
        cluster.gpu = reply["gpu"].as_str().unwrap_or_default().to_string();
        Ok(cluster)
    }

    /// Whether the run's workers have no GPU (candidates are judged on
    /// their CPUs).
    pub fn on_cpu(&self) -> bool {
        self.gpu == "cpu"
    }

    fn tail(&self) -> Vec<String> {
        // Give the stderr reader a moment to drain the last lines.
        std::thread::sleep(Duration::from_millis(100));
        self.stderr
            .lock()
            .expect("stderr tail lock")
            .iter()
            .cloned()
            .collect()
    }

    fn send(&mut self, msg: &Value) -> Result<(), ClusterError> {
        let line = serde_json::to_string(msg).expect("a JSON value serializes") + "\n";
        self.stdin
            .write_all(line.as_bytes())
            .and_then(|()| self.stdin.flush())
            .map_err(|e| ClusterError::Lost(format!("writing to it: {e}")))
    }

    fn read(&mut self) -> Result<Value, ClusterError> {
        match self.stdout.next() {
            Some(Ok(line)) => serde_json::from_str(&line)
                .map_err(|e| ClusterError::Lost(format!("a reply that is not JSON: {e}"))),
            Some(Err(e)) => Err(ClusterError::Lost(format!("reading from it: {e}"))),
            None => Err(ClusterError::Lost("it exited".into())),
        }
    }

    /// Judges the `eval` requests `requests` of the problem `prepare`
    /// prepares, as the cluster's workers are free; `each` hears every
    /// result as it comes (index, result). The results, in the requests'
    /// order.
    pub fn evaluate(
        &mut self,
        prepare: Value,
        requests: Vec<Value>,
        prepare_limit: Duration,
        limit: Duration,
        each: &mut dyn FnMut(usize, &Judged),
    ) -> Result<Vec<Judged>, ClusterError> {
        let total = requests.len();
        let mut results: Vec<Option<Judged>> = (0..total).map(|_| None).collect();
        self.send(&json!({
            "op": "batch",
            "prepare": prepare,
            "requests": requests,
            "prepare_limit": prepare_limit.as_secs_f64(),
            "limit": limit.as_secs_f64(),
            "wait_seconds": self.wait.as_secs_f64(),
        }))?;
        loop {
            let line = match self.read() {
                Ok(l) => l,
                Err(e) => {
                    let tail = self.tail();
                    return Err(ClusterError::Lost(format!(
                        "{e}{}",
                        tail.last().map(|l| format!(": {l}")).unwrap_or_default()
                    )));
                }
            };
            if line["done"] == json!(true) {
                // Workers that joined since are the run's too (their GPU
                // passed the task's check); those lost stay listed, so
                // that a slot keeps naming its worker.
                for w in workers_of(&line["workers"]) {
                    if !self.workers.iter().any(|k| k.address == w.address) {
                        self.workers.push(w);
                    }
                }
                break;
            }
            if line["ok"] == json!(false) {
                return Err(ClusterError::Lost(
                    line["error"]
                        .as_str()
                        .unwrap_or("no reason given")
                        .to_string(),
                ));
            }
            let Some(index) = line["index"].as_u64().map(|i| i as usize) else {
                return Err(ClusterError::Lost(format!(
                    "a reply without an index: {line}"
                )));
            };
            if index >= total || results[index].is_some() {
                return Err(ClusterError::Lost(format!(
                    "a second or unknown reply for candidate {index}"
                )));
            }
            let judged = Judged {
                result: outcome_of(&line["reply"]),
                worker: line["worker"].as_str().unwrap_or_default().to_string(),
            };
            each(index, &judged);
            results[index] = Some(judged);
        }
        results
            .into_iter()
            .enumerate()
            .map(|(i, r)| {
                r.ok_or_else(|| ClusterError::Lost(format!("no reply for candidate {i}")))
            })
            .collect()
    }
}

/// The workers a bridge's line lists.
fn workers_of(list: &Value) -> Vec<ClusterWorker> {
    list.as_array()
        .map(|a| {
            a.iter()
                .map(|w| ClusterWorker {
                    address: w["address"].as_str().unwrap_or_default().to_string(),
                    gpu: w["gpu"].as_str().unwrap_or_default().to_string(),
                    host: w["host"].as_str().unwrap_or_default().to_string(),
                })
                .collect()
        })
        .unwrap_or_default()
}

/// A worker's reply as an outcome: the judge's, or the end of a judge that
/// overran its limit or died (as a local worker's), or of a task lost
/// with its workers.
fn outcome_of(reply: &Value) -> Result<Outcome, EvalError> {
    let lost = |status, error: &str| {
        let mut o = Outcome::new(EvaluatorKind::Worker, status);
        o.error = Some(error.to_string());
        o
    };
    let error = reply["error"].as_str().unwrap_or("no reason given");
    let mut o = match reply["lost"].as_str() {
        Some("timeout") => lost(Status::Timeout, error),
        Some(_) => lost(Status::Crashed, error),
        None if reply["ok"] == json!(true) => {
            worker::outcome_of_result(reply["result"].clone()).map_err(EvalError::Worker)?
        }
        None => return Err(EvalError::Worker(WorkerError::Failed(error.to_string()))),
    };
    o.wall_seconds = reply["wall_seconds"].as_f64().unwrap_or(0.0);
    o.references_recomputed = reply["recomputed"] == json!(true);
    Ok(o)
}

/// A Dask cluster on this machine's loopback: a scheduler and workers, each
/// worker with its nanny, the resource `judge` and one thread, each in a
/// process group of its own (so that it can be lost as a host is lost).
/// For tests, and for trying the backend on one machine. Stopped when
/// dropped.
pub struct LocalCluster {
    /// The scheduler's address.
    pub address: String,
    scheduler: Child,
    workers: Vec<(String, Child)>,
    dir: std::path::PathBuf,
}

impl LocalCluster {
    /// Starts a scheduler and `n` workers with `python`; why not, when its
    /// Python has no Dask or the scheduler does not come up.
    pub fn start(python: &OsString, n: usize) -> Result<LocalCluster, String> {
        use std::os::unix::process::CommandExt as _;
        let has = Command::new(python)
            .args(["-c", "import distributed"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !has {
            return Err(format!(
                "{} has no Dask `distributed`",
                python.to_string_lossy()
            ));
        }
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let dir = std::env::temp_dir().join(format!(
            "mtmc-dask-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let file = dir.join("scheduler.json");
        let spawn = |c: &mut Command| {
            c.stdout(Stdio::null())
                .stderr(Stdio::null())
                .process_group(0)
                .spawn()
                .map_err(|e| format!("{} could not be started: {e}", python.to_string_lossy()))
        };
        let scheduler = spawn(
            Command::new(python)
                .args([
                    "-m",
                    "distributed.cli.dask_scheduler",
                    "--host",
                    "127.0.0.1",
                ])
                .args(["--port", "0", "--no-dashboard", "--scheduler-file"])
                .arg(&file),
        )?;
        let mut cluster = LocalCluster {
            address: String::new(),
            scheduler,
            workers: Vec::new(),
            dir,
        };
        let began = std::time::Instant::now();
        cluster.address = loop {
            if let Ok(text) = std::fs::read_to_string(&file)
                && let Ok(v) = serde_json::from_str::<Value>(&text)
                && let Some(a) = v["address"].as_str()
            {
                break a.to_string();
            }
            if began.elapsed() > Duration::from_secs(120) {
                return Err("the Dask scheduler wrote no address within 120 s".into());
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        for k in 0..n {
            let port = std::net::TcpListener::bind("127.0.0.1:0")
                .and_then(|l| l.local_addr())
                .map_err(|e| format!("no free port: {e}"))?
                .port();
            let child = spawn(
                Command::new(python)
                    .args(["-m", "distributed.cli.dask_worker", &cluster.address])
                    .args(["--host", "127.0.0.1", "--worker-port", &port.to_string()])
                    .args([
                        "--nthreads",
                        "1",
                        "--resources",
                        "judge=1",
                        "--no-dashboard",
                    ])
                    .args(["--name", &format!("w{k}")]),
            )?;
            cluster
                .workers
                .push((format!("tcp://127.0.0.1:{port}"), child));
        }
        let wait = format!(
            "from distributed import Client\nc = Client({:?}, timeout=60)\nc.wait_for_workers({n}, timeout=180)\nc.close()\n",
            cluster.address
        );
        let up = Command::new(python)
            .args(["-c", &wait])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if !up {
            return Err(format!("the {n} Dask worker(s) did not join within 180 s"));
        }
        Ok(cluster)
    }

    /// The workers' addresses, in the order they were started.
    pub fn workers(&self) -> Vec<String> {
        self.workers.iter().map(|w| w.0.clone()).collect()
    }

    /// What kills the worker at `address` with its nanny and everything
    /// it started, at once (a lost host).
    pub fn killer(&self, address: &str) -> impl Fn() + 'static {
        let pid = self
            .workers
            .iter()
            .find(|(a, _)| a == address)
            .map(|w| w.1.id());
        move || {
            if let Some(pid) = pid {
                kill_group(pid);
            }
        }
    }

    /// Stops every process of the cluster.
    pub fn stop(&mut self) {
        kill_group(self.scheduler.id());
        for w in &self.workers {
            kill_group(w.1.id());
        }
        let _ = self.scheduler.wait();
        for w in &mut self.workers {
            let _ = w.1.wait();
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        self.stop();
    }
}

/// SIGKILL to the process group `pid` leads.
fn kill_group(pid: u32) {
    let _ = Command::new("kill")
        .args(["-KILL", "--", &format!("-{pid}")])
        .stderr(Stdio::null())
        .status();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_lost_judge_is_the_candidate_s_timeout_or_crash_and_a_refusal_an_error() {
        let o = outcome_of(&json!({"lost": "timeout", "error": "no reply within 60s"})).unwrap();
        assert_eq!(o.status, Status::Timeout);
        let o = outcome_of(&json!({"lost": "killed", "error": "lost with its workers"})).unwrap();
        assert_eq!(o.status, Status::Crashed);
        assert_eq!(o.error.as_deref(), Some("lost with its workers"));
        assert!(outcome_of(&json!({"ok": false, "error": "bad request"})).is_err());
        let o = outcome_of(&json!({"ok": true, "result": {"status": "correct"}, "wall_seconds": 1.5, "recomputed": true}))
            .unwrap();
        assert_eq!(o.status, Status::Correct);
        assert_eq!(o.wall_seconds, 1.5);
        assert!(o.references_recomputed);
    }
}

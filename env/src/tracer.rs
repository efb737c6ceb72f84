//! Runs the graph tracer (`python/trace_graph.py`) on KernelBench problems.

use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use crate::python;

/// The tracer script, shipped inside the binary.
pub const TRACER_SCRIPT: &str = include_str!("../python/trace_graph.py");

/// A problem to trace, as the tracer reads it.
#[derive(Clone, Debug, serde::Serialize)]
pub struct TraceRequest<'a> {
    /// KernelBench level.
    pub level: u32,
    /// File name without `.py`.
    pub name: &'a str,
    /// Program text.
    pub code: &'a str,
}

/// Why tracing could not run.
#[derive(Debug, thiserror::Error)]
pub enum TracerError {
    /// No interpreter.
    #[error(
        "{python} could not be started ({source}); install Python 3 with torch, or set {env} to an interpreter that has it"
    )]
    NoPython {
        /// The interpreter tried.
        python: String,
        /// The OS error.
        source: std::io::Error,
        /// The variable that selects the interpreter.
        env: &'static str,
    },
    /// The interpreter has no torch.
    #[error(
        "{python} has no torch, which tracing needs: run `{python} -m pip install torch`, or set {env} to an interpreter that has it"
    )]
    NoTorch {
        /// The interpreter tried.
        python: String,
        /// The variable that selects the interpreter.
        env: &'static str,
    },
    /// The tracer stopped early.
    #[error("the tracer ({python}) failed: {stderr}")]
    Failed {
        /// The interpreter used.
        python: String,
        /// The end of what it printed on stderr.
        stderr: String,
    },
}

/// Traces problems in one interpreter run, calling `progress(done, total)`
/// after each, and returns one JSON trace per request, in order.
pub fn trace(
    requests: &[TraceRequest<'_>],
    mut progress: impl FnMut(usize, usize),
) -> Result<Vec<String>, TracerError> {
    let py = python::interpreter();
    let python = py.to_string_lossy().into_owned();
    let mut child = Command::new(&py)
        .args(["-c", TRACER_SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|source| TracerError::NoPython {
            python: python.clone(),
            source,
            env: python::PYTHON_ENV,
        })?;
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let input: String = requests
        .iter()
        .map(|r| serde_json::to_string(r).expect("requests serialize") + "\n")
        .collect();
    // Feed stdin from a thread so a full stdout pipe cannot deadlock us.
    let writer = std::thread::spawn(move || {
        let _ = stdin.write_all(input.as_bytes());
    });
    let mut traces = Vec::with_capacity(requests.len());
    let stdout = child.stdout.take().expect("stdout is piped");
    for line in BufReader::new(stdout).lines() {
        let Ok(line) = line else { break };
        traces.push(line);
        progress(traces.len(), requests.len());
    }
    let _ = writer.join();
    let out = child.wait_with_output().map_err(|e| TracerError::Failed {
        python: python.clone(),
        stderr: e.to_string(),
    })?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if stderr.contains("No module named 'torch'") {
        return Err(TracerError::NoTorch {
            python,
            env: python::PYTHON_ENV,
        });
    }
    if traces.len() != requests.len() || !out.status.success() {
        let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
        return Err(TracerError::Failed {
            python,
            stderr: tail.into_iter().rev().collect::<Vec<_>>().join(" | "),
        });
    }
    Ok(traces)
}

//! Compiling Triton kernels for a GPU architecture, on machines with or
//! without a GPU: Triton (in the Python interpreter mtmc runs, see
//! [`crate::python`]) lowers the kernel to PTX, and the ptxas Triton ships
//! reports its resources.
//!
//! As with NVRTC, a kernel that does not compile is a report with the log,
//! not an error; only a missing Triton (or Python) is an error.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::time::Instant;

use crate::nvrtc::{Arch, CompileReport, Diagnostic, parse_resources};

/// The helper that compiles one kernel (run with `python -c`).
pub const COMPILE_SCRIPT: &str = include_str!("../python/triton_compile.py");

/// One Triton kernel to compile.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TritonUnit {
    /// The `@triton.jit` function to compile.
    pub kernel: String,
    /// Python source defining it (and the jit functions it calls).
    pub source: String,
    /// Its arguments' Triton types in order (`*fp32`, `*i64`, `i32`, `i64`).
    pub signature: Vec<String>,
    /// Warps per program.
    pub num_warps: u32,
}

/// Triton could not be used at all.
#[derive(Debug, thiserror::Error)]
pub enum TritonError {
    /// Python or Triton is missing.
    #[error(
        "Triton is not available ({0}); install it for the interpreter mtmc runs (`pip install 'triton==3.6.*'`, or point MTMC_PYTHON at a Python that has it)"
    )]
    Unavailable(String),
    /// The helper failed for another reason than the kernel.
    #[error("the Triton compile helper failed: {0}")]
    Helper(String),
}

#[derive(serde::Deserialize)]
struct Reply {
    ok: bool,
    log: String,
    ptx: Option<String>,
    resources: String,
}

/// Compiles `unit` for `arch` with the interpreter mtmc runs
/// ([`crate::python::interpreter`]).
pub fn compile(unit: &TritonUnit, arch: Arch) -> Result<CompileReport, TritonError> {
    compile_with(&crate::python::interpreter(), unit, arch)
}

/// Compiles `unit` for `arch` with Triton in `python`.
pub fn compile_with(
    python: &std::ffi::OsStr,
    unit: &TritonUnit,
    arch: Arch,
) -> Result<CompileReport, TritonError> {
    let start = Instant::now();
    let mut child = Command::new(python)
        .args(["-c", COMPILE_SCRIPT])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| {
            TritonError::Unavailable(format!("cannot run {}: {e}", python.to_string_lossy()))
        })?;
    let request = serde_json::json!({
        "source": unit.source,
        "kernel": unit.kernel,
        "signature": unit.signature,
        "num_warps": unit.num_warps,
        "arch": arch.major * 10 + arch.minor,
    });
    child
        .stdin
        .take()
        .expect("stdin is piped")
        .write_all(request.to_string().as_bytes())
        .map_err(|e| TritonError::Helper(format!("cannot send the kernel: {e}")))?;
    let out = child
        .wait_with_output()
        .map_err(|e| TritonError::Helper(e.to_string()))?;
    let stderr = String::from_utf8_lossy(&out.stderr);
    if out.status.code() == Some(3) {
        return Err(TritonError::Unavailable(stderr.trim().to_string()));
    }
    let reply: Reply = serde_json::from_slice(&out.stdout).map_err(|e| {
        TritonError::Helper(format!(
            "no reply ({e}; exit {}): {}",
            out.status,
            stderr.trim()
        ))
    })?;
    Ok(CompileReport {
        ok: reply.ok,
        diagnostics: parse_diagnostics(&reply.log),
        kernels: parse_resources(&reply.resources),
        log: reply.log,
        ptx: reply.ptx,
        cubin: None,
        seconds: start.elapsed().as_secs_f64(),
        arch,
    })
}

/// Reads Triton's `at LINE:COLUMN:` compile errors: the line of the kernel
/// source and the message after the quoted code.
pub fn parse_diagnostics(log: &str) -> Vec<Diagnostic> {
    let mut out = Vec::new();
    let lines: Vec<&str> = log.lines().collect();
    for (k, line) in lines.iter().enumerate() {
        let Some(rest) = line.trim_start().strip_prefix("at ") else {
            continue;
        };
        let Some((number, _)) = rest.split_once(':') else {
            continue;
        };
        let Ok(number) = number.parse::<u32>() else {
            continue;
        };
        // The message is the last non-empty line of the block.
        let message = lines[k + 1..]
            .iter()
            .rev()
            .find(|l| !l.trim().is_empty() && !l.trim_start().starts_with('^'))
            .map_or(String::new(), |l| l.trim().to_string());
        out.push(Diagnostic {
            line: Some(number),
            severity: "error".into(),
            message,
        });
    }
    if out.is_empty()
        && let Some(last) = lines.iter().rev().find(|l| !l.trim().is_empty())
    {
        out.push(Diagnostic {
            line: None,
            severity: "error".into(),
            message: last.trim().to_string(),
        });
    }
    out
}

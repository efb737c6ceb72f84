//! The native evaluator: CUDA kernels with a launch plan, run through
//! cudarc in a child process, checked against the f64 CPU reference.
//!
//! The child is the `mtmc` binary itself (`mtmc native-worker`), speaking the
//! same JSON lines as the Python worker, so it gets the same supervision: a
//! wall-clock limit, a restart after a hang or a fatal CUDA error, no
//! network. Inside it (`run`): NVRTC compiles the source for the GPU's
//! architecture; inputs are drawn fresh for every trial (uniform, never
//! zeros); outputs and scratch buffers are poisoned (all bits set, NaN for
//! floats) before every run; the sampled and edge elements of every output
//! are compared with the f64 reference; inputs are checked unchanged; then
//! CUDA events (created with timing) time 100 runs, each after a 256 MB
//! write that flushes L2; finally new values in the same input buffers are
//! checked again.

mod run;

use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::path::Path;
use std::time::{Duration, Instant};

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::import::{Trace, import_trace};
use mtmc_actions::intent::{Bindings, compile};
use serde::{Deserialize, Serialize};

use crate::error::EvalError;
use crate::outcome::{EvaluatorKind, Outcome, Status};
use crate::worker::{Launcher, Protocol, WorkerError, WorkerSlot};

/// A CUDA program: one source unit and the plan that launches its kernels.
/// Written as JSON by people and by the coder.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CudaProgram {
    /// CUDA C++ with `extern "C" __global__` kernels.
    pub source: String,
    /// Device buffers, by name.
    pub buffers: Vec<Buffer>,
    /// Kernel launches, run in order on one stream.
    pub launches: Vec<Launch>,
}

/// One device buffer: a graph input, a graph output, or scratch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Buffer {
    /// The name launches refer to.
    pub name: String,
    /// The graph input it holds (by the input's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub input: Option<String>,
    /// The graph output it receives (by position).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub output: Option<usize>,
    /// Scratch: its size in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bytes: Option<u64>,
}

/// One kernel launch.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Launch {
    /// The kernel's (unmangled, `extern "C"`) name.
    pub kernel: String,
    /// Grid size in blocks.
    pub grid: [u32; 3],
    /// Block size in threads.
    pub block: [u32; 3],
    /// Dynamic shared memory, bytes.
    #[serde(default)]
    pub shared_bytes: u32,
    /// Arguments, in the kernel's order.
    pub args: Vec<Arg>,
}

/// A kernel argument.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Arg {
    /// A buffer's device pointer.
    Buffer(String),
    /// A 64-bit integer.
    I64(i64),
    /// A 32-bit integer.
    I32(i32),
    /// A 32-bit unsigned integer.
    U32(u32),
    /// A 32-bit float.
    F32(f32),
}

impl CudaProgram {
    /// Reads a program file; `source_file` (instead of `source`) is read
    /// relative to the program file's folder.
    pub fn load(path: &Path) -> Result<CudaProgram, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        let mut value: serde_json::Value = serde_json::from_str(&text)
            .map_err(|e| format!("`{}` is not JSON: {e}", path.display()))?;
        if let Some(file) = value
            .get("source_file")
            .and_then(|f| f.as_str())
            .map(str::to_string)
        {
            let cu = path.parent().unwrap_or(Path::new(".")).join(&file);
            let source = std::fs::read_to_string(&cu).map_err(|e| {
                format!(
                    "cannot read `{}` (source_file of `{}`): {e}",
                    cu.display(),
                    path.display()
                )
            })?;
            let obj = value
                .as_object_mut()
                .expect("a JSON object has a source_file");
            obj.remove("source_file");
            obj.insert("source".into(), source.into());
        }
        serde_json::from_value(value)
            .map_err(|e| format!("`{}` is not a CUDA program: {e}", path.display()))
    }

    /// Checks the plan against the graph: every graph input and output has
    /// exactly one float32 buffer, every argument names a buffer.
    pub fn check(&self, graph: &OpGraph) -> Result<(), String> {
        let inputs = graph_inputs(graph);
        for b in &self.buffers {
            let roles = usize::from(b.input.is_some())
                + usize::from(b.output.is_some())
                + usize::from(b.bytes.is_some());
            if roles != 1 {
                return Err(format!(
                    "buffer `{}` needs exactly one of `input`, `output`, `bytes`",
                    b.name
                ));
            }
            if let Some(name) = &b.input
                && !inputs.iter().any(|(n, _)| n == name)
            {
                let known: Vec<&str> = inputs.iter().map(|(n, _)| n.as_str()).collect();
                return Err(format!(
                    "buffer `{}` holds input `{name}`, which the graph does not have (it has: {})",
                    b.name,
                    known.join(", ")
                ));
            }
            if let Some(k) = b.output
                && k >= graph.outputs().len()
            {
                return Err(format!(
                    "buffer `{}` receives output {k}, but the graph has {}",
                    b.name,
                    graph.outputs().len()
                ));
            }
        }
        for (name, ty) in &inputs {
            if ty.dtype != DType::F32 {
                return Err(format!(
                    "input `{name}` is {}; the native evaluator runs float32 graphs",
                    ty.dtype
                ));
            }
            if self
                .buffers
                .iter()
                .filter(|b| b.input.as_deref() == Some(name))
                .count()
                != 1
            {
                return Err(format!("input `{name}` needs exactly one buffer"));
            }
        }
        for k in 0..graph.outputs().len() {
            let ty = graph.tensor(graph.outputs()[k]);
            if ty.dtype != DType::F32 {
                return Err(format!(
                    "output {k} is {}; the native evaluator runs float32 graphs",
                    ty.dtype
                ));
            }
            if self.buffers.iter().filter(|b| b.output == Some(k)).count() != 1 {
                return Err(format!("output {k} needs exactly one buffer"));
            }
        }
        if self.launches.is_empty() {
            return Err("the program launches no kernel".into());
        }
        for l in &self.launches {
            for a in &l.args {
                if let Arg::Buffer(name) = a
                    && !self.buffers.iter().any(|b| &b.name == name)
                {
                    return Err(format!(
                        "launch of `{}` passes buffer `{name}`, which is not declared",
                        l.kernel
                    ));
                }
            }
            let threads: u64 = l.block.iter().map(|&d| u64::from(d)).product();
            if threads == 0 || l.grid.contains(&0) {
                return Err(format!(
                    "launch of `{}` has an empty grid or block",
                    l.kernel
                ));
            }
        }
        Ok(())
    }

    /// Threads per block of the first launch of `kernel`.
    pub fn block_threads(&self, kernel: &str) -> Option<u32> {
        self.launches
            .iter()
            .find(|l| l.kernel == kernel)
            .map(|l| l.block.iter().product())
    }

    /// Dynamic shared memory of the first launch of `kernel`.
    pub fn dynamic_shared(&self, kernel: &str) -> u32 {
        self.launches
            .iter()
            .find(|l| l.kernel == kernel)
            .map_or(0, |l| l.shared_bytes)
    }
}

/// The graph's inputs and parameters, by name, in graph order.
pub fn graph_inputs(g: &OpGraph) -> Vec<(String, mtmc_actions::TensorType)> {
    g.nodes()
        .filter_map(|(_, n)| match &n.op {
            mtmc_actions::op::Op::Input { name } | mtmc_actions::op::Op::Param { name, .. } => {
                Some((name.clone(), n.outputs[0].clone()))
            }
            _ => None,
        })
        .collect()
}

/// Where the child gets the problem's graph from.
#[derive(Clone, Debug, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum GraphSource {
    /// An intent program with its bindings.
    Intent {
        /// The program.
        text: String,
        /// Input shapes.
        shapes: BTreeMap<String, Vec<u64>>,
        /// Element type of undeclared inputs.
        dtype: Option<DType>,
    },
    /// A KernelBench problem's trace.
    Trace(Box<Trace>),
}

impl GraphSource {
    /// The graph.
    pub fn graph(&self) -> Result<OpGraph, String> {
        match self {
            GraphSource::Intent {
                text,
                shapes,
                dtype,
            } => compile(
                text,
                &Bindings {
                    shapes: shapes.clone(),
                    dtype: *dtype,
                },
            )
            .map_err(|e| e.to_string()),
            GraphSource::Trace(t) => import_trace(t).map(|i| i.graph).map_err(|e| e.to_string()),
        }
    }
}

/// The hidden subcommand that runs the native child.
pub const SUBCOMMAND: &str = "native-worker";

/// The parent side: a supervised child process that runs programs.
pub struct NativeEvaluator {
    /// The child's slot.
    pub slot: WorkerSlot,
    /// The protocol's numbers.
    pub protocol: Protocol,
    /// Wall-clock limit per candidate.
    pub limit: Duration,
}

impl NativeEvaluator {
    /// Children run `exe native-worker` (the `mtmc` binary).
    pub fn new(
        exe: OsString,
        gpu: Option<u32>,
        protocol: Protocol,
        limit: Duration,
    ) -> NativeEvaluator {
        let launcher = Launcher::program(
            exe,
            vec![SUBCOMMAND.into()],
            "the native evaluator runs the mtmc binary itself",
        );
        NativeEvaluator {
            slot: WorkerSlot::with_launcher(launcher, gpu),
            protocol,
            limit,
        }
    }

    /// Evaluates `program` on the problem `graph`.
    pub async fn evaluate_program(
        &mut self,
        graph: &GraphSource,
        program: &CudaProgram,
    ) -> Result<Outcome, EvalError> {
        let p = &self.protocol;
        let request = serde_json::json!({
            "op": "eval",
            "graph": graph,
            "program": program,
            "seed": p.seed,
            "correctness_trials": p.correctness_trials,
            "warmup": p.warmup,
            "trials": p.trials,
            "atol": p.atol,
            "rtol": p.rtol,
        });
        let started = Instant::now();
        let lost = |status, e: &WorkerError| {
            let mut o = Outcome::new(EvaluatorKind::Native, status);
            o.error = Some(e.to_string());
            o
        };
        let mut outcome = match self.slot.request(request, self.limit).await {
            Ok(v) => {
                let replace = v["replace_worker"] == serde_json::json!(true);
                let o: Outcome = serde_json::from_value(v["outcome"].clone())
                    .map_err(|e| WorkerError::Protocol(format!("unreadable outcome: {e}")))?;
                if replace {
                    self.slot.discard();
                }
                o
            }
            Err(e @ WorkerError::Timeout(_)) => lost(Status::Timeout, &e),
            Err(e @ WorkerError::Died { .. }) => lost(Status::Crashed, &e),
            Err(e) => return Err(e.into()),
        };
        outcome.wall_seconds = started.elapsed().as_secs_f64();
        Ok(outcome)
    }
}

/// A request to the child.
#[derive(Deserialize)]
struct Request {
    id: serde_json::Value,
    /// The caller's token, echoed in the reply.
    #[serde(default)]
    token: serde_json::Value,
    op: String,
    #[serde(default)]
    graph: Option<GraphSource>,
    #[serde(default)]
    program: Option<CudaProgram>,
    #[serde(flatten)]
    settings: run::Settings,
}

/// The child's loop: JSON lines on stdin, one reply per line on stdout.
pub fn serve() -> std::io::Result<()> {
    let stdin = std::io::stdin();
    let mut stdout = std::io::stdout().lock();
    let mut gpu: Option<run::Gpu> = None;
    for line in stdin.lock().lines() {
        let line = line?;
        if line.trim().is_empty() {
            continue;
        }
        let reply = match serde_json::from_str::<Request>(&line) {
            Err(e) => {
                serde_json::json!({"id": null, "ok": false, "error": format!("request is not understood: {e}")})
            }
            Ok(req) => {
                let (id, token) = (req.id.clone(), req.token.clone());
                match handle(req, &mut gpu) {
                    Ok(result) => {
                        serde_json::json!({"id": id, "token": token, "ok": true, "result": result})
                    }
                    Err(e) => {
                        serde_json::json!({"id": id, "token": token, "ok": false, "error": e})
                    }
                }
            }
        };
        writeln!(stdout, "{reply}")?;
        stdout.flush()?;
    }
    Ok(())
}

fn handle(req: Request, gpu: &mut Option<run::Gpu>) -> Result<serde_json::Value, String> {
    match req.op.as_str() {
        "hello" => Ok(serde_json::json!({"pid": std::process::id(), "native": true})),
        "eval" => {
            let graph = req.graph.ok_or("an eval request needs `graph`")?.graph()?;
            let program = req.program.ok_or("an eval request needs `program`")?;
            if gpu.is_none() {
                *gpu = Some(run::Gpu::open()?);
            }
            let g = gpu.as_ref().expect("opened above");
            let (outcome, fatal) = run::evaluate(g, &graph, &program, &req.settings);
            if fatal {
                *gpu = None;
            }
            Ok(serde_json::json!({"outcome": outcome, "replace_worker": fatal}))
        }
        other => Err(format!("unknown op {other:?}")),
    }
}

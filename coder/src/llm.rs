//! The LLM coder: one CUDA kernel per action, written by a model behind an
//! OpenAI-compatible or Anthropic endpoint.
//!
//! The prompt follows the action's kind (MTMC): the region's ops with their
//! shapes, the kernel's exact signature and launch (the contract the
//! program and the export rely on), an example of that kind, the last good
//! program, and MaxCode's context — the best program so far with its
//! figures, the recent steps and the last critique. Repairs (fix compile,
//! fix correctness) carry the failed kernel and the compiler log or the
//! first bad element. The reply's code is extracted from among prose and
//! other blocks; what comes back is one fragment, compiled alone and rolled
//! back on failure by the session like any template fragment.

use std::collections::{HashMap, VecDeque};
use std::fmt::Write as _;
use std::sync::{Arc, Mutex};

use mtmc_actions::DType;
use mtmc_actions::graph::{OpGraph, TensorRef};
use mtmc_llm::{Client, Finish, Prompt};

use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Lang, Launch, Program};
use crate::session::{Failure, Stage};
use crate::template::Refusal;
use crate::{MicroCoder, Note};

/// Blocks a default launch is capped at (a grid-stride loop covers the
/// rest): eight per SM of an H100.
const MAX_GRID: u64 = 132 * 8;

/// The system text of every kernel request.
const SYSTEM: &str = "You are the micro coder of mtmc, an engine that writes fast GPU kernels. Each request asks for ONE CUDA kernel for one region of a PyTorch program's op graph. Reply with exactly one ```cuda code block holding the complete source: the headers it needs (no torch or host headers), device helpers, and one extern \"C\" __global__ function with exactly the name and parameters given. No host code, no main, no PyTorch. All tensors are contiguous and row-major. Results must match PyTorch float32 within 1e-4: no TF32, no half precision, no approximate math that loses accuracy.";

/// An example of each kind of request, in the contract's terms.
fn example(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::CustomKernel | ActionKind::Fuse => {
            "Region: t1 = mul(x0, x1); t2 = gelu(t1) (tanh=false), all f32[4096, 4096]; outputs: y0 = t2.\n```cuda\nextern \"C\" __global__ void k3_llm(const float* __restrict__ x0, const float* __restrict__ x1,\n                                 float* __restrict__ y0, long long n_x0, long long n_x1, long long n_y0) {\n  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_y0;\n       i += (long long)gridDim.x * blockDim.x) {\n    float v = x0[i] * x1[i];\n    y0[i] = 0.5f * v * (1.0f + erff(v * 0.70710678118654752f));\n  }\n}\n```"
        }
        ActionKind::Retile | ActionKind::Vectorize => {
            "Vectorize k0_llm (an elementwise kernel over n_y0 floats, n_y0 a multiple of 4): read and write float4, one vector per thread per trip.\n```cuda\nextern \"C\" __global__ void k0_llm(const float* __restrict__ x0, float* __restrict__ y0, long long n_x0, long long n_y0) {\n  const float4* x = reinterpret_cast<const float4*>(x0);\n  float4* y = reinterpret_cast<float4*>(y0);\n  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_y0 / 4;\n       i += (long long)gridDim.x * blockDim.x) {\n    float4 v = x[i];\n    v.x = fmaxf(v.x, 0.f); v.y = fmaxf(v.y, 0.f); v.z = fmaxf(v.z, 0.f); v.w = fmaxf(v.w, 0.f);\n    y[i] = v;\n  }\n}\n```"
        }
        ActionKind::FixCompile => {
            "Log: `k2_llm.cu(4): error: identifier \"x\" is undefined`. The kernel read `x[i]` but its input parameter is `x0`: the fix reads `x0[i]` and changes nothing else."
        }
        ActionKind::FixCorrectness => {
            "Verdict: incorrect, first bad element at [0, 4095]: expected 1.25, got 0. The grid-stride loop stopped at `i < n_y0 - 1`: the last element was never written. The fix loops while `i < n_y0`."
        }
        ActionKind::CallLibrary => "",
    }
}

/// What a kind of action asks for.
fn task(kind: ActionKind) -> &'static str {
    match kind {
        ActionKind::CustomKernel => {
            "Write one kernel that computes this op (a custom kernel in place of the library call)."
        }
        ActionKind::Fuse => {
            "Fuse the region: one kernel computes all its ops in one pass, keeping intermediates in registers (no intermediate tensor goes to memory)."
        }
        ActionKind::Retile => {
            "Re-tile the existing kernel for this region: change its block shape, the work per thread or the grid (say the launch with the mtmc-launch line) to use the GPU better; keep what it computes."
        }
        ActionKind::Vectorize => {
            "Vectorize the existing kernel for this region: wider loads and stores (float2/float4 where sizes and alignment allow, with a scalar tail otherwise); keep what it computes."
        }
        ActionKind::FixCompile => {
            "Fix the kernel below: it does not compile. Read the compiler log and change only what is needed."
        }
        ActionKind::FixCorrectness => {
            "Fix the kernel below: it compiled and ran but its results are wrong. Find the cause from the verdict and change only what is needed."
        }
        ActionKind::CallLibrary => "",
    }
}

/// The C type of an element of `d`.
fn c_type(d: DType) -> &'static str {
    match d {
        DType::F32 => "float",
        DType::F16 => "__half",
        DType::BF16 => "__nv_bfloat16",
        DType::F64 => "double",
        DType::I64 => "long long",
        DType::I32 => "int",
        DType::I16 => "short",
        DType::I8 => "signed char",
        DType::U8 => "unsigned char",
        DType::Bool => "bool",
    }
}

/// What the coder remembers of the run.
#[derive(Default)]
struct Memory {
    /// The last failure of each region, for its repair.
    failures: HashMap<Vec<u32>, Failure>,
    /// One line per recent step.
    recent: VecDeque<String>,
    /// The best program so far: its kernels and figures.
    best: Option<String>,
    /// The last critique.
    critique: Option<String>,
    /// Why nothing more can be asked (the endpoint is down).
    halted: Option<String>,
}

/// The LLM coder.
pub struct LlmCoder {
    client: Arc<Client>,
    memory: Mutex<Memory>,
}

/// The parts of a kernel's contract: its parameters and default launch.
struct Contract {
    name: String,
    inputs: Vec<TensorRef>,
    outputs: Vec<TensorRef>,
    signature: String,
    launch: Launch,
    region: String,
}

impl LlmCoder {
    /// A coder asking through `client`.
    pub fn new(client: Arc<Client>) -> LlmCoder {
        LlmCoder {
            client,
            memory: Mutex::new(Memory::default()),
        }
    }

    fn memory(&self) -> std::sync::MutexGuard<'_, Memory> {
        self.memory.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The prompt for `action` under contract `c`, or why none can be
    /// written.
    fn prompt(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
        c: &Contract,
    ) -> Result<Prompt, Refusal> {
        let memory = self.memory();
        let mut q = String::new();
        let _ = writeln!(q, "# Action: {:?}\n{}\n", action.kind, task(action.kind));
        let _ = writeln!(q, "# Region\n{}", c.region);
        let _ = writeln!(
            q,
            "# Contract\n```cuda\nextern \"C\" __global__ void {}\n```\nEach n_* parameter is that tensor's element count. The kernel is launched with grid={} and block={} (a grid-stride loop covers any size). To launch it otherwise, put one line `// mtmc-launch: grid=G block=B` in the code (integers, B a multiple of 32 up to 1024; add ` shared=S` for S bytes of dynamic shared memory).\n",
            c.signature, c.launch.grid, c.launch.block
        );
        if matches!(action.kind, ActionKind::Retile | ActionKind::Vectorize) {
            let _ = writeln!(
                q,
                "Parameters asked for: block={} vector={}.\n",
                action.params.block, action.params.vector
            );
        }
        let _ = writeln!(
            q,
            "# Example of this kind of step\n{}\n",
            example(action.kind)
        );
        let _ = writeln!(
            q,
            "# Current program (last good version)\n{}",
            program_text(g, program)
        );
        if matches!(
            action.kind,
            ActionKind::FixCompile | ActionKind::FixCorrectness
        ) {
            let f = memory.failures.get(&action.region).ok_or_else(|| {
                Refusal::new("nothing to repair: no kernel of this region failed yet")
            })?;
            let wanted = match action.kind {
                ActionKind::FixCompile => Stage::Compile,
                _ => Stage::Outcome,
            };
            if f.stage != wanted {
                return Err(Refusal::new(format!(
                    "the region's last failure is at stage {:?}, not what {:?} repairs",
                    f.stage, action.kind
                )));
            }
            let log: String = f.log.chars().take(6000).collect();
            let _ = writeln!(
                q,
                "# The kernel to fix\n```cuda\n{}```\n\n# {}\n```\n{}\n```\n",
                f.fragment.as_deref().unwrap_or(""),
                if wanted == Stage::Compile {
                    "Compiler log"
                } else {
                    "Verdict"
                },
                log.trim_end()
            );
        }
        if let Some(best) = &memory.best {
            let _ = writeln!(q, "# Best program so far\n{best}\n");
        }
        if !memory.recent.is_empty() {
            let _ = writeln!(q, "# Recent steps");
            for line in &memory.recent {
                let _ = writeln!(q, "- {line}");
            }
            q.push('\n');
        }
        if let Some(c) = &memory.critique {
            let _ = writeln!(q, "# Critique of the last run\n{c}\n");
        }
        let _ = writeln!(
            q,
            "Reply with one ```cuda block defining `{}` exactly as in the contract.",
            c.name
        );
        Ok(Prompt::ask(SYSTEM, q))
    }
}

impl MicroCoder for LlmCoder {
    fn realize(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
    ) -> Result<Fragment, Refusal> {
        if action.kind == ActionKind::CallLibrary {
            return Err(Refusal::new(crate::template::LIBRARY));
        }
        if action.kind == ActionKind::CustomKernel && action.region.len() != 1 {
            return Err(Refusal::new(crate::template::ONE_OP));
        }
        if let Some(why) = &self.memory().halted {
            return Err(Refusal::new(format!("the LLM coder stopped: {why}")));
        }
        let c = contract(g, action)?;
        let prompt = self.prompt(program, g, action, &c)?;
        let reply = match self.client.complete(&prompt) {
            Ok(r) => r,
            Err(e) => {
                if e.stops_run() {
                    self.memory().halted = Some(e.to_string());
                }
                return Err(Refusal::new(format!("the LLM call failed: {e}")));
            }
        };
        let signature = format!("{}(", c.name);
        let Some(block) = mtmc_llm::extract::code_for(&reply.text, |code| {
            code.contains("__global__") && code.contains(&signature)
        }) else {
            let start: String = reply.text.trim().chars().take(160).collect();
            return Err(Refusal::new(format!(
                "the reply has no code defining `__global__ void {}(`; it began: {start:?}",
                c.name
            )));
        };
        let mut source = block.code;
        if block.unclosed || reply.finish == Finish::Length {
            // Kept: the compiler says what is missing, and the step is
            // rolled back like any other that does not compile.
            source = format!("// mtmc: the reply was cut off at the token limit\n{source}");
        }
        let launch = launch_line(&source, &c.launch)?;
        Ok(Fragment {
            name: c.name,
            action: action.clone(),
            lang: Lang::Cuda,
            source,
            inputs: c.inputs,
            outputs: c.outputs,
            region: action.nodes(),
            launch,
            before: Vec::new(),
        })
    }

    fn observe(&self, note: &Note<'_>) {
        let mut m = self.memory();
        let line = match note {
            Note::Failed(f) => {
                m.failures.insert(f.action.region.clone(), (*f).clone());
                let first = f.log.lines().next().unwrap_or("").trim();
                format!(
                    "{:?} on region {:?}: {} — {first}",
                    f.action.kind,
                    f.action.region,
                    match f.stage {
                        Stage::Refused => "refused",
                        Stage::Compile => "did not compile, rolled back",
                        Stage::Outcome => "judged wrong, rolled back",
                    }
                )
            }
            Note::Judged {
                action,
                critique,
                best,
            } => {
                m.critique = Some(critique.to_string());
                if let Some(b) = best {
                    m.best = Some(b.to_string());
                }
                format!(
                    "{:?} on region {:?}: {critique}",
                    action.kind, action.region
                )
            }
        };
        m.recent.push_back(line);
        while m.recent.len() > 6 {
            m.recent.pop_front();
        }
    }

    fn halted(&self) -> Option<String> {
        self.memory().halted.clone()
    }
}

/// The program's kernels as text for a prompt.
pub fn program_text(g: &OpGraph, p: &Program) -> String {
    if p.fragments.is_empty() {
        return "No kernels yet: every op is a torch call.\n".into();
    }
    let mut s = String::new();
    for f in &p.fragments {
        let ops: Vec<String> = f
            .region
            .iter()
            .map(|&n| format!("{} ({})", g.node(n).name, g.node(n).op))
            .collect();
        let source: String = f.source.chars().take(4000).collect();
        let _ = writeln!(
            s,
            "## {} computes {}; launched with grid={} block={}\n```\n{}```",
            f.name,
            ops.join(", "),
            f.launch.grid,
            f.launch.block,
            source
        );
        if s.len() > 12_000 {
            s.push_str("(more kernels left out)\n");
            break;
        }
    }
    s
}

/// The kernel's name, parameters, default launch and the region as text.
fn contract(g: &OpGraph, action: &Action) -> Result<Contract, Refusal> {
    let region = action.nodes();
    let Some(&first) = region.first() else {
        return Err(Refusal::new("the region is empty"));
    };
    for &n in &region {
        if g.node(n).op.is_source() {
            return Err(Refusal::new(format!(
                "`{}` is an input, not an op",
                g.node(n).name
            )));
        }
    }
    let (inputs, outputs) = crate::template::boundary(g, &region);
    if outputs.is_empty() {
        return Err(Refusal::new("nothing reads the region's results"));
    }
    let name = format!("k{}_llm", first.index());
    let mut params = Vec::new();
    let mut text = String::from("inputs:\n");
    let mut local: HashMap<TensorRef, String> = HashMap::new();
    for (k, &t) in inputs.iter().enumerate() {
        let v = format!("x{k}");
        let tensor = g.tensor(t);
        params.push(format!("const {}* __restrict__ {v}", c_type(tensor.dtype)));
        let _ = writeln!(text, "  {v} = `{}`: {tensor}", g.node(t.node).name);
        local.insert(t, v);
    }
    let _ = writeln!(text, "ops, in order:");
    for &n in &region {
        let node = g.node(n);
        let args: Vec<String> = g
            .inputs(n)
            .iter()
            .map(|t| {
                local
                    .get(t)
                    .cloned()
                    .unwrap_or_else(|| g.node(t.node).name.clone())
            })
            .collect();
        let v = format!("t{}", n.index());
        let _ = writeln!(
            text,
            "  {v} = {} of ({}) -> {}",
            node.op,
            args.join(", "),
            g.tensor(TensorRef::first(n))
        );
        local.insert(TensorRef::first(n), v);
    }
    let _ = writeln!(text, "outputs:");
    for (k, &t) in outputs.iter().enumerate() {
        let tensor = g.tensor(t);
        params.push(format!("{}* __restrict__ y{k}", c_type(tensor.dtype)));
        let _ = writeln!(text, "  y{k} = {}: {tensor}", local[&t]);
    }
    let numel = |t: TensorRef| g.tensor(t).shape.iter().product::<u64>();
    let mut sizes = Vec::new();
    for (k, &t) in inputs.iter().enumerate() {
        params.push(format!("long long n_x{k}"));
        sizes.push(numel(t) as i64);
    }
    for (k, &t) in outputs.iter().enumerate() {
        params.push(format!("long long n_y{k}"));
        sizes.push(numel(t) as i64);
    }
    let n = outputs.iter().map(|&t| numel(t)).max().unwrap_or(1).max(1);
    let block = match action.params.block {
        b @ 32..=1024 if b.is_multiple_of(32) => b,
        _ => 256,
    };
    let grid = n.div_ceil(u64::from(block)).clamp(1, MAX_GRID) as u32;
    Ok(Contract {
        signature: format!("{name}({})", params.join(", ")),
        name,
        inputs,
        outputs,
        launch: Launch {
            grid,
            block,
            sizes,
            shared: 0,
        },
        region: text,
    })
}

/// The launch the code asks for with `// mtmc-launch: grid=G block=B
/// [shared=S]`, else `default`.
fn launch_line(source: &str, default: &Launch) -> Result<Launch, Refusal> {
    let Some(line) = source
        .lines()
        .find_map(|l| l.trim().strip_prefix("// mtmc-launch:"))
    else {
        return Ok(default.clone());
    };
    let mut launch = default.clone();
    for part in line.split_whitespace() {
        let (key, value) = part
            .split_once('=')
            .ok_or_else(|| Refusal::new(format!("mtmc-launch: `{part}` is not KEY=VALUE")))?;
        let v: u32 = value
            .trim_end_matches(',')
            .parse()
            .map_err(|_| Refusal::new(format!("mtmc-launch: `{value}` is not a whole number")))?;
        match key {
            "grid" if v >= 1 => launch.grid = v,
            "block" if (32..=1024).contains(&v) && v.is_multiple_of(32) => launch.block = v,
            "shared" if v <= 227 * 1024 => launch.shared = v,
            _ => {
                return Err(Refusal::new(format!(
                    "mtmc-launch: {key}={v} is not allowed (grid ≥ 1, block a multiple of 32 up to 1024, shared up to 227 KiB)"
                )));
            }
        }
    }
    Ok(launch)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_launch_line_overrides_the_default() {
        let d = Launch {
            grid: 10,
            block: 256,
            sizes: vec![1],
            shared: 0,
        };
        let l = launch_line("// mtmc-launch: grid=64 block=128 shared=4096\n", &d).unwrap();
        assert_eq!((l.grid, l.block, l.shared), (64, 128, 4096));
        assert_eq!(launch_line("int x;", &d).unwrap(), d);
        assert!(launch_line("// mtmc-launch: block=100", &d).is_err());
    }
}

//! `mtmc optimize --intent …`: the template coder and a small built-in
//! search, until the planner exists. Today it covers intents whose ops are
//! all pointwise: it fuses them into one kernel, tries a few launch
//! variants through the native evaluator (compile-only without a GPU),
//! keeps the fastest correct one and writes it out.

use std::path::Path;
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mtmc_actions::device::{MathMode, builtin_devices, find_device};
use mtmc_actions::graph::OpGraph;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::render::to_cuda_program;
use mtmc_coder::session::Session;
use mtmc_coder::template::TemplateCoder;
use mtmc_env::evaluator::{Candidate, CompileOnly, Evaluator, ProblemSource};
use mtmc_env::native::{GraphSource, NativeEvaluator};
use mtmc_env::nvrtc::Arch;
use mtmc_env::outcome::{Outcome, Status};
use mtmc_env::worker::Protocol;

/// What `mtmc optimize` was asked to do.
pub struct Request<'a> {
    /// The problem or intent.
    pub subject: crate::cmd::show::Subject<'a>,
    /// Where the generated code and report go.
    pub out_dir: &'a Path,
    /// Wall-clock limit per candidate.
    pub timeout: Duration,
}

/// The launch variants the built-in search tries, in order.
const VARIANTS: [Params; 4] = [
    Params {
        block: 256,
        vector: 1,
    },
    Params {
        block: 256,
        vector: 4,
    },
    Params {
        block: 512,
        vector: 4,
    },
    Params {
        block: 128,
        vector: 4,
    },
];

/// Runs the search and writes the best program.
pub fn run(out: &mut dyn std::io::Write, req: Request<'_>) -> Result<()> {
    let (text, bindings) = match &req.subject {
        crate::cmd::show::Subject::Intent { text, bindings, .. } => {
            (text.clone(), bindings.clone())
        }
        crate::cmd::show::Subject::Problem { kernelbench, name } => {
            return run_problem(out, *kernelbench, name, req.out_dir, req.timeout);
        }
    };
    let g = mtmc_actions::intent::compile(&text, &bindings).context("in --intent")?;
    let regions = problem_regions(&g)?;
    if regions.is_empty() {
        bail!(
            "the intent has nothing for a kernel: the native evaluator needs one (matmuls are library calls only in a ModelNew)"
        );
    }
    let problem = ProblemSource {
        name: "intent".into(),
        code: String::new(),
        graph: Some(GraphSource::Intent {
            text: text.clone(),
            shapes: bindings.shapes.clone(),
            dtype: bindings.dtype,
        }),
    };
    let gpu = mtmc_env::probe::driver().is_ok_and(|d| !d.gpus.is_empty());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let exe = std::env::current_exe().context("cannot find the mtmc binary")?;
    let mut native =
        NativeEvaluator::new(exe.into(), None, Protocol::KERNELBENCH_FP32, req.timeout);
    let mut compile_only = CompileOnly {
        arch: Arch::SM90,
        reason: "no GPU on this machine".into(),
    };
    writeln!(
        out,
        "intent: {} kernel(s) for {} op(s); {} launch variants, judged {}",
        regions.len(),
        regions.iter().map(Vec::len).sum::<usize>(),
        VARIANTS.len(),
        if gpu {
            "on the GPU against the f64 reference"
        } else {
            "by compile only (no GPU: nothing is run or timed)"
        }
    )?;
    let specs = builtin_devices();
    let mut attempts = Vec::new();
    let mut failures = Vec::new();
    let mut best: Option<(f64, mtmc_coder::program::Program, Params)> = None;
    for params in VARIANTS {
        let label = format!("block={} vector={}", params.block, params.vector);
        let proposed = match build(&g, &regions, params) {
            Ok(p) => p,
            Err(f) => {
                writeln!(
                    out,
                    "  {label}: {}, rolled back: {}",
                    stage_name(&f),
                    f.log.lines().next().unwrap_or("")
                )?;
                attempts.push(serde_json::json!({"params": params, "failure": f}));
                failures.push(f);
                continue;
            }
        };
        let program = to_cuda_program(&g, &proposed).map_err(anyhow::Error::msg)?;
        let candidate = Candidate::Cuda {
            name: label.clone(),
            program: program.clone(),
        };
        let mut o: Outcome = if gpu {
            runtime.block_on(native.evaluate(&problem, &candidate))?
        } else {
            runtime.block_on(compile_only.evaluate(&problem, &candidate))?
        };
        if let Some(spec) = find_device(&specs, o.device.as_deref().unwrap_or("")) {
            o.add_roofline(&g, spec, MathMode::default());
        }
        match (o.status, &o.runtime) {
            (Status::Correct, Some(rt)) => {
                let roof = o.achieved.as_ref().map_or(String::new(), |a| {
                    format!(
                        ", {:.0}% of the {} roofline",
                        100.0 * a.roofline_fraction,
                        a.device
                    )
                });
                writeln!(out, "  {label}: correct, {:.4} ms{roof}", rt.mean_ms)?;
                if best.as_ref().is_none_or(|(ms, _, _)| rt.mean_ms < *ms) {
                    best = Some((rt.mean_ms, proposed.clone(), params));
                }
            }
            (Status::CompiledOnly, _) => {
                writeln!(out, "  {label}: compiled, not run")?;
                if best.is_none() {
                    best = Some((f64::INFINITY, proposed.clone(), params));
                }
            }
            (status, _) => {
                let why = o.why.clone().or(o.error.clone()).unwrap_or_default();
                writeln!(out, "  {label}: {}, rolled back: {why}", status.name())?;
                failures.push(mtmc_coder::session::Failure {
                    action: proposed.fragments[0].action.clone(),
                    stage: mtmc_coder::session::Stage::Outcome,
                    fragment: None,
                    log: format!("{}: {why}", status.name()),
                });
            }
        }
        attempts.push(serde_json::json!({"params": params, "outcome": o}));
    }
    std::fs::create_dir_all(req.out_dir)
        .with_context(|| format!("cannot create `{}`", req.out_dir.display()))?;
    let report = serde_json::json!({"intent": text, "attempts": attempts, "failures": failures});
    write(
        req.out_dir,
        "report.json",
        &(serde_json::to_string_pretty(&report)? + "\n"),
    )?;
    let Some((ms, program, params)) = best else {
        bail!(
            "no variant was correct; the attempts are in {}",
            req.out_dir.join("report.json").display()
        );
    };
    let cuda = to_cuda_program(&g, &program).map_err(anyhow::Error::msg)?;
    write(req.out_dir, "program.cu", &cuda.source)?;
    write(
        req.out_dir,
        "program.json",
        &(serde_json::to_string_pretty(&cuda)? + "\n"),
    )?;
    if ms.is_finite() {
        writeln!(
            out,
            "best: block={} vector={}, {ms:.4} ms; wrote program.json, program.cu and report.json to {}",
            params.block,
            params.vector,
            req.out_dir.display()
        )?;
    } else {
        writeln!(
            out,
            "nothing was run or timed (no GPU); wrote the first variant that compiled (block={} vector={}) to {}",
            params.block,
            params.vector,
            req.out_dir.display()
        )?;
    }
    Ok(())
}

/// The program with one fragment per region at `params` (row kernels read
/// one element per thread), or the first failure.
fn build(
    g: &OpGraph,
    regions: &[Vec<u32>],
    params: Params,
) -> std::result::Result<mtmc_coder::program::Program, mtmc_coder::session::Failure> {
    let mut session = Session::new(g, TemplateCoder, Arch::SM90);
    for region in regions {
        let single_row_op = match &region[..] {
            [n] => matches!(
                g.node(mtmc_actions::graph::NodeId::new(*n as usize))
                    .op
                    .class(),
                mtmc_actions::op::OpClass::Reduction
                    | mtmc_actions::op::OpClass::Softmax
                    | mtmc_actions::op::OpClass::Norm
            ),
            _ => false,
        };
        let action = Action {
            kind: if region.len() == 1 {
                ActionKind::CustomKernel
            } else {
                ActionKind::Fuse
            },
            region: region.clone(),
            params: if single_row_op {
                Params {
                    vector: 1,
                    ..params
                }
            } else {
                params
            },
        };
        let next = session.propose(&action)?;
        session.accept(next);
    }
    Ok(session.good().clone())
}

fn stage_name(f: &mtmc_coder::session::Failure) -> &'static str {
    match f.stage {
        mtmc_coder::session::Stage::Refused => "refused",
        mtmc_coder::session::Stage::Compile => "does not compile",
        mtmc_coder::session::Stage::Outcome => "wrong",
    }
}

fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("cannot write `{}`", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write `{}`", path.display()))
}

/// The regions a KernelBench graph is cut into: connected pointwise chains
/// (each a fused kernel); matmuls and convolutions stay library calls.
fn problem_regions(g: &OpGraph) -> Result<Vec<Vec<u32>>> {
    use mtmc_actions::op::OpClass;
    let mut region_of: std::collections::HashMap<mtmc_actions::graph::NodeId, usize> =
        Default::default();
    let mut regions: Vec<Vec<u32>> = Vec::new();
    let mut other = Vec::new();
    for (id, n) in g.nodes() {
        if n.op.is_source() || mtmc_coder::export::library_op(&n.op) {
            continue;
        }
        if matches!(
            n.op.class(),
            OpClass::Reduction | OpClass::Softmax | OpClass::Norm
        ) {
            // One row kernel each.
            regions.push(vec![id.index() as u32]);
            region_of.insert(id, usize::MAX);
            continue;
        }
        if n.op.class() != OpClass::Pointwise {
            other.push(format!("{} ({})", n.name, n.op));
            continue;
        }
        // Join the region of a pointwise producer when this node is its only
        // reader, so that chains fuse and branches stay apart.
        let joined = g.inputs(id).iter().find_map(|t| {
            let r = *region_of.get(&t.node)?;
            (r != usize::MAX && g.consumers(t.node).len() == 1).then_some(r)
        });
        let r = joined.unwrap_or_else(|| {
            regions.push(Vec::new());
            regions.len() - 1
        });
        regions[r].push(id.index() as u32);
        region_of.insert(id, r);
    }
    if !other.is_empty() {
        bail!(
            "the template coder has no family yet for {}; today `optimize` covers pointwise chains, reductions, softmax and norms, with matmuls and convolutions as library calls",
            other.join(", ")
        );
    }
    Ok(regions)
}

/// A KernelBench problem: fragments for its pointwise chains, the rest as
/// torch calls, exported as `ModelNew` and judged by the worker.
fn run_problem(
    out: &mut dyn std::io::Write,
    kernelbench: Option<&Path>,
    name: &str,
    out_dir: &Path,
    timeout: Duration,
) -> Result<()> {
    use mtmc_env::evaluator::{WorkerEvaluator, WorkerSettings};
    use mtmc_env::worker::WorkerSlot;
    let problems = crate::source::Problems::load(kernelbench)?;
    let p = problems.find(name)?;
    if p.code.is_empty() {
        bail!(
            "optimize needs {p}'s code for its ModelNew: pass --kernelbench PATH (a problems.jsonl or a KernelBench checkout)"
        );
    }
    let traced = problems.graphs(&[p])?.remove(0);
    let g = traced
        .graph
        .map_err(|e| anyhow::anyhow!("{p} has no graph: {e}"))?;
    let regions = problem_regions(&g)?;
    let gpu = mtmc_env::probe::driver().is_ok_and(|d| !d.gpus.is_empty());
    // Without kernels, the variants are one program.
    let variants: &[Params] = if regions.is_empty() {
        &VARIANTS[..1]
    } else {
        &VARIANTS
    };
    let library = g
        .nodes()
        .filter(|(_, n)| mtmc_coder::export::library_op(&n.op))
        .count();
    writeln!(
        out,
        "{p}: {} kernel(s) for {} op(s), {library} library call(s){}; {} variant(s), judged {}",
        regions.len(),
        regions.iter().map(Vec::len).sum::<usize>(),
        if regions.is_empty() {
            " (call-library only)"
        } else {
            ""
        },
        variants.len(),
        if gpu {
            "by the worker against the PyTorch model"
        } else {
            "by compile only (no GPU: nothing is run or timed)"
        }
    )?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let settings = WorkerSettings {
        baselines: vec!["eager".into(), "compile".into()],
        baseline_cache: crate::source::cache_dir().map(|d| d.join("baselines")),
        limit: timeout,
        ..WorkerSettings::default()
    };
    let mut worker = WorkerEvaluator::new(WorkerSlot::new(None), settings);
    let problem = ProblemSource {
        name: format!("{}.py", p.name),
        code: p.code.clone(),
        graph: None,
    };
    let specs = builtin_devices();
    let mut attempts = Vec::new();
    let mut best: Option<(f64, String, Params)> = None;
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create `{}`", out_dir.display()))?;
    for &params in variants {
        let label = format!("block={} vector={}", params.block, params.vector);
        let program = match build(&g, &regions, params) {
            Ok(p) => p,
            Err(f) => {
                writeln!(
                    out,
                    "  {label}: {}, rolled back: {}",
                    stage_name(&f),
                    f.log.lines().next().unwrap_or("")
                )?;
                attempts.push(serde_json::json!({"params": params, "failure": f}));
                continue;
            }
        };
        let code =
            mtmc_coder::export::to_model_new(&g, &program, &p.code).map_err(anyhow::Error::msg)?;
        if !gpu {
            writeln!(out, "  {label}: compiled, not run")?;
            if best.is_none() {
                best = Some((f64::INFINITY, code.clone(), params));
            }
            attempts.push(serde_json::json!({"params": params, "compiled_only": true}));
            continue;
        }
        let candidate = Candidate::Python {
            name: format!("model_new {label}"),
            code: code.clone(),
        };
        let mut o = runtime.block_on(worker.evaluate(&problem, &candidate))?;
        if let Some(spec) = find_device(&specs, o.device.as_deref().unwrap_or("")) {
            o.add_roofline(&g, spec, MathMode::default());
        }
        match (o.status, &o.runtime) {
            (Status::Correct, Some(rt)) => {
                let vs = |b: &str| {
                    o.speedup_vs(b)
                        .map_or("-".to_string(), |s| format!("{s:.3}x"))
                };
                writeln!(
                    out,
                    "  {label}: correct, {:.4} ms; vs eager {}, vs torch.compile {}",
                    rt.mean_ms,
                    vs("eager"),
                    vs("compile")
                )?;
                if best.as_ref().is_none_or(|(ms, _, _)| rt.mean_ms < *ms) {
                    best = Some((rt.mean_ms, code.clone(), params));
                }
            }
            (status, _) => {
                let why = o.why.clone().or(o.error.clone()).unwrap_or_default();
                writeln!(
                    out,
                    "  {label}: {}, rolled back: {}",
                    status.name(),
                    why.lines().next().unwrap_or("")
                )?;
            }
        }
        attempts.push(serde_json::json!({"params": params, "outcome": o}));
    }
    let report = serde_json::json!({"problem": p.full_name(), "attempts": attempts});
    write(
        out_dir,
        "report.json",
        &(serde_json::to_string_pretty(&report)? + "\n"),
    )?;
    let Some((ms, code, params)) = best else {
        bail!(
            "no variant was correct; the attempts are in {}",
            out_dir.join("report.json").display()
        );
    };
    write(out_dir, "model_new.py", &code)?;
    if ms.is_finite() {
        writeln!(
            out,
            "best: block={} vector={}, {ms:.4} ms; wrote model_new.py and report.json to {}",
            params.block,
            params.vector,
            out_dir.display()
        )?;
    } else {
        writeln!(
            out,
            "nothing was run or timed (no GPU); wrote the first variant that compiled to {}",
            out_dir.display()
        )?;
    }
    Ok(())
}

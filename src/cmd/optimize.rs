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
    /// The intent program.
    pub text: String,
    /// Its bindings.
    pub bindings: mtmc_actions::intent::Bindings,
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
    let g = mtmc_actions::intent::compile(&req.text, &req.bindings).context("in --intent")?;
    let region = pointwise_region(&g)?;
    let problem = ProblemSource {
        name: "intent".into(),
        code: String::new(),
        graph: Some(GraphSource::Intent {
            text: req.text.clone(),
            shapes: req.bindings.shapes.clone(),
            dtype: req.bindings.dtype,
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
        "intent: {} pointwise op(s) fused into one kernel; {} launch variants, judged {}",
        region.len(),
        VARIANTS.len(),
        if gpu {
            "on the GPU against the f64 reference"
        } else {
            "by compile only (no GPU: nothing is run or timed)"
        }
    )?;
    let mut session = Session::new(&g, TemplateCoder, Arch::SM90);
    let specs = builtin_devices();
    let mut attempts = Vec::new();
    let mut best: Option<(f64, mtmc_coder::program::Program, Params)> = None;
    for params in VARIANTS {
        let action = Action {
            kind: ActionKind::Fuse,
            region: region.clone(),
            params,
        };
        let label = format!("fuse block={} vector={}", params.block, params.vector);
        let proposed = match session.propose(&action) {
            Ok(p) => p,
            Err(f) => {
                let stage = match f.stage {
                    mtmc_coder::session::Stage::Refused => "refused",
                    mtmc_coder::session::Stage::Compile => "does not compile",
                    mtmc_coder::session::Stage::Outcome => "wrong",
                };
                writeln!(
                    out,
                    "  {label}: {stage}, rolled back: {}",
                    f.log.lines().next().unwrap_or("")
                )?;
                attempts.push(serde_json::json!({"action": action, "failure": f}));
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
                session.reject(&action, &proposed, format!("{}: {why}", status.name()));
            }
        }
        attempts.push(serde_json::json!({"action": action, "outcome": o}));
    }
    std::fs::create_dir_all(req.out_dir)
        .with_context(|| format!("cannot create `{}`", req.out_dir.display()))?;
    let report =
        serde_json::json!({"intent": req.text, "attempts": attempts, "failures": session.failures});
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
    session.accept(program);
    let cuda = to_cuda_program(&g, session.good()).map_err(anyhow::Error::msg)?;
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

/// Every computing node, when all are pointwise; else what is not.
fn pointwise_region(g: &OpGraph) -> Result<Vec<u32>> {
    let mut region = Vec::new();
    let mut other = Vec::new();
    for (id, n) in g.nodes() {
        if n.op.is_source() {
            continue;
        }
        if n.op.class() == mtmc_actions::op::OpClass::Pointwise {
            region.push(id.index() as u32);
        } else {
            other.push(format!("{} ({})", n.name, n.op));
        }
    }
    if !other.is_empty() {
        bail!(
            "the template coder has no family yet for {}; today `optimize` covers intents made of pointwise ops",
            other.join(", ")
        );
    }
    if region.is_empty() {
        bail!("the intent computes nothing");
    }
    Ok(region)
}

fn write(dir: &Path, name: &str, text: &str) -> Result<()> {
    let path = dir.join(name);
    let tmp = dir.join(format!(".{name}.tmp"));
    std::fs::write(&tmp, text).with_context(|| format!("cannot write `{}`", tmp.display()))?;
    std::fs::rename(&tmp, &path).with_context(|| format!("cannot write `{}`", path.display()))
}

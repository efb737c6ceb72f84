//! The built-in search: the variants it builds (launch parameters,
//! fusion, how products are computed), each judged in turn, and the report
//! of every attempt with the best program.

use std::path::Path;

use anyhow::{Context, Result};
use mtmc_actions::graph::OpGraph;
use mtmc_actions::op::{Layout, Op};
use mtmc_coder::action::Params;
use mtmc_coder::program::Program;
use mtmc_coder::session::Stage;
use mtmc_coder::template::triton::TritonCoder;
use mtmc_coder::template::{TemplateCoder, product};
use mtmc_env::outcome::{Outcome, Status};

use super::Target;
use super::build::{Gemm, build, has_conv, has_gemm};
use super::write;
use crate::steps::{self, Found, OneAtATime, Proposal, Proposed};

/// One program the built-in search builds: launch parameters, whether
/// pointwise chains are fused in front of the row kernels that read them,
/// and how products (matrix products, convolutions) are computed.
#[derive(Clone, Copy, Debug)]
pub(super) struct Variant {
    pub(super) params: Params,
    pub(super) fuse: bool,
    pub(super) gemm: Gemm,
}

pub(super) const fn variant(block: u32, vector: u32, fuse: bool) -> Variant {
    Variant {
        params: Params { block, vector },
        fuse,
        gemm: Gemm::Library,
    }
}

/// The variants the built-in search tries, in order: launch parameters,
/// and chains fused in front of row kernels (the last keeps them apart, in
/// case a fused program is wrong).
pub(super) const VARIANTS: [Variant; 5] = [
    variant(256, 1, true),
    variant(256, 4, true),
    variant(512, 4, true),
    variant(128, 4, true),
    variant(256, 4, false),
];

/// The variants for graph `g`: with matrix products, a ModelNew also tries
/// them as GEMM kernels (after the library variants; Triton writes
/// matrix products, CUDA convolutions too), and a program
/// without library calls (`library: false`) computes them with kernels in
/// every variant. Without regions (`no_regions`: nothing but products
/// for kernels) launch parameters change nothing: one variant each.
pub(super) fn variants_for(g: &OpGraph, library: bool, no_regions: bool) -> Vec<Variant> {
    let products = g.nodes().any(|(_, n)| product(&n.op));
    let mut v = if no_regions {
        VARIANTS[..1].to_vec()
    } else {
        VARIANTS.to_vec()
    };
    if products {
        if library {
            // At the launch parameters of the second library variant (of
            // the only one without regions).
            let base = if no_regions { VARIANTS[0] } else { VARIANTS[1] };
            v.push(Variant {
                gemm: Gemm::Kernel,
                ..base
            });
        } else {
            for x in &mut v {
                x.gemm = Gemm::KernelOnly;
            }
        }
    }
    v
}

/// The compute ops of `g` that no fragment of `program` computes: in its
/// `ModelNew` they are library calls (torch, cuBLAS, cuDNN), and every
/// report lists them. Views and permutes (torch views) are not compute.
pub(crate) fn library_ops(g: &OpGraph, program: &Program) -> Vec<String> {
    let covered = program.covered();
    g.nodes()
        .filter(|(id, n)| {
            !n.op.is_source()
                && !n.op.is_view()
                && !matches!(n.op, Op::Layout(Layout::Permute { .. }))
                && !covered.contains(id)
        })
        .map(|(_, n)| format!("{} ({})", n.name, n.op))
        .collect()
}

/// The built-in search as a planner: each variant built with the template
/// coder in turn, printing a line each. Launch parameters do not change
/// values: once a program is wrong, its other launch variants are skipped;
/// only the variant with the pointwise chains kept apart (and the GEMM
/// variant, which computes products anew) is still tried, and after a wrong
/// unfused one nothing.
pub(super) struct VariantPlanner<'a> {
    g: &'a OpGraph,
    regions: &'a [Vec<u32>],
    variants: std::slice::Iter<'a, Variant>,
    target: Target,
    strict: bool,
    /// A fused variant was judged wrong.
    wrong_fused: bool,
    /// A judged outcome found the reference TF32-rounded.
    tf32_reference: bool,
    /// The last variant proposed.
    current: Option<Variant>,
    /// A wrong unfused variant ended the search.
    done: bool,
}

impl<'a> VariantPlanner<'a> {
    pub(super) fn new(
        g: &'a OpGraph,
        regions: &'a [Vec<u32>],
        variants: &'a [Variant],
        target: Target,
        strict: bool,
    ) -> VariantPlanner<'a> {
        VariantPlanner {
            g,
            regions,
            variants: variants.iter(),
            target,
            strict,
            wrong_fused: false,
            tf32_reference: false,
            current: None,
            done: false,
        }
    }
}

impl OneAtATime for VariantPlanner<'_> {
    fn done(&self) -> bool {
        self.done || self.variants.len() == 0
    }

    fn propose(
        &mut self,
        out: &mut dyn std::io::Write,
        found: &mut Found,
        _stopped: &dyn Fn() -> bool,
    ) -> Result<Proposal<Proposed>> {
        let g = self.g;
        let Some(&Variant { params, fuse, gemm }) = self.variants.next() else {
            return Ok(Proposal::Done);
        };
        self.current = Some(Variant { params, fuse, gemm });
        // The GEMM variant after the library ones computes products anew:
        // it is tried even when those were wrong, and its verdict says
        // nothing of them.
        if self.wrong_fused && fuse && gemm != Gemm::Kernel {
            return Ok(Proposal::Next);
        }
        let label = if self.regions.is_empty() && gemm == Gemm::Library {
            "call-library (every op a torch call)".to_string()
        } else {
            format!(
                "block={} vector={}{}{}",
                params.block,
                params.vector,
                if fuse { "" } else { " unfused" },
                if gemm == Gemm::Library { "" } else { " gemm" }
            )
        };
        let built = match self.target {
            Target::Cuda => build(g, self.regions, params, fuse, gemm, TemplateCoder, false),
            // Strict: a region the coder refuses fails the variant
            // instead of staying torch calls.
            Target::Triton => build(
                g,
                self.regions,
                params,
                fuse,
                gemm,
                TritonCoder,
                !self.strict,
            ),
        };
        let program = match built {
            Ok((p, refused)) => {
                for f in refused {
                    let first = f.log.lines().next().unwrap_or("");
                    writeln!(
                        out,
                        "  {label}: region {:?} stays torch calls: {first}",
                        f.action.region
                    )?;
                    found
                        .attempts
                        .push(serde_json::json!({"params": params, "left_to_torch": f}));
                }
                p
            }
            Err(f) => {
                let stage = match f.stage {
                    Stage::Refused => "refused",
                    Stage::Compile => "does not compile",
                    Stage::Outcome => "wrong",
                };
                let first = f.log.lines().next().unwrap_or("");
                writeln!(out, "  {label}: {stage}, rolled back: {first}")?;
                found
                    .attempts
                    .push(serde_json::json!({"params": params, "failure": f}));
                return Ok(Proposal::Next);
            }
        };
        if gemm == Gemm::Kernel && !has_gemm(g, &program) {
            writeln!(
                out,
                "  {label}: no product became a kernel; the library variants cover this program"
            )?;
            return Ok(Proposal::Next);
        }
        if self.tf32_reference && has_conv(&program) {
            writeln!(
                out,
                "  {label}: skipped: the reference's convolutions ran on TF32 (torch's default cudnn.allow_tf32), more than 1e-4 from exact float32, and an exact float32 convolution kernel cannot meet the tolerance against them"
            )?;
            return Ok(Proposal::Next);
        }
        Ok(Proposal::Judge(vec![Proposed {
            program,
            label,
            params,
        }]))
    }

    fn judged(
        &mut self,
        out: &mut dyn std::io::Write,
        found: &mut Found,
        (program, params, label): (Program, Params, String),
        o: Outcome,
    ) -> Result<()> {
        let Some(Variant { fuse, gemm, .. }) = self.current else {
            unreachable!("an outcome follows a proposed variant")
        };
        self.tf32_reference |= o.reference_tf32;
        match (o.status, &o.runtime) {
            (Status::Correct, Some(rt)) => {
                let mut line = format!("  {label}: correct, {:.4} ms", rt.mean_ms);
                if !o.baselines.is_empty() {
                    let vs = |b: &str| o.speedup_vs(b).map_or("-".into(), |s| format!("{s:.3}x"));
                    line += &format!(
                        "; vs eager {}, vs torch.compile {}",
                        vs("eager"),
                        vs("compile")
                    );
                }
                if let Some(a) = &o.achieved {
                    line += &format!(
                        "; {:.0}% of the {} roofline",
                        100.0 * a.roofline_fraction,
                        a.device
                    );
                }
                writeln!(out, "{line}")?;
                if found
                    .best
                    .as_ref()
                    .is_none_or(|(ms, _, _, _)| rt.mean_ms < *ms)
                {
                    found.best = Some((rt.mean_ms, program, params, o.clone()));
                }
            }
            (Status::CompiledOnly, _) => {
                writeln!(out, "  {label}: compiled, not run")?;
                if found.best.is_none() {
                    found.best = Some((f64::INFINITY, program, params, o.clone()));
                }
            }
            (status, _) => {
                let why = o.why.clone().or(o.error.clone()).unwrap_or_default();
                let first = why.lines().next().unwrap_or("");
                writeln!(out, "  {label}: {}, rolled back: {first}", status.name())?;
            }
        }
        let wrong = o.status == Status::Incorrect && gemm != Gemm::Kernel;
        found
            .attempts
            .push(serde_json::json!({"params": params, "outcome": o}));
        if wrong {
            if !fuse {
                writeln!(
                    out,
                    "  the program is wrong with its chains fused and apart; its other variants are skipped"
                )?;
                self.done = true;
            }
            self.wrong_fused = true;
        }
        Ok(())
    }
}

/// Builds each variant and judges it with `judge`, printing a line each;
/// once `stopped` says so it judges no more and keeps nothing of the
/// variant in flight (`Found::interrupted`).
#[allow(clippy::too_many_arguments)]
pub(super) fn search(
    out: &mut dyn std::io::Write,
    g: &OpGraph,
    regions: &[Vec<u32>],
    variants: &[Variant],
    target: Target,
    strict: bool,
    stopped: &dyn Fn() -> bool,
    judge: impl FnMut(&Program, &str) -> Result<Outcome>,
) -> Result<Found> {
    let mut planner = VariantPlanner::new(g, regions, variants, target, strict);
    steps::run(out, &mut planner, stopped, steps::each(judge))
}

/// Writes the report and the best program (through `write_best`, which
/// names the files it wrote), and says what was found: whether there was
/// a program to write.
pub(crate) fn conclude(
    out: &mut dyn std::io::Write,
    out_dir: &Path,
    subject: &str,
    found: Found,
    g: &OpGraph,
    write_best: impl FnOnce(&Program) -> Result<&'static str>,
) -> Result<bool> {
    std::fs::create_dir_all(out_dir)
        .with_context(|| format!("cannot create `{}`", out_dir.display()))?;
    // The best program's library calls, flagged in the report and the
    // last line.
    let library = found
        .best
        .as_ref()
        .map(|b| library_ops(g, &b.1))
        .unwrap_or_default();
    // The parts the IR does not express, run as the problem's own PyTorch
    // code (an unknown op, a submodule the trace could not follow).
    let own_code: Vec<(String, String, String)> = g
        .opaque_nodes()
        .filter_map(|(_, n)| match &n.op {
            mtmc_actions::Op::Opaque { target, reason, .. } => {
                Some((n.name.clone(), target.clone(), reason.clone()))
            }
            _ => None,
        })
        .collect();
    let mut report = serde_json::json!({
        "subject": subject,
        "library_calls": library,
        "own_code": own_code
            .iter()
            .map(|(node, call, reason)| serde_json::json!({"node": node, "call": call, "reason": reason}))
            .collect::<Vec<_>>(),
        "attempts": found.attempts,
    });
    if found.interrupted {
        report["interrupted"] = true.into();
    }
    write(
        out_dir,
        "report.json",
        &(serde_json::to_string_pretty(&report)? + "\n"),
    )?;
    let Some((ms, program, params, _)) = found.best else {
        return Ok(false);
    };
    let files = write_best(&program)?;
    for (_, call, reason) in &own_code {
        writeln!(out, "the problem's own PyTorch code: {call} ({reason})")?;
    }
    if !library.is_empty() {
        let shown = library.len().min(4);
        writeln!(
            out,
            "library calls in the best program (torch, cuBLAS, cuDNN): {}{}",
            library[..shown].join(", "),
            if library.len() > shown {
                format!(" and {} more", library.len() - shown)
            } else {
                String::new()
            }
        )?;
    }
    let llm_kernels: Vec<&str> = program
        .fragments
        .iter()
        .filter(|f| f.name.ends_with("_llm"))
        .map(|f| f.name.as_str())
        .collect();
    let what = if program.fragments.is_empty() {
        "every op a torch call".to_string()
    } else if !llm_kernels.is_empty() {
        format!("LLM kernels {}", llm_kernels.join(", "))
    } else {
        format!(
            "block={} vector={}{}",
            params.block,
            params.vector,
            if has_gemm(g, &program) { " gemm" } else { "" }
        )
    };
    if ms.is_finite() {
        writeln!(
            out,
            "best: {what}, {ms:.4} ms; wrote {files} and report.json to {}",
            out_dir.display()
        )?;
    } else {
        writeln!(
            out,
            "nothing was run or timed (no GPU); wrote the first program that compiled ({what}) to {}",
            out_dir.display()
        )?;
    }
    Ok(true)
}

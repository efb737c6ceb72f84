//! The critique of one outcome as the planner reads it: a structured
//! diagnosis (features) and the same in a short text for the coder and the
//! user.

use mtmc_actions::device::Bound;
use mtmc_env::outcome::{Outcome, Status};
use serde::{Deserialize, Serialize};

/// What kind of compile error the log shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CompileKind {
    /// A name the compiler does not know.
    Undefined,
    /// The text does not parse.
    Syntax,
    /// Types that do not match or convert.
    Type,
    /// Too many registers or too much shared memory.
    Resources,
    /// Anything else.
    Other,
    /// The coder has no template for it (nothing was compiled).
    Refused,
}

/// What limits a correct program's speed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Limit {
    /// Near the bandwidth roof of a memory-bound graph.
    Memory,
    /// Near the math roof of a compute-bound graph.
    Compute,
    /// The run is about as long as its kernel launches.
    Launch,
    /// Far from both roofs: waiting on latency (too little parallelism,
    /// dependent loads, serial loops).
    Latency,
    /// Not timed.
    Unknown,
}

/// Roofline fraction below which a program is called latency-bound.
pub const LATENCY_BELOW: f64 = 0.3;
/// Launch cost assumed per kernel or library call, ms.
pub const LAUNCH_MS: f64 = 0.006;
/// Occupancy below which a kernel is called low-occupancy.
pub const LOW_OCCUPANCY: f64 = 0.25;

/// The diagnosis of one outcome.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Diagnosis {
    /// The verdict.
    pub status: Status,
    /// For a compile error: its kind.
    pub compile_kind: Option<CompileKind>,
    /// For a compile error: the source line the log names first.
    pub compile_line: Option<u32>,
    /// For a wrong result: largest error over the output's scale.
    pub rel_err: Option<f64>,
    /// For a wrong result: the first bad element's index.
    pub first_bad: Option<Vec<u64>>,
    /// Speedup against eager PyTorch, timed in the same run.
    pub speedup_eager: Option<f64>,
    /// Speedup against torch.compile, timed in the same run.
    pub speedup_compile: Option<f64>,
    /// Fraction of the roofline bound reached.
    pub roofline: Option<f64>,
    /// What limits it.
    pub limit: Limit,
    /// Some kernel spills registers to local memory.
    pub spills: bool,
    /// Some kernel runs below [`LOW_OCCUPANCY`].
    pub low_occupancy: bool,
    /// A memory-bound program whose kernels load no vectors, well under
    /// the bandwidth roof.
    pub unvectorized: bool,
    /// The problem's reference outputs are TF32-rounded (its convolutions
    /// ran on TF32 under torch's defaults, more than 1e-4 from exact
    /// float32): known from any run that checked values, so an episode
    /// learns it at its first judged program ([`Outcome::reference_tf32`]).
    ///
    /// [`Outcome::reference_tf32`]: mtmc_env::outcome::Outcome::reference_tf32
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub reference_tf32: bool,
}

/// Length of [`Diagnosis::features`].
pub const FEATURES: usize = 7 + 5 + 1 + 1 + 1 + 1 + 5 + 3;

impl Diagnosis {
    /// The diagnosis of `o` for a graph whose roofline is `bound`.
    pub fn of(o: &Outcome, bound: Bound) -> Diagnosis {
        let log = o
            .compile_log
            .as_deref()
            .or(o.error.as_deref())
            .unwrap_or("");
        let (compile_kind, compile_line) = if o.status == Status::CompileError {
            let (k, l) = compile_error(log);
            (Some(k), l)
        } else {
            (None, None)
        };
        let correctness = o.correctness.as_ref();
        let roofline = o.achieved.as_ref().map(|a| a.roofline_fraction);
        let launches = o.kernels.len() + o.torch_ops.values().sum::<u32>() as usize;
        let limit = match (&o.runtime, roofline) {
            (Some(rt), _)
                if o.status == Status::Correct
                    && rt.mean_ms <= LAUNCH_MS * launches.max(1) as f64 =>
            {
                Limit::Launch
            }
            (Some(_), Some(f)) if o.status == Status::Correct => {
                if f < LATENCY_BELOW {
                    Limit::Latency
                } else if bound == Bound::Memory {
                    Limit::Memory
                } else {
                    Limit::Compute
                }
            }
            _ => Limit::Unknown,
        };
        let vectors = o.kernels.iter().any(|k| {
            ["float4", "float2", "double2", "int4", "tl.load"]
                .iter()
                .any(|v| k.source.contains(v))
        });
        Diagnosis {
            status: o.status,
            compile_kind,
            compile_line,
            rel_err: correctness.and_then(|c| c.rel_to_scale),
            first_bad: correctness.and_then(|c| c.first_bad.as_ref().map(|b| b.index.clone())),
            speedup_eager: o.speedup_vs("eager"),
            speedup_compile: o.speedup_vs("compile"),
            roofline,
            limit,
            spills: o.kernels.iter().any(|k| k.spills.is_some_and(|s| s > 0)),
            low_occupancy: o
                .kernels
                .iter()
                .any(|k| k.occupancy.is_some_and(|x| x < LOW_OCCUPANCY)),
            unvectorized: bound == Bound::Memory
                && !o.kernels.is_empty()
                && !vectors
                && roofline.is_some_and(|f| f < 0.7),
            reference_tf32: o.reference_tf32,
        }
    }

    /// A diagnosis for a fragment the coder refused or the compiler
    /// rejected before anything was evaluated.
    pub fn failed_to_build(log: &str, refused: bool) -> Diagnosis {
        let (kind, line) = if refused {
            (CompileKind::Refused, None)
        } else {
            compile_error(log)
        };
        Diagnosis {
            status: Status::CompileError,
            compile_kind: Some(kind),
            compile_line: line,
            rel_err: None,
            first_bad: None,
            speedup_eager: None,
            speedup_compile: None,
            roofline: None,
            limit: Limit::Unknown,
            spills: false,
            low_occupancy: false,
            unvectorized: false,
            reference_tf32: false,
        }
    }

    /// The diagnosis as numbers for the policy ([`FEATURES`] of them):
    /// status one-hot, compile kind one-hot, log error, log speedups,
    /// roofline fraction, limit one-hot, three flags.
    pub fn features(&self) -> Vec<f32> {
        let mut f = Vec::with_capacity(FEATURES);
        let statuses = [
            Status::Correct,
            Status::Incorrect,
            Status::CompileError,
            Status::RuntimeError,
            Status::Timeout,
            Status::Crashed,
            Status::CompiledOnly,
        ];
        // An implausible time reads as incorrect, a program screened out as
        // a correct one: the feature set (and the checkpoints trained on
        // it) predates both statuses.
        let status = match self.status {
            Status::Implausible => Status::Incorrect,
            Status::Screened => Status::Correct,
            s => s,
        };
        f.extend(statuses.iter().map(|&s| f32::from(status == s)));
        let kinds = [
            CompileKind::Undefined,
            CompileKind::Syntax,
            CompileKind::Type,
            CompileKind::Resources,
            CompileKind::Other,
        ];
        // A refusal shares the last slot (nothing was compiled either way).
        let kind = match self.compile_kind {
            Some(CompileKind::Refused) => Some(CompileKind::Other),
            k => k,
        };
        f.extend(kinds.iter().map(|&k| f32::from(kind == Some(k))));
        // log10 of the relative error, mapped so 1e-8 → 0 and 1 → 1.
        f.push(self.rel_err.map_or(0.0, |e| {
            if e.is_finite() {
                ((e.max(1e-8).log10() + 8.0) / 8.0).clamp(0.0, 1.5) as f32
            } else {
                1.5
            }
        }));
        let ln = |s: Option<f64>| s.map_or(0.0, |s| s.max(1e-3).ln().clamp(-4.0, 4.0) as f32);
        f.push(ln(self.speedup_eager));
        f.push(ln(self.speedup_compile));
        f.push(self.roofline.map_or(0.0, |r| r.clamp(0.0, 1.5) as f32));
        let limits = [
            Limit::Memory,
            Limit::Compute,
            Limit::Launch,
            Limit::Latency,
            Limit::Unknown,
        ];
        f.extend(limits.iter().map(|&l| f32::from(self.limit == l)));
        f.push(f32::from(self.spills));
        f.push(f32::from(self.low_occupancy));
        f.push(f32::from(self.unvectorized));
        debug_assert_eq!(f.len(), FEATURES);
        f
    }

    /// The diagnosis in a sentence or two.
    pub fn text(&self) -> String {
        let mut s = match self.status {
            Status::CompileError if self.compile_kind == Some(CompileKind::Refused) => {
                "refused by the coder (no template for it)".to_string()
            }
            Status::CompileError => {
                let kind = match self.compile_kind {
                    Some(CompileKind::Undefined) => "an undefined name",
                    Some(CompileKind::Syntax) => "a syntax error",
                    Some(CompileKind::Type) => "a type mismatch",
                    Some(CompileKind::Resources) => "too many resources",
                    _ => "an error",
                };
                match self.compile_line {
                    Some(l) => format!("does not compile: {kind} at line {l}"),
                    None => format!("does not compile: {kind}"),
                }
            }
            Status::Incorrect => {
                let mut s = "incorrect".to_string();
                if let Some(e) = self.rel_err {
                    s += &format!(", largest error {e:.2e} of the output's scale");
                }
                if let Some(i) = &self.first_bad {
                    s += &format!(", first at {i:?}");
                }
                if self.reference_tf32 {
                    s += "; the reference is TF32-rounded (its convolutions ran on TF32), \
                          which no exact float32 convolution kernel meets within 1e-4";
                }
                s
            }
            Status::Correct => {
                let mut s = "correct".to_string();
                if let Some(x) = self.speedup_eager {
                    s += &format!(", {x:.2}x eager");
                }
                if let Some(x) = self.speedup_compile {
                    s += &format!(", {x:.2}x torch.compile");
                }
                if let Some(r) = self.roofline {
                    s += &format!(", {:.0}% of the roofline", 100.0 * r);
                }
                s += match self.limit {
                    Limit::Memory => "; memory-bound",
                    Limit::Compute => "; compute-bound",
                    Limit::Launch => "; launch-bound (fewer kernels would help)",
                    Limit::Latency => "; latency-bound (far from both roofs)",
                    Limit::Unknown => "",
                };
                s
            }
            other => other.name().replace('_', " "),
        };
        if self.spills {
            s += "; registers spill";
        }
        if self.low_occupancy {
            s += "; low occupancy";
        }
        if self.unvectorized {
            s += "; loads are not vectorized";
        }
        s
    }
}

/// The kind and first line of an NVRTC / nvcc / Triton error log.
pub fn compile_error(log: &str) -> (CompileKind, Option<u32>) {
    let Some(first) = log.lines().find(|l| l.contains("error")) else {
        return (CompileKind::Other, None);
    };
    let lower = first.to_lowercase();
    let kind = if lower.contains("undefined") || lower.contains("not declared") {
        CompileKind::Undefined
    } else if lower.contains("expected") || lower.contains("syntax") {
        CompileKind::Syntax
    } else if lower.contains("conver") || lower.contains("incompatible") || lower.contains("type") {
        CompileKind::Type
    } else if lower.contains("resources")
        || lower.contains("shared memory")
        || lower.contains("registers")
    {
        CompileKind::Resources
    } else {
        CompileKind::Other
    };
    // `kernel.cu(12): error: …` or `file.cu:12:5: error: …`
    let line = first
        .split_once('(')
        .and_then(|(_, rest)| rest.split_once(')'))
        .and_then(|(n, _)| n.trim().parse().ok())
        .or_else(|| first.split(':').nth(1).and_then(|n| n.trim().parse().ok()));
    (kind, line)
}

/// A diagnosis of only a status and a speedup against eager, for tests.
#[cfg(test)]
pub(crate) fn diag(status: Status, speedup: Option<f64>) -> Diagnosis {
    let mut d = Diagnosis::failed_to_build("", true);
    d.status = status;
    d.compile_kind = None;
    d.speedup_eager = speedup;
    d.limit = Limit::Unknown;
    d
}

#[cfg(test)]
mod tests {
    use super::*;
    use mtmc_env::outcome::{Achieved, Baseline, EvaluatorKind, KernelReport, Timing};

    #[test]
    fn a_refusal_is_named_as_one_and_observed_like_another_build_failure() {
        let refused = Diagnosis::failed_to_build("vector width 2 is not 1 or 4", true);
        assert_eq!(refused.text(), "refused by the coder (no template for it)");
        let other = Diagnosis {
            compile_kind: Some(CompileKind::Other),
            ..refused.clone()
        };
        assert_eq!(other.text(), "does not compile: an error");
        assert_eq!(refused.features(), other.features());
    }

    fn timing(ms: f64) -> Timing {
        Timing::constant(ms, 10, "cuda_events")
    }

    fn correct(ms: f64, eager_ms: f64, roof: f64) -> Outcome {
        let mut o = Outcome::new(EvaluatorKind::Worker, Status::Correct);
        o.runtime = Some(timing(ms));
        o.baselines.insert(
            "eager".into(),
            Baseline {
                timing: Some(timing(eager_ms)),
                ..Baseline::default()
            },
        );
        o.achieved = Some(Achieved {
            bandwidth_gbps: 0.0,
            tflops: 0.0,
            roofline_ms: ms * roof,
            roofline_fraction: roof,
            device: "H100".into(),
        });
        o.kernels.push(KernelReport {
            name: "k0".into(),
            source: "float x = a[i];".into(),
            spills: Some(8),
            occupancy: Some(0.5),
            ..KernelReport::default()
        });
        o
    }

    #[test]
    fn compile_logs_give_kind_and_line() {
        assert_eq!(
            compile_error("kernel.cu(12): error: identifier \"x\" is undefined"),
            (CompileKind::Undefined, Some(12))
        );
        assert_eq!(
            compile_error("warning: …\nk.cu(3): error: expected a \";\""),
            (CompileKind::Syntax, Some(3))
        );
        assert_eq!(
            compile_error("k.cu:40:2: error: no suitable conversion from float* to int"),
            (CompileKind::Type, Some(40))
        );
        assert_eq!(compile_error("all fine"), (CompileKind::Other, None));
    }

    #[test]
    fn a_correct_run_is_classified_by_its_roofline() {
        let d = Diagnosis::of(&correct(1.0, 2.0, 0.8), Bound::Memory);
        assert_eq!(d.limit, Limit::Memory);
        assert_eq!(d.speedup_eager, Some(2.0));
        assert!(d.spills && !d.low_occupancy && !d.unvectorized);
        assert!(d.text().contains("2.00x eager") && d.text().contains("memory-bound"));
        let slow = Diagnosis::of(&correct(1.0, 0.5, 0.1), Bound::Memory);
        assert_eq!(slow.limit, Limit::Latency);
        assert!(
            slow.unvectorized,
            "memory-bound, scalar loads, 10% of the roof"
        );
        let tiny = Diagnosis::of(&correct(0.004, 0.01, 0.5), Bound::Compute);
        assert_eq!(tiny.limit, Limit::Launch);
        let f = d.features();
        assert_eq!(f.len(), FEATURES);
        assert_eq!(f[0], 1.0, "status correct");
        assert!((f[13] - 2f32.ln()).abs() < 1e-6, "ln speedup: {f:?}");
    }

    #[test]
    fn wrong_results_keep_where_and_how_large() {
        let mut o = Outcome::new(EvaluatorKind::Native, Status::Incorrect);
        o.correctness = Some(mtmc_env::outcome::Correctness {
            trials: 1,
            max_abs_err: Some(0.5),
            rel_to_scale: Some(0.01),
            first_bad: Some(mtmc_env::outcome::BadElement {
                index: vec![1, 2],
                expected: 1.0,
                got: 1.5,
            }),
            elements_checked: None,
        });
        let d = Diagnosis::of(&o, Bound::Memory);
        assert_eq!(d.limit, Limit::Unknown);
        assert_eq!(d.first_bad, Some(vec![1, 2]));
        assert!(
            d.text().contains("1.00e-2") && d.text().contains("[1, 2]"),
            "{}",
            d.text()
        );
        let f = d.features();
        assert_eq!(f[1], 1.0);
        assert!((f[12] - 0.75).abs() < 1e-6, "log error feature: {}", f[12]);
    }
}

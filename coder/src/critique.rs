//! The critique of an outcome: a short diagnosis text for the coder and
//! the user. `rules` is the default; `LlmCritic` asks a model for one
//! instead, so the two can be compared.

use mtmc_env::outcome::{Outcome, Status};
use mtmc_llm::{Client, LlmError, Prompt};

/// The rule-based diagnosis of `o`: what went wrong and where, or how fast
/// it ran against the baselines and the roofline, and what limits it.
pub fn rules(o: &Outcome) -> String {
    let first = |s: &Option<String>| {
        s.as_deref()
            .unwrap_or("")
            .lines()
            .find(|l| !l.trim().is_empty())
            .unwrap_or("")
            .trim()
            .to_string()
    };
    match o.status {
        Status::CompileError => {
            let log = o
                .compile_log
                .as_deref()
                .or(o.error.as_deref())
                .unwrap_or("");
            let errors: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("error"))
                .take(3)
                .collect();
            format!(
                "does not compile: {}",
                if errors.is_empty() {
                    first(&o.error)
                } else {
                    errors.join(" | ")
                }
            )
        }
        Status::Incorrect => {
            let mut s = "incorrect".to_string();
            if let Some(c) = &o.correctness {
                if let Some(e) = c.max_abs_err {
                    s += &format!(": max abs error {e:.3e}");
                }
                if let Some(r) = c.rel_to_scale {
                    s += &format!(" ({r:.2e} of the output's scale)");
                }
                if let Some(b) = &c.first_bad {
                    s += &format!(
                        "; first bad element at {:?}: expected {}, got {}",
                        b.index, b.expected, b.got
                    );
                }
            }
            let why = first(&o.why);
            if !why.is_empty() {
                s += &format!(" — {why}");
            }
            s
        }
        Status::CompiledOnly => "compiled, not run (no GPU)".into(),
        Status::Correct => correct(o),
        other => format!(
            "{}: {}",
            other.name(),
            first(&o.why)
                .chars()
                .chain(first(&o.error).chars())
                .collect::<String>()
        ),
    }
}

fn correct(o: &Outcome) -> String {
    let Some(rt) = &o.runtime else {
        return "correct (not timed)".into();
    };
    let mut s = format!("correct, {:.4} ms", rt.mean_ms);
    for (name, label) in [("eager", "eager"), ("compile", "torch.compile")] {
        if let Some(x) = o.speedup_vs(name) {
            s += &format!("; {x:.2}x {label}");
        }
    }
    if let Some(a) = &o.achieved {
        s += &format!(
            "; {:.0}% of the {} roofline ({:.0} GB/s, {:.2} TFLOP/s)",
            100.0 * a.roofline_fraction,
            a.device,
            a.bandwidth_gbps,
            a.tflops
        );
        s += if rt.mean_ms < 0.02 {
            "; launch-bound: a few microseconds, launches and syncs dominate"
        } else if a.roofline_fraction >= 0.7 {
            "; near the roofline"
        } else if a.tflops > 50.0 {
            "; compute-bound, below the roofline"
        } else {
            "; memory-bound, below the roofline: fewer passes over memory, wider loads"
        };
    }
    for k in &o.kernels {
        if k.spills.unwrap_or(0) > 0 || k.local_bytes.unwrap_or(0) > 0 {
            s += &format!(
                "; {} spills registers ({} registers, {} B local)",
                k.name,
                k.registers.unwrap_or(0),
                k.local_bytes.unwrap_or(0)
            );
        }
        if let Some(occ) = k.occupancy.filter(|&x| x < 0.25) {
            s += &format!("; {} has low occupancy ({:.0}%)", k.name, 100.0 * occ);
        }
    }
    s
}

/// A model's diagnosis of an outcome (MaxCode's critique model).
pub struct LlmCritic<'c> {
    client: &'c Client,
}

impl<'c> LlmCritic<'c> {
    /// A critic asking through `client`.
    pub fn new(client: &'c Client) -> LlmCritic<'c> {
        LlmCritic { client }
    }

    /// The diagnosis of `o`, the outcome of running `code`.
    pub fn critique(&self, o: &Outcome, code: &str) -> Result<String, LlmError> {
        let mut figures = serde_json::to_value(o).unwrap_or_default();
        // The kernels' sources are in `code` already.
        if let Some(ks) = figures.get_mut("kernels").and_then(|k| k.as_array_mut()) {
            for k in ks {
                if let Some(m) = k.as_object_mut() {
                    m.remove("source");
                }
            }
        }
        let code: String = code.chars().take(12_000).collect();
        let prompt = Prompt::ask(
            "You diagnose GPU kernel runs for mtmc. Given a program and its measured outcome, say in at most four sentences what limits it or what is wrong (compile error and its cause; wrong results and where; memory-, compute-, launch- or latency-bound; spills, occupancy, uncoalesced or unvectorized access) and the one change most likely to help. Plain text, no code.",
            format!(
                "# Program\n```\n{code}\n```\n\n# Outcome (JSON)\n```json\n{}\n```\n\nThe rule-based diagnosis was: {}\n",
                serde_json::to_string_pretty(&figures).unwrap_or_default(),
                rules(o)
            ),
        );
        let reply = self.client.complete(&prompt)?;
        Ok(reply.text.trim().to_string())
    }
}

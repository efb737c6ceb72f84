//! Paired comparisons of two planners over a comparison's problems: the
//! ratio of their geomeans, its 95 % interval by a bootstrap over the
//! problems, and on how many problem runs each was ahead.
//!
//! The geomeans of a table differ by a percent or two between planners,
//! about what one problem's luck moves them; the interval says whether a
//! ratio is more than that. The bootstrap draws whole problems: the passes
//! of a pooled live comparison run the same problems, and a problem's
//! runs move together.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use mtmc_planner::rng::Rng;

use crate::plan::ProblemRow;

/// Resamples of the bootstrap.
const RESAMPLES: usize = 10_000;
/// The bootstrap's seed: a table's intervals are the same every time it
/// is printed.
const SEED: u64 = 0x5EED;
/// How much faster one planner's best must be for a run to count as one
/// it was ahead on (0.5 %: below a timing's spread).
const MARGIN: f64 = 0.005;

/// One planner set against another.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub(crate) struct Paired {
    pub(crate) planner: String,
    pub(crate) against: String,
    /// The ratio of the two geomeans over the runs (as in the table).
    pub(crate) ratio: f64,
    /// The 2.5th and 97.5th percentiles of the ratio over resampled
    /// problems.
    pub(crate) low: f64,
    pub(crate) high: f64,
    pub(crate) problems: usize,
    /// Problem runs: one per problem, or one per problem and pass when
    /// passes are pooled.
    pub(crate) runs: usize,
    /// Runs where `planner`'s best was more than [`MARGIN`] above
    /// `against`'s, and below.
    pub(crate) ahead: usize,
    pub(crate) behind: usize,
    /// The problems where `planner` was furthest behind (more than
    /// [`MARGIN`], at most [`NAMED`]), worst first, with the ratio of its
    /// best to `against`'s (over their runs, the geometric mean): where to
    /// look for what it misses.
    pub(crate) furthest_behind: Vec<(String, f64)>,
}

/// Problems named in [`Paired::furthest_behind`].
const NAMED: usize = 3;

/// The pairs a comparison is read by: trained against random and greedy
/// when a trained planner is in it, else greedy against random (those
/// the rows have).
pub(crate) fn pairs(problems: &[ProblemRow]) -> Vec<Paired> {
    let has = |p: &str| problems.iter().all(|r| r.planners.contains_key(p));
    let wanted: &[(&str, &str)] = if has("trained") {
        &[("trained", "random"), ("trained", "greedy")]
    } else {
        &[("greedy", "random")]
    };
    wanted
        .iter()
        .filter_map(|&(a, b)| paired(problems, a, b))
        .collect()
}

/// `planner` against `against` over `problems` (none when a row lacks
/// either, or there are no rows). Speedups below 1 count as 1, as in the
/// table.
pub(crate) fn paired(problems: &[ProblemRow], planner: &str, against: &str) -> Option<Paired> {
    let mut by_problem: BTreeMap<&str, Vec<f64>> = BTreeMap::new();
    for r in problems {
        let a = r.planners.get(planner)?.best.max(1.0);
        let b = r.planners.get(against)?.best.max(1.0);
        by_problem
            .entry(r.problem.as_str())
            .or_default()
            .push(a.ln() - b.ln());
    }
    let groups: Vec<&Vec<f64>> = by_problem.values().collect();
    let logs: Vec<f64> = groups.iter().flat_map(|g| g.iter().copied()).collect();
    if logs.is_empty() {
        return None;
    }
    let ratio = |sum: f64, n: usize| (sum / n as f64).exp();
    let mut rng = Rng::new(SEED);
    let mut draws: Vec<f64> = (0..RESAMPLES)
        .map(|_| {
            let (mut sum, mut n) = (0.0, 0);
            for _ in 0..groups.len() {
                let g = &groups[rng.below(groups.len())];
                sum += g.iter().sum::<f64>();
                n += g.len();
            }
            ratio(sum, n)
        })
        .collect();
    draws.sort_by(f64::total_cmp);
    let at = |q: f64| draws[((q * RESAMPLES as f64) as usize).min(RESAMPLES - 1)];
    let margin = (1.0 + MARGIN).ln();
    let mut furthest_behind: Vec<(String, f64)> = by_problem
        .iter()
        .map(|(name, g)| (name.to_string(), g.iter().sum::<f64>() / g.len() as f64))
        .filter(|&(_, mean)| mean < -margin)
        .collect();
    furthest_behind.sort_by(|a, b| a.1.total_cmp(&b.1));
    furthest_behind.truncate(NAMED);
    Some(Paired {
        planner: planner.to_string(),
        against: against.to_string(),
        ratio: ratio(logs.iter().sum(), logs.len()),
        low: at(0.025),
        high: at(0.975),
        problems: groups.len(),
        runs: logs.len(),
        ahead: logs.iter().filter(|&&d| d > margin).count(),
        behind: logs.iter().filter(|&&d| d < -margin).count(),
        furthest_behind: furthest_behind
            .into_iter()
            .map(|(name, mean)| (name, mean.exp()))
            .collect(),
    })
}

/// The line under a comparison's table that gives `pairs`; none without
/// any.
pub(crate) fn line(pairs: &[Paired]) -> Option<String> {
    let first = pairs.first()?;
    let over = if first.runs == first.problems {
        format!("{} problems", first.problems)
    } else {
        format!("{} problems, {} runs", first.problems, first.runs)
    };
    let parts: Vec<String> = pairs
        .iter()
        .map(|p| {
            format!(
                "{} / {} {:.3}x [{:.3}, {:.3}], ahead on {}, behind on {}",
                p.planner, p.against, p.ratio, p.low, p.high, p.ahead, p.behind
            )
        })
        .collect();
    let mut text = format!(
        "paired over {over} (95 % interval, bootstrap over problems; runs ahead or behind by more than {:.1} %): {}",
        100.0 * MARGIN,
        parts.join("; ")
    );
    let behind: Vec<String> = pairs
        .iter()
        .filter(|p| !p.furthest_behind.is_empty())
        .map(|p| {
            let named: Vec<String> = p
                .furthest_behind
                .iter()
                .map(|(name, r)| format!("{} {r:.3}x", short(name)))
                .collect();
            format!("{} / {} {}", p.planner, p.against, named.join(", "))
        })
        .collect();
    if !behind.is_empty() {
        write!(text, "\nfurthest behind: {}", behind.join("; ")).expect("a String takes writes");
    }
    Some(text)
}

/// A problem's name up to its first `_` (`L2/34_ConvTranspose3d_…` →
/// `L2/34`), the whole name when it has none.
fn short(name: &str) -> &str {
    name.split('_').next().unwrap_or(name)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::plan::PlannerResult;

    fn row(problem: &str, trained: f64, greedy: f64) -> ProblemRow {
        let result = |best| PlannerResult {
            best,
            evaluations: 8.0,
            path: Vec::new(),
            considered: Vec::new(),
        };
        ProblemRow {
            problem: problem.into(),
            pass: None,
            programs: 10,
            exhaustive: trained.max(greedy),
            exhaustive_without: None,
            planners: [
                ("trained".to_string(), result(trained)),
                ("greedy".to_string(), result(greedy)),
            ]
            .into_iter()
            .collect(),
        }
    }

    #[test]
    fn a_uniform_gain_has_no_spread_and_counts_every_run_ahead() {
        let rows: Vec<ProblemRow> = (0..20)
            .map(|k| row(&format!("p{k}"), 1.1 * (1.0 + k as f64), 1.0 + k as f64))
            .collect();
        let p = paired(&rows, "trained", "greedy").unwrap();
        for x in [p.ratio, p.low, p.high] {
            assert!((x - 1.1).abs() < 1e-9, "{p:?}");
        }
        assert_eq!((p.problems, p.runs, p.ahead, p.behind), (20, 20, 20, 0));
        // Equal planners: ratio 1, nothing ahead or behind.
        let p = paired(&rows, "greedy", "greedy").unwrap();
        assert_eq!(
            (p.ratio, p.low, p.high, p.ahead, p.behind),
            (1.0, 1.0, 1.0, 0, 0)
        );
    }

    #[test]
    fn the_interval_holds_the_ratio_and_widens_with_the_spread() {
        // Ahead on half the problems by 20 %, behind on the other half by
        // 10 %: the ratio is near 1.045, and the interval is wide enough
        // to hold 1.
        let rows: Vec<ProblemRow> = (0..30)
            .map(|k| {
                let t = if k % 2 == 0 { 1.2 } else { 0.9 };
                row(&format!("p{k}"), 2.0 * t, 2.0)
            })
            .collect();
        let p = paired(&rows, "trained", "greedy").unwrap();
        let expected = ((1.2f64.ln() + 0.9f64.ln()) / 2.0).exp();
        assert!((p.ratio - expected).abs() < 1e-9, "{p:?}");
        assert!(p.low < 1.0 && 1.0 < p.ratio && p.ratio < p.high, "{p:?}");
        assert_eq!((p.ahead, p.behind), (15, 15));
        // Speedups below 1 count as 1: a planner slower than eager is at
        // eager.
        let rows = vec![row("a", 0.5, 1.0), row("b", 2.0, 1.0)];
        let p = paired(&rows, "trained", "greedy").unwrap();
        assert!((p.ratio - 2f64.sqrt()).abs() < 1e-9, "{p:?}");
        assert_eq!((p.ahead, p.behind), (1, 0));
        assert!(p.furthest_behind.is_empty(), "{p:?}");
    }

    #[test]
    fn the_problems_furthest_behind_are_named_worst_first() {
        // Behind on five problems by 1 % to 30 %, level on one, ahead on
        // one: the three worst are named, each by its runs' mean.
        let mut rows: Vec<ProblemRow> = [0.7, 0.99, 0.8, 0.9, 0.95, 1.0, 1.2]
            .iter()
            .enumerate()
            .map(|(k, &t)| row(&format!("L2/{k}_Conv_ReLU"), 2.0 * t, 2.0))
            .collect();
        // A second run of L2/0: its ratio is its runs' geometric mean,
        // which puts it second.
        rows.push(row("L2/0_Conv_ReLU", 2.0 * 0.95, 2.0));
        let p = paired(&rows, "trained", "greedy").unwrap();
        let named: Vec<&str> = p.furthest_behind.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(
            named,
            ["L2/2_Conv_ReLU", "L2/0_Conv_ReLU", "L2/3_Conv_ReLU"]
        );
        let second = (0.7f64 * 0.95).sqrt();
        assert!((p.furthest_behind[1].1 - second).abs() < 1e-9, "{p:?}");
        let text = line(&[p]).unwrap();
        assert!(
            text.ends_with(&format!(
                "\nfurthest behind: trained / greedy L2/2 0.800x, L2/0 {second:.3}x, L2/3 0.900x"
            )),
            "{text}"
        );
    }

    #[test]
    fn the_bootstrap_draws_whole_problems() {
        // Two runs of one problem (two pooled passes) differ, but every
        // resample draws the problem whole: no spread.
        let rows = vec![row("p", 1.3, 1.0), row("p", 0.95, 1.0)];
        let p = paired(&rows, "trained", "greedy").unwrap();
        assert_eq!((p.problems, p.runs), (1, 2));
        assert_eq!(p.low, p.ratio);
        assert_eq!(p.high, p.ratio);
        let text = line(&[p]).unwrap();
        assert!(
            text.starts_with("paired over 1 problems, 2 runs (95 % interval")
                && text.contains("trained / greedy 1.140x [1.140, 1.140], ahead on 1, behind on 0"),
            "{text}"
        );
        // A planner missing from the rows: no pair with it.
        assert!(paired(&rows, "trained", "random").is_none());
        let found: Vec<(String, String)> = pairs(&rows)
            .into_iter()
            .map(|p| (p.planner, p.against))
            .collect();
        assert_eq!(found, [("trained".to_string(), "greedy".to_string())]);
        assert!(line(&[]).is_none());
    }
}

//! `mtmc compare`: the planners replayed on the held-out problems'
//! recorded tree, and the comparison table.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use mtmc_env::outcome::Status;
use mtmc_planner::space::{ACTIONS, Move};
use mtmc_planner::store::Store;
use mtmc_planner::tree::{self, TreeEnv, TreeProblem};

use super::choice::{Choice, Considered, Loaded};
use super::enumerate::kinds_mask;
use super::rows::{PlannerResult, ProblemRow};
use super::split::{Split, levels_words, of_levels};
use super::train::compiled_only_warning;
use crate::paired::Paired;

/// One planner's figures in `compare`.
#[derive(Debug, serde::Serialize)]
pub(crate) struct Row {
    planner: String,
    problems: usize,
    geomean_speedup: f64,
    fast_1: f64,
    evaluations: f64,
    of_exhaustive: f64,
    /// Share of episodes whose best came within [`NEAR`] of the
    /// problem's exhaustive best.
    reached_90: f64,
    /// Evaluations until then, on average over those episodes.
    evaluations_to_90: f64,
}

/// How close to the exhaustive best counts as reaching it in `compare`
/// (the "90 % of the exhaustive search's best").
pub(crate) const NEAR: f64 = 0.9;

/// What `mtmc compare` was asked to do.
pub struct CompareRequest<'a> {
    /// The store.
    pub store: &'a Path,
    /// A checkpoint to compare, if any.
    pub checkpoint: Option<&'a Path>,
    /// Evaluations per problem.
    pub budget: usize,
    /// Which problems.
    pub split: Split,
    /// Only these levels' problems (every level when empty).
    pub levels: &'a [u32],
    /// Replay on the programs this planner's episodes reached alone.
    pub recorded_by: Option<&'a str>,
    /// Where the JSON goes, if anywhere.
    pub json: Option<&'a Path>,
    /// Let the trained policy's STOP end an episode early.
    pub policy_stops: bool,
    /// Action kinds (`KINDS`) left out of every planner's moves, and of
    /// the moves whose programs the exhaustive row counts: an ablation.
    pub without: &'a [String],
    /// The GPU whose outcomes to read (`--gpu NAME`; none: the store's).
    pub gpu: Option<&'a str>,
}

/// Replays each planner on the held-out problems' recorded tree with
/// `budget` evaluations (exhaustive: every recorded program), and prints
/// the comparison table.
pub fn compare(out: &mut dyn std::io::Write, req: CompareRequest<'_>) -> Result<()> {
    let CompareRequest {
        store: store_path,
        checkpoint,
        budget,
        split,
        levels,
        recorded_by,
        json,
        policy_stops,
        without,
        gpu,
    } = req;
    let left_out = kinds_mask("--without", without)?;
    let store = Store::open_to_read(store_path)?;
    let gpu = store.gpu_for(gpu)?;
    let problems: Vec<TreeProblem> = tree::load_by(&store, recorded_by, &|n| split.knows(n))?
        .into_iter()
        .filter(|p| split.keeps(&p.problem.name) && of_levels(&p.problem.name, levels))
        .collect();
    if problems.is_empty() {
        match recorded_by {
            Some(by) => {
                let names = store.problems()?.into_iter().map(|p| p.name);
                let present = planners_in(
                    &store,
                    names.filter(|n| split.keeps(n) && of_levels(n, levels)),
                )?;
                let present: Vec<String> = present.into_keys().collect();
                bail!(
                    "`{}` has no problem in this split{} with episodes of planner `{by}` (planners with episodes here: {}): name one of those, or leave out --recorded-by",
                    store_path.display(),
                    levels_words(levels),
                    if present.is_empty() {
                        "none".to_string()
                    } else {
                        present.join(", ")
                    }
                )
            }
            None => bail!(
                "`{}` has no recorded problem in this split{}: run `mtmc explore` on them first",
                store_path.display(),
                levels_words(levels)
            ),
        }
    }
    if recorded_by.is_none() {
        // Replay is fair only on trees no compared planner helped build:
        // a planner finds its own recorded path whole.
        let mut others = planners_in(&store, problems.iter().map(|p| p.problem.name.clone()))?;
        others.remove("exhaustive");
        if !others.is_empty() {
            let list: Vec<String> = others
                .iter()
                .map(|(by, n)| format!("{by} on {n}"))
                .collect();
            writeln!(
                out,
                "warning: these trees also hold episodes of other planners than exhaustive ({}); replay favours a planner on the trees its own episodes built: pass --recorded-by exhaustive to compare on the exhaustive episodes' programs only",
                list.join(", ")
            )?;
        }
    }
    if let Some(line) = compiled_only_warning(
        &problems,
        "this table measures no speed",
        "replay counts none of them as faster than eager",
    ) {
        writeln!(out, "{line}")?;
    }
    let problems = Arc::new(problems);
    let exhaustive: Vec<f64> = problems.iter().map(TreeProblem::best).collect();
    let planners = compared(checkpoint);
    let mut rows = Vec::new();
    let mut per_problem = problem_rows(&problems);
    for (name, choice) in &planners {
        // The random planner: the mean over 10 seeds.
        let seeds = if matches!(choice, Choice::Random) {
            10
        } else {
            1
        };
        let mut bests = vec![0.0f64; problems.len()];
        let mut used = vec![0usize; problems.len()];
        let mut paths = vec![Vec::new(); problems.len()];
        let mut weighed = vec![Vec::new(); problems.len()];
        // Episodes whose best reached 90 % of the exhaustive best, and the
        // evaluations that took.
        let (mut near, mut to_near) = (0usize, 0usize);
        for seed in 0..seeds {
            let mut loaded = choice.load(seed)?.policy_stops(policy_stops);
            for (k, b) in bests.iter_mut().enumerate() {
                let r = replay(
                    &mut loaded,
                    &problems,
                    k,
                    budget,
                    NEAR * exhaustive[k],
                    left_out,
                );
                *b += r.best.max(1.0).ln() / seeds as f64;
                used[k] += r.evaluations;
                if seed == 0 {
                    paths[k] = r.path;
                    weighed[k] = r.considered;
                }
                if let Some(r) = r.reached {
                    near += 1;
                    to_near += r;
                }
            }
        }
        let bests: Vec<f64> = bests.iter().map(|l| l.exp()).collect();
        for (((r, path), considered), (&best, &n)) in per_problem
            .iter_mut()
            .zip(paths)
            .zip(weighed)
            .zip(bests.iter().zip(&used))
        {
            r.planners.insert(
                name.clone(),
                PlannerResult {
                    best,
                    evaluations: n as f64 / seeds as f64,
                    path,
                    considered,
                },
            );
        }
        let evals: usize = used.iter().sum();
        let episodes = seeds as usize * problems.len();
        rows.push(row(
            name,
            &bests,
            evals as f64 / episodes as f64,
            &exhaustive,
            (
                near as f64 / episodes as f64,
                to_near as f64 / near.max(1) as f64,
            ),
        ));
    }
    let ablated = left_out.iter().any(|&l| l);
    // What the moves not left out reach on each problem: its best and how
    // many programs.
    let found: Vec<(f64, usize)> = if ablated {
        problems.iter().map(|p| p.best_without(&left_out)).collect()
    } else {
        Vec::new()
    };
    for (r, (best, _)) in per_problem.iter_mut().zip(&found) {
        r.exhaustive_without = Some(best.max(1.0));
    }
    rows.push(exhaustive_row(
        &problems,
        ablated.then_some(Ablation {
            left_out,
            found: &found,
        }),
    )?);
    writeln!(
        out,
        "{} problem(s) ({:?} split{}), budget {budget} evaluations (exhaustive: {}{}); outcomes replayed from {}{}{}",
        problems.len(),
        split,
        levels_words(levels),
        if ablated {
            "every recorded program the other moves reach"
        } else {
            "every recorded program"
        },
        stopping(checkpoint.is_some(), policy_stops),
        store_path.display(),
        gpu.as_ref()
            .map_or(String::new(), |g| format!(", judged on the {g}")),
        recorded_by.map_or(String::new(), |by| format!(
            " (the programs episodes of {by} reached)"
        ))
    )?;
    if ablated {
        writeln!(
            out,
            "without moves of kind {} (every planner, exhaustive too); `of exhaustive` and `reached 90%` still measure against the best of every recorded program",
            without.join(", ")
        )?;
    }
    let pairs = crate::paired::pairs(&per_problem);
    print_table(out, &rows, &pairs, true)?;
    if ablated {
        writeln!(out, "{}", ablation_losses(&per_problem))?;
    }
    if let Some(path) = json {
        let doc = serde_json::json!({
            "split": format!("{split:?}").to_lowercase(),
            "levels": levels,
            "budget": budget,
            "store": store_path.display().to_string(),
            "gpu": gpu,
            "recorded_by": recorded_by,
            "policy_stops": policy_stops,
            "without": without,
            "planners": rows,
            "paired": pairs,
            "problems": per_problem,
        });
        std::fs::write(path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    Ok(())
}

/// How the trained planner's episodes end, for a comparison's heading.
pub(crate) fn stopping(trained: bool, policy_stops: bool) -> &'static str {
    match (trained, policy_stops) {
        (false, _) => "",
        (true, false) => "; trained: its STOP overruled until the budget is spent",
        (true, true) => "; trained: its STOP ends the episode",
    }
}

/// The planners a comparison runs, by name: the checkpoint's (when one is
/// given), random, greedy.
pub(crate) fn compared(checkpoint: Option<&Path>) -> Vec<(String, Choice)> {
    let mut planners: Vec<(String, Choice)> = Vec::new();
    if let Some(dir) = checkpoint {
        planners.push(("trained".into(), Choice::Trained(dir.to_path_buf())));
    }
    planners.push(("random".into(), Choice::Random));
    planners.push(("greedy".into(), Choice::Greedy));
    planners
}

/// Each problem's row of the comparison's JSON, with its recorded tree's
/// best and no planner's result yet.
pub(crate) fn problem_rows(problems: &[TreeProblem]) -> Vec<ProblemRow> {
    problems
        .iter()
        .map(|p| ProblemRow {
            problem: p.problem.name.clone(),
            pass: None,
            programs: p.evals.len(),
            exhaustive: p.best().max(1.0),
            exhaustive_without: None,
            planners: Default::default(),
        })
        .collect()
}

/// Moves left out of a replay, and what the others reach on each problem
/// ([`TreeProblem::best_without`]: its best and how many programs).
pub(crate) struct Ablation<'a> {
    left_out: [bool; ACTIONS],
    found: &'a [(f64, usize)],
}

/// The line under an ablation's table: the problems (up to three) whose
/// best the moves left out were most needed for, each the best the other
/// moves reach against every recorded program's best.
fn ablation_losses(rows: &[ProblemRow]) -> String {
    let mut lost: Vec<(&str, f64)> = rows
        .iter()
        .filter_map(|r| Some((r.problem.as_str(), r.exhaustive_without? / r.exhaustive)))
        .filter(|&(_, ratio)| ratio < 0.995)
        .collect();
    let n = lost.len();
    lost.sort_by(|a, b| a.1.total_cmp(&b.1));
    if lost.is_empty() {
        return "exhaustive without them: every problem's best is still reached (within 0.5 %)"
            .into();
    }
    let named: Vec<String> = lost
        .iter()
        .take(3)
        .map(|(p, ratio)| format!("{p} {ratio:.3}x"))
        .collect();
    format!(
        "exhaustive without them: below the problem's best on {n} of {} problems, most on {}",
        rows.len(),
        named.join(", ")
    )
}

/// The exhaustive search's row: every recorded program of each problem.
/// Its best is the reference, reached by definition; how soon is the
/// enumeration's order, replayed over every recorded program. With moves
/// `left_out` (an ablation) the row is the recorded programs the other
/// moves reach ([`TreeProblem::best_without`]): their best and their
/// number, against the best of every recorded program; how soon, the
/// enumeration's walk without those moves.
pub(crate) fn exhaustive_row(
    problems: &Arc<Vec<TreeProblem>>,
    ablation: Option<Ablation<'_>>,
) -> Result<Row> {
    let exhaustive: Vec<f64> = problems.iter().map(TreeProblem::best).collect();
    let mut walk = Choice::Exhaustive.load(0)?;
    let most = problems.iter().map(|p| p.evals.len()).max().unwrap_or(0);
    let walked: Vec<Replayed> = (0..problems.len())
        .map(|k| {
            replay(
                &mut walk,
                problems,
                k,
                most,
                NEAR * exhaustive[k],
                ablation.as_ref().map_or([false; ACTIONS], |a| a.left_out),
            )
        })
        .collect();
    let n = problems.len().max(1) as f64;
    let (bests, evaluations, near) = match ablation {
        None => (
            exhaustive.clone(),
            problems.iter().map(|p| p.evals.len()).sum::<usize>(),
            1.0,
        ),
        Some(Ablation { found, .. }) => {
            let near = found
                .iter()
                .zip(&exhaustive)
                .filter(|((b, _), e)| *b >= NEAR * **e)
                .count();
            (
                found.iter().map(|f| f.0).collect(),
                found.iter().map(|f| f.1).sum(),
                near as f64 / n,
            )
        }
    };
    let to_near: usize = walked
        .iter()
        .map(|r| r.reached.unwrap_or(r.evaluations))
        .sum();
    Ok(row(
        "exhaustive",
        &bests.iter().map(|b| b.max(1.0)).collect::<Vec<_>>(),
        evaluations as f64 / n,
        &exhaustive,
        (near, to_near as f64 / n),
    ))
}

/// Prints the comparison's table, one row per planner, then its ratios
/// ([`ratios`]) and the paired comparisons `pairs`
/// ([`crate::paired`]); `bound`: whether the exhaustive row was
/// replayed on the same outcomes as the others, so that it bounds them
/// (not so in a live comparison).
pub(crate) fn print_table(
    out: &mut dyn std::io::Write,
    rows: &[Row],
    pairs: &[Paired],
    bound: bool,
) -> Result<()> {
    writeln!(
        out,
        "{:<11} {:>9} {:>8} {:>12} {:>14} {:>12} {:>13}",
        "planner",
        "geomean",
        "fast_1",
        "evaluations",
        "of exhaustive",
        "reached 90%",
        "evals to 90%"
    )?;
    for r in rows {
        writeln!(
            out,
            "{:<11} {:>8.3}x {:>7.1}% {:>12.1} {:>13.1}% {:>11.1}% {:>13.1}",
            r.planner,
            r.geomean_speedup,
            100.0 * r.fast_1,
            r.evaluations,
            100.0 * r.of_exhaustive,
            100.0 * r.reached_90,
            r.evaluations_to_90
        )?;
    }
    writeln!(
        out,
        "reached 90%: episodes whose best came within 90 % of the problem's exhaustive best; evals to 90%: the evaluations that took, on average over those"
    )?;
    if let Some(line) = ratios(rows, bound) {
        writeln!(out, "{line}")?;
    }
    if let Some(line) = crate::paired::line(pairs) {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// The geomean ratios a comparison is read by: trained against random and
/// greedy, and (with `bound`) the exhaustive best against random, which
/// bounds what any planner can gain over random on the replayed programs.
/// `None` without a random row or with nothing to set against it.
fn ratios(rows: &[Row], bound: bool) -> Option<String> {
    let geomean = |name: &str| {
        rows.iter()
            .find(|r| r.planner == name)
            .map(|r| r.geomean_speedup)
            .filter(|g| *g > 0.0)
    };
    let random = geomean("random")?;
    let mut parts = Vec::new();
    if let Some(trained) = geomean("trained") {
        let mut part = format!("trained / random {:.3}x", trained / random);
        if let Some(greedy) = geomean("greedy") {
            part += &format!(", trained / greedy {:.3}x", trained / greedy);
        }
        parts.push(part);
    }
    if let Some(exhaustive) = geomean("exhaustive").filter(|_| bound) {
        parts.push(format!(
            "exhaustive / random {:.3}x (the best recorded program against random: no planner gains more over random on these programs)",
            exhaustive / random
        ));
    }
    (!parts.is_empty()).then(|| format!("ratios: {}", parts.join("; ")))
}

/// The planners with episodes of the problems `names`, each with how many
/// of those problems it has episodes of.
fn planners_in(
    store: &Store,
    names: impl Iterator<Item = String>,
) -> Result<std::collections::BTreeMap<String, usize>> {
    let mut count = std::collections::BTreeMap::new();
    for name in names {
        for by in store.planners_of(&name)? {
            *count.entry(by).or_default() += 1;
        }
    }
    Ok(count)
}

/// The geometric mean of speedups, those below 1 counted as 1 (the
/// library program is always there to fall back on).
pub(crate) fn geomean(speedups: &[f64]) -> f64 {
    let n = speedups.len().max(1) as f64;
    (speedups.iter().map(|b| b.max(1.0).ln()).sum::<f64>() / n).exp()
}

/// A planner's row: its bests per problem, mean evaluations, and
/// `(reached_90, evaluations_to_90)`.
pub(crate) fn row(
    name: &str,
    bests: &[f64],
    evaluations: f64,
    exhaustive: &[f64],
    (reached_90, evaluations_to_90): (f64, f64),
) -> Row {
    let n = bests.len().max(1) as f64;
    Row {
        planner: name.into(),
        problems: bests.len(),
        geomean_speedup: geomean(bests),
        fast_1: bests.iter().filter(|&&b| b > 1.0).count() as f64 / n,
        evaluations,
        of_exhaustive: geomean(bests) / geomean(exhaustive),
        reached_90,
        evaluations_to_90,
    }
}

/// One episode of `loaded` on recorded problem `k`.
struct Replayed {
    /// Its best speedup.
    best: f64,
    /// The evaluations it used.
    evaluations: usize,
    /// After how many of them its best first reached `near` (none if it
    /// never did).
    reached: Option<usize>,
    /// Its steps, each `move -> program: outcome`.
    path: Vec<String>,
    /// For each of them, what the trained planner weighed (empty for the
    /// other planners).
    considered: Vec<String>,
}

/// Replays one episode of `loaded` on recorded problem `k`, the moves
/// `left_out` never legal.
fn replay(
    loaded: &mut Loaded,
    problems: &Arc<Vec<TreeProblem>>,
    k: usize,
    budget: usize,
    near: f64,
    left_out: [bool; ACTIONS],
) -> Replayed {
    use mtmc_planner::tree::Environment;
    let mut env = TreeEnv::new(problems.clone(), budget, 0).without(left_out);
    env.start(k);
    let mut reached = None;
    let mut path = Vec::new();
    let mut considered = Vec::new();
    loop {
        let obs = env.state();
        let m = loaded.choose(
            &env.problem().problem,
            env.episode(),
            &obs.features,
            &obs.mask,
        );
        let weighed = loaded.considered().map(Considered::text);
        let m = if obs.mask[m.index()] { m } else { Move::Stop };
        let target = env.episode().target(m).map(|c| c.key());
        let done = env.step(m.index()).done;
        if let (Some(key), Some(d)) = (target, &env.episode().last) {
            let outcome = match (d.status, d.speedup_eager) {
                (Status::Correct, Some(s)) => format!("{s:.3}x"),
                (status, _) => status.name().replace('_', " "),
            };
            path.push(format!("{} -> {key}: {outcome}", m.label()));
            considered.extend(weighed);
        }
        if reached.is_none() && env.episode().best_speedup() >= near {
            reached = Some(env.episode().step);
        }
        if done {
            break;
        }
    }
    Replayed {
        best: env.episode().best_speedup(),
        evaluations: env.episode().step,
        reached,
        path,
        considered,
    }
}

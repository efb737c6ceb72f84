//! `--side-by-side`: each problem's best programs built again and judged
//! in rounds, once every planner has finished it, a line per problem in
//! `side_by_side.jsonl`.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{Context, Result, bail};
use mtmc_planner::store::Store;
use mtmc_planner::tree::TreeProblem;

use crate::interrupt::Interrupt;
use crate::optimize::ProblemJudge;
use crate::plan::{Choice, counted, judge_side_by_side, rebuild_best};

use super::folder::{Finished, build_id, file_name, json_lines};

/// One problem's best programs judged side by side after every planner
/// finished it (`--side-by-side`), a line of `side_by_side.jsonl`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct SideBySide {
    pub(super) problem: String,
    pub(super) rounds: usize,
    /// Per planner: its best program and the speedups of its judgings.
    pub(super) planners: BTreeMap<String, Judged>,
    /// The mtmc build that judged them ([`build_id`]).
    pub(super) build: String,
}

/// A planner's best program judged in the rounds of a [`SideBySide`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Judged {
    /// Its key (none when the episode had no correct program).
    pub(super) key: Option<String>,
    /// Its speedup against eager in each round (0: not correct then).
    pub(super) speedups: Vec<f64>,
}

impl Judged {
    /// The median of its speedups (none without any).
    pub(super) fn median(&self) -> Option<f64> {
        crate::bench_env::median(&self.speedups)
    }
}

/// The side-by-side judgings in `path`, by problem (none when it is not
/// there; a last line cut short by a kill is dropped).
pub(super) fn side_by_side(path: &Path) -> Result<BTreeMap<String, SideBySide>> {
    let (lines, _) = json_lines::<SideBySide>(path)?;
    Ok(lines.into_iter().map(|j| (j.problem.clone(), j)).collect())
}

/// Each planner's best program of a problem built again: the planner, and
/// the program's key and ModelNew (none when nothing was correct).
type Rebuilt = Vec<(String, Option<(String, String)>)>;

/// The file of a pass's side-by-side judgings.
pub(super) const SIDE_BY_SIDE: &str = "side_by_side.jsonl";

/// Judges side by side, in `rounds` rounds, the best programs of each
/// problem of `recorded` (`chosen`: their KernelBench problems) that every
/// planner of `planners` has finished in `done` and that `judged` lacks.
/// Each episode's best program is built again from its steps in the
/// folder's (or the reused episode's folder's) `trajectories.sqlite` and
/// written to `best/`; each problem's line is appended to
/// `side_by_side.jsonl` as soon as it is judged, so a kill loses at most
/// the problem in progress. A problem whose programs cannot be built again
/// (another build of the search or coder ran its episodes) is named and
/// left as it is.
#[allow(clippy::too_many_arguments)]
pub(super) fn judge_left(
    out: &mut dyn std::io::Write,
    out_dir: &Path,
    recorded: &[TreeProblem],
    chosen: &[&mtmc_actions::problem::Problem],
    problems: &crate::source::Problems,
    planners: &[(String, Choice)],
    done: &[Finished],
    rounds: usize,
    timeout: Duration,
    judged: &mut BTreeMap<String, SideBySide>,
    stop: Option<&Interrupt>,
) -> Result<Option<String>> {
    let by: BTreeMap<(&str, &str), &Finished> = done
        .iter()
        .map(|f| ((f.problem.as_str(), f.planner.as_str()), f))
        .collect();
    let todo: Vec<usize> = recorded
        .iter()
        .enumerate()
        .filter(|(_, p)| {
            let name = p.problem.name.as_str();
            !judged.contains_key(name)
                && planners
                    .iter()
                    .all(|(n, _)| by.contains_key(&(name, n.as_str())))
        })
        .map(|(k, _)| k)
        .collect();
    if todo.is_empty() {
        return Ok(None);
    }
    writeln!(
        out,
        "side by side: {} problem(s) whose best programs every planner has found, each judged in {rounds} round(s)",
        todo.len()
    )?;
    let graphs = problems.graphs(&todo.iter().map(|&k| chosen[k]).collect::<Vec<_>>())?;
    let mut judge = ProblemJudge::with_baselines(true, timeout, true, &["eager"], false);
    let requested = || stop.is_some_and(Interrupt::requested);
    let build = build_id()?;
    let best_dir = out_dir.join("best");
    std::fs::create_dir_all(&best_dir)
        .with_context(|| format!("cannot create `{}`", best_dir.display()))?;
    let path = out_dir.join(SIDE_BY_SIDE);
    let mut file = crate::files::open_to_append(&path)?;
    let bar = crate::fmt::progress_bar(todo.len() as u64);
    // Each folder's steps, opened once (a reused episode's are in its
    // pass's folder).
    let mut stores: BTreeMap<PathBuf, Store> = BTreeMap::new();
    for (i, (&k, traced)) in todo.iter().zip(&graphs).enumerate() {
        let name = &recorded[k].problem.name;
        if requested() {
            bar.finish_and_clear();
            return Ok(Some(format!(
                "before judging {name} side by side, {} problem(s) not judged so",
                todo.len() - i
            )));
        }
        bar.set_message(format!("{name}: side by side"));
        let built = (|| -> Result<Rebuilt> {
            let g = traced
                .graph
                .as_ref()
                .map_err(|e| anyhow::anyhow!("no graph ({e})"))?;
            let mut built = Vec::new();
            for (planner, _) in planners {
                let f = by[&(name.as_str(), planner.as_str())];
                let dir = f
                    .reused_from
                    .as_ref()
                    .map_or_else(|| out_dir.to_path_buf(), PathBuf::from);
                let store = match stores.entry(dir.clone()) {
                    std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
                    std::collections::btree_map::Entry::Vacant(e) => {
                        e.insert(Store::open_to_read(&dir.join("trajectories.sqlite"))?)
                    }
                };
                let episodes = store.finished_moves(name, planner)?;
                let tol = 1e-9 * f.best.abs().max(1.0);
                let Some((_, moves)) = episodes
                    .iter()
                    .rev()
                    .find(|(b, _)| (b - f.best).abs() <= tol)
                else {
                    bail!(
                        "`{}` holds no finished {planner} episode whose best is {:.4}x, the one `episodes.jsonl` names",
                        dir.join("trajectories.sqlite").display(),
                        f.best
                    );
                };
                built.push((
                    planner.clone(),
                    rebuild_best(chosen[k], g, &mut judge, moves)?,
                ));
            }
            Ok(built)
        })();
        let built = match built {
            Ok(b) => b,
            Err(e) => {
                bar.suspend(|| writeln!(out, "{name}: not judged side by side: {e:#}"))?;
                bar.inc(1);
                continue;
            }
        };
        let mut codes = Vec::new();
        for (planner, b) in &built {
            if let Some((_, code)) = b {
                let file = best_dir.join(format!("{}.{planner}.py", file_name(name)));
                std::fs::write(&file, code)
                    .with_context(|| format!("cannot write `{}`", file.display()))?;
                codes.push(code.clone());
            }
        }
        let speedups = judge_side_by_side(chosen[k], &mut judge, &codes, rounds);
        if requested() {
            // The signal reaches the workers too: these rounds may time
            // their end, not the programs.
            bar.finish_and_clear();
            return Ok(Some(format!(
                "judging {name} side by side (not kept){}",
                counted(todo.len() - i - 1, |n| format!(
                    ", {n} problem(s) after it not judged so"
                ))
            )));
        }
        let mut speedups = speedups?.into_iter();
        let line = SideBySide {
            problem: name.clone(),
            rounds,
            planners: built
                .into_iter()
                .map(|(planner, b)| {
                    let key = b.map(|(key, _)| key);
                    let speedups = if key.is_some() {
                        speedups.next().unwrap_or_default()
                    } else {
                        Vec::new()
                    };
                    (planner, Judged { key, speedups })
                })
                .collect(),
            build: build.clone(),
        };
        writeln!(file, "{}", serde_json::to_string(&line)?)
            .and_then(|_| file.flush())
            .with_context(|| format!("cannot write `{}`", path.display()))?;
        bar.suspend(|| {
            writeln!(
                out,
                "{name}: side by side, the median of {rounds} round(s): {}",
                line.planners
                    .iter()
                    .map(|(p, j)| match j.median() {
                        Some(m) => format!("{p} {m:.3}x"),
                        None => format!("{p} (nothing correct)"),
                    })
                    .collect::<Vec<_>>()
                    .join(", ")
            )
        })?;
        judged.insert(name.clone(), line);
        bar.inc(1);
    }
    bar.finish_and_clear();
    Ok(None)
}

//! `mtmc compare --live`: each planner searches every problem of the split
//! that the store's tree holds on this machine's GPU, with its programs
//! built and judged now, and the same table as the replay is printed from
//! what they found. The exhaustive row stays the recorded tree's:
//! enumerating every program again would cost the budget many times over.
//! The observations' knowledge-base priors are read from the same store,
//! as in training (not from the folder's own steps, which would start
//! empty).
//!
//! Everything lands in the output folder as it happens, so an interrupted
//! run loses at most the episode it was in and the same command resumes:
//! `settings.json` (what was asked; a rerun with other settings is
//! refused), `episodes.jsonl` (one line per finished episode),
//! `trajectories.sqlite` (every step), `logs/` (each episode's steps as
//! text), `compare.json` (the table and each problem's results) and,
//! with `--side-by-side`, `side_by_side.jsonl` (each problem's best
//! programs judged again in rounds, one line per problem) and `best/`
//! (those programs' ModelNew files).

use std::collections::{BTreeMap, BTreeSet};
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use mtmc_planner::store::{RECORDED_H100, Store};
use mtmc_planner::tree::{self, TreeProblem};

use crate::interrupt::Interrupted;
use crate::optimize::ProblemJudge;
use crate::plan::{
    NEAR, PlanSettings, PlannerResult, Split, compared, counted, exhaustive_row, geomean,
    levels_words, of_levels, plan_problem, print_table, problem_rows, row, stopping,
};

mod folder;
mod passes;
mod side_by_side;

use folder::{
    Episodes, Finished, Settings, build_id, builds_warning, file_name, finished, inputs_sha256,
};
use passes::{Pass, check_reusable, pass_settings, pooled_passes, reuse_baselines};
use side_by_side::{SIDE_BY_SIDE, judge_left, side_by_side};

/// What `mtmc compare --live` was asked to do.
pub struct LiveRequest<'a> {
    /// The stop a signal asks for, read between rounds of judging (never
    /// set with `table_only`): the binary's [`Interrupt::catch`], or an
    /// [`Interrupt::new`] a caller sets itself.
    pub stop: crate::interrupt::Interrupt,
    /// `--kernelbench`.
    pub kernelbench: Option<&'a Path>,
    /// The store whose recorded tree chooses the problems and gives the
    /// exhaustive best.
    pub store: &'a Path,
    /// A checkpoint to compare, if any.
    pub checkpoint: Option<&'a Path>,
    /// Evaluations per episode.
    pub budget: usize,
    /// Which problems.
    pub split: Split,
    /// Only these levels' problems (every level when empty).
    pub levels: &'a [u32],
    /// Where everything is written.
    pub out_dir: &'a Path,
    /// Also write the JSON here.
    pub json: Option<&'a Path>,
    /// Limit per candidate.
    pub timeout: Duration,
    /// Seed (the random planner's episode on the k-th problem uses
    /// `seed + k`).
    pub seed: u64,
    /// Let the trained policy's STOP end an episode early.
    pub policy_stops: bool,
    /// Folders of earlier passes of the same comparison whose finished
    /// episodes the table pools with this one's.
    pub pool: &'a [PathBuf],
    /// Print the table of the episodes already finished and run none;
    /// nothing in `out_dir` but `compare.json` is written.
    pub table_only: bool,
    /// An earlier pass's folder whose random and greedy episodes this one
    /// takes ([`reuse_baselines`]).
    pub reuse_baselines: Option<&'a Path>,
    /// Rounds in which each problem's best programs are judged again side
    /// by side once every planner has finished it (0: none).
    pub side_by_side: usize,
}

/// Runs the live comparison and prints its table.
pub fn compare_live(out: &mut dyn std::io::Write, req: LiveRequest<'_>) -> Result<()> {
    // Checked here, not by the parser: its default must not stop a
    // comparison that is not live.
    if let Some(why) = crate::files::out_dir_refused(req.out_dir) {
        bail!(why);
    }
    let store = Store::open_to_read(req.store)?;
    let in_split: Vec<TreeProblem> = tree::load(&store, &|n| req.split.knows(n))?
        .into_iter()
        .filter(|p| req.split.keeps(&p.problem.name))
        .collect();
    let of = |levels: &[u32]| -> Vec<TreeProblem> {
        in_split
            .iter()
            .filter(|p| of_levels(&p.problem.name, levels))
            .cloned()
            .collect()
    };
    let recorded = of(req.levels);
    if recorded.is_empty() {
        bail!(
            "`{}` has no recorded problem in this split{}: the live comparison runs on the problems of a recorded tree, whose exhaustive best is the reference (record one with `mtmc explore --planner exhaustive`, or pass --trajectories {RECORDED_H100}, the tree recorded on an H100)",
            req.store.display(),
            levels_words(req.levels)
        );
    }
    let problems = crate::source::Problems::load(req.kernelbench)?;
    let chosen = recorded
        .iter()
        .map(|p| problems.find(&p.problem.name))
        .collect::<Result<Vec<_>>>()
        .context("a recorded problem is not among the KernelBench problems: pass the --kernelbench the tree was recorded from")?;
    if !req.table_only {
        crate::source::require_code("compare --live", &chosen)?;
    }
    let settings_path = req.out_dir.join("settings.json");
    if req.table_only && !settings_path.exists() {
        bail!(
            "`{}` holds no live comparison (no settings.json): --table-only prints what a pass already found; drop it to start one, or pass the --out a pass wrote",
            req.out_dir.display()
        );
    }
    // The settings of the pass in the folder, when there is one: read once,
    // for --table-only's `timed` and the check that this run resumes it.
    let earlier = if settings_path.exists() {
        Some(pass_settings(req.out_dir, "--out")?)
    } else {
        None
    };
    // Whether this run times its episodes: --table-only runs none, and
    // reads the pass as it was run, without asking the driver.
    let (timed, gpus) = if let (true, Some((before, _))) = (req.table_only, &earlier) {
        (before.timed, None)
    } else {
        let gpus = crate::plan::Gpus::probe();
        (gpus.any(), Some(gpus))
    };

    let settings = Settings {
        trajectories: req.store.display().to_string(),
        budget: req.budget,
        split: format!("{:?}", req.split).to_lowercase(),
        levels: req.levels.to_vec(),
        checkpoint: req.checkpoint.map(|c| c.display().to_string()),
        seed: req.seed,
        policy_stops: req.policy_stops,
        rejudge: true,
        timed,
        inputs: Some(inputs_sha256(&recorded, req.checkpoint)?),
        tree: Some(inputs_sha256(&recorded, None)?),
    };
    // Earlier passes are checked before anything is written.
    let pooled = pooled_passes(req.out_dir, req.pool, &settings, &|levels| {
        inputs_sha256(&of(levels), req.checkpoint)
    })?;
    if let Some(from) = req.reuse_baselines {
        check_reusable(from, &settings)?;
    }
    std::fs::create_dir_all(req.out_dir)
        .with_context(|| format!("cannot create `{}`", req.out_dir.display()))?;
    if let Some((before, text)) = &earlier {
        if before.timed && !settings.timed {
            bail!(
                "`{}` holds a pass run and timed on a GPU, and this machine has none: resume it where there is one, or print what it found with --table-only",
                req.out_dir.display()
            );
        }
        if !before.timed && settings.timed {
            bail!(
                "`{}` holds a pass compiled only (run where no GPU was found; every speedup 0): pass another --out to time the episodes on this GPU",
                req.out_dir.display()
            );
        }
        if !before.same_as(&settings) {
            bail!(
                "`{}` holds a live comparison with other settings ({}; this run's: {}); ask for the same to resume it, or pass another --out",
                req.out_dir.display(),
                text.trim(),
                serde_json::to_string(&settings)?
            );
        }
    } else {
        std::fs::write(&settings_path, serde_json::to_string(&settings)? + "\n")
            .with_context(|| format!("cannot write `{}`", settings_path.display()))?;
    }
    let episodes_path = req.out_dir.join("episodes.jsonl");
    let (mut done, cut) = finished(&episodes_path)?;
    // Rewrite the file when a kill cut its last line short, so that the
    // next line starts on a line of its own.
    if cut && !req.table_only {
        let text: String = done
            .iter()
            .map(|f| serde_json::to_string(f).map(|l| l + "\n"))
            .collect::<serde_json::Result<_>>()?;
        std::fs::write(&episodes_path, text)
            .with_context(|| format!("cannot write `{}`", episodes_path.display()))?;
    }
    let logs = req.out_dir.join("logs");
    if !req.table_only {
        std::fs::create_dir_all(&logs)
            .with_context(|| format!("cannot create `{}`", logs.display()))?;
    }

    let planners = compared(req.checkpoint);
    for (_, choice) in &planners {
        // A checkpoint that cannot be loaded is named before any GPU time.
        choice.load(req.seed)?;
    }

    // This build's id ([`build_id`] reads and hashes the executable): for
    // the episodes reused and those run here.
    let mut this_build = None;
    if let Some(from) = req.reuse_baselines {
        let names: Vec<&str> = recorded.iter().map(|p| p.problem.name.as_str()).collect();
        let build = this_build.insert(build_id()?);
        let taken = reuse_baselines(out, from, req.out_dir, &names, &done, build)?;
        let mut lines = Episodes::open(&episodes_path)?;
        for f in taken {
            lines.append(&f)?;
            done.push(f);
        }
    }
    let have: BTreeSet<(String, String)> = done
        .iter()
        .map(|f| (f.problem.clone(), f.planner.clone()))
        .collect();
    // Each problem's planners in turn, starting one later on each problem,
    // so that none is always the first to run after a new problem's setup.
    let mut work = Vec::new();
    for (k, p) in recorded.iter().enumerate() {
        for i in 0..planners.len() {
            let j = (k + i) % planners.len();
            if !have.contains(&(p.problem.name.clone(), planners[j].0.clone())) {
                work.push((k, j));
            }
        }
    }
    let what = format!(
        "{} problem(s) ({} split{}), planners {}, budget {}",
        recorded.len(),
        settings.split,
        levels_words(&settings.levels),
        planners
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>()
            .join(", "),
        req.budget,
    );
    // Ctrl-C stops between rounds of judging: the episode or the problem
    // judged side by side in flight is not kept, and the table covers what
    // was finished.
    let stop = req.stop.clone();
    let requested = || stop.requested();
    // Where a signal stopped the pass.
    let mut stopped: Option<String> = None;
    if req.table_only {
        writeln!(
            out,
            "compare --live --table-only: {what}; {} episode(s) in {}, {} not run",
            have.len(),
            episodes_path.display(),
            work.len(),
        )?;
        work.clear();
    } else {
        writeln!(
            out,
            "compare --live: {what}; {} episode(s) to run ({} already in {}); {}",
            work.len(),
            have.len(),
            episodes_path.display(),
            if work.is_empty() {
                "nothing to run".into()
            } else if timed {
                crate::cluster::judged_on()
            } else {
                "no GPU: compile only, nothing is run or timed (every speedup is 0)".into()
            }
        )?;
    }
    // The build that runs the episodes left, named in each one's line.
    let build = match this_build {
        _ if work.is_empty() => None,
        Some(b) => Some(b),
        None => Some(build_id()?),
    };

    if !work.is_empty() {
        let mut steps = Store::open(&req.out_dir.join("trajectories.sqlite"))?;
        // A pass resumed on another GPU would mix two GPUs' timings.
        if let Some(gpus) = &gpus {
            gpus.claim(out, &steps)?;
        }
        let mut judge = ProblemJudge::with_baselines(timed, req.timeout, true, &["eager"], false)
            .stopping_on(&stop);
        let needed: Vec<usize> = work
            .iter()
            .map(|w| w.0)
            .collect::<BTreeSet<_>>()
            .into_iter()
            .collect();
        let graphs: BTreeMap<usize, _> = needed
            .iter()
            .copied()
            .zip(problems.graphs(&needed.iter().map(|&k| chosen[k]).collect::<Vec<_>>())?)
            .collect();
        let mut lines = Episodes::open(&episodes_path)?;
        let plan = PlanSettings {
            budget: req.budget,
            near_roofline: 0.9,
            verbose: false,
            reuse: false,
            rejudge_changed: false,
            rejudge: true,
            knowledge: req.split,
        };
        let bar = crate::fmt::progress_bar(work.len() as u64);
        for (i, &(k, j)) in work.iter().enumerate() {
            let name = &recorded[k].problem.name;
            let (planner, choice) = &planners[j];
            if requested() {
                stopped = Some(format!(
                    "before {name}: {planner}, {} episode(s) not run",
                    work.len() - i
                ));
                break;
            }
            bar.set_message(format!("{name}: {planner}"));
            let g = match &graphs[&k].graph {
                Ok(g) => g,
                Err(e) => {
                    bar.suspend(|| writeln!(out, "{name}: no graph ({e}); skipped"))?;
                    bar.inc(1);
                    continue;
                }
            };
            let mut loaded = choice
                .load(req.seed.wrapping_add(k as u64))?
                .policy_stops(req.policy_stops);
            let mut log = Vec::new();
            let started = Instant::now();
            let r = plan_problem(
                &mut log,
                chosen[k],
                g,
                &mut judge,
                &mut loaded,
                &plan,
                Some(&mut steps),
                Some(&store),
                None,
                req.seed.wrapping_add(k as u64),
            );
            let seconds = started.elapsed().as_secs_f64();
            let log_path = logs.join(format!("{}.{planner}.txt", file_name(name)));
            if let Err(e) = &r {
                writeln!(log, "episode failed: {e:#}")?;
            }
            std::fs::write(&log_path, &log)
                .with_context(|| format!("cannot write `{}`", log_path.display()))?;
            match r {
                Ok(r) if r.interrupted => {
                    stopped = Some(format!(
                        "in {name}: {planner} (not kept: a rerun runs it again){}",
                        counted(work.len() - i - 1, |n| format!(
                            ", {n} episode(s) after it not run"
                        ))
                    ));
                    break;
                }
                Ok(r) => {
                    let f = Finished {
                        problem: name.clone(),
                        planner: planner.clone(),
                        best: r.best,
                        evaluations: r.evaluations,
                        bests: r.bests,
                        rejudged: r.rejudged,
                        seconds,
                        build: build.clone(),
                        reused_from: None,
                    };
                    lines.append(&f)?;
                    bar.suspend(|| {
                        writeln!(
                            out,
                            "{name}: {planner} {:.3}x in {} evaluation(s) ({seconds:.0} s)",
                            f.best, f.evaluations
                        )
                    })?;
                    done.push(f);
                }
                Err(e) => bar.suspend(|| {
                    writeln!(
                        out,
                        "{name}: {planner}: episode failed: {e:#} (see {}; a rerun tries it again)",
                        log_path.display()
                    )
                })?,
            }
            bar.inc(1);
        }
        bar.finish_and_clear();
    }

    let mut judged = side_by_side(&req.out_dir.join(SIDE_BY_SIDE))?;
    if req.side_by_side > 0 && !req.table_only && stopped.is_none() {
        if timed {
            stopped = judge_left(
                out,
                req.out_dir,
                &recorded,
                &chosen,
                &problems,
                &planners,
                &done,
                req.side_by_side,
                req.timeout,
                &mut judged,
                Some(&stop),
            )?;
        } else {
            writeln!(
                out,
                "side by side: no GPU here, nothing judged (the rounds time the programs; run them where there is one)"
            )?;
        }
    }

    // The table covers, in this pass and each pooled one, the problems
    // every planner finished: one entry per problem and pass.
    let mut passes = vec![Pass {
        dir: req.out_dir.to_path_buf(),
        levels: settings.levels.clone(),
        episodes: done,
        judged,
    }];
    passes.extend(pooled);
    // The levels the table covers: every level when a pass took all.
    let levels: Vec<u32> = if passes.iter().any(|p| p.levels.is_empty()) {
        Vec::new()
    } else {
        passes
            .iter()
            .flat_map(|p| p.levels.iter().copied())
            .collect::<BTreeSet<u32>>()
            .into_iter()
            .collect()
    };
    let mut complete: Vec<TreeProblem> = Vec::new();
    let mut runs: Vec<BTreeMap<&str, &Finished>> = Vec::new();
    let mut pass_of: Vec<usize> = Vec::new();
    let mut missing = 0;
    for (i, pass) in passes.iter().enumerate() {
        let eps = &pass.episodes;
        let by: BTreeMap<(&str, &str), &Finished> = eps
            .iter()
            .map(|f| ((f.problem.as_str(), f.planner.as_str()), f))
            .collect();
        for p in &of(&pass.levels) {
            let name = p.problem.name.as_str();
            let run: Option<BTreeMap<&str, &Finished>> = planners
                .iter()
                .map(|(n, _)| by.get(&(name, n.as_str())).map(|f| (n.as_str(), *f)))
                .collect();
            match run {
                Some(run) => {
                    complete.push(p.clone());
                    runs.push(run);
                    pass_of.push(i);
                }
                None => missing += 1,
            }
        }
    }
    // What an interrupted pass says last, as the error.
    let interrupted = |at: String| {
        Interrupted(format!(
            "stopped {at}; every finished episode is in {}: run the same command again to resume",
            episodes_path.display()
        ))
    };
    if complete.is_empty() {
        if let Some(at) = stopped {
            return Err(interrupted(at).into());
        }
        bail!(
            "no problem has a finished episode of every planner yet: run the same command again to resume"
        );
    }
    let complete = Arc::new(complete);
    let mut builds: BTreeMap<Option<String>, usize> = BTreeMap::new();
    for f in runs.iter().flat_map(|r| r.values()) {
        *builds.entry(f.build.clone()).or_default() += 1;
    }
    let exhaustive: Vec<f64> = complete.iter().map(TreeProblem::best).collect();
    let mut rows = Vec::new();
    let pass_names: Vec<String> = passes.iter().map(|p| p.dir.display().to_string()).collect();
    let mut per_problem = problem_rows(&complete);
    if passes.len() > 1 {
        for (r, &i) in per_problem.iter_mut().zip(&pass_of) {
            r.pass = Some(pass_names[i].clone());
        }
    }
    let mut seconds = 0.0;
    let mut as_found: Vec<(String, f64, usize)> = Vec::new();
    // The table reads each best program's median over the side-by-side
    // rounds where there are some, else its second timing where there is
    // one; the first, as found, is the best of several.
    let side = |n: usize, f: &Finished| -> Option<f64> {
        passes[pass_of[n]]
            .judged
            .get(&f.problem)?
            .planners
            .get(&f.planner)?
            .median()
    };
    let figure = |n: usize, f: &Finished| side(n, f).or(f.rejudged).unwrap_or(f.best).max(1.0);
    let mut side_by_side_n = 0;
    for (planner, _) in &planners {
        let eps: Vec<&Finished> = runs.iter().map(|r| r[planner.as_str()]).collect();
        let bests: Vec<f64> = eps.iter().enumerate().map(|(n, f)| figure(n, f)).collect();
        let found: Vec<f64> = eps.iter().map(|f| f.best).collect();
        side_by_side_n += eps
            .iter()
            .enumerate()
            .filter(|&(n, f)| side(n, f).is_some())
            .count();
        as_found.push((
            planner.clone(),
            geomean(&found),
            eps.iter()
                .enumerate()
                .filter(|&(n, f)| side(n, f).is_none() && f.rejudged.is_some())
                .count(),
        ));
        let (mut near, mut to_near) = (0usize, 0usize);
        for (f, &ex) in eps.iter().zip(&exhaustive) {
            if let Some(i) = f.bests.iter().position(|&b| b >= NEAR * ex) {
                near += 1;
                to_near += i + 1;
            }
        }
        for (n, (r, f)) in per_problem.iter_mut().zip(&eps).enumerate() {
            r.planners.insert(
                planner.clone(),
                PlannerResult {
                    best: figure(n, f),
                    evaluations: f.evaluations as f64,
                    path: Vec::new(),
                    considered: Vec::new(),
                },
            );
        }
        seconds += eps.iter().map(|f| f.seconds).sum::<f64>();
        let n = eps.len() as f64;
        rows.push(row(
            planner,
            &bests,
            eps.iter().map(|f| f.evaluations).sum::<usize>() as f64 / n,
            &exhaustive,
            (near as f64 / n, to_near as f64 / near.max(1) as f64),
        ));
    }
    rows.push(exhaustive_row(&complete, None)?);
    writeln!(
        out,
        "{} ({} split{}), budget {} evaluations, every planner's programs judged live{}{}; exhaustive: the best of every program recorded in {} (not run again){}",
        if passes.len() > 1 {
            format!(
                "{} problem run(s) in {} passes pooled ({} and {})",
                complete.len(),
                passes.len(),
                pass_names[0],
                pass_names[1..].join(", ")
            )
        } else {
            format!("{} problem(s)", complete.len())
        },
        settings.split,
        levels_words(&levels),
        req.budget,
        // Episodes compiled only, where no GPU was found, have no timing.
        if timed { "" } else { " (compile only)" },
        stopping(req.checkpoint.is_some(), req.policy_stops),
        req.store.display(),
        if missing > 0 {
            format!("; {missing} problem(s) left out: not every planner finished them")
        } else {
            String::new()
        }
    )?;
    if let Some(line) = builds_warning(&builds) {
        writeln!(out, "{line}")?;
    }
    let pairs = crate::paired::pairs(&per_problem);
    print_table(out, &rows, &pairs, false)?;
    let again: usize = as_found.iter().map(|a| a.2).sum();
    if again + side_by_side_n > 0 {
        let episodes = as_found.len() * complete.len();
        let how = match (side_by_side_n, again) {
            (0, _) => format!(
                "each episode's best program judged once more after its search ({again} of {episodes} episodes; the others as found)"
            ),
            (s, 0) => format!(
                "each episode's best program judged again side by side with the other planners' in rounds, the median of its rounds ({s} of {episodes} episodes; the others as found)"
            ),
            (s, a) => format!(
                "each episode's best program judged again side by side with the other planners' in rounds, the median of its rounds ({s} of {episodes} episodes), or judged once more after its search ({a}; the others as found)"
            ),
        };
        writeln!(
            out,
            "geomean: {how}; as found, the best of the search's timings: {}",
            as_found
                .iter()
                .map(|(p, g, _)| format!("{p} {g:.3}x"))
                .collect::<Vec<_>>()
                .join(", ")
        )?;
    }
    writeln!(
        out,
        "{:.0} s of episodes; each episode's steps are in {}{}",
        seconds,
        logs.display(),
        if passes.len() > 1 {
            " (and in each pooled folder's logs)"
        } else {
            ""
        }
    )?;
    let doc = serde_json::json!({
        "live": true,
        "split": settings.split,
        "levels": levels,
        "budget": req.budget,
        "store": req.store.display().to_string(),
        "checkpoint": settings.checkpoint,
        "policy_stops": req.policy_stops,
        "as_found": as_found
            .iter()
            .map(|(p, g, _)| (p.clone(), serde_json::json!(g)))
            .collect::<serde_json::Map<_, _>>(),
        "passes": pass_names,
        "builds": builds
            .iter()
            .map(|(b, n)| (b.clone().unwrap_or_default(), serde_json::json!(n)))
            .collect::<serde_json::Map<_, _>>(),
        "problems_left_out": missing,
        "planners": rows,
        "paired": pairs,
        "problems": per_problem,
    });
    let text = serde_json::to_string_pretty(&doc)? + "\n";
    for path in std::iter::once(req.out_dir.join("compare.json")).chain(req.json.map(Into::into)) {
        std::fs::write(&path, &text)
            .with_context(|| format!("cannot write `{}`", path.display()))?;
    }
    match stopped {
        Some(at) => Err(interrupted(at).into()),
        None => Ok(()),
    }
}

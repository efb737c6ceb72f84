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
use mtmc_planner::policy::Checkpoint;
use mtmc_planner::store::{RECORDED_H100, Store};
use mtmc_planner::tree::{self, TreeProblem};
use sha2::{Digest, Sha256};

use crate::cmd::optimize::ProblemJudge;
use crate::cmd::plan::{
    Choice, NEAR, PlanSettings, PlannerResult, Split, compared, counted, exhaustive_row, geomean,
    judge_side_by_side, levels_words, of_levels, plan_problem, print_table, problem_rows,
    rebuild_best, row, stopping,
};
use crate::interrupt::{Interrupt, Interrupted};

/// What `mtmc compare --live` was asked to do.
pub struct LiveRequest<'a> {
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

/// What a live comparison was asked to do, kept in `settings.json`: a
/// rerun into the same folder must ask for the same.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Settings {
    /// The recorded tree: the problems, the exhaustive best and the
    /// trained planner's priors.
    trajectories: String,
    budget: usize,
    split: String,
    /// The levels the problems were limited to (none: every level, as in
    /// folders written before the setting existed).
    #[serde(default)]
    levels: Vec<u32>,
    checkpoint: Option<String>,
    seed: u64,
    /// Whether the trained policy's STOP may end an episode early. Folders
    /// written before the setting existed ran that way.
    #[serde(default = "stopped_early")]
    policy_stops: bool,
    /// Whether each episode's best program is judged once more, the table
    /// reading that timing (false in folders written before).
    #[serde(default)]
    rejudge: bool,
    /// Whether the episodes run on a GPU and are timed (false: compiled
    /// only, where no GPU was found, every speedup 0), so that neither
    /// kind of pass is resumed, pooled or reused as the other.
    #[serde(default = "timed_before")]
    timed: bool,
    /// SHA-256 of what the paths above held ([`inputs_sha256`]), so that
    /// a pass run with another checkpoint or tree under the same names is
    /// neither resumed nor pooled as this one (none in folders written
    /// before).
    #[serde(default)]
    inputs: Option<String>,
    /// SHA-256 of the recorded tree alone (`inputs` without the
    /// checkpoint), which a pass of another checkpoint compares before it
    /// reuses this one's random and greedy episodes (none in folders
    /// written before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tree: Option<String>,
}

impl Settings {
    /// Whether a pass of `self` is a pass of the comparison `ours`
    /// describes: the same settings, where the digests of the inputs, when
    /// both name them, stand for the paths (a tree or checkpoint copied or
    /// moved is the same input).
    fn same_as(&self, ours: &Settings) -> bool {
        let key = |s: &Settings| match s.inputs {
            Some(_) => s.without_paths(),
            None => s.clone(),
        };
        key(&self.clone().with_tree_of(ours)) == key(ours)
    }

    /// These settings with the paths of the tree and checkpoint blanked
    /// (whether there is a checkpoint still counts): for comparing where a
    /// digest stands for what the paths held.
    fn without_paths(&self) -> Settings {
        Settings {
            trajectories: String::new(),
            checkpoint: self.checkpoint.as_ref().map(|_| String::new()),
            ..self.clone()
        }
    }

    /// These settings as a folder written before `tree` existed would
    /// compare: its `tree` taken from `ours` (its `inputs` digest covers
    /// the tree already).
    fn with_tree_of(mut self, ours: &Settings) -> Settings {
        if self.tree.is_none() {
            self.tree.clone_from(&ours.tree);
        }
        self
    }
}

/// SHA-256 (hex) of a comparison's inputs: the recorded tree of its
/// problems (each one's name, programs and best) and the checkpoint's
/// weights.
fn inputs_sha256(recorded: &[TreeProblem], checkpoint: Option<&Path>) -> Result<String> {
    let mut h = Sha256::new();
    for p in recorded {
        h.update(format!("{}\t{}\t{}\n", p.problem.name, p.evals.len(), p.best()).as_bytes());
    }
    if let Some(dir) = checkpoint {
        let mut files = Checkpoint::at(dir).policy_files()?;
        files.push(dir.join("rtg.mpk"));
        for path in files {
            if path.is_file() {
                let bytes = std::fs::read(&path)
                    .with_context(|| format!("cannot read `{}`", path.display()))?;
                // Named relative to the folder, as folders written before
                // committees named their two files.
                let name = path.strip_prefix(dir).unwrap_or(&path);
                h.update(name.to_string_lossy().as_bytes());
                h.update((bytes.len() as u64).to_le_bytes());
                h.update(&bytes);
            }
        }
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// `policy_stops` of a `settings.json` that does not name it.
fn stopped_early() -> bool {
    true
}

/// `timed` of a `settings.json` that does not name it: passes written
/// before the setting existed are taken as run on a GPU.
fn timed_before() -> bool {
    true
}

/// One finished episode, a line of `episodes.jsonl`.
#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Finished {
    problem: String,
    planner: String,
    /// Best speedup against eager (0: nothing correct).
    best: f64,
    evaluations: usize,
    /// The best after each evaluation.
    bests: Vec<f64>,
    /// The best program's speedup judged once more after the search (none
    /// without a GPU or a correct program).
    #[serde(default)]
    rejudged: Option<f64>,
    seconds: f64,
    /// The mtmc build that ran it ([`build_id`]; none in folders written
    /// before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    build: Option<String>,
    /// The folder of the pass that ran it, where `--reuse-baselines`
    /// took it from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    reused_from: Option<String>,
}

/// One problem's best programs judged side by side after every planner
/// finished it (`--side-by-side`), a line of `side_by_side.jsonl`.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct SideBySide {
    problem: String,
    rounds: usize,
    /// Per planner: its best program and the speedups of its judgings.
    planners: BTreeMap<String, Judged>,
    /// The mtmc build that judged them ([`build_id`]).
    build: String,
}

/// A planner's best program judged in the rounds of a [`SideBySide`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
struct Judged {
    /// Its key (none when the episode had no correct program).
    key: Option<String>,
    /// Its speedup against eager in each round (0: not correct then).
    speedups: Vec<f64>,
}

impl Judged {
    /// The median of its speedups (none without any).
    fn median(&self) -> Option<f64> {
        crate::cmd::bench_env::median(&self.speedups)
    }
}

/// The side-by-side judgings in `path`, by problem (none when it is not
/// there; a last line cut short by a kill is dropped).
fn side_by_side(path: &Path) -> Result<BTreeMap<String, SideBySide>> {
    let (lines, _) = json_lines::<SideBySide>(path)?;
    Ok(lines.into_iter().map(|j| (j.problem.clone(), j)).collect())
}

/// Each planner's best program of a problem built again: the planner, and
/// the program's key and ModelNew (none when nothing was correct).
type Rebuilt = Vec<(String, Option<(String, String)>)>;

/// The file of a pass's side-by-side judgings.
const SIDE_BY_SIDE: &str = "side_by_side.jsonl";

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
fn judge_left(
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
    let mut file = super::open_to_append(&path)?;
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

/// The running mtmc's build: its version and the first 12 hex digits of
/// the executable's SHA-256. A change of mtmc between passes, or between
/// a pass and its resume, changes what the planners' searches do (the
/// coder, the early stop), so the table names the builds its episodes ran
/// on when there are several.
fn build_id() -> Result<String> {
    let exe = std::env::current_exe().context("cannot find the running mtmc's executable")?;
    let bytes = std::fs::read(&exe).with_context(|| format!("cannot read `{}`", exe.display()))?;
    let hex = crate::source::sha256_hex(bytes);
    Ok(format!("{}+{}", env!("CARGO_PKG_VERSION"), &hex[..12]))
}

/// The warning a table prints when its episodes ran on several builds
/// (`builds`: episodes per build, `None` for episodes that name none);
/// none when they ran on one.
fn builds_warning(builds: &BTreeMap<Option<String>, usize>) -> Option<String> {
    if builds.len() < 2 {
        return None;
    }
    let each: Vec<String> = builds
        .iter()
        .map(|(b, n)| {
            format!(
                "{} {n}",
                b.as_deref()
                    .unwrap_or("unnamed (written before builds were kept)")
            )
        })
        .collect();
    Some(format!(
        "warning: these episodes ran on {} builds of mtmc (episodes each: {}); a change of mtmc changes what the searches do: run every pass of a comparison with one build",
        builds.len(),
        each.join(", ")
    ))
}

/// A problem's file-name form: `L2/76_Gemm` → `L2-76_Gemm`.
fn file_name(problem: &str) -> String {
    problem
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '_' || c == '-' {
                c
            } else {
                '-'
            }
        })
        .collect()
}

/// Reads the episodes already finished in `path` (none when it is not
/// there), and whether its last line was cut short by a kill (that line
/// is dropped).
fn finished(path: &Path) -> Result<(Vec<Finished>, bool)> {
    json_lines(path)
}

/// The lines of the JSON-lines file at `path` that this command appends
/// to (none when it is not there), and whether its last line was cut
/// short by a kill (that line is dropped).
fn json_lines<T: serde::de::DeserializeOwned>(path: &Path) -> Result<(Vec<T>, bool)> {
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok((Vec::new(), false)),
        Err(e) => return Err(e).with_context(|| format!("cannot read `{}`", path.display())),
    };
    let lines: Vec<&str> = text.lines().filter(|l| !l.trim().is_empty()).collect();
    let mut done = Vec::new();
    for (i, line) in lines.iter().enumerate() {
        match serde_json::from_str::<T>(line) {
            Ok(f) => done.push(f),
            Err(_) if i + 1 == lines.len() && !text.ends_with('\n') => {}
            Err(e) => bail!(
                "`{}` line {}: {e}: the file is not one this command wrote; pass another --out",
                path.display(),
                i + 1
            ),
        }
    }
    Ok((done, !text.is_empty() && !text.ends_with('\n')))
}

/// `episodes.jsonl`, open to append finished episodes to.
struct Episodes {
    path: PathBuf,
    file: std::fs::File,
}

impl Episodes {
    fn open(path: &Path) -> Result<Episodes> {
        let file = super::open_to_append(path)?;
        Ok(Episodes {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Appends `f`'s line and flushes it, so a kill loses no finished
    /// episode.
    fn append(&mut self, f: &Finished) -> Result<()> {
        writeln!(self.file, "{}", serde_json::to_string(f)?)
            .and_then(|_| self.file.flush())
            .with_context(|| format!("cannot write `{}`", self.path.display()))
    }
}

/// One pass of a comparison whose episodes the table reads.
struct Pass {
    /// Its folder.
    dir: PathBuf,
    /// The levels its problems were limited to (none: every level).
    levels: Vec<u32>,
    /// Its finished episodes.
    episodes: Vec<Finished>,
    /// Its problems' best programs judged side by side, by problem.
    judged: BTreeMap<String, SideBySide>,
}

/// Whether `theirs`, an earlier pass's settings, may be pooled with
/// `ours`: the same comparison, or the same but on other levels, whose
/// digest (`digest` of their levels: the tree of those levels' problems
/// and the checkpoint) is the one the pass recorded.
fn poolable(
    theirs: &Settings,
    ours: &Settings,
    digest: &dyn Fn(&[u32]) -> Result<String>,
) -> Result<bool> {
    if theirs.levels == ours.levels {
        return Ok(theirs.same_as(ours));
    }
    let theirs = &theirs.clone().with_tree_of(ours);
    // The paths count for nothing here: the digest below, of the inputs
    // at this run's paths, must be the one the pass recorded.
    let bare = |s: &Settings| Settings {
        levels: Vec::new(),
        inputs: None,
        tree: None,
        ..s.without_paths()
    };
    Ok(bare(theirs) == bare(ours)
        && theirs.inputs.is_some()
        && theirs.inputs.as_deref() == Some(digest(&theirs.levels)?.as_str()))
}

/// The finished episodes of each folder in `pool`: earlier passes of the
/// comparison `settings` describes, or of the same comparison on other
/// levels (`digest` gives the inputs' digest of a list of levels), written
/// into other folders than `out`.
fn pooled_passes(
    out: &Path,
    pool: &[PathBuf],
    settings: &Settings,
    digest: &dyn Fn(&[u32]) -> Result<String>,
) -> Result<Vec<Pass>> {
    let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
        (Ok(a), Ok(b)) => a == b,
        _ => a == b,
    };
    let mut passes: Vec<Pass> = Vec::new();
    for dir in pool {
        if same(dir, out) || passes.iter().any(|p| same(&p.dir, dir)) {
            bail!(
                "`{}` is pooled twice (--out counts as one pass): name each earlier pass's folder once",
                dir.display()
            );
        }
        let (theirs, text) = pass_settings(dir, "--pool")?;
        if !poolable(&theirs, settings, digest)? {
            bail!(
                "`{}` ran with other settings ({}; this run's: {}): pool only passes of the same comparison (of the same levels, or of others with the same checkpoint, tree and settings)",
                dir.display(),
                text.trim(),
                serde_json::to_string(settings)?
            );
        }
        let (episodes, _) = finished(&dir.join("episodes.jsonl"))?;
        passes.push(Pass {
            dir: dir.clone(),
            levels: theirs.levels,
            episodes,
            judged: side_by_side(&dir.join(SIDE_BY_SIDE))?,
        });
    }
    Ok(passes)
}

/// The settings of the pass in `dir`, parsed and as written, for the
/// option `flag` that named it.
fn pass_settings(dir: &Path, flag: &str) -> Result<(Settings, String)> {
    let path = dir.join("settings.json");
    let text = std::fs::read_to_string(&path).with_context(|| {
        format!(
            "cannot read `{}`: {flag} takes a folder that `compare --live` wrote",
            path.display()
        )
    })?;
    let settings = serde_json::from_str(&text).with_context(|| {
        format!(
            "`{}` is not a live comparison's settings: {flag} takes a folder that `compare --live` wrote",
            path.display()
        )
    })?;
    Ok((settings, text))
}

/// The planners whose episodes do not depend on the checkpoint.
const BASELINES: [&str; 2] = ["random", "greedy"];

/// Checks that `from` holds a pass whose random and greedy episodes the
/// pass `settings` describes may take: the same tree and settings, but
/// the checkpoint.
fn check_reusable(from: &Path, settings: &Settings) -> Result<()> {
    let (theirs, text) = pass_settings(from, "--reuse-baselines")?;
    if theirs.tree.is_none() {
        bail!(
            "`{}` names no digest of its tree (written before passes kept one), so its episodes cannot be shown to be of this tree: run the baselines again (drop --reuse-baselines)",
            from.join("settings.json").display()
        );
    }
    let but_checkpoint = |s: &Settings| Settings {
        trajectories: String::new(),
        checkpoint: None,
        inputs: None,
        ..s.clone()
    };
    if but_checkpoint(&theirs) != but_checkpoint(settings) {
        bail!(
            "`{}` ran on another tree or with other settings ({}; this run's: {}): --reuse-baselines takes a pass that differs in its checkpoint only",
            from.display(),
            text.trim(),
            serde_json::to_string(settings)?
        );
    }
    Ok(())
}

/// The random and greedy episodes of the pass in `from` (checked by
/// [`check_reusable`]) that the pass in `out_dir`, with `done` finished,
/// still needs on the problems `names`, each of them run on this build
/// (`build`, [`build_id`]). Their logs are copied into `out_dir/logs`;
/// their steps stay in `from`'s `trajectories.sqlite`.
fn reuse_baselines(
    out: &mut dyn std::io::Write,
    from: &Path,
    out_dir: &Path,
    names: &[&str],
    done: &[Finished],
    build: &str,
) -> Result<Vec<Finished>> {
    let (episodes, _) = finished(&from.join("episodes.jsonl"))?;
    // Each problem's episode of each planner once: those this pass has,
    // and those taken.
    let mut have: BTreeSet<(String, String)> = done
        .iter()
        .map(|f| (f.problem.clone(), f.planner.clone()))
        .collect();
    let (mut taken, mut other_build) = (Vec::new(), 0usize);
    let logs = out_dir.join("logs");
    for f in episodes {
        if !BASELINES.contains(&f.planner.as_str())
            || !names.contains(&f.problem.as_str())
            || !have.insert((f.problem.clone(), f.planner.clone()))
        {
            continue;
        }
        if f.build.as_deref() != Some(build) {
            other_build += 1;
            continue;
        }
        let log = format!("{}.{}.txt", file_name(&f.problem), f.planner);
        let theirs_log = from.join("logs").join(&log);
        if theirs_log.is_file() {
            std::fs::create_dir_all(&logs)
                .with_context(|| format!("cannot create `{}`", logs.display()))?;
            std::fs::copy(&theirs_log, logs.join(&log))
                .with_context(|| format!("cannot copy `{}`", theirs_log.display()))?;
        }
        // An episode that pass took from a third keeps that one's folder,
        // where its steps are.
        let reused_from = f
            .reused_from
            .clone()
            .or_else(|| Some(from.display().to_string()));
        taken.push(Finished { reused_from, ..f });
    }
    writeln!(
        out,
        "reused {} random and greedy episode(s) from {} (this build, the same tree and settings; those planners never read the checkpoint){}",
        taken.len(),
        from.display(),
        if other_build > 0 {
            format!("; {other_build} more ran on another build of mtmc and run again here")
        } else {
            String::new()
        }
    )?;
    Ok(taken)
}

/// Runs the live comparison and prints its table.
pub fn compare_live(out: &mut dyn std::io::Write, req: LiveRequest<'_>) -> Result<()> {
    // Checked here, not by the parser: its default must not stop a
    // comparison that is not live.
    if let Some(why) = super::out_dir_refused(req.out_dir) {
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
        let gpus = crate::cmd::plan::Gpus::probe();
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
    let stop = match req.table_only {
        true => None,
        false => Some(Interrupt::catch().context("catching Ctrl-C")?),
    };
    let requested = || stop.as_ref().is_some_and(Interrupt::requested);
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
                "nothing to run"
            } else if timed {
                "judged on the GPU"
            } else {
                "no GPU: compile only, nothing is run or timed (every speedup is 0)"
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
        let mut judge = ProblemJudge::with_baselines(timed, req.timeout, true, &["eager"], false);
        if let Some(s) = &stop {
            judge = judge.stopping_on(s);
        }
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
                stop.as_ref(),
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
    let pairs = crate::cmd::paired::pairs(&per_problem);
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn several_builds_are_named_and_one_is_not() {
        let mut builds: BTreeMap<Option<String>, usize> = BTreeMap::new();
        builds.insert(Some("0.1.0+abc".into()), 4);
        assert_eq!(builds_warning(&builds), None);
        builds.insert(None, 2);
        let w = builds_warning(&builds).unwrap();
        assert!(
            w.contains("2 builds of mtmc (episodes each: unnamed (written before builds were kept) 2, 0.1.0+abc 4)"),
            "{w}"
        );
        let id = build_id().unwrap();
        assert!(
            id.starts_with(env!("CARGO_PKG_VERSION"))
                && id.len() == env!("CARGO_PKG_VERSION").len() + 13,
            "{id}"
        );
    }

    #[test]
    fn a_problem_name_becomes_one_file_name() {
        assert_eq!(
            file_name("L2/76_Gemm_Add_ReLU"),
            "L2-76_Gemm_Add_ReLU".to_string()
        );
        assert_eq!(file_name("L1/9_Tall skinny.x"), "L1-9_Tall-skinny-x");
    }

    #[test]
    fn a_line_cut_short_by_a_kill_is_dropped_and_a_foreign_file_refused() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("episodes.jsonl");
        assert!(finished(&path).unwrap().0.is_empty());
        let line = r#"{"problem":"L1/1_a","planner":"greedy","best":1.5,"evaluations":3,"bests":[1.0,1.5,1.5],"seconds":2.0}"#;
        std::fs::write(&path, format!("{line}\n{}", &line[..40])).unwrap();
        let (got, cut) = finished(&path).unwrap();
        assert!(cut);
        assert_eq!(got.len(), 1);
        assert_eq!(got[0].bests, vec![1.0, 1.5, 1.5]);
        std::fs::write(&path, format!("{line}\n")).unwrap();
        let (got, cut) = finished(&path).unwrap();
        assert!(!cut && got.len() == 1);
        std::fs::write(&path, format!("not json\n{line}\n")).unwrap();
        let err = finished(&path).unwrap_err().to_string();
        assert!(
            err.contains("line 1") && err.contains("another --out"),
            "{err}"
        );
    }
}

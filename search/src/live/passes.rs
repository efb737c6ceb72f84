//! Other passes of the same comparison: folders whose episodes the table
//! pools (`--pool`), and a pass whose random and greedy episodes this one
//! takes (`--reuse-baselines`).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use super::folder::{Finished, Settings, file_name, finished};
use super::side_by_side::{SIDE_BY_SIDE, SideBySide, side_by_side};

/// One pass of a comparison whose episodes the table reads.
pub(super) struct Pass {
    /// Its folder.
    pub(super) dir: PathBuf,
    /// The levels its problems were limited to (none: every level).
    pub(super) levels: Vec<u32>,
    /// Its finished episodes.
    pub(super) episodes: Vec<Finished>,
    /// Its problems' best programs judged side by side, by problem.
    pub(super) judged: BTreeMap<String, SideBySide>,
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
pub(super) fn pooled_passes(
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
pub(super) fn pass_settings(dir: &Path, flag: &str) -> Result<(Settings, String)> {
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
pub(super) fn check_reusable(from: &Path, settings: &Settings) -> Result<()> {
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
/// (`build`, [`build_id`](super::folder::build_id)). Their logs are copied into `out_dir/logs`;
/// their steps stay in `from`'s `trajectories.sqlite`.
pub(super) fn reuse_baselines(
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

//! What a live comparison keeps in its output folder: `settings.json`
//! (what was asked, with digests of the inputs), `episodes.jsonl` (one
//! line per finished episode, appended and flushed as each ends) and the
//! build of mtmc that ran them.

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use mtmc_planner::policy::Checkpoint;
use mtmc_planner::tree::TreeProblem;
use sha2::{Digest, Sha256};

/// What a live comparison was asked to do, kept in `settings.json`: a
/// rerun into the same folder must ask for the same.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct Settings {
    /// The recorded tree: the problems, the exhaustive best and the
    /// trained planner's priors.
    pub(super) trajectories: String,
    pub(super) budget: usize,
    pub(super) split: String,
    /// The levels the problems were limited to (none: every level, as in
    /// folders written before the setting existed).
    #[serde(default)]
    pub(super) levels: Vec<u32>,
    pub(super) checkpoint: Option<String>,
    pub(super) seed: u64,
    /// Whether the trained policy's STOP may end an episode early. Folders
    /// written before the setting existed ran that way.
    #[serde(default = "stopped_early")]
    pub(super) policy_stops: bool,
    /// Whether each episode's best program is judged once more, the table
    /// reading that timing (false in folders written before).
    #[serde(default)]
    pub(super) rejudge: bool,
    /// Whether the episodes run on a GPU and are timed (false: compiled
    /// only, where no GPU was found, every speedup 0), so that neither
    /// kind of pass is resumed, pooled or reused as the other.
    #[serde(default = "timed_before")]
    pub(super) timed: bool,
    /// SHA-256 of what the paths above held ([`inputs_sha256`]), so that
    /// a pass run with another checkpoint or tree under the same names is
    /// neither resumed nor pooled as this one (none in folders written
    /// before).
    #[serde(default)]
    pub(super) inputs: Option<String>,
    /// SHA-256 of the recorded tree alone (`inputs` without the
    /// checkpoint), which a pass of another checkpoint compares before it
    /// reuses this one's random and greedy episodes (none in folders
    /// written before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) tree: Option<String>,
}

impl Settings {
    /// Whether a pass of `self` is a pass of the comparison `ours`
    /// describes: the same settings, where the digests of the inputs, when
    /// both name them, stand for the paths (a tree or checkpoint copied or
    /// moved is the same input).
    pub(super) fn same_as(&self, ours: &Settings) -> bool {
        let key = |s: &Settings| match s.inputs {
            Some(_) => s.without_paths(),
            None => s.clone(),
        };
        key(&self.clone().with_tree_of(ours)) == key(ours)
    }

    /// These settings with the paths of the tree and checkpoint blanked
    /// (whether there is a checkpoint still counts): for comparing where a
    /// digest stands for what the paths held.
    pub(super) fn without_paths(&self) -> Settings {
        Settings {
            trajectories: String::new(),
            checkpoint: self.checkpoint.as_ref().map(|_| String::new()),
            ..self.clone()
        }
    }

    /// These settings as a folder written before `tree` existed would
    /// compare: its `tree` taken from `ours` (its `inputs` digest covers
    /// the tree already).
    pub(super) fn with_tree_of(mut self, ours: &Settings) -> Settings {
        if self.tree.is_none() {
            self.tree.clone_from(&ours.tree);
        }
        self
    }
}

/// SHA-256 (hex) of a comparison's inputs: the recorded tree of its
/// problems (each one's name, programs and best) and the checkpoint's
/// weights.
pub(super) fn inputs_sha256(recorded: &[TreeProblem], checkpoint: Option<&Path>) -> Result<String> {
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
pub(super) struct Finished {
    pub(super) problem: String,
    pub(super) planner: String,
    /// Best speedup against eager (0: nothing correct).
    pub(super) best: f64,
    pub(super) evaluations: usize,
    /// The best after each evaluation.
    pub(super) bests: Vec<f64>,
    /// The best program's speedup judged once more after the search (none
    /// without a GPU or a correct program).
    #[serde(default)]
    pub(super) rejudged: Option<f64>,
    pub(super) seconds: f64,
    /// The mtmc build that ran it ([`build_id`]; none in folders written
    /// before).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) build: Option<String>,
    /// The folder of the pass that ran it, where `--reuse-baselines`
    /// took it from there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) reused_from: Option<String>,
}

/// The running mtmc's build: its version and the first 12 hex digits of
/// the executable's SHA-256. A change of mtmc between passes, or between
/// a pass and its resume, changes what the planners' searches do (the
/// coder, the early stop), so the table names the builds its episodes ran
/// on when there are several.
pub(super) fn build_id() -> Result<String> {
    let exe = std::env::current_exe().context("cannot find the running mtmc's executable")?;
    let bytes = std::fs::read(&exe).with_context(|| format!("cannot read `{}`", exe.display()))?;
    let hex = crate::source::sha256_hex(bytes);
    Ok(format!("{}+{}", env!("CARGO_PKG_VERSION"), &hex[..12]))
}

/// The warning a table prints when its episodes ran on several builds
/// (`builds`: episodes per build, `None` for episodes that name none);
/// none when they ran on one.
pub(super) fn builds_warning(builds: &BTreeMap<Option<String>, usize>) -> Option<String> {
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
pub(super) fn file_name(problem: &str) -> String {
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
pub(super) fn finished(path: &Path) -> Result<(Vec<Finished>, bool)> {
    json_lines(path)
}

/// The lines of the JSON-lines file at `path` that this command appends
/// to (none when it is not there), and whether its last line was cut
/// short by a kill (that line is dropped).
pub(super) fn json_lines<T: serde::de::DeserializeOwned>(path: &Path) -> Result<(Vec<T>, bool)> {
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
pub(super) struct Episodes {
    pub(super) path: PathBuf,
    pub(super) file: std::fs::File,
}

impl Episodes {
    pub(super) fn open(path: &Path) -> Result<Episodes> {
        let file = crate::files::open_to_append(path)?;
        Ok(Episodes {
            path: path.to_path_buf(),
            file,
        })
    }

    /// Appends `f`'s line and flushes it, so a kill loses no finished
    /// episode.
    pub(super) fn append(&mut self, f: &Finished) -> Result<()> {
        writeln!(self.file, "{}", serde_json::to_string(f)?)
            .and_then(|_| self.file.flush())
            .with_context(|| format!("cannot write `{}`", self.path.display()))
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

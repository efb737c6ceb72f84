//! The trajectory store: every step of every episode in one SQLite file,
//! and the knowledge base read from it.
//!
//! Tables: `problems` (name, pattern, graph features, shape), `episodes`
//! (problem, planner, version, seed, start and end, best speedup), `steps`
//! (one row per evaluated or stopping step: state, observation, action,
//! fragment hash and code, outcome, diagnosis, critique, reward, best so
//! far, timestamps, planner version) and `evaluations` (the trajectory
//! tree's nodes: the diagnosis of each program, by problem and key).
//!
//! Crash safety: WAL, and each step is one transaction of its own, so a
//! writer killed at any point leaves every step it finished (and no half
//! of one).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use mtmc_env::outcome::Status;
use rusqlite::{Connection, OptionalExtension, params};

use crate::critique::Diagnosis;
use crate::features::Problem;
use crate::space::{ACTIONS, Move};

/// A store error, naming the file.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// SQLite refused.
    #[error("trajectory store `{path}`: {source}")]
    Sqlite {
        /// The file.
        path: PathBuf,
        /// What SQLite said.
        source: rusqlite::Error,
    },
    /// A row's JSON did not parse (a store written by another version?).
    #[error("trajectory store `{path}`: a row does not parse: {source}")]
    Json {
        /// The file.
        path: PathBuf,
        /// What serde said.
        source: serde_json::Error,
    },
    /// No file where a store was to be read.
    #[error(
        "trajectory store `{path}` does not exist: record one with `mtmc explore`, or read the tree recorded on an H100 that comes with mtmc (--trajectories {RECORDED_H100})"
    )]
    Missing {
        /// The file.
        path: PathBuf,
    },
    /// A folder where a store's file was named.
    #[error(
        "trajectory store `{path}` is a folder: a store is one SQLite file (such as `{path}/mtmc-trajectories.sqlite`)"
    )]
    Folder {
        /// The folder.
        path: PathBuf,
    },
    /// A store was to be merged into itself.
    #[error(
        "trajectory store `{path}`: cannot merge a store into itself; name another store to merge"
    )]
    SelfMerge {
        /// The file.
        path: PathBuf,
    },
    /// A compressed store was opened to be written.
    #[error(
        "trajectory store `{path}` is compressed: `mtmc train` and `mtmc compare` read it as it is; to record into it, unpack a copy first (gunzip -c {path} > mtmc-trajectories.sqlite, the default store)"
    )]
    Compressed {
        /// The file.
        path: PathBuf,
    },
    /// Outcomes judged on one GPU were to be written into a store of
    /// another's.
    #[error(
        "trajectory store `{path}` holds outcomes judged on the {recorded}, and {this} is the GPU here: speedups from two GPUs do not compare in one tree. Record into another store (--trajectories NEW.sqlite; `mtmc merge` refuses to mix them too), or run this on the {recorded}"
    )]
    OtherGpu {
        /// The file.
        path: PathBuf,
        /// The GPU the store names.
        recorded: String,
        /// The GPU that would judge now.
        this: String,
    },
    /// Two stores of outcomes judged on different GPUs were to be merged.
    #[error(
        "cannot merge `{from}` (outcomes judged on the {theirs}) into `{path}` (on the {ours}): speedups from two GPUs do not compare in one tree; merge stores of one GPU"
    )]
    MergeGpus {
        /// The store merged into.
        path: PathBuf,
        /// The store merged from.
        from: PathBuf,
        /// The GPU the store merged into names.
        ours: String,
        /// The GPU the store merged from names.
        theirs: String,
    },
    /// A store whose outcomes name more than one GPU.
    #[error(
        "trajectory store `{path}` mixes outcomes judged on {gpus}: speedups from two GPUs do not compare in one tree; judge each GPU's programs into a store of its own"
    )]
    MixedGpus {
        /// The file.
        path: PathBuf,
        /// Each GPU its outcomes name, with how many.
        gpus: String,
    },
    /// A store of one GPU's outcomes read as another's (`--gpu NAME`).
    #[error(
        "trajectory store `{path}` holds outcomes judged on the {recorded}, not the {wanted} (--gpu {wanted}): pass --gpu {recorded}, or a store recorded on the {wanted}"
    )]
    NotThatGpu {
        /// The file.
        path: PathBuf,
        /// The GPU the store's outcomes were judged on.
        recorded: String,
        /// The GPU asked for.
        wanted: String,
    },
    /// A compressed store could not be unpacked.
    #[error("trajectory store `{path}`: cannot unpack it: {source}")]
    Unpack {
        /// The file.
        path: PathBuf,
        /// What failed.
        source: std::io::Error,
    },
}

impl StoreError {
    /// The error for a store's path that holds no file: a folder, or
    /// nothing.
    pub fn no_file(path: &Path) -> StoreError {
        let path = path.to_path_buf();
        if path.is_dir() {
            StoreError::Folder { path }
        } else {
            StoreError::Missing { path }
        }
    }
}

/// What [`Store::claim_gpu`] found.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Claim {
    /// The store already named this GPU.
    Same,
    /// The store held no outcome judged on a GPU; it now names this one.
    New,
    /// The store held outcomes judged on a GPU it did not name (written by
    /// an earlier mtmc); it now names this one as theirs.
    Unnamed,
}

/// What [`Store::merge`] copied into a store.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Merged {
    /// Problems this store had not recorded.
    pub problems: usize,
    /// Episodes copied.
    pub episodes: usize,
    /// Episodes the store already held (the same problem, planner, seed
    /// and start time), not copied again, nor their steps: merging a
    /// store twice changes nothing.
    pub skipped: usize,
    /// Steps copied (those of the episodes copied).
    pub steps: usize,
    /// Judged programs this store had not judged.
    pub evaluations: usize,
    /// Of those, programs this store had judged with another outcome,
    /// which now hold the source's.
    pub replaced: usize,
    /// Programs the source compiled only (no GPU timed them) that this
    /// store had judged on a GPU: they keep this store's outcome.
    pub kept: usize,
    /// The GPU the store merged from names, where the store merged into
    /// named none before and names it now.
    pub named_gpu: Option<String>,
}

/// The conflict clause of an evaluation's insert: the new outcome replaces
/// the recorded one, but for an outcome compiled only (where no GPU was
/// found; `only` is the parameter that holds its status name), which never
/// replaces one judged on a GPU.
fn keep_timed(only: &str) -> String {
    format!(
        "ON CONFLICT (problem, key) DO UPDATE SET status = excluded.status,
            speedup = excluded.speedup, diagnosis = excluded.diagnosis,
            fragment_hash = excluded.fragment_hash
         WHERE excluded.status != {only} OR evaluations.status = {only}"
    )
}

/// Writes the evaluation of program `key` of `problem` (diagnosis `d`,
/// serialized as `text`, of the fragments hashed `hash`) over the recorded
/// one, unless that would put a compile-only outcome over a timed one
/// ([`keep_timed`]): the rows written (0 or 1).
fn put_evaluation(
    conn: &rusqlite::Connection,
    problem: &str,
    key: &str,
    d: &Diagnosis,
    text: &str,
    hash: &str,
) -> rusqlite::Result<usize> {
    conn.execute(
        &format!(
            "INSERT INTO evaluations (problem, key, status, speedup, diagnosis,
                fragment_hash) VALUES (?1, ?2, ?3, ?4, ?5, ?6) {}",
            keep_timed("?7")
        ),
        params![
            problem,
            key,
            d.status.name(),
            d.speedup_eager,
            text,
            hash,
            Status::CompiledOnly.name()
        ],
    )
}

/// The recorded tree that comes with mtmc, relative to the repository's
/// root: the outcomes `mtmc explore` recorded on an H100 for KernelBench
/// problems of levels 1, 2 and 3 (its `problems` table lists them),
/// gzipped. Training and comparing on it needs no GPU.
pub const RECORDED_H100: &str = "planner/data/kernelbench-h100.sqlite.gz";

/// Whether `path` names a gzipped store.
fn compressed(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "gz")
}

/// One step as it is written.
#[derive(Clone, Debug)]
pub struct StepRecord {
    /// The episode's id.
    pub episode: i64,
    /// Step number in the episode (0-based).
    pub step: usize,
    /// Key of the program before the step.
    pub state: String,
    /// The observation the planner saw.
    pub observation: Vec<f32>,
    /// The move.
    pub action: Move,
    /// Key of the program evaluated (empty for stop).
    pub next_state: String,
    /// SHA-256 of the program's fragments (empty when nothing was built).
    pub fragment_hash: String,
    /// The fragments' code.
    pub code: String,
    /// The outcome as JSON (empty when nothing was evaluated).
    pub outcome: String,
    /// The diagnosis (none for stop).
    pub diagnosis: Option<Diagnosis>,
    /// The reward.
    pub reward: f64,
    /// Best speedup after the step.
    pub best_speedup: f64,
    /// When the step started (Unix seconds).
    pub started_at: f64,
    /// Its diagnosis is the store's recorded evaluation of `next_state`
    /// (nothing was built or judged now): the evaluation, and the hash of
    /// the code that was judged, are left as they are.
    pub reused: bool,
}

/// Seconds since the Unix epoch.
pub fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// An open store.
pub struct Store {
    conn: Connection,
    path: PathBuf,
    /// The folder a compressed store was unpacked into, removed when the
    /// store is dropped (after `conn`, which is dropped first).
    _unpacked: Option<tempfile::TempDir>,
}

/// A recorded step read back for training.
#[derive(Clone, Debug)]
pub struct Recorded {
    /// Problem name.
    pub problem: String,
    /// Episode id.
    pub episode: i64,
    /// Step number.
    pub step: usize,
    /// The observation.
    pub observation: Vec<f32>,
    /// The move's index.
    pub action: usize,
    /// The reward.
    pub reward: f64,
    /// Best speedup after the step.
    pub best_speedup: f64,
    /// The step's own speedup, when its program was correct and timed.
    pub speedup: Option<f64>,
}

/// One recorded move of an episode ([`Store::finished_moves`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Taken {
    /// The move's index.
    pub action: usize,
    /// The key of the program it reached (as the step recorded it).
    pub next_state: String,
    /// How that program was judged (none for STOP).
    pub diagnosis: Option<Diagnosis>,
    /// The SHA-256 of its fragments (empty where nothing was built).
    pub fragment_hash: String,
    /// Its mean time per call, where it was correct and timed.
    pub mean_ms: Option<f64>,
}

/// The speedup of a correct, timed program.
pub fn correct_speedup(d: &Diagnosis) -> Option<f64> {
    (d.status == Status::Correct)
        .then_some(d.speedup_eager)
        .flatten()
}

impl Store {
    /// Opens (creating if needed) the store at `path` to read and write
    /// it. A gzipped store is refused: it could only be written to a copy.
    pub fn open(path: &Path) -> Result<Store, StoreError> {
        if path.is_dir() {
            return Err(StoreError::no_file(path));
        }
        if compressed(path) {
            return Err(StoreError::Compressed {
                path: path.to_path_buf(),
            });
        }
        Store::open_file(path)
    }

    /// Opens the existing store at `path` to read it; a gzipped one (such
    /// as [`RECORDED_H100`]) is unpacked into a temporary folder first, and
    /// nothing is written back to it.
    pub fn open_to_read(path: &Path) -> Result<Store, StoreError> {
        if !path.is_file() {
            return Err(StoreError::no_file(path));
        }
        if !compressed(path) {
            return Store::open_file(path);
        }
        let unpack_err = |source| StoreError::Unpack {
            path: path.to_path_buf(),
            source,
        };
        let dir = tempfile::tempdir().map_err(unpack_err)?;
        let unpacked = dir.path().join("store.sqlite");
        let file = std::fs::File::open(path).map_err(unpack_err)?;
        let mut gz = flate2::read::GzDecoder::new(std::io::BufReader::new(file));
        let mut out = std::fs::File::create(&unpacked).map_err(unpack_err)?;
        std::io::copy(&mut gz, &mut out).map_err(unpack_err)?;
        drop(out);
        let mut store = Store::open_file(&unpacked).map_err(|e| match e {
            StoreError::Sqlite { source, .. } => StoreError::Sqlite {
                path: path.to_path_buf(),
                source,
            },
            other => other,
        })?;
        store.path = path.to_path_buf();
        store._unpacked = Some(dir);
        Ok(store)
    }

    fn open_file(path: &Path) -> Result<Store, StoreError> {
        let path = path.to_path_buf();
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            // A missing folder would make SQLite's error say only "unable
            // to open"; create it.
            let _ = std::fs::create_dir_all(dir);
        }
        let conn = Connection::open(&path).map_err(err)?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(err)?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(err)?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(err)?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS problems (
                name TEXT PRIMARY KEY,
                pattern TEXT NOT NULL,
                problem TEXT NOT NULL
            );
            CREATE TABLE IF NOT EXISTS episodes (
                id INTEGER PRIMARY KEY,
                problem TEXT NOT NULL,
                planner TEXT NOT NULL,
                planner_version TEXT NOT NULL,
                seed INTEGER NOT NULL,
                started_at REAL NOT NULL,
                finished_at REAL,
                best_speedup REAL
            );
            CREATE TABLE IF NOT EXISTS steps (
                id INTEGER PRIMARY KEY,
                episode INTEGER NOT NULL REFERENCES episodes(id),
                step INTEGER NOT NULL,
                problem TEXT NOT NULL,
                pattern TEXT NOT NULL,
                state TEXT NOT NULL,
                observation TEXT NOT NULL,
                action INTEGER NOT NULL,
                action_name TEXT NOT NULL,
                next_state TEXT NOT NULL,
                fragment_hash TEXT NOT NULL,
                code TEXT NOT NULL,
                status TEXT,
                speedup REAL,
                outcome TEXT NOT NULL,
                diagnosis TEXT,
                critique TEXT,
                reward REAL NOT NULL,
                best_speedup REAL NOT NULL,
                started_at REAL NOT NULL,
                finished_at REAL NOT NULL,
                planner_version TEXT NOT NULL
            );
            CREATE INDEX IF NOT EXISTS steps_pattern ON steps(pattern, action);
            CREATE TABLE IF NOT EXISTS evaluations (
                problem TEXT NOT NULL,
                key TEXT NOT NULL,
                status TEXT NOT NULL,
                speedup REAL,
                diagnosis TEXT NOT NULL,
                fragment_hash TEXT NOT NULL,
                PRIMARY KEY (problem, key)
            );",
        )
        .map_err(err)?;
        Ok(Store {
            conn,
            path,
            _unpacked: None,
        })
    }

    fn sql(&self, source: rusqlite::Error) -> StoreError {
        StoreError::Sqlite {
            path: self.path.clone(),
            source,
        }
    }

    fn json(&self, source: serde_json::Error) -> StoreError {
        StoreError::Json {
            path: self.path.clone(),
            source,
        }
    }

    /// The file the store was opened from (a gzipped one's own path).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The GPU the store's outcomes were judged on, where it names one
    /// (as [`Store::claim_gpu`] wrote it).
    pub fn gpu(&self) -> Result<Option<String>, StoreError> {
        let has_meta: bool = self
            .conn
            .query_row(
                "SELECT COUNT(*) > 0 FROM sqlite_master WHERE type = 'table' AND name = 'meta'",
                [],
                |r| r.get(0),
            )
            .map_err(|e| self.sql(e))?;
        if !has_meta {
            return Ok(None);
        }
        self.conn
            .query_row("SELECT value FROM meta WHERE key = 'gpu'", [], |r| r.get(0))
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// The GPU each outcome names (its `device`, as the driver named it),
    /// with how many outcomes name it, most first.
    pub fn outcome_gpus(&self) -> Result<Vec<(String, u64)>, StoreError> {
        let mut q = self
            .conn
            .prepare(
                "SELECT json_extract(outcome, '$.device') AS d, COUNT(*) FROM steps \
                 WHERE json_valid(outcome) AND d IS NOT NULL GROUP BY d ORDER BY 2 DESC, 1",
            )
            .map_err(|e| self.sql(e))?;
        let rows = q
            .query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, u64>(1)?)))
            .map_err(|e| self.sql(e))?;
        rows.collect::<Result<_, _>>().map_err(|e| self.sql(e))
    }

    /// The GPU the store's outcomes were judged on, for a command that
    /// reads them (`train`, `compare`, `rejudge`): `wanted` (`--gpu NAME`)
    /// where the store is that GPU's, else the store's own. A store whose
    /// outcomes name several GPUs is refused ([`StoreError::MixedGpus`]),
    /// and so is one of another GPU than `wanted`
    /// ([`StoreError::NotThatGpu`]). Names compare without case, and a
    /// driver's name holds the table's (`NVIDIA H200` is the `H200`).
    pub fn gpu_for(&self, wanted: Option<&str>) -> Result<Option<String>, StoreError> {
        let outcomes = self.outcome_gpus()?;
        if outcomes.len() > 1 {
            let gpus: Vec<String> = outcomes.iter().map(|(g, n)| format!("{g} ({n})")).collect();
            return Err(StoreError::MixedGpus {
                path: self.path.clone(),
                gpus: gpus.join(" and "),
            });
        }
        let recorded = self
            .gpu()?
            .or_else(|| outcomes.first().map(|(g, _)| g.clone()));
        let names = |recorded: &str, wanted: &str| {
            let (r, w) = (recorded.to_lowercase(), wanted.to_lowercase());
            r == w || r.split_whitespace().any(|word| word == w)
        };
        match (recorded, wanted) {
            (Some(r), Some(w)) if !names(&r, w) => Err(StoreError::NotThatGpu {
                path: self.path.clone(),
                recorded: r,
                wanted: w.to_string(),
            }),
            (Some(r), _) => Ok(Some(r)),
            (None, w) => Ok(w.map(str::to_string)),
        }
    }

    /// Before outcomes judged on the GPU `gpu` (a device table name such
    /// as `H100` where the driver's name has one) are written: a store
    /// that names another GPU is refused ([`StoreError::OtherGpu`]), one
    /// that names none is made to name this one. Until then, a store
    /// names nothing and reads as before.
    pub fn claim_gpu(&self, gpu: &str) -> Result<Claim, StoreError> {
        match self.gpu()? {
            Some(recorded) if recorded == gpu => return Ok(Claim::Same),
            Some(recorded) => {
                return Err(StoreError::OtherGpu {
                    path: self.path.clone(),
                    recorded,
                    this: gpu.to_string(),
                });
            }
            None => {}
        }
        let judged: bool = self
            .conn
            .query_row(
                "SELECT COUNT(*) > 0 FROM evaluations WHERE status NOT IN (?1, ?2)",
                [Status::CompiledOnly.name(), Status::CompileError.name()],
                |r| r.get(0),
            )
            .map_err(|e| self.sql(e))?;
        self.name_gpu(gpu)?;
        Ok(if judged { Claim::Unnamed } else { Claim::New })
    }

    fn name_gpu(&self, gpu: &str) -> Result<(), StoreError> {
        self.conn
            .execute_batch(
                "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)",
            )
            .map_err(|e| self.sql(e))?;
        self.conn
            .execute(
                "INSERT OR REPLACE INTO meta (key, value) VALUES ('gpu', ?1)",
                [gpu],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// Records (or replaces) what the planner knows of a problem.
    pub fn put_problem(&self, p: &Problem) -> Result<(), StoreError> {
        let text = serde_json::to_string(p).map_err(|e| self.json(e))?;
        self.conn
            .execute(
                "INSERT OR REPLACE INTO problems (name, pattern, problem) VALUES (?1, ?2, ?3)",
                params![p.name, p.pattern, text],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// Every recorded problem, by name (a shape recorded before it had a
    /// convolutions flag takes it from the graph features; graph features
    /// recorded before the rewrites' flags get them cleared:
    /// [`Problem::upgraded`]).
    pub fn problems(&self) -> Result<Vec<Problem>, StoreError> {
        Ok(self
            .problems_as_recorded()?
            .into_iter()
            .map(|p| {
                let mut p = p.upgraded();
                p.shape.convolutions |= p.has_convolutions();
                p
            })
            .collect())
    }

    /// The recorded problems whose graph features came before the
    /// rewrites' flags (they read them cleared: [`Problem::upgraded`]),
    /// by name.
    pub fn problems_without_rewrite_flags(&self) -> Result<Vec<String>, StoreError> {
        Ok(self
            .problems_as_recorded()?
            .into_iter()
            .filter(Problem::lacks_rewrite_flags)
            .map(|p| p.name)
            .collect())
    }

    /// Every recorded problem as its record reads, by name.
    fn problems_as_recorded(&self) -> Result<Vec<Problem>, StoreError> {
        let mut q = self
            .conn
            .prepare("SELECT problem FROM problems ORDER BY name")
            .map_err(|e| self.sql(e))?;
        let rows: Vec<String> = q
            .query_map([], |r| r.get(0))
            .and_then(|rows| rows.collect())
            .map_err(|e| self.sql(e))?;
        rows.iter()
            .map(|t| serde_json::from_str(t).map_err(|e| self.json(e)))
            .collect()
    }

    /// Starts an episode; returns its id.
    pub fn begin_episode(
        &self,
        problem: &str,
        planner: &str,
        version: &str,
        seed: u64,
    ) -> Result<i64, StoreError> {
        self.conn
            .execute(
                "INSERT INTO episodes (problem, planner, planner_version, seed, started_at)
                 VALUES (?1, ?2, ?3, ?4, ?5)",
                params![problem, planner, version, seed as i64, now()],
            )
            .map_err(|e| self.sql(e))?;
        Ok(self.conn.last_insert_rowid())
    }

    /// Closes an episode with its best speedup.
    pub fn end_episode(&self, id: i64, best_speedup: f64) -> Result<(), StoreError> {
        self.conn
            .execute(
                "UPDATE episodes SET finished_at = ?2, best_speedup = ?3 WHERE id = ?1",
                params![id, now(), best_speedup],
            )
            .map_err(|e| self.sql(e))?;
        Ok(())
    }

    /// Writes one step (and the evaluation it made) in one transaction.
    pub fn add_step(
        &mut self,
        problem: &Problem,
        version: &str,
        s: &StepRecord,
    ) -> Result<i64, StoreError> {
        let obs = serde_json::to_string(&s.observation).map_err(|e| self.json(e))?;
        let diagnosis = s
            .diagnosis
            .as_ref()
            .map(serde_json::to_string)
            .transpose()
            .map_err(|e| self.json(e))?;
        let path = self.path.clone();
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        let tx = self.conn.transaction().map_err(err)?;
        tx.execute(
            "INSERT INTO steps (episode, step, problem, pattern, state, observation, action,
                action_name, next_state, fragment_hash, code, status, speedup, outcome, diagnosis,
                critique, reward, best_speedup, started_at, finished_at, planner_version)
             VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12, ?13, ?14, ?15, ?16,
                ?17, ?18, ?19, ?20, ?21)",
            params![
                s.episode,
                s.step as i64,
                problem.name,
                problem.pattern,
                s.state,
                obs,
                s.action.index() as i64,
                s.action.label(),
                s.next_state,
                s.fragment_hash,
                s.code,
                s.diagnosis.as_ref().map(|d| d.status.name()),
                s.diagnosis.as_ref().and_then(correct_speedup),
                s.outcome,
                diagnosis,
                s.diagnosis.as_ref().map(Diagnosis::text),
                s.reward,
                s.best_speedup,
                s.started_at,
                now(),
                version,
            ],
        )
        .map_err(err)?;
        let id = tx.last_insert_rowid();
        if let (Some(d), Some(text), false) = (&s.diagnosis, &diagnosis, s.reused) {
            put_evaluation(&tx, &problem.name, &s.next_state, d, text, &s.fragment_hash)
                .map_err(err)?;
        }
        tx.commit().map_err(err)?;
        Ok(id)
    }

    /// The recorded evaluations of `problem`: the diagnosis of each
    /// program, by key.
    pub fn evaluations(&self, problem: &str) -> Result<BTreeMap<String, Diagnosis>, StoreError> {
        self.diagnoses(
            "SELECT key, diagnosis FROM evaluations WHERE problem = ?1",
            &[problem],
        )
    }

    /// The recorded evaluations of `problem` that episodes of `planner`
    /// reached (as a step's program), by key: the tree that planner's
    /// episodes alone built.
    pub fn evaluations_by(
        &self,
        problem: &str,
        planner: &str,
    ) -> Result<BTreeMap<String, Diagnosis>, StoreError> {
        self.diagnoses(
            "SELECT e.key, e.diagnosis FROM evaluations e
             WHERE e.problem = ?1 AND EXISTS (
                 SELECT 1 FROM steps s JOIN episodes p ON s.episode = p.id
                 WHERE s.problem = e.problem AND s.next_state = e.key AND p.planner = ?2)",
            &[problem, planner],
        )
    }

    /// The `(key, diagnosis)` rows of `sql` (whose first argument is the
    /// problem), decoded, by key. Where some recorded outcome of the
    /// problem found its reference TF32-rounded, every diagnosis of a run
    /// that checked values says so: diagnoses recorded before they held
    /// the flag are read as a run today would write them.
    fn diagnoses(
        &self,
        sql: &str,
        args: &[&str],
    ) -> Result<BTreeMap<String, Diagnosis>, StoreError> {
        let mut q = self.conn.prepare(sql).map_err(|e| self.sql(e))?;
        let rows: Vec<(String, String)> = q
            .query_map(rusqlite::params_from_iter(args), |r| {
                Ok((r.get(0)?, r.get(1)?))
            })
            .and_then(|rows| rows.collect())
            .map_err(|e| self.sql(e))?;
        let tf32 = !rows.is_empty() && self.reference_tf32(args[0])?;
        rows.into_iter()
            .map(|(k, d)| {
                let mut d: Diagnosis = serde_json::from_str(&d).map_err(|e| self.json(e))?;
                d.reference_tf32 |= tf32 && matches!(d.status, Status::Correct | Status::Incorrect);
                Ok((k, d))
            })
            .collect()
    }

    /// Whether some recorded outcome of `problem` found its reference
    /// outputs TF32-rounded (`Outcome::reference_tf32`).
    pub fn reference_tf32(&self, problem: &str) -> Result<bool, StoreError> {
        self.conn
            .query_row(
                "SELECT EXISTS (SELECT 1 FROM steps WHERE problem = ?1
                     AND instr(outcome, '\"reference_tf32\":true') > 0)
                 OR EXISTS (SELECT 1 FROM evaluations WHERE problem = ?1
                     AND instr(diagnosis, '\"reference_tf32\":true') > 0)",
                [problem],
                |r| r.get(0),
            )
            .map_err(|e| self.sql(e))
    }

    /// The planners that recorded episodes of `problem`, by name.
    pub fn planners_of(&self, problem: &str) -> Result<Vec<String>, StoreError> {
        let mut q = self
            .conn
            .prepare("SELECT DISTINCT planner FROM episodes WHERE problem = ?1 ORDER BY planner")
            .map_err(|e| self.sql(e))?;
        q.query_map([problem], |r| r.get(0))
            .and_then(|rows| rows.collect())
            .map_err(|e| self.sql(e))
    }

    /// Records program `key` of `problem` judged again outside an episode
    /// (`mtmc rejudge`): its diagnosis and the hash of the fragments
    /// judged replace the recorded ones, as a step's would. A compile-only
    /// outcome (no GPU) never replaces a timed one: whether it was kept.
    pub fn judged_again(
        &mut self,
        problem: &str,
        key: &str,
        d: &Diagnosis,
        hash: &str,
    ) -> Result<bool, StoreError> {
        let text = serde_json::to_string(d).map_err(|e| self.json(e))?;
        let rows =
            put_evaluation(&self.conn, problem, key, d, &text, hash).map_err(|e| self.sql(e))?;
        Ok(rows > 0)
    }

    /// The evaluation of one program of `problem`, if recorded (read as
    /// [`Store::evaluations`] reads it).
    pub fn evaluation(&self, problem: &str, key: &str) -> Result<Option<Diagnosis>, StoreError> {
        Ok(self
            .diagnoses(
                "SELECT key, diagnosis FROM evaluations WHERE problem = ?1 AND key = ?2",
                &[problem, key],
            )?
            .remove(key))
    }

    /// The SHA-256 of the fragments whose evaluation of program `key` of
    /// `problem` is recorded: empty where nothing was built; `None` when
    /// there is no evaluation. In a store written before reused steps kept
    /// the evaluation's hash, a step that took the recorded outcome wrote
    /// an empty one over it: the hash is then that of the last step that
    /// built the program, where one did.
    pub fn evaluation_hash(&self, problem: &str, key: &str) -> Result<Option<String>, StoreError> {
        let mut q = self
            .conn
            .prepare_cached(
                "SELECT CASE WHEN e.fragment_hash != '' THEN e.fragment_hash ELSE COALESCE(
                    (SELECT s.fragment_hash FROM steps s WHERE s.problem = e.problem
                        AND s.next_state = e.key AND s.fragment_hash != ''
                        ORDER BY s.id DESC LIMIT 1), '') END
                 FROM evaluations e WHERE e.problem = ?1 AND e.key = ?2",
            )
            .map_err(|e| self.sql(e))?;
        q.query_row(params![problem, key], |r| r.get(0))
            .optional()
            .map_err(|e| self.sql(e))
    }

    /// The knowledge base: for each action, the mean reward it earned on
    /// other problems with the same op-class pattern (or, with fewer than
    /// `MIN_SIMILAR` such steps, on problems whose pattern starts with the
    /// same class), clipped to [-1, 1]; 0 where it was never taken. Only
    /// the steps of problems that `known` accepts are read, so that a
    /// held-out problem's outcomes never reach the planner's observations.
    pub fn prior(
        &self,
        pattern: &str,
        problem: &str,
        known: &dyn Fn(&str) -> bool,
    ) -> Result<[f32; ACTIONS], StoreError> {
        const MIN_SIMILAR: i64 = 8;
        // (action, mean reward, steps) over the known problems.
        let query = |sql: &str, key: &str| -> Result<Vec<(i64, f64, i64)>, StoreError> {
            let mut q = self.conn.prepare_cached(sql).map_err(|e| self.sql(e))?;
            let rows: Vec<(String, i64, f64, i64)> = q
                .query_map(params![key, problem], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?))
                })
                .and_then(|rows| rows.collect())
                .map_err(|e| self.sql(e))?;
            let mut by_action: BTreeMap<i64, (f64, i64)> = BTreeMap::new();
            for (name, action, sum, n) in rows {
                if known(&name) {
                    let e = by_action.entry(action).or_default();
                    e.0 += sum;
                    e.1 += n;
                }
            }
            Ok(by_action
                .into_iter()
                .map(|(a, (sum, n))| (a, sum / n as f64, n))
                .collect())
        };
        let mut rows = query(
            "SELECT problem, action, SUM(reward), COUNT(*) FROM steps
             WHERE pattern = ?1 AND problem != ?2 GROUP BY problem, action",
            pattern,
        )?;
        if rows.iter().map(|r| r.2).sum::<i64>() < MIN_SIMILAR {
            let head = pattern.split(['+', '*']).next().unwrap_or(pattern);
            rows = query(
                "SELECT problem, action, SUM(reward), COUNT(*) FROM steps
                 WHERE (pattern = ?1 OR pattern LIKE ?1 || '+%' OR pattern LIKE ?1 || '*%')
                   AND problem != ?2 GROUP BY problem, action",
                head,
            )?;
        }
        let mut prior = [0.0f32; ACTIONS];
        for (a, mean, _) in rows {
            if let Some(p) = prior.get_mut(a as usize) {
                *p = mean.clamp(-1.0, 1.0) as f32;
            }
        }
        Ok(prior)
    }

    /// Finished episodes of `planner`, by problem.
    pub fn finished_episodes(&self, planner: &str) -> Result<BTreeMap<String, usize>, StoreError> {
        let mut q = self
            .conn
            .prepare(
                "SELECT problem, COUNT(*) FROM episodes
                 WHERE planner = ?1 AND finished_at IS NOT NULL GROUP BY problem",
            )
            .map_err(|e| self.sql(e))?;
        let rows: Vec<(String, i64)> = q
            .query_map([planner], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .map_err(|e| self.sql(e))?;
        Ok(rows.into_iter().map(|(p, n)| (p, n as usize)).collect())
    }

    /// The finished episodes of `planner` on `problem`, oldest first: each
    /// one's best speedup and its moves in order, with the programs they
    /// reached and how those were judged (what [`crate::episode::Episode`]
    /// needs to walk the episode again).
    pub fn finished_moves(
        &self,
        problem: &str,
        planner: &str,
    ) -> Result<Vec<(f64, Vec<Taken>)>, StoreError> {
        let mut q = self
            .conn
            .prepare(
                "SELECT id, best_speedup FROM episodes WHERE problem = ?1 AND planner = ?2
                 AND finished_at IS NOT NULL ORDER BY id",
            )
            .map_err(|e| self.sql(e))?;
        let episodes: Vec<(i64, Option<f64>)> = q
            .query_map(params![problem, planner], |r| Ok((r.get(0)?, r.get(1)?)))
            .and_then(|rows| rows.collect())
            .map_err(|e| self.sql(e))?;
        let mut q = self
            .conn
            .prepare(
                "SELECT action, next_state, diagnosis, fragment_hash, outcome FROM steps
                 WHERE episode = ?1 ORDER BY step",
            )
            .map_err(|e| self.sql(e))?;
        let mut out = Vec::new();
        for (id, best) in episodes {
            type Row = (i64, String, Option<String>, String, String);
            let rows: Vec<Row> = q
                .query_map([id], |r| {
                    Ok((r.get(0)?, r.get(1)?, r.get(2)?, r.get(3)?, r.get(4)?))
                })
                .and_then(|rows| rows.collect())
                .map_err(|e| self.sql(e))?;
            let moves = rows
                .into_iter()
                .map(|(action, next_state, d, fragment_hash, outcome)| {
                    let mean_ms = serde_json::from_str::<serde_json::Value>(&outcome)
                        .ok()
                        .and_then(|o| o["runtime"]["mean_ms"].as_f64());
                    Ok(Taken {
                        action: action as usize,
                        next_state,
                        diagnosis: d
                            .filter(|d| !d.is_empty())
                            .map(|d| serde_json::from_str(&d))
                            .transpose()
                            .map_err(|e| self.json(e))?,
                        fragment_hash,
                        mean_ms,
                    })
                })
                .collect::<Result<Vec<_>, StoreError>>()?;
            out.push((best.unwrap_or(0.0), moves));
        }
        Ok(out)
    }

    /// Every recorded step, in episode and step order, observations in
    /// this build's layout where they can be ([`crate::features::upgrade`]).
    pub fn steps(&self) -> Result<Vec<Recorded>, StoreError> {
        let mut q = self
            .conn
            .prepare(
                "SELECT problem, episode, step, observation, action, reward, best_speedup, speedup
                 FROM steps ORDER BY episode, step",
            )
            .map_err(|e| self.sql(e))?;
        type Row = (String, i64, i64, String, i64, f64, f64, Option<f64>);
        let rows: Vec<Row> = q
            .query_map([], |r| {
                Ok((
                    r.get(0)?,
                    r.get(1)?,
                    r.get(2)?,
                    r.get(3)?,
                    r.get(4)?,
                    r.get(5)?,
                    r.get(6)?,
                    r.get(7)?,
                ))
            })
            .and_then(|rows| rows.collect())
            .map_err(|e| self.sql(e))?;
        rows.into_iter()
            .map(
                |(problem, episode, step, obs, action, reward, best, speedup)| {
                    Ok(Recorded {
                        problem,
                        episode,
                        step: step as usize,
                        observation: crate::features::upgrade(
                            serde_json::from_str(&obs).map_err(|e| self.json(e))?,
                        ),
                        action: action as usize,
                        reward,
                        best_speedup: best,
                        speedup,
                    })
                },
            )
            .collect()
    }

    /// Copies every problem, episode, step and evaluation of the store at
    /// `from` (plain or gzipped, left unchanged) into this one, in one
    /// transaction: a failure leaves this store as it was. Episodes get
    /// new ids after this store's, and their steps follow them. A problem
    /// recorded in both keeps this store's description; a program judged
    /// in both takes `from`'s outcome, as if its steps had been recorded
    /// after this store's (the same rule as [`Store::add_step`]). An
    /// episode this store already holds is skipped with its steps.
    pub fn merge(&mut self, from: &Path) -> Result<Merged, StoreError> {
        let same = |a: &Path, b: &Path| match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => false,
        };
        if same(from, &self.path) {
            return Err(StoreError::SelfMerge {
                path: self.path.clone(),
            });
        }
        // Opened to check it is a store (and to unpack it); SQLite reads
        // its write-ahead log through the attached copy too.
        let source = Store::open_to_read(from)?;
        let (ours, theirs) = (self.gpu()?, source.gpu()?);
        match (&ours, &theirs) {
            (Some(o), Some(t)) if o != t => {
                return Err(StoreError::MergeGpus {
                    path: self.path.clone(),
                    from: from.to_path_buf(),
                    ours: o.clone(),
                    theirs: t.clone(),
                });
            }
            _ => {}
        }
        let file = source
            ._unpacked
            .as_ref()
            .map_or_else(|| from.to_path_buf(), |d| d.path().join("store.sqlite"));
        let path = self.path.clone();
        let err = |source| StoreError::Sqlite {
            path: path.clone(),
            source,
        };
        self.conn
            .execute(
                "ATTACH DATABASE ?1 AS source",
                [file.to_string_lossy().as_ref()],
            )
            .map_err(err)?;
        let merged = (|| -> rusqlite::Result<Merged> {
            let tx = self.conn.transaction()?;
            let only = Status::CompiledOnly.name();
            let count = |sql: &str, args: &[&str]| {
                tx.query_row(sql, rusqlite::params_from_iter(args), |r| {
                    r.get::<_, i64>(0)
                })
            };
            let offset = count("SELECT COALESCE(MAX(id), 0) FROM main.episodes", &[])?;
            let replaced = count(
                "SELECT COUNT(*) FROM source.evaluations s JOIN main.evaluations m
                 ON s.problem = m.problem AND s.key = m.key
                 WHERE (s.status IS NOT m.status OR s.speedup IS NOT m.speedup)
                    AND (s.status != ?1 OR m.status = ?1)",
                &[only],
            )? as usize;
            let kept = count(
                "SELECT COUNT(*) FROM source.evaluations s JOIN main.evaluations m
                 ON s.problem = m.problem AND s.key = m.key
                 WHERE s.status = ?1 AND m.status != ?1",
                &[only],
            )? as usize;
            let fresh = count(
                "SELECT COUNT(*) FROM source.evaluations s WHERE NOT EXISTS
                 (SELECT 1 FROM main.evaluations m WHERE s.problem = m.problem AND s.key = m.key)",
                &[],
            )? as usize;
            let problems = tx.execute(
                "INSERT OR IGNORE INTO main.problems (name, pattern, problem)
                 SELECT name, pattern, problem FROM source.problems",
                [],
            )?;
            let episodes = tx.execute(
                "INSERT INTO main.episodes (id, problem, planner, planner_version, seed,
                    started_at, finished_at, best_speedup)
                 SELECT id + ?1, problem, planner, planner_version, seed, started_at,
                    finished_at, best_speedup FROM source.episodes s
                 WHERE NOT EXISTS (SELECT 1 FROM main.episodes m WHERE m.problem = s.problem
                    AND m.planner = s.planner AND m.seed = s.seed
                    AND m.started_at = s.started_at)
                 ORDER BY id",
                [offset],
            )?;
            let skipped = count("SELECT COUNT(*) FROM source.episodes", &[])? as usize - episodes;
            let steps = tx.execute(
                "INSERT INTO main.steps (episode, step, problem, pattern, state, observation,
                    action, action_name, next_state, fragment_hash, code, status, speedup,
                    outcome, diagnosis, critique, reward, best_speedup, started_at, finished_at,
                    planner_version)
                 SELECT episode + ?1, step, problem, pattern, state, observation, action,
                    action_name, next_state, fragment_hash, code, status, speedup, outcome,
                    diagnosis, critique, reward, best_speedup, started_at, finished_at,
                    planner_version FROM source.steps
                 WHERE episode + ?1 IN (SELECT id FROM main.episodes) ORDER BY id",
                [offset],
            )?;
            tx.execute(
                &format!(
                    "INSERT INTO main.evaluations (problem, key, status, speedup,
                        diagnosis, fragment_hash)
                     SELECT problem, key, status, speedup, diagnosis, fragment_hash
                     FROM source.evaluations WHERE true {}",
                    keep_timed("?1")
                ),
                params![only],
            )?;
            tx.commit()?;
            Ok(Merged {
                problems,
                episodes,
                skipped,
                steps,
                evaluations: fresh,
                replaced,
                kept,
                named_gpu: None,
            })
        })();
        let detached = self.conn.execute("DETACH DATABASE source", []);
        let mut merged = merged.map_err(err)?;
        detached.map_err(err)?;
        // A store that named no GPU takes the one the merged store names.
        if let (None, Some(t)) = (ours, theirs) {
            self.name_gpu(&t)?;
            merged.named_gpu = Some(t);
        }
        Ok(merged)
    }

    /// `PRAGMA integrity_check`'s answer (`ok` for a sound file).
    pub fn integrity(&self) -> Result<String, StoreError> {
        self.conn
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .map_err(|e| self.sql(e))
    }
}

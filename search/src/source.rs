//! Where problems and their graphs come from.
//!
//! Problems: a KernelBench `problems.jsonl`, a KernelBench checkout
//! (`KernelBench/level{1,2,3,4}/*.py`), or — when neither is given — the
//! traces built into this binary (the 200 shared problems, graphs only).
//!
//! Graphs: a problem's trace is looked up by the SHA-256 of its code, first in
//! the traces built into the binary, then in the cache; a problem with
//! neither is traced on the fly with Python and torch, and the trace cached.

use std::collections::HashMap;
use std::io::IsTerminal;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use mtmc_actions::OpGraph;
use mtmc_actions::import::{Trace, import_trace, parse_trace};
use mtmc_actions::problem::{self, Problem};
use sha2::{Digest, Sha256};

/// The traces of the shared KernelBench problems.
const BUILTIN_TRACES: &str = mtmc_actions::import::SHARED_TRACES;

/// Environment variable for the KernelBench path.
pub const KERNELBENCH_ENV: &str = "MTMC_KERNELBENCH";

/// Where the problem list came from.
pub enum Origin {
    /// A JSONL file.
    Jsonl(PathBuf),
    /// A KernelBench checkout.
    Checkout(PathBuf),
    /// The traces built into the binary.
    Builtin,
}

/// A set of problems and the means to get their graphs.
pub struct Problems {
    /// The problems, sorted by (level, number).
    pub list: Vec<Problem>,
    /// Where they came from.
    pub origin: Origin,
    /// Code hash → trace line of the built-in set.
    builtin: HashMap<String, &'static str>,
    /// Problem id → code hash, for built-in problems without code.
    hashes: HashMap<String, String>,
}

/// A problem's graph, or why there is none.
pub struct Traced {
    /// The trace it came from; `None` when tracing could not run.
    pub trace: Option<Trace>,
    /// The imported graph, or why it failed.
    pub graph: Result<OpGraph, String>,
}

/// The SHA-256 of `data` in lowercase hex.
pub fn sha256_hex(data: impl AsRef<[u8]>) -> String {
    let digest = Sha256::digest(data.as_ref());
    digest.iter().map(|b| format!("{b:02x}")).collect()
}

fn builtin_index() -> HashMap<String, &'static str> {
    let mut map = HashMap::new();
    for line in BUILTIN_TRACES.lines().filter(|l| !l.trim().is_empty()) {
        // The hash sits near the start of each line; a full parse is deferred.
        if let Some(start) = line.find("\"code_sha256\": \"") {
            let rest = &line[start + 16..];
            if let Some(end) = rest.find('"') {
                map.insert(rest[..end].to_string(), line);
            }
        }
    }
    map
}

impl Problems {
    /// Loads problems from `path` (a JSONL file or a KernelBench checkout), or
    /// the built-in set when `path` is `None`.
    pub fn load(path: Option<&Path>) -> Result<Problems> {
        let builtin = builtin_index();
        let mut hashes = HashMap::new();
        let (list, origin) = match path {
            None => {
                let mut list = Vec::new();
                for (hash, line) in &builtin {
                    let trace = parse_trace(line).context("a built-in trace is unreadable")?;
                    let (Some(level), Some(name)) = (trace.level, trace.name) else {
                        continue;
                    };
                    let p = problem::problem_from_file(level, &name, String::new())?;
                    hashes.insert(p.id(), hash.clone());
                    list.push(p);
                }
                (list, Origin::Builtin)
            }
            Some(path) => {
                let meta = std::fs::metadata(path).with_context(|| {
                    format!(
                        "cannot read KernelBench path `{}`; pass --kernelbench with a problems.jsonl or a KernelBench checkout",
                        path.display()
                    )
                })?;
                if meta.is_dir() {
                    (load_checkout(path)?, Origin::Checkout(path.to_path_buf()))
                } else {
                    let text = std::fs::read_to_string(path)
                        .with_context(|| format!("cannot read `{}`", path.display()))?;
                    let list = problem::parse_jsonl(&text).with_context(|| {
                        format!(
                            "`{}` is not a KernelBench problems.jsonl (one {{level, problem_id, name, code}} object per line)",
                            path.display()
                        )
                    })?;
                    (list, Origin::Jsonl(path.to_path_buf()))
                }
            }
        };
        let mut list = list;
        list.sort_by_key(|p| (p.level, p.number));
        Ok(Problems {
            list,
            origin,
            builtin,
            hashes,
        })
    }

    /// Finds one problem by name.
    pub fn find(&self, query: &str) -> Result<&Problem> {
        Ok(problem::find(&self.list, query)?)
    }

    /// An error naming the first of `levels` no problem is of, and the
    /// levels there are.
    pub fn check_levels(&self, levels: &[u32]) -> Result<()> {
        let there: std::collections::BTreeSet<u32> = self.list.iter().map(|p| p.level).collect();
        if let Some(l) = levels.iter().find(|l| !there.contains(l)) {
            let words: Vec<String> = there.iter().map(u32::to_string).collect();
            bail!(
                "--level {l}: no problem is of level {l}; the problems' levels are {}",
                words.join(", ")
            );
        }
        Ok(())
    }

    /// The problems named in `names`, then every problem `also` takes, each
    /// once, in that order.
    pub fn choose(
        &self,
        names: &[String],
        also: impl Fn(&Problem) -> bool,
    ) -> Result<Vec<&Problem>> {
        let mut chosen = Vec::new();
        for name in names {
            chosen.push(self.find(name)?);
        }
        chosen.extend(self.list.iter().filter(|p| also(p)));
        let mut seen = std::collections::HashSet::new();
        chosen.retain(|p| seen.insert(p.full_name()));
        Ok(chosen)
    }

    fn hash(&self, p: &Problem) -> String {
        match self.hashes.get(&p.id()) {
            Some(h) => h.clone(),
            None => sha256_hex(&p.code),
        }
    }

    /// The graphs of `problems`, tracing in one Python run those that have
    /// no built-in or cached trace. When tracing cannot run, those problems
    /// get an entry saying why, and the others are still returned.
    pub fn graphs(&self, problems: &[&Problem]) -> Result<Vec<Traced>> {
        let cache = cache_dir().map(|d| d.join("traces"));
        let mut texts: Vec<Option<String>> = Vec::with_capacity(problems.len());
        let mut missing = Vec::new();
        let mut failure = None;
        let hashes: Vec<String> = problems.iter().map(|p| self.hash(p)).collect();
        for (i, hash) in hashes.iter().enumerate() {
            let text = self.builtin.get(hash).map(|s| s.to_string()).or_else(|| {
                let file = cache.as_ref()?.join(format!("{hash}.json"));
                std::fs::read_to_string(file).ok()
            });
            if text.is_none() {
                missing.push(i);
            }
            texts.push(text);
        }
        if !missing.is_empty() {
            let requests: Vec<_> = missing
                .iter()
                .map(|&i| mtmc_env::tracer::TraceRequest {
                    level: problems[i].level,
                    name: &problems[i].name,
                    code: &problems[i].code,
                })
                .collect();
            let tty = std::io::stderr().is_terminal();
            eprintln!(
                "tracing {} problem(s) without a stored trace (python + torch; traces are cached)",
                requests.len()
            );
            let traced = mtmc_env::tracer::trace(&requests, |done, total| {
                if tty {
                    eprint!("\r  traced {done}/{total}");
                }
            });
            if tty {
                eprintln!();
            }
            match traced {
                Ok(traced) => {
                    for (&i, text) in missing.iter().zip(traced) {
                        let ok = parse_trace(&text).is_ok_and(|t| t.status == "ok");
                        if let (Some(dir), true) = (&cache, ok) {
                            store(dir, &hashes[i], &text);
                        }
                        texts[i] = Some(text);
                    }
                }
                Err(e) => failure = Some(format!("cannot trace it: {e}")),
            }
        }
        texts
            .into_iter()
            .zip(problems)
            .map(|(text, p)| match (text, &failure) {
                (Some(text), _) => traced_from(&text, p),
                (None, Some(why)) => Ok(Traced {
                    trace: None,
                    graph: Err(why.clone()),
                }),
                (None, None) => {
                    unreachable!("a problem without a trace is traced or has a failure")
                }
            })
            .collect()
    }
}

fn traced_from(text: &str, p: &Problem) -> Result<Traced> {
    let trace =
        parse_trace(text).with_context(|| format!("the stored trace of {p} is unreadable"))?;
    let graph = import_trace(&trace)
        .map(|im| im.graph)
        .map_err(|e| e.to_string());
    Ok(Traced {
        trace: Some(trace),
        graph,
    })
}

/// Writes a trace atomically (temp file, then rename), so an interrupted
/// run never leaves half a trace in the cache.
fn store(dir: &Path, hash: &str, text: &str) {
    if std::fs::create_dir_all(dir).is_err() {
        return;
    }
    let tmp = dir.join(format!(".{hash}.{}.tmp", std::process::id()));
    if std::fs::write(&tmp, text).is_ok() {
        let _ = std::fs::rename(&tmp, dir.join(format!("{hash}.json")));
    }
}

/// Fails before anything runs where a command judges ModelNew files, which
/// are built from a problem's code, and one of `chosen` has none (the
/// built-in traces hold graphs only): the error names it and the fix.
pub fn require_code(command: &str, chosen: &[&Problem]) -> Result<()> {
    if let Some(p) = chosen.iter().find(|p| p.code.is_empty()) {
        bail!(
            "{command} builds each problem's ModelNew from its code, and {p} has none here (the built-in traces hold graphs only): pass --kernelbench PATH (a problems.jsonl or a KernelBench checkout)"
        );
    }
    Ok(())
}

/// `$MTMC_CACHE_DIR`, else `$XDG_CACHE_HOME/mtmc`, else `~/.cache/mtmc`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = std::env::var_os("MTMC_CACHE_DIR").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d));
    }
    if let Some(d) = std::env::var_os("XDG_CACHE_HOME").filter(|d| !d.is_empty()) {
        return Some(PathBuf::from(d).join("mtmc"));
    }
    std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache").join("mtmc"))
}

/// Reads `level{N}/*.py` under a checkout root, its `KernelBench/` folder, or
/// the folder itself.
fn load_checkout(root: &Path) -> Result<Vec<Problem>> {
    let base = [root.join("KernelBench"), root.to_path_buf()]
        .into_iter()
        .find(|b| (1..=4).any(|l| b.join(format!("level{l}")).is_dir()))
        .with_context(|| {
            format!(
                "`{}` holds no level1..level4 folders; pass the KernelBench checkout (or its KernelBench/ folder)",
                root.display()
            )
        })?;
    let mut out = Vec::new();
    for level in 1..=4u32 {
        let dir = base.join(format!("level{level}"));
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries {
            let path = entry?.path();
            if path.extension().is_none_or(|e| e != "py") {
                continue;
            }
            let file = path
                .file_name()
                .unwrap_or_default()
                .to_string_lossy()
                .into_owned();
            let code = std::fs::read_to_string(&path)
                .with_context(|| format!("cannot read `{}`", path.display()))?;
            match problem::problem_from_file(level, &file, code) {
                Ok(p) => out.push(p),
                Err(_) => continue, // helper modules without a problem number
            }
        }
    }
    problem::check_unique(&out)?;
    if out.is_empty() {
        bail!(
            "`{}` has level folders but no problem files",
            base.display()
        );
    }
    Ok(out)
}

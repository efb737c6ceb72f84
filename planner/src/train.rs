//! Training the policy with PPO on the recorded trajectory tree: curves as
//! CSV and SVG, a checkpoint after every iteration, resumable.
//!
//! Each iteration draws its randomness from `(seed, iteration)`, and the
//! checkpoint keeps Adam's state at full precision, so a run resumed after
//! an interruption continues as the uninterrupted run would have.

use std::ops::ControlFlow;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::episode::Reward;
use crate::policy::{Checkpoint, CheckpointError, CpuTrain, Device, Meta};
use crate::ppo::{AdamRecord, EpisodeSummary, Ppo, PpoConfig, rollout};
use crate::rng::Rng;
use crate::tree::{TreeEnv, TreeProblem};

/// Checkpoint format written by this version.
pub const FORMAT: u32 = 1;

/// One row of the training curves.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct CurveRow {
    /// Iteration (1-based).
    pub iteration: usize,
    /// Mean episode return of the iteration's rollouts.
    pub mean_return: f64,
    /// Geometric mean of the episodes' best speedups (nothing correct
    /// counts as 1: the library program).
    pub best_speedup: f64,
    /// Mean policy entropy over the update.
    pub entropy: f64,
    /// Mean value loss over the update.
    pub value_loss: f64,
    /// Mean clipped surrogate loss over the update.
    pub policy_loss: f64,
    /// Mean approximate KL of the update.
    pub approx_kl: f64,
    /// Transitions in the update.
    pub transitions: usize,
    /// Seconds the iteration took.
    pub seconds: f64,
}

/// A training error.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// Nothing to train on.
    #[error(
        "no recorded problem to train on: fill the store with `mtmc explore` first (or check --store)"
    )]
    Empty,
    /// The checkpoint could not be read or written.
    #[error(transparent)]
    Checkpoint(#[from] CheckpointError),
    /// The build cannot train on the device asked for.
    #[error(
        "this mtmc was built without burn's CUDA backend: build it with `cargo build --release --features cuda` to train with --device cuda"
    )]
    NoCuda,
    /// A run resumed with other settings than the checkpoint's.
    #[error(
        "checkpoint `{dir}` was trained with other settings ({differences}): resume it with the ones it was trained with (its meta.json lists them under `ppo`), or train a new one with another --out"
    )]
    Settings {
        /// The checkpoint folder.
        dir: PathBuf,
        /// What differs.
        differences: String,
    },
    /// A run resumed on other problems than the checkpoint's.
    #[error(
        "checkpoint `{dir}` was trained on {there}, and this run has {here}: resume it from the store it was trained on, with --validation as it was (or not), or train a new one with another --out"
    )]
    Problems {
        /// The checkpoint folder.
        dir: PathBuf,
        /// Its problems.
        there: String,
        /// This run's.
        here: String,
    },
    /// A run resumed to fewer iterations than the checkpoint holds.
    #[error(
        "checkpoint `{dir}` holds {done} iterations, more than --iterations {iterations}: pass --iterations {done} or more to resume it"
    )]
    Ahead {
        /// The checkpoint folder.
        dir: PathBuf,
        /// Iterations it holds.
        done: usize,
        /// Iterations asked for.
        iterations: usize,
    },
    /// The curves could not be written.
    #[error("cannot write `{path}`: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// Why.
        source: std::io::Error,
    },
}

/// Geometric mean of the episodes' best speedups, nothing correct counted
/// as 1.
pub fn geomean_best(s: &[EpisodeSummary]) -> f64 {
    if s.is_empty() {
        return 0.0;
    }
    (s.iter().map(|e| e.best.max(1e-9).ln()).sum::<f64>() / s.len() as f64).exp()
}

/// What a training run works on.
pub struct Run<'a> {
    /// The recorded trees of the training problems.
    pub problems: Arc<Vec<TreeProblem>>,
    /// PPO's settings.
    pub config: &'a PpoConfig,
    /// Iterations in all (a resumed run does the ones left).
    pub iterations: usize,
    /// The checkpoint folder.
    pub dir: &'a Path,
    /// Continue the checkpoint in `dir`.
    pub resume: bool,
    /// The committee's other members (folders inside `dir`), named in
    /// every meta written from the first iteration on: a run killed
    /// before they are trained leaves a checkpoint that is refused as a
    /// committee cut short, not one that acts as its first member alone.
    pub members: Vec<String>,
}

/// Trains on `device` for `run.iterations` more iterations (to that many
/// in all, when resuming from the checkpoint in `run.dir`), calling
/// `progress` after each, once its checkpoint and curves are written:
/// `ControlFlow::Break` stops the run there (a stop asked for), and a
/// later `resume` continues it exactly. Returns every curve row, old and
/// new. The checkpoint is the same whatever the device (burn's recorder
/// at full precision), so a policy trained on the GPU acts on the CPU.
pub fn train(
    device: Device,
    run: Run<'_>,
    progress: impl FnMut(&CurveRow) -> ControlFlow<()>,
) -> Result<Vec<CurveRow>, TrainError> {
    match device {
        Device::Cpu => train_with::<CpuTrain>(&Default::default(), run, progress),
        #[cfg(feature = "cuda")]
        Device::Cuda => train_with::<crate::policy::CudaTrain>(&Default::default(), run, progress),
        #[cfg(not(feature = "cuda"))]
        Device::Cuda => Err(TrainError::NoCuda),
    }
}

fn train_with<B: AutodiffBackend>(
    device: &B::Device,
    run: Run<'_>,
    mut progress: impl FnMut(&CurveRow) -> ControlFlow<()>,
) -> Result<Vec<CurveRow>, TrainError> {
    let Run {
        problems,
        config,
        iterations,
        dir,
        resume,
        members,
    } = run;
    if problems.is_empty() {
        return Err(TrainError::Empty);
    }
    let device = device.clone();
    let ck = Checkpoint::at(dir);
    let mut ppo = Ppo::<B>::new(config.clone(), &device);
    let mut start = 0;
    let csv = dir.join("curves.csv");
    let mut rows: Vec<CurveRow> = Vec::new();
    let digest = problems_digest(&problems);
    if resume && ck.exists() {
        let (net, meta) = ck.load::<B>(&device)?;
        resumable(dir, &meta, config, &digest, iterations)?;
        ppo.net = net;
        if let Some(rec) = ck.load_optimizer::<B, AdamRecord<B>>(&device)? {
            ppo.optim = ppo.optim.load_record(rec);
        }
        start = meta.iteration;
        rows = read_curves(&csv)
            .into_iter()
            .filter(|r| r.iteration <= start)
            .collect();
    }
    std::fs::create_dir_all(dir).map_err(|source| TrainError::Io {
        path: dir.to_path_buf(),
        source,
    })?;
    for it in start..iterations {
        let t0 = Instant::now();
        let seed = config.seed.wrapping_mul(1_000_003).wrapping_add(it as u64);
        let mut env = TreeEnv::new(problems.clone(), config.max_steps, seed).with_reward(Reward {
            step: -config.step_cost,
            ..Reward::default()
        });
        let mut rng = Rng::new(seed ^ 0xA5A5);
        let (t, summaries) = rollout(
            &ppo.acting(),
            &mut env,
            config.episodes,
            false,
            &mut rng,
            &device,
        );
        let stats = ppo.update(&t, &mut rng);
        let row = CurveRow {
            iteration: it + 1,
            mean_return: summaries.iter().map(|s| s.ret).sum::<f64>()
                / summaries.len().max(1) as f64,
            best_speedup: geomean_best(
                &summaries
                    .iter()
                    .map(|s| EpisodeSummary {
                        best: s.best.max(1.0),
                        ..s.clone()
                    })
                    .collect::<Vec<_>>(),
            ),
            entropy: stats.entropy,
            value_loss: stats.value_loss,
            policy_loss: stats.policy_loss,
            approx_kl: stats.approx_kl,
            transitions: stats.transitions,
            seconds: t0.elapsed().as_secs_f64(),
        };
        rows.push(row.clone());
        let meta = Meta {
            format: FORMAT,
            obs: crate::features::OBS,
            actions: crate::space::ACTIONS,
            hidden: config.hidden,
            iteration: it + 1,
            seed: config.seed,
            version: format!("{}+it{}", env!("CARGO_PKG_VERSION"), it + 1),
            members: members.clone(),
            ppo: Some(config.clone()),
            problems: Some(digest.clone()),
        };
        // The curves first: a kill between the two leaves a checkpoint
        // whose iteration the curves hold, and resuming drops their rows
        // past it.
        write_curves(dir, &rows)?;
        ck.save(&ppo.net, Some(ppo.optim.to_record()), &meta)?;
        if progress(&row).is_break() {
            break;
        }
    }
    Ok(rows)
}

/// The problems a run trains on, as a checkpoint keeps them: their count
/// and the first 16 hex digits of the SHA-256 of their names, a line each.
pub fn problems_digest(problems: &[TreeProblem]) -> String {
    use sha2::{Digest, Sha256};
    let mut names: Vec<&str> = problems.iter().map(|p| p.problem.name.as_str()).collect();
    names.sort_unstable();
    let hash = Sha256::digest(names.join("\n").as_bytes());
    let hex: String = hash.iter().take(8).map(|b| format!("{b:02x}")).collect();
    format!("{} problems (names {hex})", names.len())
}

/// Whether the checkpoint `meta` in `dir` can be resumed as asked: with
/// the settings and problems it was trained with (those its meta keeps;
/// a checkpoint of an earlier build keeps the hidden units and the seed
/// alone), to no fewer iterations than it holds.
fn resumable(
    dir: &Path,
    meta: &Meta,
    config: &PpoConfig,
    digest: &str,
    iterations: usize,
) -> Result<(), TrainError> {
    let differences = match &meta.ppo {
        Some(there) => there.differences(config),
        None => PpoConfig {
            hidden: meta.hidden,
            seed: meta.seed,
            ..config.clone()
        }
        .differences(config),
    };
    if !differences.is_empty() {
        return Err(TrainError::Settings {
            dir: dir.to_path_buf(),
            differences: differences.join(", "),
        });
    }
    if let Some(there) = meta.problems.as_deref().filter(|there| *there != digest) {
        return Err(TrainError::Problems {
            dir: dir.to_path_buf(),
            there: there.to_string(),
            here: digest.to_string(),
        });
    }
    if meta.iteration > iterations {
        return Err(TrainError::Ahead {
            dir: dir.to_path_buf(),
            done: meta.iteration,
            iterations,
        });
    }
    Ok(())
}

const HEADER: &str = "iteration,mean_return,best_speedup,entropy,value_loss,policy_loss,approx_kl,transitions,seconds";

fn read_curves(path: &Path) -> Vec<CurveRow> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Vec::new();
    };
    text.lines()
        .skip(1)
        .filter_map(|l| {
            let f: Vec<&str> = l.split(',').collect();
            let x = |i: usize| f.get(i).and_then(|s| s.parse::<f64>().ok());
            Some(CurveRow {
                iteration: x(0)? as usize,
                mean_return: x(1)?,
                best_speedup: x(2)?,
                entropy: x(3)?,
                value_loss: x(4)?,
                policy_loss: x(5)?,
                approx_kl: x(6)?,
                transitions: x(7)? as usize,
                seconds: x(8)?,
            })
        })
        .collect()
}

/// Writes `curves.csv` and `curves.svg` in `dir`, each under a temporary
/// name and then renamed, so that a kill leaves the previous ones whole.
pub fn write_curves(dir: &Path, rows: &[CurveRow]) -> Result<(), TrainError> {
    let io = |path: PathBuf| move |source| TrainError::Io { path, source };
    let write = |name: &str, text: &str| {
        let (tmp, path) = (dir.join(format!("{name}.tmp")), dir.join(name));
        std::fs::write(&tmp, text).map_err(io(tmp.clone()))?;
        std::fs::rename(&tmp, &path).map_err(io(path))
    };
    let mut text = format!("{HEADER}\n");
    for r in rows {
        text += &format!(
            "{},{},{},{},{},{},{},{},{:.3}\n",
            r.iteration,
            r.mean_return,
            r.best_speedup,
            r.entropy,
            r.value_loss,
            r.policy_loss,
            r.approx_kl,
            r.transitions,
            r.seconds
        );
    }
    write("curves.csv", &text)?;
    write("curves.svg", &plot(rows))
}

/// Four panels (mean return, best speedup, entropy, value loss) against
/// the iteration, as an SVG a browser opens.
pub fn plot(rows: &[CurveRow]) -> String {
    type Panel = (&'static str, fn(&CurveRow) -> f64);
    let panels: [Panel; 4] = [
        ("mean return", |r| r.mean_return),
        ("best speedup (geomean)", |r| r.best_speedup),
        ("entropy", |r| r.entropy),
        ("value loss", |r| r.value_loss),
    ];
    let (w, h) = (420.0, 240.0);
    let mut s = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{}" height="{}" font-family="sans-serif" font-size="12">
<rect width="100%" height="100%" fill="white"/>
"#,
        2.0 * w,
        2.0 * h
    );
    for (k, (name, get)) in panels.iter().enumerate() {
        let (x0, y0) = ((k % 2) as f64 * w, (k / 2) as f64 * h);
        let (left, top, pw, ph) = (x0 + 55.0, y0 + 25.0, w - 75.0, h - 60.0);
        let ys: Vec<f64> = rows.iter().map(get).filter(|y| y.is_finite()).collect();
        let (lo, hi) = ys
            .iter()
            .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), &y| {
                (a.min(y), b.max(y))
            });
        let (lo, hi) = if lo.is_finite() && hi > lo {
            (lo, hi)
        } else if lo.is_finite() {
            (lo - 0.5, lo + 0.5)
        } else {
            (0.0, 1.0)
        };
        let last = rows.last().map_or(1, |r| r.iteration).max(1) as f64;
        s += &format!(
            r##"<text x="{}" y="{}" font-weight="bold">{name}</text>
<rect x="{left}" y="{top}" width="{pw}" height="{ph}" fill="none" stroke="#999"/>
<text x="{}" y="{}" text-anchor="end">{hi:.3}</text>
<text x="{}" y="{}" text-anchor="end">{lo:.3}</text>
<text x="{}" y="{}" text-anchor="middle">iteration (1 to {last})</text>
"##,
            left,
            y0 + 17.0,
            left - 4.0,
            top + 10.0,
            left - 4.0,
            top + ph,
            left + pw / 2.0,
            top + ph + 18.0,
        );
        let points: Vec<String> = rows
            .iter()
            .filter(|r| get(r).is_finite())
            .map(|r| {
                let x = left + pw * (r.iteration as f64 - 1.0) / (last - 1.0).max(1.0);
                let y = top + ph * (1.0 - (get(r) - lo) / (hi - lo));
                format!("{x:.1},{y:.1}")
            })
            .collect();
        s += &format!(
            r##"<polyline points="{}" fill="none" stroke="#1f77b4" stroke-width="1.5"/>
"##,
            points.join(" ")
        );
    }
    s + "</svg>\n"
}

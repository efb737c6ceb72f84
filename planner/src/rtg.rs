//! The reward-to-go model (MaxCode): from a state and a candidate move it
//! predicts the best speedup reachable after taking it, `ln max(1, s)`, so
//! a search can rank candidates before spending GPU time on them.
//!
//! Targets come in hindsight from recorded episodes: a step's target is
//! the best speedup its episode held from that step on.

use std::collections::BTreeMap;
use std::path::Path;

use burn::module::{AutodiffModule, Module};
use burn::nn::Linear;
use burn::optim::{AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::record::DefaultRecorder;
use burn::tensor::activation::relu;

use crate::features::OBS;
use crate::policy::{Cpu, CpuTrain};
use crate::rng::Rng;
use crate::space::ACTIONS;
use crate::store::Recorded;

/// Input length: the observation and the move, one-hot.
pub const INPUT: usize = OBS + ACTIONS;

/// The model: a two-layer MLP.
#[derive(Module, Debug)]
pub struct RewardToGo<B: Backend> {
    l1: Linear<B>,
    l2: Linear<B>,
    out: Linear<B>,
}

/// One training or test sample.
#[derive(Clone, Debug)]
pub struct Sample {
    /// The problem (held-out splits are by problem).
    pub problem: String,
    /// The observation before the move.
    pub obs: Vec<f32>,
    /// The move.
    pub action: usize,
    /// `ln max(1, best speedup reached at this step or later)`.
    pub target: f32,
}

/// Samples from recorded steps (stop steps are left out: they evaluate
/// nothing).
pub fn samples(steps: &[Recorded]) -> Vec<Sample> {
    let mut by_episode: BTreeMap<i64, Vec<&Recorded>> = BTreeMap::new();
    for s in steps {
        by_episode.entry(s.episode).or_default().push(s);
    }
    let stop = crate::space::Move::Stop.index();
    let mut out = Vec::new();
    for (_, mut ep) in by_episode {
        ep.sort_by_key(|s| s.step);
        let mut best = 1.0f64;
        let mut rev = Vec::new();
        for s in ep.iter().rev() {
            best = best.max(s.speedup.unwrap_or(0.0));
            if s.action != stop && s.observation.len() == OBS {
                rev.push(Sample {
                    problem: s.problem.clone(),
                    obs: s.observation.clone(),
                    action: s.action,
                    target: best.ln() as f32,
                });
            }
        }
        rev.reverse();
        out.extend(rev);
    }
    out
}

fn input(samples: &[&Sample]) -> Vec<f32> {
    let mut x = Vec::with_capacity(samples.len() * INPUT);
    for s in samples {
        x.extend_from_slice(&s.obs);
        x.extend((0..ACTIONS).map(|a| f32::from(a == s.action)));
    }
    x
}

impl<B: Backend> RewardToGo<B> {
    /// A model with `hidden` units, weights from `seed`.
    pub fn new(hidden: usize, seed: u64, device: &B::Device) -> RewardToGo<B> {
        let mut rng = Rng::new(seed);
        RewardToGo {
            l1: crate::policy::linear(INPUT, hidden, 1.0, &mut rng, device),
            l2: crate::policy::linear(hidden, hidden, 1.0, &mut rng, device),
            out: crate::policy::linear(hidden, 1, 1.0, &mut rng, device),
        }
    }

    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        self.out
            .forward(relu(self.l2.forward(relu(self.l1.forward(x)))))
    }

    /// Predictions for `samples`.
    pub fn predict(&self, samples: &[&Sample], device: &B::Device) -> Vec<f32> {
        if samples.is_empty() {
            return Vec::new();
        }
        let x = Tensor::<B, 2>::from_data(
            TensorData::new(input(samples), [samples.len(), INPUT]),
            device,
        );
        self.forward(x).into_data().to_vec().unwrap_or_default()
    }

    /// The prediction for move `action` from observation `obs`.
    pub fn score(&self, obs: &[f32], action: usize, device: &B::Device) -> f32 {
        let s = Sample {
            problem: String::new(),
            obs: obs.to_vec(),
            action,
            target: 0.0,
        };
        self.predict(&[&s], device).first().copied().unwrap_or(0.0)
    }
}

/// Fits a model to `samples` (mean squared error, Adam, `epochs` passes of
/// minibatches of 256).
pub fn fit(samples: &[Sample], hidden: usize, epochs: usize, seed: u64) -> RewardToGo<Cpu> {
    let device = Default::default();
    let mut model = RewardToGo::<CpuTrain>::new(hidden, seed, &device);
    let mut optim = AdamConfig::new().init::<CpuTrain, RewardToGo<CpuTrain>>();
    let mut rng = Rng::new(seed ^ 0x5EED);
    let mut order: Vec<usize> = (0..samples.len()).collect();
    for _ in 0..epochs {
        rng.shuffle(&mut order);
        for chunk in order.chunks(256) {
            let batch: Vec<&Sample> = chunk.iter().map(|&i| &samples[i]).collect();
            let n = batch.len();
            let x = Tensor::<CpuTrain, 2>::from_data(
                TensorData::new(input(&batch), [n, INPUT]),
                &device,
            );
            let y = Tensor::<CpuTrain, 2>::from_data(
                TensorData::new(batch.iter().map(|s| s.target).collect::<Vec<f32>>(), [n, 1]),
                &device,
            );
            let loss = (model.forward(x) - y).square().mean();
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = optim.step(1e-3, model, grads);
        }
    }
    model.valid()
}

/// How well predictions rank outcomes.
#[derive(Clone, Copy, Debug, Default, PartialEq, serde::Serialize)]
pub struct Ranking {
    /// Spearman's rank correlation over every sample.
    pub spearman: f64,
    /// Of the pairs of steps on the same problem with different targets,
    /// the fraction the predictions order rightly.
    pub pairwise: f64,
    /// How many such pairs there were.
    pub pairs: usize,
    /// Samples scored.
    pub samples: usize,
}

/// The ranking quality of `model` on `samples`.
pub fn ranking(model: &RewardToGo<Cpu>, samples: &[Sample]) -> Ranking {
    let refs: Vec<&Sample> = samples.iter().collect();
    let pred = model.predict(&refs, &Default::default());
    let target: Vec<f32> = samples.iter().map(|s| s.target).collect();
    // Pairs within one problem: the candidates a search on it would rank.
    let mut states: BTreeMap<&str, Vec<usize>> = BTreeMap::new();
    for (i, s) in samples.iter().enumerate() {
        states.entry(&s.problem).or_default().push(i);
    }
    let (mut right, mut pairs) = (0usize, 0usize);
    for idx in states.values() {
        for (a, &i) in idx.iter().enumerate() {
            for &j in &idx[a + 1..] {
                if (target[i] - target[j]).abs() < 1e-6 {
                    continue;
                }
                pairs += 1;
                right += usize::from((pred[i] - pred[j]) * (target[i] - target[j]) > 0.0);
            }
        }
    }
    Ranking {
        spearman: spearman(&pred, &target),
        pairwise: if pairs == 0 {
            f64::NAN
        } else {
            right as f64 / pairs as f64
        },
        pairs,
        samples: samples.len(),
    }
}

/// Spearman's rank correlation (average ranks for ties).
pub fn spearman(a: &[f32], b: &[f32]) -> f64 {
    fn ranks(x: &[f32]) -> Vec<f64> {
        let mut idx: Vec<usize> = (0..x.len()).collect();
        idx.sort_by(|&i, &j| x[i].total_cmp(&x[j]));
        let mut r = vec![0.0; x.len()];
        let mut k = 0;
        while k < idx.len() {
            let mut e = k;
            while e + 1 < idx.len() && x[idx[e + 1]] == x[idx[k]] {
                e += 1;
            }
            let avg = (k + e) as f64 / 2.0 + 1.0;
            for &i in &idx[k..=e] {
                r[i] = avg;
            }
            k = e + 1;
        }
        r
    }
    let (ra, rb) = (ranks(a), ranks(b));
    let n = ra.len() as f64;
    if n < 2.0 {
        return f64::NAN;
    }
    let (ma, mb) = (ra.iter().sum::<f64>() / n, rb.iter().sum::<f64>() / n);
    let cov: f64 = ra.iter().zip(&rb).map(|(x, y)| (x - ma) * (y - mb)).sum();
    let va: f64 = ra.iter().map(|x| (x - ma).powi(2)).sum();
    let vb: f64 = rb.iter().map(|y| (y - mb).powi(2)).sum();
    if va == 0.0 || vb == 0.0 {
        f64::NAN
    } else {
        cov / (va * vb).sqrt()
    }
}

/// Saves the model as `rtg.mpk` in `dir`.
pub fn save(model: &RewardToGo<Cpu>, dir: &Path, hidden: usize) -> Result<(), String> {
    std::fs::write(dir.join("rtg.json"), format!("{{\"hidden\": {hidden}}}\n"))
        .map_err(|e| e.to_string())?;
    model
        .clone()
        .save_file(dir.join("rtg"), &DefaultRecorder::new())
        .map_err(|e| format!("cannot write rtg.mpk in `{}`: {e}", dir.display()))
}

/// Loads the model from `dir`, if one was saved there.
pub fn load(dir: &Path) -> Result<Option<RewardToGo<Cpu>>, String> {
    let Ok(meta) = std::fs::read_to_string(dir.join("rtg.json")) else {
        return Ok(None);
    };
    let hidden = serde_json::from_str::<serde_json::Value>(&meta)
        .ok()
        .and_then(|v| v["hidden"].as_u64())
        .ok_or_else(|| format!("`{}`: rtg.json has no hidden size", dir.display()))?;
    let device = Default::default();
    RewardToGo::<Cpu>::new(hidden as usize, 0, &device)
        .load_file(dir.join("rtg"), &DefaultRecorder::new(), &device)
        .map(Some)
        .map_err(|e| format!("cannot read rtg.mpk in `{}`: {e}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spearman_of_monotone_and_reversed_orders() {
        assert!((spearman(&[1.0, 2.0, 3.0], &[10.0, 20.0, 35.0]) - 1.0).abs() < 1e-12);
        assert!((spearman(&[1.0, 2.0, 3.0], &[3.0, 2.0, 1.0]) + 1.0).abs() < 1e-12);
        assert!(spearman(&[1.0, 1.0], &[1.0, 2.0]).is_nan());
    }

    #[test]
    fn targets_are_the_best_from_each_step_on() {
        let rec = |step: usize, action: usize, speedup: Option<f64>| Recorded {
            problem: "p".into(),
            episode: 1,
            step,
            observation: vec![0.0; OBS],
            action,
            reward: 0.0,
            best_speedup: 0.0,
            speedup,
        };
        let s = samples(&[
            rec(0, 1, Some(3.0)),
            rec(1, 2, None),
            rec(2, 3, Some(2.0)),
            rec(3, 4, Some(0.5)),
            rec(4, crate::space::Move::Stop.index(), None),
        ]);
        let t: Vec<f32> = s.iter().map(|s| s.target).collect();
        // From step 0: 3x; from steps 1 and 2: 2x; from step 3: nothing
        // better than eager (ln 1 = 0). The stop step is left out.
        let want = [3f32.ln(), 2f32.ln(), 2f32.ln(), 0.0];
        assert_eq!(t.len(), 4);
        assert!(
            t.iter().zip(want).all(|(a, b)| (a - b).abs() < 1e-6),
            "{t:?}"
        );
    }
}

//! PPO with GAE, written for burn: rollouts on an environment, advantages,
//! and the clipped surrogate loss with a value loss and an entropy bonus.

use burn::module::AutodiffModule;
use burn::optim::adaptor::OptimizerAdaptor;
use burn::optim::{Adam, AdamConfig, GradientsParams, Optimizer};
use burn::prelude::*;
use burn::rl::Environment;
use burn::tensor::backend::AutodiffBackend;
use serde::{Deserialize, Serialize};

use crate::features::OBS;
use crate::policy::Net;
use crate::rng::Rng;
pub use crate::settings::PpoConfig;
use crate::space::ACTIONS;
use crate::tree::{Obs, TreeEnv};

/// One step of a rollout.
#[derive(Clone, Debug)]
pub struct Transition {
    /// The observation.
    pub obs: Vec<f32>,
    /// The legal moves.
    pub mask: [bool; ACTIONS],
    /// The move taken.
    pub action: usize,
    /// Its log-probability under the policy that acted.
    pub logp: f32,
    /// The value estimate.
    pub value: f32,
    /// The reward.
    pub reward: f32,
    /// Whether the episode ended with it.
    pub done: bool,
}

/// How one rollout episode went.
#[derive(Clone, Debug, PartialEq)]
pub struct EpisodeSummary {
    /// Sum of rewards.
    pub ret: f64,
    /// Best speedup found (0: nothing correct).
    pub best: f64,
    /// Evaluations made.
    pub evaluations: usize,
}

/// Runs `episodes` episodes of `net` on `env`, sampling moves with `rng`
/// (`greedy`: the most likely move instead).
pub fn rollout<B: Backend>(
    net: &Net<B>,
    env: &mut TreeEnv,
    episodes: usize,
    greedy: bool,
    rng: &mut Rng,
    device: &B::Device,
) -> (Vec<Transition>, Vec<EpisodeSummary>) {
    let mut out = Vec::new();
    let mut summaries = Vec::new();
    for _ in 0..episodes {
        env.reset();
        let mut ret = 0.0;
        let mut obs: Obs = env.state();
        loop {
            let (p, value) = net.act(&obs.features, &obs.mask, device);
            let action = if greedy {
                p.iter()
                    .enumerate()
                    .max_by(|a, b| a.1.total_cmp(b.1))
                    .map_or(crate::space::Move::Stop.index(), |(i, _)| i)
            } else {
                rng.pick(&p)
            };
            let step = env.step(action);
            ret += step.reward;
            out.push(Transition {
                obs: obs.features,
                mask: obs.mask,
                action,
                logp: p[action].max(1e-12).ln(),
                value,
                reward: step.reward as f32,
                done: step.done,
            });
            obs = step.next_state;
            if step.done {
                break;
            }
        }
        summaries.push(EpisodeSummary {
            ret,
            best: env.episode().best_speedup(),
            evaluations: env.episode().step,
        });
    }
    (out, summaries)
}

/// GAE advantages and returns of consecutive episodes in `t` (each ends
/// with `done`; the value after the end is 0).
pub fn gae(t: &[Transition], gamma: f64, lambda: f64) -> (Vec<f32>, Vec<f32>) {
    let mut adv = vec![0.0f32; t.len()];
    let mut next_value = 0.0f64;
    let mut next_adv = 0.0f64;
    for i in (0..t.len()).rev() {
        if t[i].done {
            next_value = 0.0;
            next_adv = 0.0;
        }
        let delta = t[i].reward as f64 + gamma * next_value - t[i].value as f64;
        next_adv = delta + gamma * lambda * next_adv;
        adv[i] = next_adv as f32;
        next_value = t[i].value as f64;
    }
    let returns = adv.iter().zip(t).map(|(a, x)| a + x.value).collect();
    (adv, returns)
}

/// Losses and statistics of one update.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct UpdateStats {
    /// Clipped surrogate loss (mean over minibatches).
    pub policy_loss: f64,
    /// Value loss.
    pub value_loss: f64,
    /// Mean entropy of the policy over the legal moves.
    pub entropy: f64,
    /// Mean approximate KL between the acting and the updated policy.
    pub approx_kl: f64,
    /// Transitions trained on.
    pub transitions: usize,
}

/// Adam over the policy network.
pub type NetAdam<B> = OptimizerAdaptor<Adam, Net<B>, B>;

/// The optimizer's record, as checkpoints keep it.
pub type AdamRecord<B> = <NetAdam<B> as Optimizer<Net<B>, B>>::Record;

/// The trainer: the network, its optimizer and the settings.
pub struct Ppo<B: AutodiffBackend> {
    /// The network.
    pub net: Net<B>,
    /// Adam.
    pub optim: NetAdam<B>,
    /// Settings.
    pub config: PpoConfig,
    device: B::Device,
}

impl<B: AutodiffBackend> Ppo<B> {
    /// A new trainer with a fresh network (weights from the seed) and Adam.
    pub fn new(config: PpoConfig, device: &B::Device) -> Ppo<B> {
        Ppo {
            net: Net::new(config.hidden, config.seed, device),
            optim: AdamConfig::new().init::<B, Net<B>>(),
            config,
            device: device.clone(),
        }
    }

    /// The network without autodiff, for rollouts.
    pub fn acting(&self) -> Net<B::InnerBackend> {
        self.net.valid()
    }

    /// One PPO update on `t` (whole episodes): `epochs` passes of shuffled
    /// minibatches.
    pub fn update(&mut self, t: &[Transition], rng: &mut Rng) -> UpdateStats {
        let c = self.config.clone();
        let (mut adv, returns) = gae(t, c.gamma, c.lambda);
        // Normalized advantages.
        let n = adv.len().max(1) as f32;
        let mean = adv.iter().sum::<f32>() / n;
        let std = (adv.iter().map(|a| (a - mean).powi(2)).sum::<f32>() / n).sqrt();
        adv.iter_mut().for_each(|a| *a = (*a - mean) / (std + 1e-8));
        let mut stats = UpdateStats {
            transitions: t.len(),
            ..UpdateStats::default()
        };
        let mut batches = 0usize;
        let mut order: Vec<usize> = (0..t.len()).collect();
        for _ in 0..c.epochs {
            rng.shuffle(&mut order);
            for chunk in order.chunks(c.minibatch.max(1)) {
                let s = self.minibatch(t, &adv, &returns, chunk);
                stats.policy_loss += s.policy_loss;
                stats.value_loss += s.value_loss;
                stats.entropy += s.entropy;
                stats.approx_kl += s.approx_kl;
                batches += 1;
            }
        }
        let b = batches.max(1) as f64;
        stats.policy_loss /= b;
        stats.value_loss /= b;
        stats.entropy /= b;
        stats.approx_kl /= b;
        stats
    }

    fn minibatch(
        &mut self,
        t: &[Transition],
        adv: &[f32],
        returns: &[f32],
        idx: &[usize],
    ) -> UpdateStats {
        let c = &self.config;
        let d = &self.device;
        let n = idx.len();
        let obs: Vec<f32> = idx.iter().flat_map(|&i| t[i].obs.iter().copied()).collect();
        let mask: Vec<bool> = idx.iter().flat_map(|&i| t[i].mask).collect();
        let actions: Vec<i64> = idx.iter().map(|&i| t[i].action as i64).collect();
        let old: Vec<f32> = idx.iter().map(|&i| t[i].logp).collect();
        let a: Vec<f32> = idx.iter().map(|&i| adv[i]).collect();
        let r: Vec<f32> = idx.iter().map(|&i| returns[i]).collect();
        let obs = Tensor::<B, 2>::from_data(TensorData::new(obs, [n, OBS]), d);
        let legal = Tensor::<B, 2, Bool>::from_data(TensorData::new(mask, [n, ACTIONS]), d);
        let actions = Tensor::<B, 2, Int>::from_data(TensorData::new(actions, [n, 1]), d);
        let old = Tensor::<B, 2>::from_data(TensorData::new(old, [n, 1]), d);
        let a = Tensor::<B, 2>::from_data(TensorData::new(a, [n, 1]), d);
        let r = Tensor::<B, 2>::from_data(TensorData::new(r, [n, 1]), d);

        let (logp_all, value) = self.net.log_probs(obs, legal.clone());
        let logp = logp_all.clone().gather(1, actions);
        let ratio = (logp.clone() - old.clone()).exp();
        let surr1 = ratio.clone() * a.clone();
        let surr2 = ratio.clamp(1.0 - c.clip, 1.0 + c.clip) * a;
        let policy_loss = surr1.min_pair(surr2).mean().neg();
        let value_loss = (value - r).square().mean();
        let safe = logp_all.clone().mask_fill(legal.bool_not(), 0.0);
        let entropy = (logp_all.exp() * safe).sum_dim(1).mean().neg();
        let loss = policy_loss.clone() + value_loss.clone().mul_scalar(c.value_coef)
            - entropy.clone().mul_scalar(c.entropy_coef);
        let approx_kl = (old - logp).mean();

        let scalar = |x: Tensor<B, 1>| -> f64 {
            x.into_data()
                .to_vec::<f32>()
                .ok()
                .and_then(|v| v.first().copied())
                .unwrap_or(f32::NAN) as f64
        };
        let stats = UpdateStats {
            policy_loss: scalar(policy_loss.clone().detach()),
            value_loss: scalar(value_loss.detach()),
            entropy: scalar(entropy.detach()),
            approx_kl: scalar(approx_kl.detach()),
            transitions: n,
        };
        let grads = GradientsParams::from_grads(loss.backward(), &self.net);
        let net = self.net.clone();
        self.net = self.optim.step(c.lr, net, grads);
        stats
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tr(reward: f32, value: f32, done: bool) -> Transition {
        Transition {
            obs: vec![],
            mask: [true; ACTIONS],
            action: 0,
            logp: 0.0,
            value,
            reward,
            done,
        }
    }

    #[test]
    fn gae_matches_the_hand_computation_and_stops_at_episode_ends() {
        let t = [tr(1.0, 0.5, false), tr(2.0, 0.25, true), tr(3.0, 1.0, true)];
        let (adv, ret) = gae(&t, 0.9, 0.8);
        // Last episode: one step, δ = 3 − 1.
        assert!((adv[2] - 2.0).abs() < 1e-6);
        // First episode: δ1 = 2 − 0.25; δ0 = 1 + 0.9·0.25 − 0.5.
        let d1 = 1.75f64;
        let d0 = 1.0 + 0.9 * 0.25 - 0.5;
        assert!((adv[1] as f64 - d1).abs() < 1e-6);
        assert!((adv[0] as f64 - (d0 + 0.9 * 0.8 * d1)).abs() < 1e-6);
        assert!((ret[0] - (adv[0] + 0.5)).abs() < 1e-6);
    }
}

//! PPO's settings: what a run is trained with, kept in its checkpoints so
//! that a resumed run goes on with them.

use serde::{Deserialize, Serialize};

/// PPO's settings.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct PpoConfig {
    /// Discount.
    pub gamma: f64,
    /// GAE's λ.
    pub lambda: f64,
    /// Ratio clip ε.
    pub clip: f64,
    /// Adam's learning rate.
    pub lr: f64,
    /// Passes over each batch.
    pub epochs: usize,
    /// Minibatch size.
    pub minibatch: usize,
    /// Weight of the value loss.
    pub value_coef: f64,
    /// Weight of the entropy bonus.
    pub entropy_coef: f64,
    /// Episodes per iteration.
    pub episodes: usize,
    /// Hidden units.
    pub hidden: usize,
    /// Evaluations per episode.
    pub max_steps: usize,
    /// What each evaluation costs in the reward (`Reward::step` is its
    /// negative).
    pub step_cost: f64,
    /// Seed of everything random.
    pub seed: u64,
}

impl Default for PpoConfig {
    fn default() -> PpoConfig {
        PpoConfig {
            gamma: 0.99,
            lambda: 0.95,
            clip: 0.2,
            lr: 1e-3,
            epochs: 4,
            minibatch: 128,
            value_coef: 0.5,
            entropy_coef: 0.01,
            episodes: 64,
            hidden: 128,
            max_steps: 8,
            step_cost: 0.0,
            seed: 1,
        }
    }
}

impl PpoConfig {
    /// Where `asked` differs from these settings, a phrase each (`--hidden
    /// 32 here, 16 there`), named by `mtmc train`'s flag where one sets it.
    pub fn differences(&self, asked: &PpoConfig) -> Vec<String> {
        let (Ok(serde_json::Value::Object(there)), Ok(serde_json::Value::Object(here))) =
            (serde_json::to_value(self), serde_json::to_value(asked))
        else {
            unreachable!("PPO's settings serialize to an object")
        };
        there
            .iter()
            .filter(|(key, value)| here.get(*key) != Some(value))
            .map(|(key, value)| {
                let name = match key.as_str() {
                    "max_steps" => "--budget".to_string(),
                    "step_cost" => "--step-cost".to_string(),
                    "gamma" | "lr" | "hidden" | "episodes" | "seed" => format!("--{key}"),
                    other => other.to_string(),
                };
                let asked = here.get(key).map_or("none".into(), ToString::to_string);
                format!("{name} {asked} here, {value} there")
            })
            .collect()
    }
}

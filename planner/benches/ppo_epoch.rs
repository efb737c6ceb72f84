//! One PPO epoch (minibatches of 128) over 10k transitions on the CPU
//! backend, against one forward pass over the same transitions measured in
//! the same run. Run: `cargo bench -p mtmc-planner --bench ppo_epoch`.

use std::time::Instant;

use mtmc_planner::features::OBS;
use mtmc_planner::policy::CpuTrain;
use mtmc_planner::ppo::{Ppo, PpoConfig, Transition};
use mtmc_planner::rng::Rng;
use mtmc_planner::space::ACTIONS;

fn main() {
    let n = 10_000;
    let mut rng = Rng::new(5);
    // Episodes of 8 steps with random observations and legal moves.
    let t: Vec<Transition> = (0..n)
        .map(|i| {
            let mut mask = [false; ACTIONS];
            for m in mask.iter_mut() {
                *m = rng.unit() < 0.5;
            }
            mask[ACTIONS - 1] = true;
            let legal: Vec<usize> = (0..ACTIONS).filter(|&a| mask[a]).collect();
            Transition {
                obs: (0..OBS).map(|_| rng.unit() as f32).collect(),
                mask,
                action: legal[rng.below(legal.len())],
                logp: -(legal.len() as f32).ln(),
                value: 0.0,
                reward: rng.unit() as f32 - 0.5,
                done: i % 8 == 7,
            }
        })
        .collect();
    let config = PpoConfig {
        epochs: 1,
        minibatch: 128,
        ..PpoConfig::default()
    };
    let device = Default::default();
    let mut ppo = Ppo::<CpuTrain>::new(config, &device);

    let net = ppo.acting();
    let t0 = Instant::now();
    for x in &t {
        std::hint::black_box(net.act(&x.obs, &x.mask, &device));
    }
    let forward = t0.elapsed().as_secs_f64();

    let t0 = Instant::now();
    let stats = ppo.update(&t, &mut rng);
    let epoch = t0.elapsed().as_secs_f64();
    println!(
        "ppo epoch over {n} transitions (minibatch 128, hidden 128): {epoch:.2} s ({:.0} transitions/s); \
         one-by-one forward passes over the same: {forward:.2} s; epoch/forward = {:.2}; value loss {:.4}",
        n as f64 / epoch,
        epoch / forward,
        stats.value_loss
    );
}

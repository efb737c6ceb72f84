//! One PPO epoch (minibatches of 128) over 10k transitions on the CPU
//! backend, against one forward pass over the same transitions measured in
//! the same run; built with `--features cuda`, the same epoch on burn's
//! CUDA backend too (after a warm-up epoch that compiles its kernels), as a
//! ratio to the CPU's. Run: `cargo bench -p mtmc-planner --bench ppo_epoch
//! [--features cuda]`.

use std::time::Instant;

use burn::tensor::backend::AutodiffBackend;
use mtmc_planner::features::OBS;
use mtmc_planner::policy::CpuTrain;
use mtmc_planner::ppo::{Ppo, PpoConfig, Transition};
use mtmc_planner::rng::Rng;
use mtmc_planner::space::ACTIONS;

/// Seconds of one epoch over `t`, seconds of one-by-one forward passes
/// over it, and the epoch's value loss.
fn epoch<B: AutodiffBackend>(t: &[Transition], device: &B::Device) -> (f64, f64, f64) {
    let config = PpoConfig {
        epochs: 1,
        minibatch: 128,
        ..PpoConfig::default()
    };
    let mut rng = Rng::new(6);
    let mut ppo = Ppo::<B>::new(config, device);
    let net = ppo.acting();
    let t0 = Instant::now();
    for x in t {
        std::hint::black_box(net.act(&x.obs, &x.mask, device));
    }
    let forward = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    // The update reads its losses back to the host, so it has finished on
    // the device when it returns.
    let stats = ppo.update(t, &mut rng);
    (t0.elapsed().as_secs_f64(), forward, stats.value_loss)
}

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
    let (cpu, forward, loss) = epoch::<CpuTrain>(&t, &Default::default());
    println!(
        "ppo epoch over {n} transitions (minibatch 128, hidden 128), cpu: {cpu:.2} s ({:.0} transitions/s); \
         one-by-one forward passes over the same: {forward:.2} s; epoch/forward = {:.2}; value loss {loss:.4}",
        n as f64 / cpu,
        cpu / forward,
    );
    #[cfg(feature = "cuda")]
    {
        type Gpu = mtmc_planner::policy::CudaTrain;
        let device = Default::default();
        let warm = epoch::<Gpu>(&t[..1024], &device);
        let (gpu, forward, loss) = epoch::<Gpu>(&t, &device);
        println!(
            "ppo epoch over {n} transitions, cuda: {gpu:.2} s (warm-up on 1024: {:.2} s); one-by-one forward passes: \
             {forward:.2} s; cpu/cuda = {:.2}; value loss {loss:.4}",
            warm.0,
            cpu / gpu,
        );
    }
}

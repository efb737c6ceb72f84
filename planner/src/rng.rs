//! The planner's seeded generator: sampling actions, shuffling minibatches
//! and initial weights all come from it, so a seeded run is reproducible
//! without a global random state. It is the environment's
//! ([`mtmc_env::reference::Rng`], `rand`'s ChaCha8), seeded apart from it.

/// The environment's generator, seeded apart from it.
#[derive(Clone, Debug)]
pub struct Rng(mtmc_env::reference::Rng);

impl Rng {
    /// A generator from `seed`.
    pub fn new(seed: u64) -> Rng {
        Rng(mtmc_env::reference::Rng::new(seed ^ 0x9E37_79B9_7F4A_7C15))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        self.0.unit()
    }

    /// Uniform in [0, n) (0 when `n` is 0).
    pub fn below(&mut self, n: usize) -> usize {
        self.0.below(n)
    }

    /// An index drawn with probabilities `p` (which sum to about 1).
    pub fn pick(&mut self, p: &[f32]) -> usize {
        let u = self.unit() as f32 * p.iter().sum::<f32>();
        let mut acc = 0.0;
        for (i, &x) in p.iter().enumerate() {
            acc += x;
            if u < acc && x > 0.0 {
                return i;
            }
        }
        p.iter().rposition(|&x| x > 0.0).unwrap_or(0)
    }

    /// Shuffles `v` in place.
    pub fn shuffle<T>(&mut self, v: &mut [T]) {
        self.0.shuffle(v);
    }
}

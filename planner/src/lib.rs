//! The macro planner: a small policy network (burn) that picks the next
//! optimization action from the problem's graph features, the applied
//! actions, the last outcome's critique and the best result so far.
//!
//! - [`space`]: the moves (kind × region × parameter) and their legality;
//! - [`critique`]: the diagnosis of an outcome, as features and text;
//! - [`episode`]: an episode's state and the reward (max-reward shaping);
//! - [`features`]: the graph features and the observation vector;
//! - [`store`]: the SQLite trajectory store and the knowledge base;
//! - [`tree`]: the offline environment on the recorded trajectory tree;
//! - [`policy`], [`ppo`], [`settings`], [`train`]: the network, PPO with
//!   GAE and its settings, training with curves and checkpoints;
//! - [`rtg`]: the reward-to-go model;
//! - [`planners`]: trained, random, greedy and exhaustive planners;
//! - [`rng`]: the seeded generator everything random draws from.

pub mod critique;
pub mod episode;
pub mod features;
pub mod planners;
pub mod policy;
pub mod ppo;
pub mod rng;
pub mod rtg;
pub mod settings;
pub mod space;
pub mod store;
pub mod train;
pub mod tree;

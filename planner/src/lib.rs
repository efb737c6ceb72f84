//! The macro planner: a small policy network (burn) that picks the next
//! optimization action from the problem's graph features, the applied
//! actions, the last outcome's critique and the best result so far.
//!
//! Empty for now: the critique, the observation features, PPO, the
//! trajectory store and the reward-to-go model land with the planner issue.
//! The crate exists so that the workspace has its final shape; it will be
//! the only crate that depends on burn.

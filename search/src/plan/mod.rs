//! The planner's commands: a planned search on one problem (`optimize
//! --planner`), `explore` (episodes that fill the trajectory store),
//! `train` (PPO and the reward-to-go model on the recorded tree) and
//! `compare` (the planners on the held-out problems' recorded tree).
//!
//! A planned search is an episode: from the library program, each move
//! edits the program's configuration (which regions are kernels, fusion,
//! GEMM kernels, launch parameters); the template coder builds the
//! configuration fragment by fragment (each compiled alone, rolled back on
//! failure) and the worker judges it. Every step goes to the store.
//!
//! A file per idea: `choice` (the planner `--planner` names, loaded to
//! act), `episode` (one planned search), `judging` (a configuration
//! built and judged, a round of candidates at a time), `enumerate` (the
//! exhaustive tree and its extension), `split` (which problems train,
//! validate and test), and one per command: `explore` (with `merge`),
//! `rejudge`, `train`, `compare` and `search` (`optimize
//! --planner`).

mod choice;
mod compare;
mod enumerate;
mod episode;
mod explore;
mod judging;
mod rejudge;
mod rows;
mod search;
mod split;
mod train;

pub use choice::Choice;
pub use compare::{CompareRequest, compare};
pub(crate) use compare::{
    NEAR, compared, exhaustive_row, geomean, print_table, problem_rows, row, stopping,
};
pub use enumerate::Beyond;
pub use episode::{Gpus, PlanSettings, plan_problem};
pub(crate) use episode::{judge_side_by_side, rebuild_best};
pub use explore::{ExploreRequest, explore, merge};
pub use rejudge::{RejudgeRequest, rejudge};
pub(crate) use rows::{PlannerResult, ProblemRow};
pub use search::{OptimizeRequest, optimize};
pub use split::{Split, levels_words, of_levels};
pub use train::{TrainRequest, train};

/// A clause of a report line that counts `n` of something (`text` writes
/// it), or nothing when there are none.
pub(crate) fn counted(n: usize, text: impl FnOnce(usize) -> String) -> String {
    if n > 0 { text(n) } else { String::new() }
}

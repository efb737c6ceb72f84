//! The search: the macro planner picks an action, the micro coder writes it
//! as a fragment, the evaluator judges the program, and the best program so
//! far with its critique steers the next step. Each of mtmc's commands that
//! searches or judges many programs is a function here; the `mtmc` binary
//! parses flags, calls them and prints what they return.
//!
//! - `steps`: the search loop the built-in search and the LLM coder's
//!   steps run (a planner proposes a program, the judge judges it, the
//!   best is kept); [`optimize`]: one problem or intent, with either;
//!   [`plan`] runs the planned search.
//! - [`bench`]: `optimize` over a set of KernelBench problems, with
//!   KernelBench's metrics; [`bench_env`]: how fast the environment judges.
//! - [`plan`]: episodes into the trajectory store (`explore`), training,
//!   the replayed comparison of planners, and rejudging the tree.
//! - [`live`] and [`paired`]: planners compared by searching on the GPU, and
//!   the paired statistics of two planners.
//! - [`cluster`]: the Dask cluster a run judges on, when it names one.
//! - [`screen`]: exploration's screening, a short timing before the full
//!   protocol for the programs near the fastest.
//! - [`source`], [`subject`], [`files`], [`fmt`], [`interrupt`]: where
//!   problems come from, what a command works on, the files results go to,
//!   the text of reports, and Ctrl-C between items of work.

pub mod bench;
pub mod bench_env;
pub mod cluster;
pub mod files;
pub mod fmt;
pub mod interrupt;
pub mod live;
pub mod optimize;
pub mod paired;
pub mod plan;
pub mod screen;
pub mod source;
mod steps;
pub mod subject;

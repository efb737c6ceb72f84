//! One module per subcommand.

pub mod bench;
pub mod bench_env;
pub mod compile;
pub mod doctor;
pub mod eval;
pub mod live;
pub mod llm;
pub mod optimize;
pub mod paired;
pub mod plan;
pub mod problems;
pub mod show;

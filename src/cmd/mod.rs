//! One module per subcommand.

pub mod compile;
pub mod doctor;
pub mod eval;
pub mod llm;
pub mod problems;
pub mod show;

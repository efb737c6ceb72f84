//! One module per subcommand.

pub mod doctor;
pub mod problems;
pub mod show;

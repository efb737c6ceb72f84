//! The Python interpreter mtmc runs its helpers with.

use std::ffi::OsString;

/// Environment variable naming the interpreter; defaults to `python3`.
pub const PYTHON_ENV: &str = "MTMC_PYTHON";

/// The interpreter to run: `$MTMC_PYTHON`, else `python3` from `PATH`.
pub fn interpreter() -> OsString {
    std::env::var_os(PYTHON_ENV)
        .filter(|p| !p.is_empty())
        .unwrap_or_else(|| OsString::from("python3"))
}

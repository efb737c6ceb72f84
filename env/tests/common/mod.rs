//! Helpers shared by the env tests.

use std::ffi::OsString;

/// A Python with torch for the worker's CPU mode: `$MTMC_TEST_PYTHON`.
/// scripts/test installs one and sets `MTMC_EXPECT_TORCH=1`, which turns a
/// missing torch into a failure instead of a skip.
pub fn torch_python() -> Option<OsString> {
    match std::env::var_os("MTMC_TEST_PYTHON") {
        Some(p) => Some(p),
        None if std::env::var_os("MTMC_EXPECT_TORCH").is_some() => {
            panic!("MTMC_EXPECT_TORCH is set but MTMC_TEST_PYTHON (a Python with torch) is not")
        }
        None => {
            eprintln!("skipped: set MTMC_TEST_PYTHON to a Python with torch");
            None
        }
    }
}

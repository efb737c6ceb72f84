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

/// A local Dask cluster of `n` workers started with `python`, or `None`
/// (skipped) when it has no Dask and `MTMC_EXPECT_DASK` is unset
/// (scripts/test sets it and installs Dask).
#[allow(dead_code)]
pub fn local_cluster(python: &OsString, n: usize) -> Option<mtmc_env::cluster::LocalCluster> {
    match mtmc_env::cluster::LocalCluster::start(python, n) {
        Ok(c) => Some(c),
        Err(e) if std::env::var_os("MTMC_EXPECT_DASK").is_none() => {
            eprintln!("skipped: {e}");
            None
        }
        Err(e) => panic!("MTMC_EXPECT_DASK is set, and {e}"),
    }
}

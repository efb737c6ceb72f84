//! The judge's input staging (`Stage` in `python/judge.py`), driven
//! directly on the CPU with real torch by `tests/inputs/stage_inputs.py`:
//! a timed call's inputs are drawn again in place where every input is
//! the untouched result of one of torch's random factories (same
//! distributions, same addresses, new values), drawn by `get_inputs()`
//! again otherwise, and kept at one address per input (the slots the GPU
//! stage uses) unless inputs share memory; and the judge's own Triton
//! kernels, in Triton's interpreter; and its reading of the L2 flushes
//! between a candidate's calls.

mod common;
use common::torch_python;

/// Runs one of the judge's test scripts under `tests/inputs/` with the
/// judge's folder on the path: its exit code and everything it printed.
fn run_script(python: std::ffi::OsString, script: &str) -> (Option<i32>, String) {
    let out = std::process::Command::new(python)
        .arg(format!(
            "{}/tests/inputs/{script}",
            env!("CARGO_MANIFEST_DIR")
        ))
        .env("PYTHONPATH", concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .output()
        .expect("cannot run the test's Python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

/// The judge's reading of its L2 flushes between a candidate's calls
/// (`tests/inputs/flushes.py`): an honest candidate on a GPU another
/// process shares (flushes as an H200 shared by 20 processes timed them)
/// is not failed, work left running after every call is, on a quiet GPU
/// and a shared one.
#[test]
fn flushes_fail_work_left_running_and_not_a_shared_gpu() {
    let Some(python) = torch_python() else {
        return;
    };
    let (code, text) = run_script(python, "flushes.py");
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(passed(&text), 7, "{text}");
}

/// How many checks a script's output says passed.
fn passed(text: &str) -> usize {
    text.lines().filter(|l| l.starts_with("ok ")).count()
}

#[test]
fn timed_inputs_are_drawn_again_in_place_at_the_same_addresses() {
    let Some(python) = torch_python() else {
        return;
    };
    let (code, text) = run_script(python, "stage_inputs.py");
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(passed(&text), 16, "{text}");
}

/// The judge's own Triton kernels (the comparison's first pass and the
/// draw of timed inputs) in Triton's CPU interpreter, against torch:
/// `tests/inputs/judge_kernels.py`. Skipped where Triton is missing,
/// unless scripts/test said it is there (`MTMC_EXPECT_TRITON=1`).
#[test]
fn the_judges_kernels_find_what_torch_finds_in_tritons_interpreter() {
    let Some(python) = torch_python() else {
        return;
    };
    let (code, text) = run_script(python, "judge_kernels.py");
    if code == Some(2) && std::env::var_os("MTMC_EXPECT_TRITON").is_none() {
        eprintln!("skipped: the test's Python has no Triton");
        return;
    }
    assert_eq!(code, Some(0), "{text}");
    assert_eq!(passed(&text), 15, "{text}");
}

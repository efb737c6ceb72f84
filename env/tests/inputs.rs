//! The judge's input staging (`Stage` in `python/judge.py`), driven
//! directly on the CPU with real torch by `tests/inputs/stage_inputs.py`:
//! a timed call's inputs are drawn again in place where every input is
//! the untouched result of one of torch's random factories (same
//! distributions, same addresses, new values), drawn by `get_inputs()`
//! again otherwise, and kept at one address per input (the slots the GPU
//! stage uses) unless inputs share memory.

mod common;
use common::torch_python;

#[test]
fn timed_inputs_are_drawn_again_in_place_at_the_same_addresses() {
    let Some(python) = torch_python() else {
        return;
    };
    let out = std::process::Command::new(python)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/inputs/stage_inputs.py"
        ))
        .env("PYTHONPATH", concat!(env!("CARGO_MANIFEST_DIR"), "/python"))
        .output()
        .expect("cannot run the test's Python");
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "{text}");
    let passed = text.lines().filter(|l| l.starts_with("ok ")).count();
    assert_eq!(passed, 16, "{text}");
}

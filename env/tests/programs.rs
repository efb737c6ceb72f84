//! CUDA programs (the native evaluator's candidates): reading them and
//! checking their launch plan against the problem's graph.

use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_actions::{DType, OpGraph};
use mtmc_env::native::CudaProgram;

const PROGRAMS: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/programs");

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    };
    compile(src, &b).unwrap()
}

fn program(file: &str) -> CudaProgram {
    CudaProgram::load(std::path::Path::new(&format!("{PROGRAMS}/{file}"))).unwrap()
}

#[test]
fn the_shipped_programs_fit_their_intents() {
    let relu = graph("y = relu(x)", "x=4194304");
    for f in [
        "relu.json",
        "relu_misses_the_tail.json",
        "relu_in_place.json",
        "hangs.json",
        "illegal_address.json",
    ] {
        program(f)
            .check(&relu)
            .unwrap_or_else(|e| panic!("{f}: {e}"));
    }
    let gemm = graph("y = gelu(x @ w + b)", "x=1024x1024,w=1024x1024,b=1024");
    let p = program("linear_gelu.json");
    p.check(&gemm).unwrap();
    assert!(
        p.source.contains("__global__ void linear_gelu"),
        "source_file was read"
    );
    assert_eq!(p.block_threads("linear_gelu"), Some(1024));
}

#[test]
fn a_plan_that_does_not_fit_says_what_is_wrong() {
    let relu = graph("y = relu(x)", "x=16");
    let base = program("relu.json");
    type Breakage = fn(&mut CudaProgram);
    let cases: [(&str, Breakage); 5] = [
        ("input `x` needs exactly one buffer", |p| {
            p.buffers.retain(|b| b.input.is_none())
        }),
        ("output 0 needs exactly one buffer", |p| {
            p.buffers.retain(|b| b.output.is_none())
        }),
        ("passes buffer `z`, which is not declared", |p| {
            p.launches[0].args[0] = mtmc_env::native::Arg::Buffer("z".into())
        }),
        ("has an empty grid or block", |p| {
            p.launches[0].grid = [0, 1, 1]
        }),
        ("needs exactly one of `input`, `output`, `bytes`", |p| {
            p.buffers[0].bytes = Some(64)
        }),
    ];
    for (want, break_it) in cases {
        let mut p = base.clone();
        break_it(&mut p);
        let e = p.check(&relu).unwrap_err();
        assert!(e.contains(want), "expected `{want}` in `{e}`");
    }
}

#[test]
fn unreadable_program_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("p.json");
    std::fs::write(
        &f,
        r#"{"source_file": "missing.cu", "buffers": [], "launches": []}"#,
    )
    .unwrap();
    let e = CudaProgram::load(&f).unwrap_err();
    assert!(
        e.contains("missing.cu") && e.contains("source_file of"),
        "{e}"
    );
    std::fs::write(
        &f,
        r#"{"source": "", "buffers": [], "launches": [], "extra": 1}"#,
    )
    .unwrap();
    let e = CudaProgram::load(&f).unwrap_err();
    assert!(
        e.contains("is not a CUDA program") && e.contains("extra"),
        "{e}"
    );
}

//! End-to-end tests of the `mtmc` binary: listings, graphs, and one clear
//! error line with exit status 2 for each kind of bad input.

mod common;

use common::{
    interrupted, interrupted_report, mtmc, python3_has_torch, read_json, shared_jsonl,
    shared_problem_code, torch_python,
};

#[test]
fn problems_lists_the_200_shared_problems_from_the_jsonl() {
    let out = mtmc(&["problems", "--kernelbench", &shared_jsonl()]).success();
    let rows = out.stdout.lines().filter(|l| l.starts_with('L')).count();
    assert_eq!(rows, 200, "{}", out.stdout);
    assert!(out.stdout.contains("200 problems from"));
    assert!(
        out.stdout
            .contains("traced with no opaque node: L1 80/80, L2 80/80, L3 ")
    );
    let relu = out
        .stdout
        .lines()
        .find(|l| l.starts_with("L1/19 "))
        .unwrap();
    assert!(
        relu.contains("19_ReLU") && relu.contains("pointwise"),
        "{relu}"
    );
}

#[test]
fn problems_without_a_path_uses_the_built_in_traces() {
    let out = mtmc(&["problems", "--level", "2"]).success();
    assert_eq!(
        out.stdout.lines().filter(|l| l.starts_with("L2/")).count(),
        80
    );
    assert!(out.stdout.contains("traces built into mtmc"));
    // A level no problem is of is named, with the levels there are, and
    // so are bench's and explore's.
    let kb = shared_jsonl();
    for args in [
        vec!["problems", "--level", "5"],
        vec![
            "--kernelbench",
            &kb,
            "bench",
            "--level",
            "5",
            "--out",
            "unused",
        ],
        vec![
            "--kernelbench",
            &kb,
            "explore",
            "--level",
            "1",
            "--level",
            "5",
        ],
    ] {
        let err = mtmc(&args).failure();
        assert!(
            err.error
                .contains("--level 5: no problem is of level 5; the problems' levels are 1, 2, 3"),
            "{args:?}: {}",
            err.error
        );
    }
}

#[test]
fn show_prints_the_graph_costs_and_roofline() {
    let out = mtmc(&["show", "L2/1"]).success();
    let s = &out.stdout;
    assert!(
        s.starts_with("L2/1_Conv2D_ReLU_BiasAdd (traced with fx"),
        "{s}"
    );
    assert!(
        s.contains("conv2d k=3x3 s=1x1 p=0x0 d=1x1 g=1 +bias"),
        "{s}"
    );
    assert!(s.contains("f32[128x128x126x126]"), "{s}");
    assert!(s.contains("total: 300 GFLOP in 7 nodes"), "{s}");
    for device in ["H100", "H200"] {
        assert!(
            s.lines()
                .any(|l| l.trim_start().starts_with(device) && l.contains("compute-bound")),
            "{s}"
        );
    }
}

#[test]
fn show_accepts_an_intent() {
    let out = mtmc(&[
        "show",
        "--intent",
        "y = gelu(x @ w + b)",
        "--shape",
        "x=4096x4096,w=4096x4096,b=4096",
        "--dtype",
        "f32",
        "--device",
        "h100",
    ])
    .success();
    assert!(
        out.stdout.contains("total: 138 GFLOP in 6 nodes"),
        "{}",
        out.stdout
    );
    assert!(out.stdout.contains("  H100 "), "{}", out.stdout);
    assert!(!out.stdout.contains("  H200 "), "{}", out.stdout);
}

#[test]
fn a_checkout_problem_with_known_code_needs_no_python() {
    let dir = tempfile::tempdir().unwrap();
    let level = dir.path().join("KernelBench").join("level1");
    std::fs::create_dir_all(&level).unwrap();
    std::fs::write(level.join("19_ReLU.py"), shared_problem_code(1, "19_ReLU")).unwrap();
    std::fs::write(level.join("helpers.py"), "# not a problem\n").unwrap();
    let out = mtmc(&[
        "show",
        "19_ReLU",
        "--kernelbench",
        dir.path().to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", "/nonexistent/python3")
    .success();
    assert!(out.stdout.starts_with("L1/19_ReLU "), "{}", out.stdout);
}

/// A problem whose code matches no built-in trace must be traced with torch.
fn changed_checkout() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    let level = dir.path().join("level1");
    std::fs::create_dir_all(&level).unwrap();
    let code = shared_problem_code(1, "19_ReLU").replace("batch_size = ", "batch_size = 2 * ");
    std::fs::write(level.join("19_ReLU.py"), code).unwrap();
    dir
}

#[test]
fn tracing_without_python_says_how_to_fix_it() {
    let dir = changed_checkout();
    let cache = tempfile::tempdir().unwrap();
    let out = mtmc(&[
        "show",
        "L1/19",
        "--kernelbench",
        dir.path().to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", "/nonexistent/python3")
    .env("MTMC_CACHE_DIR", cache.path())
    .failure();
    assert!(
        out.error
            .contains("/nonexistent/python3 could not be started")
            && out.error.contains("set MTMC_PYTHON"),
        "{}",
        out.error
    );
}

#[test]
fn tracing_on_the_fly_uses_torch_where_python_has_it() {
    let dir = changed_checkout();
    let cache = tempfile::tempdir().unwrap();
    let has_torch = python3_has_torch();
    let run = || {
        mtmc(&[
            "show",
            "L1/19",
            "--kernelbench",
            dir.path().to_str().unwrap(),
        ])
        .env("MTMC_PYTHON", "python3")
        .env("MTMC_CACHE_DIR", cache.path())
    };
    if has_torch {
        let first = run().success();
        assert!(
            first.stdout.contains("f32[8192x393216]"),
            "{}",
            first.stdout
        );
        assert!(first.stderr.contains("tracing 1 problem(s)"));
        let cached = std::fs::read_dir(cache.path().join("traces"))
            .unwrap()
            .count();
        assert_eq!(cached, 1);
        let second = run().success();
        assert!(!second.stderr.contains("tracing"), "{}", second.stderr);
    } else {
        let out = run().failure();
        assert!(
            out.error.contains("has no torch") && out.error.contains("-m pip install torch"),
            "{}",
            out.error
        );
    }
}

#[test]
fn a_missing_path_is_one_error_line() {
    let out = mtmc(&["problems", "--kernelbench", "/no/such/problems.jsonl"]).failure();
    assert_eq!(
        out.error,
        "error: cannot read KernelBench path `/no/such/problems.jsonl`; pass --kernelbench with \
         a problems.jsonl or a KernelBench checkout: No such file or directory (os error 2)"
    );
}

#[test]
fn a_malformed_jsonl_line_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("p.jsonl");
    std::fs::write(
        &file,
        "{\"level\":1,\"problem_id\":1,\"name\":\"1_A\",\"code\":\"\"}\n{\"level\": 1,\n",
    )
    .unwrap();
    let out = mtmc(&["problems", "--kernelbench", file.to_str().unwrap()]).failure();
    assert!(
        out.error
            .contains("p.jsonl` is not a KernelBench problems.jsonl"),
        "{}",
        out.error
    );
    assert!(out.error.contains(": line 2: "), "{}", out.error);
}

#[test]
fn an_unknown_problem_suggests_names() {
    let out = mtmc(&["show", "Conv2D_ReLU"]).failure();
    assert_eq!(
        out.error,
        "error: no problem named `Conv2D_ReLU`; did you mean L2/1_Conv2D_ReLU_BiasAdd, \
         L2/57_Conv2d_ReLU_HardSwish?"
    );
}

#[test]
fn bad_intent_syntax_points_at_line_and_column() {
    let out = mtmc(&[
        "show",
        "--intent",
        "y = relu(x)\nz = y +* 2",
        "--shape",
        "x=8",
    ])
    .failure();
    assert_eq!(
        out.error,
        "error: --intent, line 2, column 8: expected an expression, found `*`"
    );
}

#[test]
fn inconsistent_shapes_are_one_error_line() {
    let out = mtmc(&["show", "--intent", "y = x @ w", "--shape", "x=8x4,w=8x4"]).failure();
    assert_eq!(
        out.error,
        "error: --intent, line 1, column 7: `@` needs matching inner dims, but f32[8x4] has 4 \
         columns and f32[8x4] has 8 rows"
    );
    let out = mtmc(&["show", "--intent", "y = x", "--shape", "x=8by4"]).failure();
    assert!(
        out.error.starts_with("error: --shape `x=8by4`: "),
        "{}",
        out.error
    );
    let out = mtmc(&["show", "L1/19", "--device", "A100"]).failure();
    assert_eq!(
        out.error,
        "error: unknown device `A100`; built in: H100, H200"
    );
}

#[test]
fn help_lists_only_working_commands() {
    let out = mtmc(&["--help"]).success();
    let commands: Vec<&str> = out
        .stdout
        .split("Commands:")
        .nth(1)
        .unwrap()
        .split("Options:")
        .next()
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert_eq!(
        commands,
        [
            "problems",
            "show",
            "compile",
            "eval",
            "optimize",
            "explore",
            "rejudge",
            "train",
            "compare",
            "merge",
            "llm-check",
            "llm-replay",
            "bench",
            "bench-env",
            "doctor",
            "help"
        ]
    );
}

#[test]
fn doctor_reports_each_component_with_a_fix() {
    let out = mtmc(&["doctor"]).success();
    for component in ["GPU", "NVRTC", "python"] {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.split_whitespace().nth(1) == Some(component)),
            "{component} missing from:\n{}",
            out.stdout
        );
    }
    for line in out.stdout.lines().filter(|l| l.starts_with("missing")) {
        let _ = line;
        assert!(out.stdout.contains("fix: "), "{}", out.stdout);
    }
    // The test script installs NVRTC from pip and puts it on the library path.
    if std::env::var_os("MTMC_EXPECT_NVRTC").is_some() {
        assert!(
            out.stdout
                .lines()
                .any(|l| l.starts_with("ok") && l.contains("NVRTC") && l.contains("13.")),
            "{}",
            out.stdout
        );
    }
}

#[test]
fn doctor_names_what_the_test_script_installed_in_the_checkout() {
    // A checkout's `.deps/` as `scripts/test` fills it: the NVRTC wheel
    // and a venv with torch (files standing in for them).
    let dir = tempfile::tempdir().unwrap();
    let deps = dir.path().join(".deps");
    let lib = deps.join("python/nvidia/cu13/lib");
    std::fs::create_dir_all(&lib).unwrap();
    std::fs::write(lib.join("libnvrtc.so.13"), "").unwrap();
    let venv = deps.join("torch/bin/python");
    std::fs::create_dir_all(venv.parent().unwrap()).unwrap();
    std::fs::write(&venv, "").unwrap();
    let out = mtmc(&["doctor"])
        .current_dir(dir.path())
        .env("LD_LIBRARY_PATH", "")
        .success();
    let fix_of = |component: &str| {
        let mut lines = out.stdout.lines();
        lines
            .find(|l| l.starts_with("missing") && l.split_whitespace().nth(1) == Some(component))?;
        lines.next().map(str::trim).map(str::to_string)
    };
    // NVRTC on the system's own library path is found there; else the
    // fix puts the checkout's wheel on the path (python3's own wheel
    // first, where it has one).
    if let Some(fix) = fix_of("NVRTC") {
        assert!(
            fix.starts_with("fix: export LD_LIBRARY_PATH="),
            "{}",
            out.stdout
        );
        let python3_has_wheel = std::process::Command::new("python3")
            .args(["-c", "import nvidia"])
            .output()
            .is_ok_and(|o| o.status.success());
        if !python3_has_wheel {
            assert!(fix.contains(&lib.display().to_string()), "{}", out.stdout);
        }
    }
    if !python3_has_torch() {
        let fix = fix_of("torch").expect("torch missing");
        assert_eq!(
            fix,
            format!(
                "fix: export MTMC_PYTHON={}   (the Python scripts/test installed torch in)",
                venv.display()
            ),
            "{}",
            out.stdout
        );
    }
}

/// Whether the test script put NVRTC on the library path.
fn nvrtc_expected() -> bool {
    std::env::var_os("MTMC_EXPECT_NVRTC").is_some()
}

/// `mtmc optimize PROBLEM --kernelbench <shared problems> FLAGS… --out OUT`.
fn optimize_shared(problem: &str, flags: &[&str], out: &std::path::Path) -> common::Run {
    let kb = shared_jsonl();
    let mut args = vec!["optimize", problem, "--kernelbench", &kb];
    args.extend(flags);
    args.extend(["--out", out.to_str().unwrap()]);
    mtmc(&args)
}

#[test]
fn compile_reports_each_kernel_or_says_nvrtc_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("relu.cu");
    std::fs::write(
        &file,
        "extern \"C\" __global__ void relu(const float* x, float* y, long n) {\n\
         long i = blockIdx.x * (long)blockDim.x + threadIdx.x;\n\
         if (i < n) y[i] = fmaxf(x[i], 0.0f);\n}\n",
    )
    .unwrap();
    let run = mtmc(&["compile", file.to_str().unwrap(), "--block", "128"]);
    if nvrtc_expected() {
        let out = run.success();
        assert!(
            out.stdout.starts_with("relu.cu compiled for sm_90a in "),
            "{}",
            out.stdout
        );
        let row = out.stdout.lines().find(|l| l.starts_with("relu ")).unwrap();
        assert!(row.contains("none") && row.ends_with("100%"), "{row}");
        assert!(out.stdout.contains("OCCUPANCY@128"));
    } else {
        let out = run.failure();
        assert!(
            out.error.contains("NVRTC is not available"),
            "{}",
            out.error
        );
        assert!(out.error.contains("mtmc doctor"), "{}", out.error);
    }
    // A block no GPU launches is refused (it printed 0 % occupancy).
    for block in ["0", "1025"] {
        let out = mtmc(&["compile", file.to_str().unwrap(), "--block", block]).failure();
        assert!(out.error.contains("is not in 1..=1024"), "{}", out.error);
    }
}

#[test]
fn compile_errors_are_listed_with_their_lines() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("bad.cu");
    std::fs::write(
        &file,
        "extern \"C\" __global__ void k(float* y) {\n  y[0] = nope;\n}\n",
    )
    .unwrap();
    let out = mtmc(&["compile", file.to_str().unwrap()]).failure();
    assert_eq!(
        out.stdout,
        "bad.cu:2: error: identifier \"nope\" is undefined\n"
    );
    assert!(
        out.error
            .ends_with("bad.cu` does not compile (1 error(s) above)"),
        "{}",
        out.error
    );
}

#[test]
fn eval_needs_the_problem_code() {
    let dir = tempfile::tempdir().unwrap();
    let cand = dir.path().join("c.py");
    std::fs::write(&cand, "class ModelNew: pass\n").unwrap();
    let out = mtmc(&[
        "eval",
        "L1/19",
        "--evaluator",
        "worker",
        "--candidate",
        cand.to_str().unwrap(),
    ])
    .failure();
    assert!(
        out.error.contains("needs L1/19_ReLU's code") && out.error.contains("--kernelbench"),
        "{}",
        out.error
    );
}

#[test]
fn eval_without_torch_says_how_to_fix_it() {
    let has_torch = python3_has_torch();
    if has_torch {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cand = dir.path().join("c.py");
    std::fs::write(&cand, "class ModelNew: pass\n").unwrap();
    let out = mtmc(&[
        "eval",
        "L1/19",
        "--kernelbench",
        &shared_jsonl(),
        "--evaluator",
        "worker",
        "--candidate",
        cand.to_str().unwrap(),
    ])
    .failure();
    assert!(
        out.error.contains("python3 has no torch") && out.error.contains("MTMC_PYTHON"),
        "{}",
        out.error
    );
}

#[test]
fn eval_without_a_gpu_compiles_the_candidates_cuda_and_runs_nothing() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let cand = dir.path().join("relu.py");
    std::fs::write(
        &cand,
        "import cupy as cp\n_SRC = r\"\"\"\nextern \"C\" __global__ void relu(const float* x, float* y, long n) {\n\
         long i = blockIdx.x * (long)blockDim.x + threadIdx.x;\n  if (i < n) y[i] = fmaxf(x[i], 0.0f);\n}\n\"\"\"\n",
    )
    .unwrap();
    let json = dir.path().join("out.json");
    let out = mtmc(&[
        "eval",
        "L1/19",
        "--kernelbench",
        &shared_jsonl(),
        "--evaluator",
        "compile-only",
        "--candidate",
        cand.to_str().unwrap(),
        "--json",
        json.to_str().unwrap(),
    ])
    .success();
    assert!(
        out.stdout.starts_with("relu.py: compiled_only (compile-only)\n  why: compile only (asked for): 1 kernel(s) compiled for sm_90a; nothing was run"),
        "{}",
        out.stdout
    );
    assert!(
        out.stdout.contains("kernel relu (nvrtc): "),
        "{}",
        out.stdout
    );
    let saved = read_json(&json);
    assert_eq!(saved[0]["outcome"]["status"], "compiled_only");
    assert_eq!(saved[0]["outcome"]["evaluator"], "compile_only");
}

#[test]
fn eval_on_the_cpu_judges_candidates_and_keeps_going_after_a_cheat() {
    let Some(python) = torch_python() else { return };
    let cheats = concat!(env!("CARGO_MANIFEST_DIR"), "/env/tests/cheats");
    let checkout = tempfile::tempdir().unwrap();
    let level1 = checkout.path().join("level1");
    std::fs::create_dir(&level1).unwrap();
    std::fs::copy(
        format!("{cheats}/problem_relu.py"),
        level1.join("1_Small_ReLU.py"),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let out = mtmc(&[
        "eval",
        "L1/1",
        "--kernelbench",
        checkout.path().to_str().unwrap(),
        "--cpu",
        "--trials",
        "5",
        "--baselines",
        "eager",
        "--candidate",
        &format!("{cheats}/falls_back.py"),
        "--candidate",
        &format!("{cheats}/counts_calls.py"),
        "--candidate",
        &format!("{cheats}/honest.py"),
    ])
    .env("MTMC_PYTHON", &python)
    .env("MTMC_CACHE_DIR", cache.path())
    .env("MTMC_JUDGE_DEBUG", "1")
    .success();
    // With MTMC_JUDGE_DEBUG=1 the judge's and the runners' lines reach
    // mtmc's stderr.
    let e = &out.stderr;
    assert!(
        e.contains("mtmc judge ") && e.contains(": candidate: begin calls"),
        "{e}"
    );
    assert!(
        e.contains(" candidate op calls done: {'ok': True, 'served': True}"),
        "{e}"
    );
    let s = &out.stdout;
    assert!(
        s.contains(
            "falls_back.py: incorrect (worker)\n  why: the forward caught an exception and went on"
        ),
        "{s}"
    );
    assert!(
        s.contains("counts_calls.py: incorrect (worker)\n  why: on call "),
        "{s}"
    );
    assert!(s.contains("  failed check: timed_call\n"), "{s}");
    assert!(
        s.contains("honest.py: correct (worker)\n  apart from the judge: a process of its own"),
        "{s}"
    );
    assert!(
        s.contains("  6 correctness trial(s), max abs error 0.000e0"),
        "{s}"
    );
    assert!(
        s.contains("  inputs from a normal distribution: passed\n"),
        "{s}"
    );
    assert!(s.contains("(5 trials, host)"), "{s}");
    // A cheat costs its runner only: one judge for all three.
    assert!(
        s.ends_with("L1/1_Small_ReLU: 3 candidate(s), 1 worker start(s)\n"),
        "{s}"
    );
    // The eager baseline went to the cache, keyed by problem, device and torch.
    let cached: Vec<_> = std::fs::read_dir(cache.path().join("baselines"))
        .unwrap()
        .collect();
    assert_eq!(cached.len(), 1);
}

#[test]
fn eval_of_an_intent_takes_cuda_programs_and_checks_their_plan() {
    if !nvrtc_expected() {
        return;
    }
    let programs = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/programs");
    let out = mtmc(&[
        "eval",
        "--intent",
        "y = relu(x)",
        "--shape",
        "x=4194304",
        "--evaluator",
        "compile-only",
        "--candidate",
        &format!("{programs}/relu.json"),
        "--candidate",
        &format!("{programs}/linear_gelu.json"),
    ])
    .success();
    let s = &out.stdout;
    assert!(
        s.starts_with("relu.json: compiled_only (compile-only)\n"),
        "{s}"
    );
    assert!(
        s.contains("kernel relu (nvrtc): 10 registers, 0 B shared, 0 B local, occupancy 100% at 256 threads"),
        "{s}"
    );
    assert!(
        s.contains("linear_gelu.json: compile_error (compile-only)\n  error: the launch plan does not fit the problem: buffer `w` holds input `w`, which the graph does not have (it has: x)"),
        "{s}"
    );
}

#[test]
fn the_worker_s_settings_for_cuda_programs_alone_are_refused() {
    let programs = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/programs");
    let relu = format!("{programs}/relu.json");
    for (flags, said) in [
        (&["--strict"][..], "--strict only changes how the worker"),
        (
            &["--host-inputs", "--eager-alone"][..],
            "--host-inputs and --eager-alone only change how the worker",
        ),
    ] {
        let mut args = vec![
            "eval",
            "--intent",
            "y = relu(x)",
            "--shape",
            "x=4194304",
            "--candidate",
            &relu,
        ];
        args.extend_from_slice(flags);
        let out = mtmc(&args).failure();
        assert!(
            out.error.contains(said)
                && out.error.contains("every candidate here is a CUDA program"),
            "{}",
            out.error
        );
    }
}

#[test]
fn the_llm_coder_s_flags_with_the_template_coder_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("o");
    let out_dir = out_dir.to_str().unwrap();
    for (flags, said) in [
        (
            &["--model", "m", "--repairs", "3"][..],
            "--model, --repairs configure the LLM coder, and the template coder writes this run: add --coder llm, or drop them",
        ),
        (
            &["--offline"][..],
            "--offline configures the LLM coder, and the template coder writes this run: add --coder llm, or drop it",
        ),
        (
            &["--planner", "random", "--base-url", "http://127.0.0.1:9/v1"][..],
            "--base-url configures the LLM coder, and the template coder writes this run: --planner drives the template coder: drop it",
        ),
        (
            &["--critic", "llm"][..],
            "--critic llm steers the LLM coder: add --coder llm",
        ),
    ] {
        let mut args = vec![
            "optimize",
            "--intent",
            "y = relu(x)",
            "--shape",
            "x=16",
            "--out",
            out_dir,
        ];
        args.extend_from_slice(flags);
        let out = mtmc(&args).failure();
        assert!(out.error.contains(said), "{flags:?}: {}", out.error);
        assert!(!dir.path().join("o").exists(), "{flags:?} wrote its folder");
    }
}

#[test]
fn a_python_candidate_for_an_intent_is_one_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let cand = dir.path().join("c.py");
    std::fs::write(&cand, "class ModelNew: pass\n").unwrap();
    let out = mtmc(&[
        "eval",
        "--intent",
        "y = relu(x)",
        "--shape",
        "x=16",
        "--evaluator",
        "native",
        "--candidate",
        cand.to_str().unwrap(),
    ])
    .failure();
    assert!(
        out.error
            .contains("c.py is Python: the native evaluator runs CUDA programs"),
        "{}",
        out.error
    );
}

#[test]
fn optimize_writes_a_program_for_a_pointwise_intent_or_says_what_it_lacks() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let out = mtmc(&[
        "optimize",
        "--intent",
        "y = gelu(x * s + b) - 0.5 * x",
        "--shape",
        "x=64x128,s=128,b=128",
        "--out",
        out_dir.to_str().unwrap(),
    ])
    .success();
    let s = &out.stdout;
    // No GPU here: compiled only, and said so.
    assert!(
        s.contains("judged by compile only (no GPU: nothing is run or timed)"),
        "{s}"
    );
    assert!(s.contains("block=256 vector=1: compiled, not run"), "{s}");
    assert!(s.contains("block=256 vector=4: compiled, not run"), "{s}");
    // The written program is a candidate `mtmc eval` takes for the same intent.
    let program = out_dir.join("program.json");
    assert!(out_dir.join("program.cu").is_file() && out_dir.join("report.json").is_file());
    let again = mtmc(&[
        "eval",
        "--intent",
        "y = gelu(x * s + b) - 0.5 * x",
        "--shape",
        "x=64x128,s=128,b=128",
        "--evaluator",
        "compile-only",
        "--candidate",
        program.to_str().unwrap(),
    ])
    .success();
    assert!(
        again
            .stdout
            .starts_with("program.json: compiled_only (compile-only)"),
        "{}",
        again.stdout
    );
    // A matrix product becomes a GEMM kernel with the chain after it fused.
    let out = mtmc(&[
        "optimize",
        "--intent",
        "y = relu(x @ w + b)",
        "--shape",
        "x=256x512,w=512x384,b=384",
        "--out",
        out_dir.to_str().unwrap(),
    ])
    .success();
    assert!(
        out.stdout
            .contains("block=256 vector=1 gemm: compiled, not run"),
        "{}",
        out.stdout
    );
    let cu = std::fs::read_to_string(out_dir.join("program.cu")).unwrap();
    assert!(cu.contains("mma.sync") && cu.contains("k0_gemm_e("), "{cu}");
    let out = mtmc(&[
        "optimize",
        "--intent",
        "y = transpose(x, dim0=0, dim1=1) * 2",
        "--shape",
        "x=4x8",
        "--out",
        out_dir.to_str().unwrap(),
    ])
    .failure();
    assert!(
        out.error.contains("no family yet for") && out.error.contains("permute"),
        "{}",
        out.error
    );
}

#[test]
fn optimize_stopped_by_ctrl_c_writes_the_best_variant_so_far() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("out");
    let (kb, out_s) = (shared_jsonl(), out_dir.to_string_lossy());
    let args = ["--kernelbench", &kb, "optimize", "L2/76", "--out", &out_s];
    // Ctrl-C once the first of its six variants is judged.
    let (stdout, stderr) = interrupted(&args, |l| l.starts_with("  block="));
    let judged = stdout
        .lines()
        .filter(|l| l.ends_with(": compiled, not run"))
        .count();
    // The variant in flight, if any, is not kept.
    let cut = stdout.matches(": interrupted, not kept").count();
    assert!(judged >= 1 && judged + cut < 6 && cut <= 1, "{stdout}");
    assert!(
        stderr.contains(&format!(
            "interrupted: stopped after {judged} variant(s) judged; the best program so far is in {out_s}"
        )),
        "{stderr}"
    );
    assert!(out_dir.join("model_new.py").is_file());
    assert_eq!(interrupted_report(&out_dir).len(), judged);
    // Uninterrupted, the report does not say so.
    mtmc(&args).success();
    assert!(read_json(&out_dir.join("report.json"))["interrupted"].is_null());
}

#[test]
fn optimize_exports_a_model_new_python_can_parse_for_level_1_and_2_problems() {
    if !nvrtc_expected() {
        return;
    }
    for problem in ["L1/19", "L2/12", "L2/1"] {
        let dir = tempfile::tempdir().unwrap();
        let out = optimize_shared(problem, &[], dir.path()).success();
        assert!(
            out.stdout
                .contains("judged by compile only (no GPU: nothing is run or timed)"),
            "{}",
            out.stdout
        );
        let file = dir.path().join("model_new.py");
        let code = std::fs::read_to_string(&file).unwrap();
        assert!(
            code.contains("class ModelNew(nn.Module):") && code.contains("_KERNELS["),
            "{code}"
        );
        let parsed = std::process::Command::new("python3")
            .args(["-c", "import ast, sys; ast.parse(open(sys.argv[1]).read())"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(
            parsed.status.success(),
            "{problem}: {}",
            String::from_utf8_lossy(&parsed.stderr)
        );
    }
    // A problem it has a family for but cannot write (a product reduction)
    // ends with every variant rolled back, and says where the attempts are.
    let dir = tempfile::tempdir().unwrap();
    let out = mtmc(&[
        "optimize",
        "--intent",
        "y = prod(x, dim=1)",
        "--shape",
        "x=4x8",
        "--out",
        dir.path().to_str().unwrap(),
    ])
    .failure();
    assert!(
        out.error.contains("no variant was correct"),
        "{}",
        out.error
    );
    assert!(
        out.stdout
            .contains("refused, rolled back: no row kernel yet for Prod"),
        "{}",
        out.stdout
    );
}

#[test]
fn bench_stopped_by_ctrl_c_keeps_every_finished_problem_and_resumes() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("bench");
    let kb = shared_jsonl();
    let names = ["L1/19", "L1/20", "L1/21", "L1/22", "L1/24"];
    let mut args = vec!["bench"];
    args.extend(names);
    args.extend(["--kernelbench", &kb, "--out", out_dir.to_str().unwrap()]);
    let (stdout, stderr) = interrupted(&args, |l| l.starts_with("L1/19_ReLU "));
    // Each finished problem has its line, in the file and on the screen;
    // the one in flight has neither.
    let printed: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("L1/") && !l.ends_with(": interrupted, not kept"))
        .collect();
    let results = std::fs::read_to_string(out_dir.join("results.jsonl")).unwrap();
    let kept = results.lines().count();
    assert!((1..names.len()).contains(&kept), "{stdout}");
    assert_eq!(printed.len(), kept, "{stdout}\n{results}");
    for (line, record) in printed.iter().zip(results.lines()) {
        let record: serde_json::Value = serde_json::from_str(record).unwrap();
        let name = record["problem"].as_str().unwrap();
        assert!(line.starts_with(&format!("{name} ")), "{line} / {name}");
    }
    if let Some(cut) = stdout
        .lines()
        .find(|l| l.ends_with(": interrupted, not kept"))
    {
        assert!(
            !results.contains(cut.split(':').next().unwrap()),
            "{results}"
        );
    }
    assert!(
        stderr.contains(&format!(
            "interrupted: stopped after {kept} of the 5 problem(s) to run; every finished problem is in {}",
            out_dir.join("results.jsonl").display()
        )),
        "{stderr}"
    );
    let bench = read_json(&out_dir.join("bench.json"));
    assert_eq!(bench["problems"].as_array().unwrap().len(), kept, "{bench}");
    // Run again, it runs only what was left.
    let again = mtmc(&args).success();
    assert!(
        again
            .stdout
            .contains(&format!("5 problem(s), {kept} already done")),
        "{}",
        again.stdout
    );
    let results = std::fs::read_to_string(out_dir.join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), names.len(), "{results}");
}

#[test]
fn bench_keeps_each_result_resumes_where_it_stopped_and_starts_over_on_fresh() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out_dir = dir.path().join("bench");
    let kb = shared_jsonl();
    let args = |extra: &[&'static str]| {
        let mut a = vec![
            "bench",
            "L1/19",
            "L1/20",
            "--kernelbench",
            &kb,
            "--out",
            out_dir.to_str().unwrap(),
        ];
        a.extend_from_slice(extra);
        a.into_iter().map(String::from).collect::<Vec<_>>()
    };
    let run = |extra: &[&'static str]| {
        let a = args(extra);
        mtmc(&a.iter().map(String::as_str).collect::<Vec<_>>()).success()
    };
    let first = run(&[]);
    assert!(
        first.stdout.contains("2 problem(s), 0 already done"),
        "{}",
        first.stdout
    );
    assert!(
        first.stdout.contains("| L1 | 2 | 2 | 0 |"),
        "both compiled, neither call-library only: {}",
        first.stdout
    );
    let results = std::fs::read_to_string(out_dir.join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 2, "{results}");
    assert!(out_dir.join("L1_19_ReLU/model_new.py").is_file());
    let bench = read_json(&out_dir.join("bench.json"));
    assert_eq!(bench["levels"]["L1"]["compiled_only"], 2, "{bench}");

    // A run cut short keeps its finished lines; a torn last line is
    // dropped and that problem runs again.
    let kept = results.lines().next().unwrap().to_string();
    std::fs::write(
        out_dir.join("results.jsonl"),
        format!("{kept}\n{{\"problem\": \"L1/8"),
    )
    .unwrap();
    let second = run(&[]);
    assert!(
        second.stdout.contains("2 problem(s), 1 already done"),
        "{}",
        second.stdout
    );
    let fresh = run(&["--fresh"]);
    assert!(
        fresh.stdout.contains("2 problem(s), 0 already done"),
        "{}",
        fresh.stdout
    );
    let results = std::fs::read_to_string(out_dir.join("results.jsonl")).unwrap();
    assert_eq!(results.lines().count(), 2, "{results}");
}

/// An op no family computes (SqueezeNet's concatenation) stays a torch
/// call beside kernels for the rest, listed with the library calls; strict
/// mode names it as what it cannot cover.
#[test]
fn an_op_without_a_family_stays_a_torch_call_beside_the_kernels() {
    if !nvrtc_expected() {
        return;
    }
    let kb = shared_jsonl();
    let dir = tempfile::tempdir().unwrap();
    let out = optimize_shared("L3/17", &[], dir.path()).success();
    assert!(
        out.stdout
            .contains("L3/17_SqueezeNetFireModule: 3 kernel(s) for 3 op(s), 4 library call(s)")
            && out.stdout.contains("cat (concat dim=1)")
            && !out.stdout.contains("call-library only"),
        "{}",
        out.stdout
    );
    let code = std::fs::read_to_string(dir.path().join("model_new.py")).unwrap();
    assert!(
        code.contains("torch.cat([") && code.contains("_KERNELS[\"k2_pointwise\"]"),
        "{code}"
    );
    let out = mtmc(&["optimize", "L3/17", "--kernelbench", &kb, "--strict"]).failure();
    assert!(
        out.error.contains("no family yet for") && out.error.contains("cat (concat dim=1)"),
        "{}",
        out.error
    );
}

/// L2/39's `* scale` after its linear layer folds into the weights: the
/// rewritten graph's only kernel is the batch norm, and the folded weight
/// and bias are torch calls (kept by the export), counted with the GEMM.
#[test]
fn folded_weights_stay_torch_calls_beside_the_kernels() {
    if !nvrtc_expected() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let out = optimize_shared("L2/39", &[], dir.path()).success();
    assert!(
        out.stdout.contains("L2/39_Gemm_Scale_BatchNorm: 2 kernel(s) for 2 op(s), 1 library call(s)")
            && out.stdout.contains(
                "rewritten (fold_into_weights) L2/39_Gemm_Scale_BatchNorm: 1 kernel(s) for 1 op(s), 3 library call(s)"
            ),
        "{}",
        out.stdout
    );
}

/// Strict mode: every op in a custom kernel. A GEMM problem gets its
/// product as a GEMM kernel and a report with no library call (the same
/// problem without `--strict` lists its cuBLAS call); a convolution, which
/// no family computes, is named as not covered; the planner and a bench
/// folder of the other mode are refused with what to do.
#[test]
fn strict_mode_keeps_every_op_in_a_kernel_and_names_what_it_cannot() {
    if !nvrtc_expected() {
        return;
    }
    let kb = shared_jsonl();
    let report = |dir: &std::path::Path| read_json(&dir.join("report.json"));
    let strict = tempfile::tempdir().unwrap();
    let out = optimize_shared("L2/12", &["--strict"], strict.path()).success();
    assert!(
        out.stdout.contains("(strict: every op a kernel)")
            && !out.stdout.contains("library calls in the best program"),
        "{}",
        out.stdout
    );
    let code = std::fs::read_to_string(strict.path().join("model_new.py")).unwrap();
    assert!(code.contains("_gemm"), "{code}");
    assert_eq!(
        report(strict.path())["library_calls"],
        serde_json::json!([])
    );

    let loose = tempfile::tempdir().unwrap();
    let out = optimize_shared("L2/12", &[], loose.path()).success();
    assert!(
        out.stdout
            .contains("library calls in the best program (torch, cuBLAS, cuDNN): gemm (matmul"),
        "{}",
        out.stdout
    );
    let listed = report(loose.path())["library_calls"].to_string();
    assert!(listed.contains("matmul"), "{listed}");

    // A convolution of one group is an implicit-GEMM kernel in strict
    // mode; a transposed one has no family.
    let conv = tempfile::tempdir().unwrap();
    optimize_shared("L2/1", &["--strict"], conv.path()).success();
    let code = std::fs::read_to_string(conv.path().join("model_new.py")).unwrap();
    assert!(code.contains("_conv"), "{code}");
    assert_eq!(report(conv.path())["library_calls"], serde_json::json!([]));
    let out = optimize_shared("L2/2", &["--strict"], strict.path()).failure();
    assert!(
        out.error
            .contains("strict: the template coder has no family yet for conv_transpose")
            && out.error.contains("conv2dᵀ")
            && out.error.contains("without --strict it stays one"),
        "{}",
        out.error
    );
    let out = mtmc(&[
        "optimize",
        "L2/12",
        "--kernelbench",
        &kb,
        "--strict",
        "--planner",
        "random",
    ])
    .failure();
    assert!(out.error.contains("drop --planner"), "{}", out.error);

    let bench = tempfile::tempdir().unwrap();
    let dir = bench.path().join("b");
    let dir = dir.to_str().unwrap();
    let out = mtmc(&[
        "bench",
        "L1/19",
        "L2/2",
        "--kernelbench",
        &kb,
        "--strict",
        "--out",
        dir,
    ])
    .success();
    assert!(
        out.stdout.contains("strict: every op in a custom kernel")
            && out.stdout.contains(
                "L2/2_ConvTranspose2d_BiasAdd_Clamp_Scaling_Clamp_Divide — not_covered: strict:"
            ),
        "{}",
        out.stdout
    );
    let summary = read_json(&bench.path().join("b/bench.json"));
    assert_eq!(summary["strict"], true, "{summary}");
    assert_eq!(summary["levels"]["L1"]["compiled_only"], 1, "{summary}");
    let out = mtmc(&["bench", "L1/19", "--kernelbench", &kb, "--out", dir]).failure();
    assert!(
        out.error
            .contains("holds results of --target cuda --strict (L1/19_ReLU), not of --target cuda: pass --fresh"),
        "{}",
        out.error
    );
}

/// The problems of `tests/families` (the GPU test's, a family or more
/// each) compile for both targets without a GPU: CUDA by NVRTC, Triton
/// by Triton. Few long lines are cut into runs combined atomically (the
/// maximum, the minimum); the scans written with slices and the losses
/// (the KL divergence's batch mean among them) are all kernels; a causal
/// mask torch computed and a comparison in the chain are read as
/// booleans by the masked_fill and the where.
#[test]
fn family_problems_compile_for_cuda_and_triton() {
    let Some(python) = torch_python() else { return };
    if !nvrtc_expected() || std::env::var_os("MTMC_EXPECT_TRITON").is_none() {
        return;
    }
    let cache = tempfile::tempdir().unwrap();
    let dir = tempfile::tempdir().unwrap();
    for target in ["cuda", "triton"] {
        for id in 1..=18 {
            let problem = format!("L1/{id}");
            let out_dir = dir.path().join(format!("{target}_{id}"));
            let out = common::optimize_family(target, id, &out_dir)
                .env("MTMC_PYTHON", &python)
                .env("MTMC_CACHE_DIR", cache.path())
                .success();
            let s = &out.stdout;
            assert!(s.contains(": compiled, not run"), "{target} {problem}: {s}");
            assert!(!s.contains("failed"), "{target} {problem}: {s}");
            let code = std::fs::read_to_string(out_dir.join("model_new.py")).unwrap();
            let wants: &[&str] = match (target, id) {
                ("triton", 2) => &["tl.atomic_max("],
                ("triton", 3) => &["tl.atomic_min("],
                (_, 13 | 14) => &[" 0 library call(s)"],
                // The mask and the scaling fused in front of the softmax.
                ("cuda", 17) => &[
                    "const bool* __restrict__ px1",
                    "#define MTMC_PROLOGUE",
                    "__int_as_float(0xff800000)",
                ],
                ("triton", 17) => &["float('-inf')", "2 pointwise op(s) fused in front of"],
                ("cuda", 18) => &[" > 5e-1f)", " 0 library call(s)"],
                ("triton", 18) => &["tl.where(", " 0 library call(s)"],
                _ => &[],
            };
            for want in wants {
                assert!(
                    code.contains(want) || s.contains(want),
                    "{target} {problem}: {want}\n{s}"
                );
            }
        }
    }
}

/// `--target triton` without a GPU: every fragment compiled by Triton for
/// sm_90 (`$MTMC_TEST_PYTHON` has triton), the `ModelNew` launches Triton
/// kernels and no cupy; a region the Triton coder has no template for
/// (an eval-mode batch norm) stays torch calls and says so; an intent is
/// refused with the reason.
#[test]
fn optimize_writes_triton_kernels_for_problems() {
    let Some(python) = torch_python() else { return };
    let has_triton = std::process::Command::new(&python)
        .args(["-c", "import triton"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_triton {
        assert!(
            std::env::var_os("MTMC_EXPECT_TRITON").is_none(),
            "MTMC_EXPECT_TRITON is set but {python} has no triton"
        );
        return;
    }
    // L1/89's cumsum is a Triton scan; L2/52's batch norm a Triton norm
    // with the activation in front of it.
    // Problems of this test's own: `F.normalize` over a middle dim, a
    // Triton norm whose lines are strided; an eval-mode batch norm, which
    // has no Triton kernel: its region stays torch calls.
    let own = tempfile::tempdir().unwrap();
    let model = |forward: &str, init: &str| {
        format!(
            "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\nclass Model(nn.Module):\n    def __init__(self):\n        super().__init__()\n{init}\n    def forward(self, x):\n        return {forward}\n\ndef get_inputs():\n    return [torch.rand(64, 32, 16)]\n\ndef get_init_inputs():\n    return []\n"
        )
    };
    let jsonl = own.path().join("problems.jsonl");
    std::fs::write(
        &jsonl,
        [
            serde_json::json!({"level": 1, "problem_id": 901, "name": "901_Normalize", "code": model("F.normalize(x, dim=1) * 2.0", "")}),
            serde_json::json!({"level": 1, "problem_id": 902, "name": "902_Eval_BatchNorm", "code": model("self.bn(x) * 2.0", "        self.bn = nn.BatchNorm1d(32)\n        self.eval()\n")}),
        ]
        .map(|v| v.to_string())
        .join("\n"),
    )
    .unwrap();
    let shared = shared_jsonl();
    for (problem, problems, kernel, refused) in [
        ("L1/19", shared.as_str(), Some("t0_triton[("), None),
        ("L1/24", &shared, Some("t0_triton_x(base + kk, m, x)"), None),
        ("L2/12", &shared, Some("t0_triton[("), None),
        ("L1/89", &shared, Some("t0_triton[("), None),
        (
            "L2/52",
            &shared,
            Some("# t0_triton: batch norm over 128 channels of 64 x 15876"),
            None,
        ),
        (
            "L1/901",
            jsonl.to_str().unwrap(),
            Some("base = (r // 16) * 512 + r % 16"),
            None,
        ),
        (
            "L1/902",
            jsonl.to_str().unwrap(),
            None,
            Some("stays torch calls: no Triton norm kernel yet for Batch with running statistics"),
        ),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let out = mtmc(&[
            "optimize",
            problem,
            "--kernelbench",
            problems,
            "--target",
            "triton",
            "--out",
            dir.path().to_str().unwrap(),
        ])
        .env("MTMC_PYTHON", &python)
        .env("MTMC_CACHE_DIR", own.path())
        .success();
        let file = dir.path().join("model_new.py");
        let code = std::fs::read_to_string(&file).unwrap();
        assert!(!code.contains("import cupy"), "{problem}:\n{code}");
        if let Some(kernel) = kernel {
            assert!(
                code.contains("@triton.jit") && code.contains(kernel),
                "{problem}:\n{code}"
            );
        }
        if let Some(refused) = refused {
            assert!(out.stdout.contains(refused), "{problem}: {}", out.stdout);
        }
        let parsed = std::process::Command::new("python3")
            .args(["-c", "import ast, sys; ast.parse(open(sys.argv[1]).read())"])
            .arg(&file)
            .output()
            .unwrap();
        assert!(parsed.status.success(), "{problem}");
    }
    let out = mtmc(&[
        "optimize",
        "--intent",
        "y = relu(x)",
        "--shape",
        "x=64",
        "--target",
        "triton",
    ])
    .failure();
    assert!(
        out.error
            .contains("native evaluator, which runs CUDA programs only"),
        "{}",
        out.error
    );
}

/// A problem fx traces only in part (`coder/tests/opaque/partial.py`: a
/// submodule that branches on a value, one that keeps state) gets a program
/// around those two submodules: the run and the report name each, with its
/// reason, and the program calls them on the problem's own model.
#[test]
fn a_partial_trace_is_optimized_around_the_problems_own_submodules() {
    let Some(python) = torch_python() else { return };
    if !nvrtc_expected() {
        return;
    }
    let checkout = tempfile::tempdir().unwrap();
    let level1 = checkout.path().join("level1");
    std::fs::create_dir(&level1).unwrap();
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/coder/tests/opaque/partial.py"),
        level1.join("1_Partial.py"),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let run = mtmc(&[
        "optimize",
        "L1/1",
        "--kernelbench",
        checkout.path().to_str().unwrap(),
        "--out",
        out_dir.path().to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", &python)
    .env("MTMC_CACHE_DIR", cache.path())
    .success();
    for line in [
        "the problem's own PyTorch code: Gate `gate` (its forward does what fx cannot trace: symbolically traced variables cannot be used as inputs to control flow)",
        "the problem's own PyTorch code: Accumulate `acc` (keeps state across calls: it assigns or updates self.calls, self.total)",
    ] {
        assert!(run.stdout.contains(line), "{line}\n{}", run.stdout);
    }
    let report = read_json(&out_dir.path().join("report.json"));
    let own: Vec<&str> = report["own_code"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o["call"].as_str().unwrap())
        .collect();
    assert_eq!(own, ["Gate `gate`", "Accumulate `acc`"], "{report}");
    let code = std::fs::read_to_string(out_dir.path().join("model_new.py")).unwrap();
    assert!(
        code.contains("self.reference_parameters.get_submodule(\"gate\")(")
            && code.contains("self.reference_parameters.get_submodule(\"acc\")(")
            && code.contains("_KERNELS["),
        "{code}"
    );
}

/// A problem with no graph (a model that keeps state across calls, whose
/// trace does not import) still gets a program: its whole forward as the
/// problem's own code, said so, written with its report, and judged
/// correct call after call; a planner, which has nothing to choose there,
/// says where to go instead.
#[test]
fn a_problem_with_no_graph_is_written_as_its_own_forward() {
    let Some(python) = torch_python() else { return };
    let checkout = tempfile::tempdir().unwrap();
    let level1 = checkout.path().join("level1");
    std::fs::create_dir(&level1).unwrap();
    std::fs::copy(
        concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/coder/tests/opaque/stateful.py"
        ),
        level1.join("1_Stateful.py"),
    )
    .unwrap();
    let cache = tempfile::tempdir().unwrap();
    let out_dir = tempfile::tempdir().unwrap();
    let kb = checkout.path().to_str().unwrap();
    let run = mtmc(&[
        "optimize",
        "L1/1",
        "--kernelbench",
        kb,
        "--out",
        out_dir.path().to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", &python)
    .env("MTMC_CACHE_DIR", cache.path())
    .success();
    assert!(
        run.stdout.contains(
            "no graph (tracing failed: Model.forward keeps state across calls: it assigns or updates self.hidden): the whole forward stays the problem's own PyTorch code"
        ),
        "{}",
        run.stdout
    );
    let code = std::fs::read_to_string(out_dir.path().join("model_new.py")).unwrap();
    assert!(
        code.contains("return self.reference_parameters(*args, **kwargs)"),
        "{code}"
    );
    let report = read_json(&out_dir.path().join("report.json"));
    assert_eq!(
        report["whole_forward"],
        "tracing failed: Model.forward keeps state across calls: it assigns or updates self.hidden"
    );
    // The judge judges it call after call against its own model fed the
    // same calls (lockstep), and it is correct.
    let judged = mtmc(&[
        "eval",
        "L1/1",
        "--kernelbench",
        kb,
        "--cpu",
        "--baselines",
        "none",
        "--candidate",
        out_dir.path().join("model_new.py").to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", &python)
    .env("MTMC_CACHE_DIR", cache.path())
    .success();
    assert!(
        judged.stdout.contains(": correct (worker)")
            && judged.stdout.contains("every call was mirrored, in order"),
        "{}",
        judged.stdout
    );
    let planned = mtmc(&[
        "optimize",
        "L1/1",
        "--kernelbench",
        kb,
        "--planner",
        "random",
        "--out",
        out_dir.path().join("planned").to_str().unwrap(),
    ])
    .env("MTMC_PYTHON", &python)
    .env("MTMC_CACHE_DIR", cache.path())
    .failure();
    assert!(
        planned
            .stderr
            .contains("without --planner writes its whole forward"),
        "{}",
        planned.stderr
    );
}

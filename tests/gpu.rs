//! GPU tests, opt-in with `MTMC_GPU=1` (on a machine with a CUDA GPU and
//! `libcuda`/`libnvrtc` on the library path): intents optimized and judged
//! on the GPU against the f64 reference, one per kernel family that runs
//! natively, GEMM kernels in each operand layout among them; small
//! problems of every family optimized for CUDA and for Triton; a candidate
//! out of memory beside the kept reference outputs judged again.

#[allow(dead_code)]
mod common;
use common::mtmc;

/// Held by every GPU test while it runs: shared by the tests that judge
/// correctness, taken alone by the one that times eager beside a
/// candidate, since another test's kernels on the GPU would slow eager
/// beside the candidate and not alone, and by the one that fills most of
/// the GPU's memory.
static GPU: std::sync::RwLock<()> = std::sync::RwLock::new(());

/// Whether `MTMC_GPU` asks for the GPU tests: set to anything but empty
/// or `0`.
fn wanted() -> bool {
    if std::env::var_os("MTMC_GPU").is_some_and(|v| !v.is_empty() && v != "0") {
        return true;
    }
    eprintln!("skipped: set MTMC_GPU=1 on a machine with a GPU");
    false
}

/// The GPU, shared with the other correctness tests; `None` unless
/// `MTMC_GPU` asks for it.
fn gpu() -> Option<std::sync::RwLockReadGuard<'static, ()>> {
    wanted().then(|| {
        GPU.read()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    })
}

/// The GPU with no other test on it; `None` unless `MTMC_GPU` asks for
/// it.
fn gpu_alone() -> Option<std::sync::RwLockWriteGuard<'static, ()>> {
    wanted().then(|| {
        GPU.write()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    })
}

#[test]
fn intents_are_correct_on_the_gpu_in_every_family() {
    let Some(_gpu) = gpu() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (intent, shapes) in [
        ("y = gelu(x * s + b) - 0.5 * x", "x=4096x1024,s=1024,b=1024"),
        ("y = softmax(x, dim=1)", "x=4096x1000"),
        // The chain after a softmax fused where it writes.
        (
            "y = sigmoid(softmax(x, dim=1) + b) * 2.0",
            "x=4096x1000,b=1000",
        ),
        // Long rows of a softmax: a cluster of blocks per row, alone and
        // with a chain fused in front of it.
        ("y = log_softmax(x, dim=1)", "x=64x65536"),
        ("y = softmax(relu(x) * 2.0, dim=1)", "x=64x65536"),
        // Norms over long rows: a team of blocks per row, each block's
        // chunk in registers, 16 bytes at a time (rows of 65536), or
        // element by element (rows of 40001), with a chain fused in front
        // or after.
        (
            "y = layer_norm(x, w, b, dim=-1)",
            "x=64x65536,w=65536,b=65536",
        ),
        ("y = rms_norm(relu(x), g, dim=-1)", "x=64x65536,g=65536"),
        (
            "y = gelu(layer_norm(x, w, b, dim=-1)) * 2.0",
            "x=32x65536,w=65536,b=65536",
        ),
        (
            "y = layer_norm(x, w, b, dim=-1)",
            "x=16x40001,w=40001,b=40001",
        ),
        // Few groups of a million: a team of 64 blocks per group.
        (
            "y = layer_norm(x, w, b, dim=-1)",
            "x=8x1048576,w=1048576,b=1048576",
        ),
        // Groups too long for a team: a statistics launch, the last block
        // of a group combining, then a normalizing launch.
        ("y = rms_norm(x, g, dim=-1)", "x=2x16777216,g=16777216"),
        // Short rows held in registers (8 lanes of 8 elements a row, and
        // a block of 1024 threads of 16), with the chain after the norm
        // fused where it writes.
        (
            "y = gelu(layer_norm(x, w, b, dim=-1)) * 2.0",
            "x=65536x64,w=64,b=64",
        ),
        (
            "y = relu(rms_norm(x, g, dim=-1)) - 0.5",
            "x=2048x15876,g=15876",
        ),
        // A residual after the norm: the norm passes its input, held in
        // registers, to the chain (a warp's part of a row, a block per
        // row, a team per row).
        (
            "y = x + tanh(layer_norm(x, w, b, dim=-1))",
            "x=4096x64,w=64,b=64",
        ),
        (
            "y = x + tanh(layer_norm(x, w, b, dim=-1))",
            "x=300x4000,w=4000,b=4000",
        ),
        (
            "y = x + tanh(layer_norm(x, w, b, dim=-1))",
            "x=64x65536,w=65536,b=65536",
        ),
        // F.normalize over the last dim: rows in registers (4 lanes of 8,
        // a chain after), a block of 1024 per row of 16384 (a chain in
        // front), and a block looping over each long row.
        ("y = normalize(x, dim=-1) * 3.0", "x=4096x32"),
        ("y = normalize(relu(x) - 0.25, dim=-1)", "x=64x16384"),
        ("y = normalize(x, dim=-1)", "x=16x65536"),
        // Norms written out over a middle dim: a thread per line, the
        // line in registers (64) or read twice (100, a residual after).
        (
            "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) + 1e-5)",
            "x=16x64x4096",
        ),
        (
            "y = tanh(x * rsqrt(mean(x * x, dim=1, keepdim=true) + 1e-5)) + x",
            "x=8x100x3000",
        ),
        ("y = x / norm(x, dim=1, keepdim=true)", "x=8x48x4096"),
        ("y = sum(x, dim=0)", "x=2048x512"),
        // Scans of many rows: a warp per row, with 16-byte loads (rows of
        // 1000) or through the fused chain (rows of 1001).
        ("y = cumsum(x, dim=1)", "x=2048x1000"),
        ("y = cumsum(relu(x) * 2.0, dim=1)", "x=2048x1001"),
        // Exclusive scans: a warp per row, a block per row (reverse), a
        // thread per line.
        ("y = cumsum(x, dim=1, exclusive=true)", "x=2048x1000"),
        (
            "y = cumsum(x, dim=1, reverse=true, exclusive=true)",
            "x=64x3000",
        ),
        ("y = cumsum(x, dim=1, exclusive=true)", "x=64x100x33"),
        ("y = logsumexp(exp(x) + 1.0, dim=1)", "x=512x8192"),
        ("y = relu(x @ w + b)", "x=1024x512,w=512x768,b=768"),
        // B stored [K, N], transposed into shared memory for `wgmma`:
        // edges in every dimension, and K below one slice.
        ("y = x @ w", "x=333x520,w=520x260"),
        ("y = x @ w", "x=64x8,w=8x4096"),
        ("y = x @ w.T", "x=1000x256,w=600x256"),
        ("y = gelu(x @ w.T + b) * 0.5", "x=333x520,w=260x520,b=260"),
        // An odd N: two 4-byte stores a pair instead of one 8-byte one.
        ("y = x @ w.T + 1.0", "x=200x64,w=301x64"),
        ("y = x.T @ w", "x=256x512,w=256x384"),
        ("y = x.T @ w.T", "x=256x512,w=384x256"),
        ("y = tanh(a @ b) * 2.0", "a=8x128x256,b=8x256x192"),
    ] {
        let s = &optimize_intent(dir.path(), intent, shapes);
        assert!(s.contains(": correct, "), "{intent}: {s}");
        assert!(!s.contains("incorrect"), "{intent}: {s}");
        if intent.contains('@') {
            assert!(s.contains(" gemm: correct"), "{intent}: {s}");
        }
    }
}

/// `mtmc optimize --intent INTENT --shape SHAPES` into a folder of `dir`,
/// judged natively on the GPU; its standard output.
fn optimize_intent(dir: &std::path::Path, intent: &str, shapes: &str) -> String {
    let out_dir = dir.join("out");
    let s = mtmc(&[
        "optimize",
        "--intent",
        intent,
        "--shape",
        shapes,
        "--out",
        out_dir.to_str().unwrap(),
    ])
    .success()
    .stdout;
    assert!(
        s.contains("judged on the GPU against the f64 reference"),
        "{intent}: {s}"
    );
    s
}

/// The shared KernelBench problems: `MTMC_KERNELBENCH`, else the
/// `shared/kernelbench` folder beside the checkout.
fn kernelbench() -> String {
    std::env::var("MTMC_KERNELBENCH").unwrap_or_else(|_| {
        format!(
            "{}/../shared/kernelbench/problems.jsonl",
            env!("CARGO_MANIFEST_DIR")
        )
    })
}

/// `mtmc optimize PROBLEM` (a shared KernelBench problem) into a folder
/// of `dir`; its standard output.
fn optimize_problem(dir: &std::path::Path, problem: &str) -> String {
    let out = dir.join(problem.replace('/', "_"));
    mtmc(&[
        "optimize",
        problem,
        "--kernelbench",
        &kernelbench(),
        "--out",
        out.to_str().unwrap(),
    ])
    .success()
    .stdout
}

#[test]
fn convolutions_become_correct_kernels_where_the_reference_is_exact_float32() {
    let Some(_gpu) = gpu() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let optimize = |problem: &str| optimize_problem(dir.path(), problem);
    // 8 input channels: cuDNN's reference is exact float32, and the
    // implicit-GEMM kernel with ReLU and HardSwish fused after it is judged
    // correct by the worker.
    let s = &optimize("L2/57");
    assert!(s.contains("block=256 vector=4 gemm: correct"), "{s}");
    // 64 input channels: the reference's convolution ran on TF32, and
    // the kernel that cannot meet the tolerance against it is skipped.
    let s = &optimize("L2/1");
    assert!(
        s.contains("gemm: skipped: the reference's convolutions ran on TF32"),
        "{s}"
    );
    assert!(!s.contains("gemm: incorrect"), "{s}");
}

#[test]
fn long_products_with_few_tiles_are_correct_split_over_k() {
    let Some(_gpu) = gpu() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // Judged natively against the f64 reference: a plain product (parts
    // add to the zeroed output), and a bias with a chain applied after
    // the parts (x.T: A stored [K, M]). Each has fewer tiles than half the
    // SMs over K = 8192 and at least 2^28 multiply-adds, so it is split
    // (`coder/tests/gemm.rs` checks the rule). K stays at 8192: the f64
    // reference's dot products over a longer K take most of a minute.
    for (intent, shapes) in [
        ("y = x @ w", "x=128x8192,w=8192x256"),
        (
            "y = gelu(x @ w.T + b) - 0.5",
            "x=10x8192,w=4096x8192,b=4096",
        ),
        ("y = x.T @ w.T + b", "x=8192x12,w=4096x8192,b=4096"),
    ] {
        let s = optimize_intent(dir.path(), intent, shapes);
        assert!(s.contains(" gemm: correct"), "{intent}: {s}");
        assert!(!s.contains("incorrect"), "{intent}: {s}");
    }
    // KernelBench's long product (256x256 over K = 524288), judged by the
    // worker against torch.
    let s = optimize_problem(dir.path(), "L1/6");
    assert!(s.contains(" gemm: correct"), "{s}");
}

#[test]
fn pooling_is_correct_staged_in_shared_memory_and_walked() {
    let Some(_gpu) = gpu() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    // L1/46 (3-d average, stride 2): staged at 1 and 2 columns a thread,
    // walked at 4; L1/41 (1-d max, dilation 3) and L1/42 (2-d max, 4 rows
    // a thread) staged; L1/45 (11 x 11 windows) walked. Every variant is
    // judged against the reference, none may be wrong.
    for problem in ["L1/46", "L1/41", "L1/42", "L1/45"] {
        let s = optimize_problem(dir.path(), problem);
        assert!(
            s.contains("judged by the worker against the PyTorch model"),
            "{problem}: {s}"
        );
        assert!(s.matches(": correct, ").count() >= 4, "{problem}: {s}");
        assert!(!s.contains("incorrect"), "{problem}: {s}");
    }
}

/// The problems of `tests/families` (one or more kernel families each:
/// pointwise chains, sums, maxima and minima cut into runs combined
/// atomically, argmax, logsumexp, softmax, norms, L1/L2 and Frobenius
/// normalization, pools, scans, losses, a GEMM with its epilogue, a
/// causal masked_fill, a where on a comparison),
/// optimized for `target` and judged by the worker against the PyTorch
/// model: every judged variant correct. `MTMC_GPU_JOBS` problems (4 by
/// default) are optimized at once, since Triton's 18 one at a time took
/// more than 570 s on an H200, and correctness does not depend on what
/// else runs on the GPU.
fn family_problems_are_correct(target: &str) {
    let Some(_gpu) = gpu() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let jobs: usize = std::env::var("MTMC_GPU_JOBS")
        .ok()
        .and_then(|j| j.parse().ok())
        .filter(|&j| j > 0)
        .unwrap_or(4);
    let next = std::sync::atomic::AtomicU32::new(1);
    let failed = std::sync::Mutex::new(Vec::new());
    // Every problem runs before the verdict, so that one run names all
    // the problems that fail.
    std::thread::scope(|scope| {
        for _ in 0..jobs {
            scope.spawn(|| {
                loop {
                    let id = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                    if id > 18 {
                        break;
                    }
                    let problem = format!("L1/{id}");
                    let out = dir.path().join(format!("{target}_{id}"));
                    let (status, run) = common::optimize_family(target, id, &out).finish();
                    let s = &run.stdout;
                    let judged = s.contains("judged by the worker against the PyTorch model");
                    let ok = status.success()
                        && judged
                        && s.contains(": correct, ")
                        && !s.contains("incorrect");
                    eprintln!("{target} {problem}: {}", if ok { "ok" } else { "FAILED" });
                    if !ok {
                        failed.lock().unwrap().push((
                            id,
                            format!(
                                "{target} {problem} (exit {:?}):\n{s}\n{}",
                                status.code(),
                                run.stderr
                            ),
                        ));
                    }
                }
            });
        }
    });
    let mut failed = failed.into_inner().unwrap();
    failed.sort();
    let failed: Vec<String> = failed.into_iter().map(|(_, f)| f).collect();
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

#[test]
fn family_problems_are_correct_on_the_gpu_in_cuda() {
    family_problems_are_correct("cuda");
}

#[test]
fn family_problems_are_correct_on_the_gpu_in_triton() {
    family_problems_are_correct("triton");
}

#[test]
fn eager_is_timed_beside_the_candidate_on_the_gpu_and_a_candidate_cannot_slow_it() {
    let Some(_alone) = gpu_alone() else {
        return;
    };
    let cheats = concat!(env!("CARGO_MANIFEST_DIR"), "/env/tests/cheats");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("outcomes.json");
    mtmc(&[
        "eval",
        "L1/19",
        "--kernelbench",
        &kernelbench(),
        "--baselines",
        "eager",
        "--candidate",
        &format!("{cheats}/honest.py"),
        "--candidate",
        &format!("{cheats}/slows_reference.py"),
        "--json",
        json.to_str().unwrap(),
    ])
    .env("MTMC_CACHE_DIR", dir.path())
    .success();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    let outcomes = v.as_array().unwrap_or_else(|| panic!("{v}"));
    let honest = &outcomes[0]["outcome"]["baselines"]["eager"];
    assert_eq!(honest["paired"], true, "{honest}");
    // Its patch of every `Model` it finds reaches none: the reference runs
    // in a process of its own, and eager beside it stays paired.
    let cheat = &outcomes[1]["outcome"];
    assert_eq!(cheat["status"], "correct", "{cheat}");
    let eager = &cheat["baselines"]["eager"];
    assert_eq!(eager["paired"], true, "{eager}");
    let speedup =
        eager["mean_ms"].as_f64().unwrap() / cheat["runtime"]["mean_ms"].as_f64().unwrap();
    assert!(speedup < 2.0, "{speedup}");
}

/// A candidate that runs out of GPU memory beside the reference outputs
/// the worker keeps is judged once more with them recomputed for each
/// check, on a real GPU: the problem's input and output are sized to the
/// GPU's memory, and the candidate's scratch fits only without the kept
/// outputs. It takes the GPU alone, since it fills most of its memory.
#[test]
fn out_of_memory_beside_the_kept_references_is_judged_again_with_them_recomputed() {
    let Some(_alone) = gpu_alone() else {
        return;
    };
    let memory = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/memory");
    let dir = tempfile::tempdir().unwrap();
    let json = dir.path().join("outcomes.json");
    let s = mtmc(&[
        "eval",
        "L1/1",
        "--kernelbench",
        memory,
        "--candidate",
        &format!("{memory}/needs_most_of_the_gpu.py"),
        "--json",
        json.to_str().unwrap(),
    ])
    .env("MTMC_CACHE_DIR", dir.path())
    .success()
    .stdout;
    assert!(
        s.contains("judged again with the reference outputs recomputed for each check"),
        "{s}"
    );
    let v = common::read_json(&json);
    let outcome = &v[0]["outcome"];
    assert_eq!(outcome["status"], "correct", "{outcome}");
    assert_eq!(outcome["references_recomputed"], true, "{outcome}");
}

/// `explore` on the GPU screens each round: every program gets a short
/// timing first, and only those near their problem's fastest screen the
/// full protocol. Each problem has a program judged in full, a program
/// screened out is recorded as `screened` with no speedup, and one judged
/// in full has one.
#[test]
fn explore_screens_each_round_and_judges_the_fast_in_full() {
    let Some(_gpu) = gpu() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("tree.sqlite");
    let problems = ["L1/19", "L1/24", "L2/12"];
    let mut args = vec!["explore"];
    args.extend(problems);
    let (kb, store_s) = (kernelbench(), store.to_string_lossy().to_string());
    args.extend([
        "--split",
        "all",
        "--planner",
        "random",
        "--episodes",
        "1",
        "--budget",
        "8",
        "--trajectories",
        &store_s,
        "--kernelbench",
        &kb,
    ]);
    let s = mtmc(&args).success().stdout;
    let line = s
        .lines()
        .find(|l| l.starts_with("screening: "))
        .unwrap_or_else(|| panic!("no screening line in {s}"));
    let count = |after: &str| -> usize {
        line.split(after)
            .next()
            .unwrap()
            .split(' ')
            .next_back()
            .unwrap()
            .parse()
            .unwrap_or_else(|_| panic!("{line}"))
    };
    let (screened, promoted) = (count(" program(s) screened"), count(" of them within"));
    assert!(promoted >= problems.len() && promoted <= screened, "{line}");
    let tree = mtmc_planner::store::Store::open(&store).unwrap();
    let mut full = 0;
    for p in tree.problems().unwrap() {
        for (key, d) in tree.evaluations(&p.name).unwrap() {
            match d.status {
                mtmc_env::outcome::Status::Screened => {
                    assert_eq!(d.speedup_eager, None, "{key}: {d:?}")
                }
                mtmc_env::outcome::Status::Correct => {
                    assert!(d.speedup_eager.is_some(), "{key}: {d:?}");
                    full += 1;
                }
                _ => {}
            }
        }
    }
    assert!(full >= problems.len(), "{s}");
}

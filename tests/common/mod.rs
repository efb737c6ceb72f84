//! Helpers shared by the end-to-end tests.

use std::path::PathBuf;
use std::process::Command;

/// A prepared run of the binary.
pub struct Run(Command);

/// What a finished run printed.
pub struct Output {
    pub stdout: String,
    pub stderr: String,
    /// The stderr's one line, for failures.
    pub error: String,
}

/// The binary with arguments, isolated from the caller's settings.
pub fn mtmc(args: &[&str]) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_mtmc"));
    cmd.args(args)
        .env_remove("MTMC_KERNELBENCH")
        .env_remove("MTMC_PYTHON")
        .env_remove("RUST_BACKTRACE");
    Run(cmd)
}

impl Run {
    #[allow(dead_code)]
    pub fn env(mut self, key: &str, value: impl AsRef<std::ffi::OsStr>) -> Run {
        self.0.env(key, value);
        self
    }

    /// Runs it in `dir`.
    #[allow(dead_code)]
    pub fn current_dir(mut self, dir: &std::path::Path) -> Run {
        self.0.current_dir(dir);
        self
    }

    fn output(mut self) -> (std::process::ExitStatus, Output) {
        let out = self.0.output().expect("the binary runs");
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        let error = stderr
            .lines()
            .filter(|l| l.starts_with("error: "))
            .collect::<Vec<_>>()
            .join("\n");
        (
            out.status,
            Output {
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr,
                error,
            },
        )
    }

    /// Starts it with stdout and stderr piped, and returns at once.
    #[allow(dead_code)]
    pub fn spawn(mut self) -> std::process::Child {
        self.0
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .expect("the binary starts")
    }

    /// Runs, whatever its exit status.
    #[allow(dead_code)]
    pub fn finish(self) -> (std::process::ExitStatus, Output) {
        self.output()
    }

    /// Runs and expects exit status 0.
    #[track_caller]
    pub fn success(self) -> Output {
        let (status, out) = self.output();
        assert!(
            status.success(),
            "exit {status}\nstdout:\n{}\nstderr:\n{}",
            out.stdout,
            out.stderr
        );
        out
    }

    /// Runs and expects exit status 2 with exactly one `error:` line and no panic.
    #[track_caller]
    pub fn failure(self) -> Output {
        let (status, out) = self.output();
        assert_eq!(
            status.code(),
            Some(2),
            "stdout:\n{}\nstderr:\n{}",
            out.stdout,
            out.stderr
        );
        assert!(!out.stderr.contains("panicked"), "{}", out.stderr);
        assert!(!out.stderr.contains("backtrace"), "{}", out.stderr);
        assert_eq!(
            out.stderr
                .lines()
                .filter(|l| l.starts_with("error: "))
                .count(),
            1,
            "{}",
            out.stderr
        );
        out
    }
}

/// The shared KernelBench problems file beside the checkout.
pub fn shared_jsonl() -> String {
    let path: PathBuf = [
        env!("CARGO_MANIFEST_DIR"),
        "..",
        "shared",
        "kernelbench",
        "problems.jsonl",
    ]
    .iter()
    .collect();
    assert!(
        path.is_file(),
        "these tests read the shared KernelBench problems at {}",
        path.display()
    );
    path.to_string_lossy().into_owned()
}

/// The code of one shared problem.
#[allow(dead_code)]
pub fn shared_problem_code(level: u64, name: &str) -> String {
    let text = std::fs::read_to_string(shared_jsonl()).unwrap();
    text.lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .find(|v| v["level"] == level && v["name"] == name)
        .and_then(|v| v["code"].as_str().map(str::to_string))
        .unwrap_or_else(|| panic!("no shared problem L{level}/{name}"))
}

/// Whether `python3` on the path can import torch.
#[allow(dead_code)]
pub fn python3_has_torch() -> bool {
    Command::new("python3")
        .args(["-c", "import torch"])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `mtmc optimize L1/ID` of the problems in `tests/families` for
/// `target`, written to `out` (for `cli.rs` and `gpu.rs`).
#[allow(dead_code)]
pub fn optimize_family(target: &str, id: u32, out: &std::path::Path) -> Run {
    let problem = format!("L1/{id}");
    mtmc(&[
        "optimize",
        &problem,
        "--kernelbench",
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/families"),
        "--target",
        target,
        "--out",
        out.to_str().unwrap(),
    ])
}

/// A JSON file the command wrote, parsed (the test fails, naming it, when
/// it is missing or not JSON).
#[allow(dead_code)]
pub fn read_json(path: &std::path::Path) -> serde_json::Value {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{} is not JSON: {e}", path.display()))
}

/// The attempts in the `report.json` of a search a signal stopped, which
/// the report says (the test fails when it does not).
#[allow(dead_code)]
pub fn interrupted_report(out_dir: &std::path::Path) -> Vec<serde_json::Value> {
    let report = read_json(&out_dir.join("report.json"));
    assert_eq!(report["interrupted"], true, "{report}");
    report["attempts"].as_array().unwrap().clone()
}

/// Every file under `dir`, at any depth.
#[allow(dead_code)]
pub fn walk(dir: &std::path::Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// Runs mtmc with `args` and sends it SIGINT once it printed a line that
/// `until` accepts; expects it to stop with status 130 and an
/// `interrupted:` line. Returns its stdout and stderr.
#[allow(dead_code)]
pub fn interrupted(args: &[&str], until: impl Fn(&str) -> bool) -> (String, String) {
    interrupted_run(mtmc(args), until)
}

/// [`interrupted`] for a prepared run (one with its own environment).
#[allow(dead_code)]
pub fn interrupted_run(run: Run, until: impl Fn(&str) -> bool) -> (String, String) {
    let (stdout, stderr, status) = run_until(run, until, |pid| {
        let kill = std::process::Command::new("kill")
            .args(["-INT", &pid.to_string()])
            .status()
            .unwrap();
        assert!(kill.success());
    });
    // It stops with 128 + SIGINT, not killed by the signal, and says where.
    assert_eq!(status.code(), Some(130), "{stdout}\n{stderr}");
    assert!(
        stderr.contains("interrupted: stopped ") && !stderr.contains("panicked"),
        "{stderr}"
    );
    (stdout, stderr)
}

/// Starts `run`, reads its stdout until it prints a line `until` accepts,
/// calls `then` with its process id (to signal it, or to lose a worker
/// under it), and reads on to its end: its stdout, stderr and exit status.
#[allow(dead_code)]
pub fn run_until(
    run: Run,
    until: impl Fn(&str) -> bool,
    then: impl FnOnce(u32),
) -> (String, String, std::process::ExitStatus) {
    use std::io::{BufRead, Read};
    let mut child = run.spawn();
    let mut out = std::io::BufReader::new(child.stdout.take().unwrap());
    let mut stdout = String::new();
    loop {
        let mut line = String::new();
        let n = out.read_line(&mut line).unwrap();
        assert!(n > 0, "it ended before the line awaited:\n{stdout}");
        stdout.push_str(&line);
        if until(line.trim_end()) {
            break;
        }
    }
    then(child.id());
    out.read_to_string(&mut stdout).unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    let status = child.wait().unwrap();
    (stdout, stderr, status)
}

/// A Python with torch for the worker's CPU mode: `$MTMC_TEST_PYTHON`.
#[allow(dead_code)]
pub fn torch_python() -> Option<String> {
    match std::env::var("MTMC_TEST_PYTHON") {
        Ok(p) => Some(p),
        Err(_) if std::env::var_os("MTMC_EXPECT_TORCH").is_some() => {
            panic!("MTMC_EXPECT_TORCH is set but MTMC_TEST_PYTHON is not")
        }
        Err(_) => None,
    }
}

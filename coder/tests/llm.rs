//! The LLM coder against a real HTTP server on loopback replaying scripted
//! replies, with real NVRTC compiles: a good fragment is used, one that
//! does not compile is rolled back and repaired from the compiler log, the
//! kernel is found among prose and other blocks, garbage and cut-off
//! replies are rolled back, a wrong kernel is repaired from the verdict,
//! and a dead endpoint stops the coder cleanly.

mod common;

use std::sync::Arc;

use mtmc_actions::DType;
use mtmc_actions::graph::OpGraph;
use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, ActionKind, Params};
use mtmc_coder::llm::LlmCoder;
use mtmc_coder::session::{Session, Stage};
use mtmc_env::nvrtc::Arch;
use mtmc_llm::replay::{Server, Step};
use mtmc_llm::{Client, Config, Provider, Secret, Store};

const KEY: &str = "sk-mtmc-coder-test-91b2";

fn graph() -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes("x=64x1000").unwrap(),
        dtype: Some(DType::F32),
    };
    compile("y = relu(x) * 2", &b).unwrap()
}

/// Every computing node as one region, under the action `kind`.
fn fuse(g: &OpGraph, kind: ActionKind) -> Action {
    Action {
        kind,
        ..common::fuse_all(g, Params::default())
    }
}

struct Setup {
    server: Server,
    coder: LlmCoder,
    dir: tempfile::TempDir,
}

impl Setup {
    /// The run's store is sound, holds a row per call with `statuses`, and
    /// none of its files holds the key.
    #[track_caller]
    fn store_intact(&self, statuses: &[&str]) {
        let store = Store::open(&self.dir.path().join("store.sqlite")).unwrap();
        assert_eq!(store.integrity().unwrap(), "ok");
        let seen: Vec<String> = store
            .calls()
            .unwrap()
            .into_iter()
            .map(|c| c.status)
            .collect();
        assert_eq!(seen, statuses);
        for entry in std::fs::read_dir(self.dir.path()).unwrap() {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            assert!(!bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()));
        }
    }
}

fn setup(script: Vec<Step>, url: Option<String>) -> Setup {
    let server = Server::start(0, script, None, "replay-model").unwrap();
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("store.sqlite")).unwrap());
    let config = Config {
        base_url: url.unwrap_or_else(|| server.url()),
        model: "replay-model".into(),
        timeout_s: 2.0,
        retries: 1,
        backoff_ms: 10,
        breaker_after: 2,
        ..Config::default()
    };
    let client = Client::with_key(config, Some(Secret::new(KEY)), Some(store), "coder-test")
        .with_log(Arc::new(|_: &str| {}));
    Setup {
        server,
        coder: LlmCoder::new(Arc::new(client)),
        dir,
    }
}

/// The kernel the contract asks for, fused relu then times two.
fn kernel(name: &str, body: &str) -> String {
    format!(
        "extern \"C\" __global__ void {name}(const float* __restrict__ x0, float* __restrict__ y0, long long n_x0, long long n_y0) {{\n  for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n_y0; i += (long long)gridDim.x * blockDim.x) {{\n    {body}\n  }}\n}}\n"
    )
}

fn good(name: &str) -> String {
    kernel(name, "y0[i] = fmaxf(x0[i], 0.f) * 2.f;")
}

fn kernel_name(g: &OpGraph) -> String {
    let first = g.nodes().find(|(_, n)| !n.op.is_source()).unwrap().0;
    format!("k{}_llm", first.index())
}

#[test]
fn a_good_fragment_is_compiled_and_used() {
    let g = graph();
    let name = kernel_name(&g);
    let s = setup(
        vec![Step::text(
            Provider::Openai,
            &format!("Here you go:\n```cuda\n{}```\n", good(&name)),
        )],
        None,
    );
    let mut session = Session::new(&g, &s.coder, Arch::SM90);
    let action = fuse(&g, ActionKind::Fuse);
    let program = session.propose(&action).expect("the fragment compiles");
    let f = &program.fragments[0];
    assert_eq!(f.name, name);
    assert_eq!(f.launch.sizes, vec![64_000, 64_000]);
    assert_eq!((f.launch.block, f.launch.grid), (256, 250));
    // The prompt carried the contract, the region and the task.
    let body = &s.server.requests()[0].body;
    assert!(body.contains(&format!("void {name}(const float* __restrict__ x0, float* __restrict__ y0, long long n_x0, long long n_y0)")), "{body}");
    assert!(body.contains("relu"), "{body}");
    assert!(body.contains("# Action: Fuse"), "{body}");
    assert!(body.contains("No kernels yet"), "{body}");
    s.store_intact(&["ok"]);
}

#[test]
fn a_fragment_that_does_not_compile_is_rolled_back_and_repaired_from_the_log() {
    let g = graph();
    let name = kernel_name(&g);
    let broken = kernel(&name, "y0[i] = fmaxf(x[i], 0.f) * 2.f;");
    let s = setup(
        vec![
            Step::text(Provider::Openai, &format!("```cuda\n{broken}```")),
            Step::text(
                Provider::Openai,
                &format!("Fixed:\n```cuda\n{}```", good(&name)),
            ),
        ],
        None,
    );
    let mut session = Session::new(&g, &s.coder, Arch::SM90);
    let f = session.propose(&fuse(&g, ActionKind::Fuse)).unwrap_err();
    assert_eq!(f.stage, Stage::Compile);
    assert!(f.log.contains("identifier \"x\" is undefined"), "{}", f.log);
    assert!(
        session.good().fragments.is_empty(),
        "rolled back to the empty program"
    );
    // The repair step sends the broken kernel and the compiler's words.
    let repaired = session
        .propose(&fuse(&g, ActionKind::FixCompile))
        .expect("the repaired fragment compiles");
    assert_eq!(repaired.fragments.len(), 1);
    let body = &s.server.requests()[1].body;
    assert!(body.contains("# Action: FixCompile"), "{body}");
    assert!(body.contains("Compiler log"), "{body}");
    assert!(body.contains("is undefined"), "{body}");
    assert!(body.contains("fmaxf(x[i]"), "{body}");
    // The trajectory so far is in the prompt too.
    assert!(body.contains("did not compile, rolled back"), "{body}");
    s.store_intact(&["ok", "ok"]);
}

#[test]
fn the_kernel_is_found_among_prose_and_other_blocks() {
    let g = graph();
    let name = kernel_name(&g);
    let reply = format!(
        "First, the host side (not needed):\n```python\nk = mod.get_function('{name}')\n```\nThe kernel:\n```cuda\n{}```\nThis reads each element once.",
        good(&name)
    );
    let s = setup(vec![Step::text(Provider::Openai, &reply)], None);
    let mut session = Session::new(&g, &s.coder, Arch::SM90);
    let p = session.propose(&fuse(&g, ActionKind::Fuse)).unwrap();
    assert!(p.fragments[0].source.starts_with("extern \"C\""));
    assert!(!p.fragments[0].source.contains("get_function"));
    s.store_intact(&["ok"]);
}

#[test]
fn garbage_is_refused_and_a_cut_off_reply_is_rolled_back() {
    let g = graph();
    let name = kernel_name(&g);
    let cut: String = format!("```cuda\n{}", good(&name))
        .chars()
        .take(150)
        .collect();
    let s = setup(
        vec![
            Step::text(
                Provider::Openai,
                "I am sorry, I cannot write kernels today.",
            ),
            Step::finished(Provider::Openai, &cut, true),
        ],
        None,
    );
    let mut session = Session::new(&g, &s.coder, Arch::SM90);
    let f = session.propose(&fuse(&g, ActionKind::Fuse)).unwrap_err();
    assert_eq!(f.stage, Stage::Refused);
    assert!(f.log.contains("no code defining"), "{}", f.log);
    let f = session.propose(&fuse(&g, ActionKind::Fuse)).unwrap_err();
    assert_eq!(f.stage, Stage::Compile, "{}", f.log);
    assert!(f.fragment.unwrap().contains("cut off at the token limit"));
    assert!(session.good().fragments.is_empty());
    assert_eq!(session.failures.len(), 2);
    s.store_intact(&["ok", "ok"]);
}

#[test]
fn a_wrong_kernel_is_repaired_from_the_verdict() {
    let g = graph();
    let name = kernel_name(&g);
    let wrong = kernel(&name, "y0[i] = fmaxf(x0[i], 0.f);");
    let s = setup(
        vec![
            Step::text(Provider::Openai, &format!("```cuda\n{wrong}```")),
            Step::text(Provider::Openai, &format!("```cuda\n{}```", good(&name))),
        ],
        None,
    );
    let mut session = Session::new(&g, &s.coder, Arch::SM90);
    let action = fuse(&g, ActionKind::Fuse);
    let p = session.propose(&action).unwrap();
    session.reject(
        &action,
        &p,
        "incorrect: first bad element at [0, 3]: expected 1.5, got 0.75",
    );
    let fixed = session
        .propose(&fuse(&g, ActionKind::FixCorrectness))
        .unwrap();
    assert!(fixed.fragments[0].source.contains("* 2.f"));
    let body = &s.server.requests()[1].body;
    assert!(body.contains("# Action: FixCorrectness"), "{body}");
    assert!(body.contains("expected 1.5, got 0.75"), "{body}");
    // With nothing to repair, a repair is refused without a request.
    let s2 = setup(vec![], None);
    let mut fresh = Session::new(&g, &s2.coder, Arch::SM90);
    let f = fresh
        .propose(&fuse(&g, ActionKind::FixCompile))
        .unwrap_err();
    assert!(f.log.contains("nothing to repair"), "{}", f.log);
    assert!(s2.server.requests().is_empty());
    s.store_intact(&["ok", "ok"]);
    s2.store_intact(&[]);
}

#[test]
fn a_dead_endpoint_halts_the_coder_and_the_key_is_nowhere() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let g = graph();
    let s = setup(vec![], Some(format!("http://127.0.0.1:{port}/v1")));
    let mut session = Session::new(&g, &s.coder, Arch::SM90);
    let f = session.propose(&fuse(&g, ActionKind::Fuse)).unwrap_err();
    assert_eq!(f.stage, Stage::Refused);
    assert!(f.log.contains("is down"), "{}", f.log);
    let why = s.coder.halted().expect("the coder halted");
    assert!(why.contains(&format!("127.0.0.1:{port}")), "{why}");
    let again = session.propose(&fuse(&g, ActionKind::Fuse)).unwrap_err();
    assert!(again.log.contains("stopped"), "{}", again.log);
    for f in &session.failures {
        assert!(!f.log.contains(KEY));
    }
    // One failed call (the breaker opened during it); the second was
    // refused by the halted coder without a call.
    s.store_intact(&["endpoint_down"]);
}

#[test]
fn the_llm_critic_sends_the_outcome_and_returns_the_diagnosis() {
    use mtmc_env::outcome::{EvaluatorKind, Outcome, Status};
    let s = setup(
        vec![Step::text(
            Provider::Openai,
            "Memory-bound at 40% of the roofline: use float4 loads.",
        )],
        None,
    );
    let server = &s.server;
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("s.sqlite")).unwrap());
    let client = Client::with_key(
        Config {
            base_url: server.url(),
            model: "replay-model".into(),
            ..Config::default()
        },
        None,
        Some(store),
        "critic-test",
    );
    let mut o = Outcome::new(EvaluatorKind::CompileOnly, Status::Incorrect);
    o.why = Some("first bad element at [2]".into());
    let text = mtmc_coder::critique::LlmCritic::new(&client)
        .critique(&o, "__global__ void k() {}")
        .unwrap();
    assert_eq!(
        text,
        "Memory-bound at 40% of the roofline: use float4 loads."
    );
    let body = &server.requests()[0].body;
    assert!(body.contains("__global__ void k()"), "{body}");
    assert!(
        body.contains("The rule-based diagnosis was: incorrect"),
        "{body}"
    );
    assert!(body.contains("first bad element at [2]"), "{body}");
}

//! Each robustness case against a real HTTP server on loopback: what the
//! client did (used the reply, retried how often after which delays,
//! stopped), what the store holds afterwards, and that the key is never
//! written anywhere.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use mtmc_llm::replay::{Server, Step};
use mtmc_llm::{Client, Config, LlmError, Prompt, Provider, Secret, Store};

const KEY: &str = "sk-mtmc-test-4f1c9a77";

struct Run {
    client: Client,
    log: Arc<Mutex<Vec<String>>>,
    store: Arc<Store>,
    dir: tempfile::TempDir,
}

fn config(url: &str, provider: Provider) -> Config {
    Config {
        provider,
        base_url: url.to_string(),
        model: "replay-model".into(),
        timeout_s: 0.5,
        retries: 4,
        backoff_ms: 40,
        max_backoff_ms: 5000,
        breaker_after: 50,
        price_in_per_mtok: 2.0,
        price_out_per_mtok: 10.0,
        ..Config::default()
    }
}

fn run(config: Config) -> Run {
    let dir = tempfile::tempdir().unwrap();
    let store = Arc::new(Store::open(&dir.path().join("store.sqlite")).unwrap());
    let log = Arc::new(Mutex::new(Vec::new()));
    let sink = log.clone();
    let client = Client::with_key(
        config,
        Some(Secret::new(KEY)),
        Some(store.clone()),
        "test-run",
    )
    .with_log(Arc::new(move |l: &str| {
        sink.lock().unwrap().push(l.to_string())
    }));
    Run {
        client,
        log,
        store,
        dir,
    }
}

impl Run {
    /// The store is sound, and neither it (with its WAL), the log nor
    /// `errors` hold the key.
    fn check_clean(&self, errors: &[String]) {
        assert_eq!(self.store.integrity().unwrap(), "ok");
        for entry in std::fs::read_dir(self.dir.path()).unwrap() {
            let bytes = std::fs::read(entry.unwrap().path()).unwrap();
            assert!(
                !bytes.windows(KEY.len()).any(|w| w == KEY.as_bytes()),
                "the key is in the store's files"
            );
        }
        for line in self.log.lock().unwrap().iter().chain(errors) {
            assert!(!line.contains(KEY), "the key is in `{line}`");
        }
    }
}

fn ask() -> Prompt {
    Prompt::ask("system text", "write kernel k0")
}

fn gaps(server: &Server) -> Vec<f64> {
    let r = server.requests();
    r.windows(2)
        .map(|w| (w[1].at - w[0].at).as_secs_f64())
        .collect()
}

#[test]
fn a_good_reply_is_used_cached_and_replayed_offline() {
    let server = Server::start(
        0,
        vec![Step::text(Provider::Openai, "```cuda\nok\n```")],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let reply = r.client.complete(&ask()).unwrap();
    assert_eq!(reply.text, "```cuda\nok\n```");
    assert_eq!((reply.attempts, reply.cached), (1, false));
    // The same prompt again: from the cache, no request.
    let again = r.client.complete(&ask()).unwrap();
    assert!(again.cached);
    assert_eq!(server.requests().len(), 1);
    let seen = &server.requests()[0];
    assert_eq!(seen.path, "/v1/chat/completions");
    assert_eq!(
        seen.header("authorization"),
        Some(&*format!("Bearer {KEY}"))
    );
    let body: serde_json::Value = serde_json::from_str(&seen.body).unwrap();
    assert_eq!(body["model"], "replay-model");
    assert_eq!(body["messages"][0]["role"], "system");
    // Accounting: 100 + 50 tokens at $2 / $10 per million.
    let s = r.client.stats();
    assert_eq!(
        (s.calls, s.requests, s.cache_hits, s.tokens_in, s.tokens_out),
        (2, 1, 1, 100, 50)
    );
    assert!((s.cost_usd - (100.0 * 2.0 + 50.0 * 10.0) / 1e6).abs() < 1e-12);
    // Offline, with the server gone, the store still answers.
    drop(server);
    let offline = Client::with_key(
        Config {
            offline: true,
            ..config("http://127.0.0.1:9/v1", Provider::Openai)
        },
        None,
        Some(r.store.clone()),
        "replay",
    );
    assert!(offline.complete(&ask()).unwrap().cached);
    let miss = offline.complete(&Prompt::ask("s", "another")).unwrap_err();
    assert!(matches!(miss, LlmError::NotCached(_)), "{miss}");
    let calls = r.store.calls().unwrap();
    let statuses: Vec<&str> = calls.iter().map(|c| c.status.as_str()).collect();
    assert_eq!(statuses, ["ok", "cached", "cached"]);
    assert_eq!(r.store.cache_len().unwrap(), 1);
    r.check_clean(&[miss.to_string()]);
}

#[test]
fn a_429_waits_as_retry_after_asks() {
    let server = Server::start(
        0,
        vec![
            Step::status(429, Some("1")),
            Step::text(Provider::Openai, "fine"),
        ],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let reply = r.client.complete(&ask()).unwrap();
    assert_eq!((reply.text.as_str(), reply.attempts), ("fine", 2));
    let g = gaps(&server);
    assert_eq!(g.len(), 1);
    // Backoff alone would wait 20-40 ms; retry-after says 1 s.
    // Upper bounds leave room for a loaded machine.
    assert!(g[0] >= 0.98 && g[0] < 2.5, "waited {} s", g[0]);
    assert!(r.log.lock().unwrap()[0].contains("retry-after"));
    assert_eq!(r.client.stats().retries, 1);
    r.check_clean(&[]);
}

#[test]
fn server_errors_are_retried_with_growing_delays_then_succeed() {
    let server = Server::start(
        0,
        vec![
            Step::status(500, None),
            Step::status(502, None),
            Step::status(503, None),
            Step::text(Provider::Openai, "at last"),
        ],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let reply = r.client.complete(&ask()).unwrap();
    assert_eq!((reply.text.as_str(), reply.attempts), ("at last", 4));
    let g = gaps(&server);
    // Backoff 40 ms doubled per retry, jittered into [half, all].
    for (k, gap) in g.iter().enumerate() {
        let full = 0.040 * f64::from(1u32 << k);
        assert!(
            *gap >= full * 0.5 - 0.002 && *gap < full + 1.0,
            "retry {k}: {gap} s"
        );
    }
    let s = r.client.stats();
    assert_eq!((s.requests, s.retries, s.failures), (4, 3, 0));
    assert_eq!(r.store.calls().unwrap()[0].attempts, 4);
    r.check_clean(&[]);
}

#[test]
fn a_slow_reply_past_the_limit_is_retried() {
    let server = Server::start(
        0,
        vec![
            Step::text(Provider::Openai, "too late").after(Duration::from_millis(1500)),
            Step::text(Provider::Openai, "in time"),
        ],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let reply = r.client.complete(&ask()).unwrap();
    assert_eq!((reply.text.as_str(), reply.attempts), ("in time", 2));
    let g = gaps(&server);
    // The limit (0.5 s) plus the first backoff (20-40 ms).
    assert!(g[0] >= 0.5 && g[0] < 2.0, "{g:?}");
    assert!(r.log.lock().unwrap()[0].contains("within 0.5 s"));
    r.check_clean(&[]);
}

#[test]
fn cut_off_and_dropped_replies_are_retried() {
    let server = Server::start(
        0,
        vec![
            Step::Truncated {
                body: r#"{"choices":[{"message":{"content":"half"#.into(),
                missing: 200,
            },
            Step::Hangup,
            Step::text(Provider::Openai, "whole"),
        ],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let reply = r.client.complete(&ask()).unwrap();
    assert_eq!((reply.text.as_str(), reply.attempts), ("whole", 3));
    assert_eq!(r.client.stats().retries, 2);
    r.check_clean(&[]);
}

#[test]
fn an_endpoint_that_is_down_opens_the_breaker_and_stops_the_run() {
    // A port nothing listens on.
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let r = run(Config {
        retries: 10,
        breaker_after: 3,
        ..config(&format!("http://127.0.0.1:{port}/v1"), Provider::Openai)
    });
    let e = r.client.complete(&ask()).unwrap_err();
    assert!(
        matches!(e, LlmError::EndpointDown { failures: 3, .. }),
        "{e}"
    );
    assert!(e.stops_run());
    assert_eq!(r.client.stats().requests, 3);
    // Later calls fail at once, without a request.
    let started = std::time::Instant::now();
    let again = r.client.complete(&Prompt::ask("s", "other")).unwrap_err();
    assert!(matches!(again, LlmError::EndpointDown { .. }));
    assert!(started.elapsed() < Duration::from_millis(50));
    assert_eq!(r.client.stats().requests, 3);
    let calls = r.store.calls().unwrap();
    assert_eq!(calls.len(), 2);
    assert!(calls.iter().all(|c| c.status == "endpoint_down"));
    r.check_clean(&[e.to_string(), again.to_string()]);
}

#[test]
fn retries_run_out() {
    let server = Server::start(0, vec![], Some(Step::status(503, None)), "replay-model").unwrap();
    let r = run(Config {
        retries: 2,
        ..config(&server.url(), Provider::Openai)
    });
    let e = r.client.complete(&ask()).unwrap_err();
    assert!(matches!(e, LlmError::GaveUp { attempts: 3, .. }), "{e}");
    assert!(!e.stops_run());
    assert_eq!(server.requests().len(), 3);
    r.check_clean(&[e.to_string()]);
}

#[test]
fn a_refused_key_is_not_retried_and_stops_the_run() {
    let server = Server::start(0, vec![Step::status(401, None)], None, "replay-model").unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let e = r.client.complete(&ask()).unwrap_err();
    assert!(matches!(e, LlmError::Auth(_)), "{e}");
    assert!(e.to_string().contains("$OPENAI_API_KEY"), "{e}");
    assert!(e.stops_run());
    assert_eq!(server.requests().len(), 1);
    r.check_clean(&[e.to_string()]);
}

#[test]
fn a_body_that_is_not_a_chat_reply_is_an_error_named_as_such() {
    let server = Server::start(
        0,
        vec![Step::Reply {
            status: 200,
            headers: vec![],
            body: "<html>gateway</html>".into(),
            delay: Duration::ZERO,
        }],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let e = r.client.complete(&ask()).unwrap_err();
    assert!(matches!(e, LlmError::Shape(_)), "{e}");
    assert!(e.to_string().contains("<html>"), "{e}");
    r.check_clean(&[e.to_string()]);
}

#[test]
fn anthropic_requests_carry_its_headers_and_shape() {
    let server = Server::start(
        0,
        vec![Step::text(Provider::Anthropic, "claude says")],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Anthropic));
    let reply = r.client.complete(&ask()).unwrap();
    assert_eq!(reply.text, "claude says");
    let seen = &server.requests()[0];
    assert_eq!(seen.path, "/v1/messages");
    assert_eq!(seen.header("x-api-key"), Some(KEY));
    assert_eq!(seen.header("anthropic-version"), Some("2023-06-01"));
    assert_eq!(seen.header("authorization"), None);
    let body: serde_json::Value = serde_json::from_str(&seen.body).unwrap();
    assert_eq!(body["system"], "system text");
    assert_eq!(body["messages"][0]["role"], "user");
    r.check_clean(&[]);
}

#[test]
fn requests_in_flight_stay_within_the_limit() {
    let slow = Step::text(Provider::Openai, "x").after(Duration::from_millis(300));
    let server = Server::start(0, vec![], Some(slow), "replay-model").unwrap();
    let r = Arc::new(run(Config {
        concurrency: 2,
        timeout_s: 5.0,
        cache: false,
        ..config(&server.url(), Provider::Openai)
    }));
    let threads: Vec<_> = (0..6)
        .map(|i| {
            let r = r.clone();
            std::thread::spawn(move || {
                r.client
                    .complete(&Prompt::ask("s", format!("q{i}")))
                    .unwrap()
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    let at: Vec<_> = server.requests().iter().map(|s| s.at).collect();
    assert_eq!(at.len(), 6);
    // With two in flight, the third arrives only when the first is done.
    for k in 2..6 {
        let gap = (at[k] - at[k - 2]).as_secs_f64();
        assert!(
            gap >= 0.28,
            "requests {} and {k} overlap: {gap} s apart",
            k - 2
        );
    }
    r.check_clean(&[]);
}

#[test]
fn the_check_reports_each_finding() {
    let server = Server::start(
        0,
        vec![Step::text(Provider::Openai, "ok")],
        None,
        "replay-model",
    )
    .unwrap();
    let r = run(config(&server.url(), Provider::Openai));
    let lines = r.client.check().unwrap();
    let text = lines.join("\n");
    assert!(text.contains("reachable"), "{text}");
    assert!(text.contains("`replay-model` is listed"), "{text}");
    assert!(text.contains("\"ok\""), "{text}");
    assert!(!text.contains(KEY));
    // A model the endpoint does not list is named.
    let r = run(Config {
        model: "missing".into(),
        ..config(&server.url(), Provider::Openai)
    });
    let e = r.client.check().unwrap_err().to_string();
    assert!(e.contains("`missing` is not among"), "{e}");
}

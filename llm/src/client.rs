//! One client for both wire formats: requests with a limit each, retries
//! with exponential backoff and jitter (honouring `retry-after`), a circuit
//! breaker that takes the endpoint as down after enough consecutive
//! failures, a bound on requests in flight, token and cost accounting, and
//! the response cache in the store.

use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use serde::Serialize;
use serde_json::{Value, json};
use sha2::{Digest, Sha256};

use crate::LlmError;
use crate::config::{Config, Provider, Secret};
pub use crate::message::{Finish, Message, Prompt, Reply, Role, Usage};
use crate::store::{CallRow, Store};

/// What a run spent, in total.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize)]
pub struct Stats {
    /// Calls (prompts asked).
    pub calls: u64,
    /// HTTP requests sent (attempts).
    pub requests: u64,
    /// Attempts that were retries.
    pub retries: u64,
    /// Calls answered from the cache.
    pub cache_hits: u64,
    /// Calls that failed in the end.
    pub failures: u64,
    /// Prompt tokens (requests sent).
    pub tokens_in: u64,
    /// Reply tokens (requests sent).
    pub tokens_out: u64,
    /// US dollars, at the configured prices.
    pub cost_usd: f64,
}

/// A bound on requests in flight.
struct Gate {
    free: Mutex<u32>,
    freed: Condvar,
}

impl Gate {
    fn enter(&self) -> GatePass<'_> {
        let mut free = self.free.lock().unwrap_or_else(|p| p.into_inner());
        while *free == 0 {
            free = self.freed.wait(free).unwrap_or_else(|p| p.into_inner());
        }
        *free -= 1;
        GatePass(self)
    }
}

struct GatePass<'a>(&'a Gate);

impl Drop for GatePass<'_> {
    fn drop(&mut self) {
        *self.0.free.lock().unwrap_or_else(|p| p.into_inner()) += 1;
        self.0.freed.notify_one();
    }
}

/// Where the client says what it is doing (retries, the breaker).
pub type Log = Arc<dyn Fn(&str) + Send + Sync>;

/// The client.
pub struct Client {
    config: Config,
    key: Option<Secret>,
    http: reqwest::blocking::Client,
    store: Option<Arc<Store>>,
    run: String,
    gate: Gate,
    /// Consecutive failed attempts (reset by any success).
    failed_in_a_row: Mutex<(u32, String)>,
    stats: Mutex<Stats>,
    /// The jitter's generator, seeded from the clock.
    jitter: Mutex<rand_chacha::ChaCha8Rng>,
    log: Log,
}

/// How one attempt went wrong.
enum Attempt {
    /// Worth another try, after `after` when the endpoint said so.
    Retry {
        why: String,
        after: Option<Duration>,
    },
    /// Not worth another.
    Fail(LlmError),
}

impl Client {
    /// A client for `config`, with the key from the environment variable it
    /// names, caching and recording calls of run `run` in `store`.
    pub fn new(config: Config, store: Option<Arc<Store>>, run: &str) -> Result<Client, LlmError> {
        config.validate()?;
        let key = Secret::from_env(config.key_env());
        Ok(Client::with_key(config, key, store, run))
    }

    /// A client with an explicit key (or none).
    pub fn with_key(
        config: Config,
        key: Option<Secret>,
        store: Option<Arc<Store>>,
        run: &str,
    ) -> Client {
        // Only the TLS back end could fail to start, and rustls is built in.
        let http = reqwest::blocking::Client::builder()
            .timeout(config.timeout())
            .user_agent(concat!("mtmc/", env!("CARGO_PKG_VERSION")))
            .build()
            .expect("an HTTP client with rustls and no other settings starts");
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0x9e37_79b9, |d| d.as_nanos() as u64);
        Client {
            gate: Gate {
                free: Mutex::new(config.concurrency.max(1)),
                freed: Condvar::new(),
            },
            config,
            key,
            http,
            store,
            run: run.to_string(),
            failed_in_a_row: Mutex::new((0, String::new())),
            stats: Mutex::new(Stats::default()),
            jitter: Mutex::new(rand::SeedableRng::seed_from_u64(seed)),
            log: Arc::new(|line: &str| eprintln!("llm: {line}")),
        }
    }

    /// The client with its notices sent to `log` instead of stderr.
    pub fn with_log(mut self, log: Log) -> Client {
        self.log = log;
        self
    }

    /// Its configuration.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// What the run spent so far.
    pub fn stats(&self) -> Stats {
        *self.stats.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether a key was found.
    pub fn has_key(&self) -> bool {
        self.key.is_some()
    }

    /// The cache key of `prompt` under this configuration.
    pub fn prompt_hash(&self, prompt: &Prompt) -> String {
        let canonical = json!({
            "provider": self.config.provider,
            "model": self.config.model,
            "temperature": self.config.temperature,
            "max_tokens": self.config.max_tokens,
            "prompt": prompt,
        });
        let digest = Sha256::digest(canonical.to_string().as_bytes());
        digest.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The reply to `prompt`: from the cache when it holds one, else from
    /// the endpoint, retried as configured.
    pub fn complete(&self, prompt: &Prompt) -> Result<Reply, LlmError> {
        let hash = self.prompt_hash(prompt);
        let model = self.config.model.clone();
        self.bump(|s| s.calls += 1);
        if self.config.cache
            && let Some(store) = &self.store
            && let Some(reply) = store.cached(&model, &hash)?
        {
            self.bump(|s| s.cache_hits += 1);
            self.record(&hash, "cached", &reply, None, 0.0);
            return Ok(reply);
        }
        if self.config.offline {
            self.bump(|s| s.failures += 1);
            return Err(LlmError::NotCached(hash));
        }
        let started = Instant::now();
        let result = self.send_with_retries(prompt);
        let latency_ms = started.elapsed().as_secs_f64() * 1e3;
        match result {
            Ok(mut reply) => {
                reply.latency_ms = latency_ms;
                let cost = self.cost(reply.usage);
                self.bump(|s| {
                    s.tokens_in += reply.usage.input;
                    s.tokens_out += reply.usage.output;
                    s.cost_usd += cost;
                });
                if self.config.cache
                    && let Some(store) = &self.store
                {
                    let text = serde_json::to_string(prompt).unwrap_or_default();
                    store.put(&model, &hash, &text, &reply)?;
                }
                self.record(&hash, "ok", &reply, None, latency_ms);
                Ok(reply)
            }
            Err((e, attempts)) => {
                self.bump(|s| s.failures += 1);
                let failed = Reply {
                    text: String::new(),
                    finish: Finish::Other("error".into()),
                    usage: Usage::default(),
                    cached: false,
                    attempts,
                    latency_ms,
                };
                self.record(&hash, e.kind(), &failed, Some(e.to_string()), latency_ms);
                Err(e)
            }
        }
    }

    fn cost(&self, u: Usage) -> f64 {
        (u.input as f64 * self.config.price_in_per_mtok
            + u.output as f64 * self.config.price_out_per_mtok)
            / 1e6
    }

    fn record(&self, hash: &str, status: &str, r: &Reply, error: Option<String>, ms: f64) {
        let Some(store) = &self.store else { return };
        let row = CallRow {
            run: self.run.clone(),
            model: self.config.model.clone(),
            prompt_hash: hash.to_string(),
            status: status.to_string(),
            attempts: r.attempts,
            tokens_in: r.usage.input,
            tokens_out: r.usage.output,
            cost_usd: if r.cached { 0.0 } else { self.cost(r.usage) },
            error,
        };
        if let Err(e) = store.record(&row, ms) {
            (self.log)(&format!("cannot record the call in the store: {e}"));
        }
    }

    fn bump(&self, f: impl FnOnce(&mut Stats)) {
        f(&mut self.stats.lock().unwrap_or_else(|p| p.into_inner()));
    }

    /// The breaker's verdict: `Err` once the endpoint is taken as down.
    fn breaker(&self) -> Result<(), LlmError> {
        let (n, last) = &*self
            .failed_in_a_row
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if *n >= self.config.breaker_after {
            return Err(LlmError::EndpointDown {
                url: self.config.base(),
                failures: *n,
                last: last.clone(),
            });
        }
        Ok(())
    }

    fn send_with_retries(&self, prompt: &Prompt) -> Result<Reply, (LlmError, u32)> {
        let mut attempts = 0;
        loop {
            self.breaker().map_err(|e| (e, attempts))?;
            attempts += 1;
            self.bump(|s| {
                s.requests += 1;
                s.retries += u64::from(attempts > 1);
            });
            let outcome = {
                let _pass = self.gate.enter();
                self.exchange(prompt, self.config.max_tokens)
            };
            match outcome {
                Ok(mut reply) => {
                    *self
                        .failed_in_a_row
                        .lock()
                        .unwrap_or_else(|p| p.into_inner()) = (0, String::new());
                    reply.attempts = attempts;
                    return Ok(reply);
                }
                Err(Attempt::Fail(e)) => return Err((e, attempts)),
                Err(Attempt::Retry { why, after }) => {
                    let down = {
                        let mut f = self
                            .failed_in_a_row
                            .lock()
                            .unwrap_or_else(|p| p.into_inner());
                        f.0 += 1;
                        f.1 = why.clone();
                        f.0 >= self.config.breaker_after
                    };
                    if down {
                        (self.log)(&format!(
                            "{why}; {} failures in a row: the endpoint is taken as down",
                            self.config.breaker_after
                        ));
                        return Err((self.breaker().unwrap_err(), attempts));
                    }
                    if attempts > self.config.retries {
                        return Err((
                            LlmError::GaveUp {
                                attempts,
                                last: why,
                            },
                            attempts,
                        ));
                    }
                    let wait = self.delay(attempts - 1, after);
                    (self.log)(&format!(
                        "{why}; retry {} of {} in {:.2} s{}",
                        attempts,
                        self.config.retries,
                        wait.as_secs_f64(),
                        if after.is_some() {
                            " (as retry-after asks)"
                        } else {
                            ""
                        }
                    ));
                    std::thread::sleep(wait);
                }
            }
        }
    }

    /// The wait before retry `k` (0 for the first): what the endpoint asked
    /// for, else `backoff * 2^k` with jitter (between half and all of it),
    /// at most `max_backoff_ms` either way.
    fn delay(&self, k: u32, asked: Option<Duration>) -> Duration {
        let cap = Duration::from_millis(self.config.max_backoff_ms);
        if let Some(a) = asked {
            return a.min(cap);
        }
        let full = Duration::from_millis(self.config.backoff_ms)
            .saturating_mul(1u32 << k.min(20))
            .min(cap);
        let unit: f64 = rand::Rng::random(&mut *self.jitter.lock().expect("jitter lock"));
        full.mul_f64(0.5 + 0.5 * unit)
    }

    fn url(&self, path: &str) -> String {
        format!("{}/{path}", self.config.base())
    }

    fn request(
        &self,
        builder: reqwest::blocking::RequestBuilder,
    ) -> reqwest::blocking::RequestBuilder {
        let builder = builder.header("content-type", "application/json");
        match (self.config.provider, &self.key) {
            (Provider::Openai, Some(k)) => {
                builder.header("authorization", format!("Bearer {}", k.expose()))
            }
            (Provider::Openai, None) => builder,
            (Provider::Anthropic, k) => {
                let b = builder.header("anthropic-version", "2023-06-01");
                match k {
                    Some(k) => b.header("x-api-key", k.expose()),
                    None => b,
                }
            }
        }
    }

    fn body(&self, prompt: &Prompt, max_tokens: u32) -> Value {
        let c = &self.config;
        match c.provider {
            Provider::Openai => {
                let mut messages = vec![json!({"role": "system", "content": prompt.system})];
                messages.extend(prompt.messages.iter().map(|m| json!(m)));
                json!({
                    "model": c.model,
                    "messages": messages,
                    "temperature": c.temperature,
                    "max_tokens": max_tokens,
                })
            }
            Provider::Anthropic => json!({
                "model": c.model,
                "system": prompt.system,
                "messages": prompt.messages,
                "temperature": c.temperature,
                "max_tokens": max_tokens,
            }),
        }
    }

    /// One HTTP exchange, the reply at most `max_tokens` long.
    fn exchange(&self, prompt: &Prompt, max_tokens: u32) -> Result<Reply, Attempt> {
        let path = match self.config.provider {
            Provider::Openai => "chat/completions",
            Provider::Anthropic => "messages",
        };
        let url = self.url(path);
        let body = self.body(prompt, max_tokens).to_string();
        let response = self.request(self.http.post(&url)).body(body).send();
        let (status, text, after) = read(response, &url, self.config.timeout_s)?;
        if status != 200 {
            return Err(classify(status, &text, after, &url, self));
        }
        parse_reply(self.config.provider, &text).map_err(Attempt::Fail)
    }

    /// Checks the endpoint: reachable, the model listed, a tiny request
    /// answered in the expected JSON shape. One line per finding.
    pub fn check(&self) -> Result<Vec<String>, LlmError> {
        let mut lines = Vec::new();
        let url = self.url("models");
        let started = Instant::now();
        let mut get = self.http.get(&url);
        get = match (self.config.provider, &self.key) {
            (Provider::Openai, Some(k)) => {
                get.header("authorization", format!("Bearer {}", k.expose()))
            }
            (Provider::Anthropic, Some(k)) => get
                .header("x-api-key", k.expose())
                .header("anthropic-version", "2023-06-01"),
            (Provider::Anthropic, None) => get.header("anthropic-version", "2023-06-01"),
            (Provider::Openai, None) => get,
        };
        let (status, text, _) = match read(get.send(), &url, self.config.timeout_s) {
            Ok(r) => r,
            Err(Attempt::Retry { why, .. })
            | Err(Attempt::Fail(LlmError::Http { body: why, .. })) => {
                return Err(LlmError::Unreachable(why));
            }
            Err(Attempt::Fail(e)) => return Err(e),
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        lines.push(format!(
            "reachable: {} answered HTTP {status} in {ms:.0} ms",
            self.config.base()
        ));
        let key_note = if self.key.is_some() {
            format!("the key from ${}", self.config.key_env())
        } else {
            format!("no key (${} is not set)", self.config.key_env())
        };
        match status {
            200 => {
                let ids: Vec<String> = serde_json::from_str::<Value>(&text)
                    .ok()
                    .and_then(|v| v.get("data").and_then(Value::as_array).cloned())
                    .unwrap_or_default()
                    .iter()
                    .filter_map(|m| m.get("id").and_then(Value::as_str).map(String::from))
                    .collect();
                if ids.contains(&self.config.model) {
                    lines.push(format!("model: `{}` is listed", self.config.model));
                } else if ids.is_empty() {
                    lines.push(
                        "model: the endpoint's model list is empty or unreadable; going on".into(),
                    );
                } else {
                    let shown = ids.iter().take(8).cloned().collect::<Vec<_>>().join(", ");
                    return Err(LlmError::Config(format!(
                        "model `{}` is not among the {} the endpoint lists ({shown}{})",
                        self.config.model,
                        ids.len(),
                        if ids.len() > 8 { ", …" } else { "" }
                    )));
                }
            }
            401 | 403 => {
                return Err(LlmError::Auth(format!(
                    "{url} refused {key_note} (HTTP {status})"
                )));
            }
            _ => lines.push(format!(
                "model: the endpoint lists no models (HTTP {status} at /models); going on"
            )),
        }
        let started = Instant::now();
        let prompt = Prompt::ask(
            "You are a health check. Answer with one word.",
            "Reply with the single word: ok",
        );
        let reply = match self.exchange(&prompt, 16) {
            Ok(r) => r,
            Err(Attempt::Retry { why, .. }) => return Err(LlmError::Unreachable(why)),
            Err(Attempt::Fail(e)) => return Err(e),
        };
        let ms = started.elapsed().as_secs_f64() * 1e3;
        let shown: String = reply.text.trim().chars().take(40).collect();
        lines.push(format!(
            "reply: {:?} in {ms:.0} ms ({} prompt + {} reply tokens, finish `{}`), JSON as expected",
            shown,
            reply.usage.input,
            reply.usage.output,
            reply.finish.name()
        ));
        lines.push(format!("auth: {key_note}"));
        Ok(lines)
    }
}

/// Status, body and `retry-after` of a response, or how the exchange
/// failed (timeouts, refused or dropped connections, bodies cut short:
/// retried).
fn read(
    response: Result<reqwest::blocking::Response, reqwest::Error>,
    url: &str,
    timeout_s: f64,
) -> Result<(u16, String, Option<Duration>), Attempt> {
    let transport = |e: &reqwest::Error| {
        let retry = |why: String| Attempt::Retry { why, after: None };
        // The causes, as one line (the error's own text only names the
        // request, which the message names already).
        let mut causes = Vec::new();
        let mut cause = std::error::Error::source(e);
        while let Some(c) = cause {
            causes.push(c.to_string());
            cause = c.source();
        }
        let text = if causes.is_empty() {
            e.to_string()
        } else {
            causes.join(": ")
        };
        if e.is_timeout() {
            retry(format!("no reply from {url} within {timeout_s} s"))
        } else if e.is_connect() {
            retry(format!("cannot connect to {url}: {text}"))
        } else if e.is_body() || e.is_decode() || e.is_request() {
            retry(format!("connection to {url} failed: {text}"))
        } else {
            Attempt::Fail(LlmError::Http {
                status: 0,
                url: url.to_string(),
                body: text,
            })
        }
    };
    let mut response = response.map_err(|e| transport(&e))?;
    let status = response.status().as_u16();
    let header = |name: &str| {
        response
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.trim().parse::<f64>().ok())
            .filter(|s| s.is_finite() && *s >= 0.0)
    };
    let after = header("retry-after-ms")
        .map(|ms| Duration::from_secs_f64(ms / 1e3))
        .or_else(|| header("retry-after").map(Duration::from_secs_f64));
    // At most 64 MiB of body; a read that fails part way (a dropped
    // connection, a timeout) is the attempt's failure.
    let mut bytes = Vec::new();
    let read = std::io::Read::read_to_end(
        &mut std::io::Read::take(&mut response, 64 << 20),
        &mut bytes,
    );
    if let Err(e) = read {
        let inner = e
            .get_ref()
            .and_then(|i| i.downcast_ref::<reqwest::Error>())
            .map(&transport);
        return Err(inner.unwrap_or_else(|| Attempt::Retry {
            why: format!("connection to {url} failed: {e}"),
            after: None,
        }));
    }
    let text = String::from_utf8(bytes).map_err(|_| Attempt::Retry {
        why: format!("broken reply from {url}: the body is not UTF-8"),
        after: None,
    })?;
    Ok((status, text, after))
}

/// A non-200 status as an attempt's failure.
fn classify(status: u16, body: &str, after: Option<Duration>, url: &str, c: &Client) -> Attempt {
    let snippet: String = body.chars().take(300).collect();
    match status {
        429 | 500..=599 => Attempt::Retry {
            why: format!("HTTP {status} from {url}"),
            after,
        },
        401 | 403 => Attempt::Fail(LlmError::Auth(format!(
            "{url} answered HTTP {status}: {} (key from ${}: {})",
            snippet.trim(),
            c.config.key_env(),
            if c.key.is_some() { "set" } else { "not set" }
        ))),
        404 => Attempt::Fail(LlmError::Config(format!(
            "{url} answered HTTP 404 ({}): check the base URL (it ends at the API version, e.g. …/v1) and the model name `{}`",
            snippet.trim(),
            c.config.model
        ))),
        _ => Attempt::Fail(LlmError::Http {
            status,
            url: url.to_string(),
            body: snippet,
        }),
    }
}

/// The reply in `text`, a response body of `provider`'s format.
fn parse_reply(provider: Provider, text: &str) -> Result<Reply, LlmError> {
    let shape = |what: &str| {
        let snippet: String = text.chars().take(200).collect();
        LlmError::Shape(format!("{what}; the body began: {snippet}"))
    };
    let v: Value = serde_json::from_str(text).map_err(|e| shape(&format!("not JSON ({e})")))?;
    let n = |p: &str| v.pointer(p).and_then(Value::as_u64).unwrap_or(0);
    let (text, finish, input, output) = match provider {
        Provider::Openai => {
            let choice = v
                .get("choices")
                .and_then(|c| c.get(0))
                .ok_or_else(|| shape("no choices[0] in the reply"))?;
            let text = choice
                .get("message")
                .and_then(|m| m.get("content"))
                .and_then(Value::as_str)
                .ok_or_else(|| shape("no choices[0].message.content in the reply"))?;
            let finish = choice.get("finish_reason").and_then(Value::as_str);
            (
                text.to_string(),
                finish.unwrap_or("stop"),
                n("/usage/prompt_tokens"),
                n("/usage/completion_tokens"),
            )
        }
        Provider::Anthropic => {
            let blocks = v
                .get("content")
                .and_then(Value::as_array)
                .ok_or_else(|| shape("no content array in the reply"))?;
            let text: String = blocks
                .iter()
                .filter(|b| b.get("type").and_then(Value::as_str) == Some("text"))
                .filter_map(|b| b.get("text").and_then(Value::as_str))
                .collect();
            let finish = v.get("stop_reason").and_then(Value::as_str);
            (
                text,
                finish.unwrap_or("end_turn"),
                n("/usage/input_tokens"),
                n("/usage/output_tokens"),
            )
        }
    };
    Ok(Reply {
        text,
        finish: Finish::from_name(finish),
        usage: Usage { input, output },
        cached: false,
        attempts: 1,
        latency_ms: 0.0,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_reply_shapes_parse() {
        let r = parse_reply(
            Provider::Openai,
            r#"{"choices":[{"message":{"content":"hi"},"finish_reason":"length"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}"#,
        )
        .unwrap();
        assert_eq!(
            (r.text.as_str(), r.finish, r.usage.input),
            ("hi", Finish::Length, 3)
        );
        let r = parse_reply(
            Provider::Anthropic,
            r#"{"content":[{"type":"text","text":"a"},{"type":"text","text":"b"}],"stop_reason":"end_turn","usage":{"input_tokens":5,"output_tokens":2}}"#,
        )
        .unwrap();
        assert_eq!(
            (r.text.as_str(), r.finish, r.usage.output),
            ("ab", Finish::Stop, 2)
        );
        let e = parse_reply(Provider::Openai, "<html>")
            .unwrap_err()
            .to_string();
        assert!(e.contains("not JSON"), "{e}");
    }

    #[test]
    fn backoff_doubles_with_jitter_and_retry_after_wins() {
        let c = Config {
            model: "m".into(),
            backoff_ms: 100,
            max_backoff_ms: 350,
            ..Config::default()
        };
        let client = Client::with_key(c, None, None, "t");
        for k in 0..4 {
            let full = (100u64 << k).min(350) as f64;
            let d = client.delay(k, None).as_secs_f64() * 1e3;
            assert!(
                d >= full * 0.5 - 1e-6 && d <= full + 1e-6,
                "retry {k}: {d} ms"
            );
        }
        assert_eq!(
            client
                .delay(0, Some(Duration::from_millis(200)))
                .as_millis(),
            200
        );
        assert_eq!(
            client.delay(0, Some(Duration::from_secs(9))).as_millis(),
            350
        );
    }
}

//! A scripted HTTP server on loopback that stands in for an LLM endpoint:
//! each request to a completion path takes the next step of its script
//! (a reply, a status with `retry-after`, a slow reply, a cut-off body, a
//! dropped connection) and is recorded with its arrival time, headers and
//! body. `GET …/models` lists the configured model without taking a step.
//! The tests use it, and `mtmc llm-replay` serves it for end-to-end runs.
//! It binds 127.0.0.1 only and stops when dropped.

use std::collections::VecDeque;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use serde_json::json;

use crate::config::Provider;

/// What the server does with one request.
#[derive(Clone, Debug)]
pub enum Step {
    /// Answers with `status`, extra headers and `body`, after `delay`.
    Reply {
        /// Status code.
        status: u16,
        /// Extra headers.
        headers: Vec<(String, String)>,
        /// Body.
        body: String,
        /// Wait before answering.
        delay: Duration,
    },
    /// Announces `body`'s length plus `missing` bytes, sends `body`, and
    /// closes: a reply cut off in transit.
    Truncated {
        /// What is sent.
        body: String,
        /// Bytes announced but never sent.
        missing: usize,
    },
    /// Closes the connection without a word.
    Hangup,
}

impl Step {
    /// A 200 reply carrying `text` in `provider`'s format, finished
    /// normally.
    pub fn text(provider: Provider, text: &str) -> Step {
        Step::finished(provider, text, false)
    }

    /// A 200 reply carrying `text`, cut at the token limit when `cut`.
    pub fn finished(provider: Provider, text: &str, cut: bool) -> Step {
        let body = match provider {
            Provider::Openai => json!({
                "id": "replay",
                "object": "chat.completion",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": if cut { "length" } else { "stop" }}],
                "usage": {"prompt_tokens": 100, "completion_tokens": 50, "total_tokens": 150},
            }),
            Provider::Anthropic => json!({
                "id": "replay",
                "type": "message",
                "role": "assistant",
                "content": [{"type": "text", "text": text}],
                "stop_reason": if cut { "max_tokens" } else { "end_turn" },
                "usage": {"input_tokens": 100, "output_tokens": 50},
            }),
        };
        Step::Reply {
            status: 200,
            headers: Vec::new(),
            body: body.to_string(),
            delay: Duration::ZERO,
        }
    }

    /// An error status, with `retry-after` (seconds) when given.
    pub fn status(status: u16, retry_after: Option<&str>) -> Step {
        Step::Reply {
            status,
            headers: retry_after
                .map(|s| vec![("retry-after".to_string(), s.to_string())])
                .unwrap_or_default(),
            body: json!({"error": {"message": format!("scripted {status}")}}).to_string(),
            delay: Duration::ZERO,
        }
    }

    /// This step, answered after `delay`.
    pub fn after(self, delay: Duration) -> Step {
        match self {
            Step::Reply {
                status,
                headers,
                body,
                ..
            } => Step::Reply {
                status,
                headers,
                body,
                delay,
            },
            other => other,
        }
    }
}

/// A request as the server saw it.
#[derive(Clone, Debug)]
pub struct Seen {
    /// When it arrived (headers read).
    pub at: Instant,
    /// Method.
    pub method: String,
    /// Path.
    pub path: String,
    /// Headers, names in lower case.
    pub headers: Vec<(String, String)>,
    /// Body.
    pub body: String,
}

impl Seen {
    /// The header `name` (lower case).
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// The running server.
pub struct Server {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct Shared {
    script: Mutex<VecDeque<Step>>,
    /// What answers once the script is done (`None`: HTTP 500).
    then: Option<Step>,
    model: String,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Server {
    /// Serves `script` on 127.0.0.1 at `port` (0: any free port); `then`
    /// answers every request after the script (`None`: HTTP 500); `model`
    /// is the one `GET …/models` lists.
    pub fn start(
        port: u16,
        script: Vec<Step>,
        then: Option<Step>,
        model: &str,
    ) -> std::io::Result<Server> {
        let listener = TcpListener::bind(("127.0.0.1", port))?;
        listener.set_nonblocking(true)?;
        let port = listener.local_addr()?.port();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared {
            script: Mutex::new(script.into()),
            then,
            model: model.to_string(),
            seen: seen.clone(),
        });
        let stopping = stop.clone();
        let thread = std::thread::spawn(move || {
            while !stopping.load(Ordering::Relaxed) {
                match listener.accept() {
                    Ok((stream, _)) => {
                        let shared = shared.clone();
                        std::thread::spawn(move || {
                            let _ = serve(stream, &shared);
                        });
                    }
                    Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                        std::thread::sleep(Duration::from_millis(2));
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(2)),
                }
            }
        });
        Ok(Server {
            port,
            seen,
            stop,
            thread: Some(thread),
        })
    }

    /// The base URL (`http://127.0.0.1:PORT/v1`).
    pub fn url(&self) -> String {
        format!("http://127.0.0.1:{}/v1", self.port)
    }

    /// Its port.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// The completion requests seen so far, in order of arrival.
    pub fn requests(&self) -> Vec<Seen> {
        let mut v: Vec<Seen> = self
            .seen
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|s| s.method == "POST")
            .cloned()
            .collect();
        v.sort_by_key(|s| s.at);
        v
    }

    /// Every request seen, `GET`s included.
    pub fn all_requests(&self) -> Vec<Seen> {
        self.seen.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Serves until the process ends (for `mtmc llm-replay`).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn serve(stream: TcpStream, shared: &Shared) -> std::io::Result<()> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut line = String::new();
    reader.read_line(&mut line)?;
    let mut parts = line.split_whitespace();
    let method = parts.next().unwrap_or("").to_string();
    let path = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if reader.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((n, v)) = h.split_once(':') {
            headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    let at = Instant::now();
    let len: usize = headers
        .iter()
        .find(|(n, _)| n == "content-length")
        .and_then(|(_, v)| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; len];
    reader.read_exact(&mut body)?;
    let seen = Seen {
        at,
        method: method.clone(),
        path: path.clone(),
        headers,
        body: String::from_utf8_lossy(&body).into_owned(),
    };
    shared
        .seen
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .push(seen);
    let mut out = stream;
    if method == "GET" && path.ends_with("/models") {
        let body = json!({"object": "list", "data": [{"id": shared.model, "object": "model"}]});
        return respond(&mut out, 200, &[], &body.to_string());
    }
    let step = shared
        .script
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .pop_front()
        .or_else(|| shared.then.clone());
    match step {
        None => respond(
            &mut out,
            500,
            &[],
            r#"{"error":{"message":"the replay script is exhausted"}}"#,
        ),
        Some(Step::Reply {
            status,
            headers,
            body,
            delay,
        }) => {
            std::thread::sleep(delay);
            respond(&mut out, status, &headers, &body)
        }
        Some(Step::Truncated { body, missing }) => {
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len() + missing
            );
            out.write_all(head.as_bytes())?;
            out.write_all(body.as_bytes())?;
            out.flush()?;
            out.shutdown(std::net::Shutdown::Both)
        }
        Some(Step::Hangup) => out.shutdown(std::net::Shutdown::Both),
    }
}

fn respond(
    out: &mut TcpStream,
    status: u16,
    headers: &[(String, String)],
    body: &str,
) -> std::io::Result<()> {
    let reason = match status {
        200 => "OK",
        401 => "Unauthorized",
        404 => "Not Found",
        429 => "Too Many Requests",
        500 => "Internal Server Error",
        502 => "Bad Gateway",
        503 => "Service Unavailable",
        _ => "Status",
    };
    let mut head = format!(
        "HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n",
        body.len()
    );
    for (n, v) in headers {
        head.push_str(&format!("{n}: {v}\r\n"));
    }
    head.push_str("\r\n");
    out.write_all(head.as_bytes())?;
    out.write_all(body.as_bytes())?;
    out.flush()
}

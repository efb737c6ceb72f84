//! Talking to LLM endpoints: OpenAI-compatible chat completions (OpenAI,
//! vLLM, Ollama, llama.cpp server) and Anthropic messages.
//!
//! - [`config`]: the `[llm]` settings (file and flags), the key's variable;
//! - [`message`]: a prompt and its messages, a reply and its usage;
//! - [`client`]: requests with limits, retries with backoff and jitter
//!   (honouring `retry-after`), a circuit breaker, a bound on requests in
//!   flight, token and cost accounting, the response cache;
//! - [`store`]: the SQLite tables for the cache and the call records;
//! - [`extract`]: the code in a reply (several blocks, prose, cut-off
//!   replies);
//! - [`replay`]: a scripted loopback server standing in for an endpoint.
//!
//! HTTP goes through reqwest's blocking client (rustls) with the two
//! request and reply shapes written here: the search loop is synchronous;
//! async-openai speaks OpenAI only and retries with a backoff of its own;
//! genai speaks both but brings its own request model, and the retries,
//! breaker, cache and accounting would still be written around it.

pub mod client;
pub mod config;
pub mod extract;
pub mod message;
pub mod replay;
pub mod store;

pub use client::{Client, Finish, Message, Prompt, Reply, Role, Stats, Usage};
pub use config::{Config, Provider, Secret};
pub use store::Store;

/// What can go wrong talking to an endpoint.
#[derive(Debug, thiserror::Error)]
pub enum LlmError {
    /// The configuration is wrong.
    #[error("LLM config: {0}")]
    Config(String),
    /// The endpoint refused the key (or its absence).
    #[error("the LLM endpoint refused the request: {0}")]
    Auth(String),
    /// The endpoint cannot be reached at all.
    #[error("cannot reach the LLM endpoint: {0}")]
    Unreachable(String),
    /// An HTTP status that retrying will not change.
    #[error("HTTP {status} from {url}: {body}")]
    Http {
        /// Status (0: no response).
        status: u16,
        /// The URL.
        url: String,
        /// The start of the body, or the transport's error.
        body: String,
    },
    /// Every retry failed.
    #[error("gave up after {attempts} attempts; the last: {last}")]
    GaveUp {
        /// Attempts made.
        attempts: u32,
        /// The last failure.
        last: String,
    },
    /// The breaker is open: too many failures in a row.
    #[error(
        "the LLM endpoint {url} is down ({failures} failed attempts in a row; the last: {last}); the run stops"
    )]
    EndpointDown {
        /// The base URL.
        url: String,
        /// Consecutive failures.
        failures: u32,
        /// The last one.
        last: String,
    },
    /// The reply is not in the expected JSON shape.
    #[error("the LLM reply is not in the expected shape: {0}")]
    Shape(String),
    /// Offline, and the prompt is not in the cache.
    #[error("offline: prompt {0} is not in the cache")]
    NotCached(String),
    /// The store failed.
    #[error("store: {0}")]
    Store(String),
}

impl LlmError {
    /// A short name of the kind, as recorded.
    pub fn kind(&self) -> &'static str {
        match self {
            LlmError::Config(_) => "config",
            LlmError::Auth(_) => "auth",
            LlmError::Unreachable(_) => "unreachable",
            LlmError::Http { .. } => "http",
            LlmError::GaveUp { .. } => "gave_up",
            LlmError::EndpointDown { .. } => "endpoint_down",
            LlmError::Shape(_) => "shape",
            LlmError::NotCached(_) => "not_cached",
            LlmError::Store(_) => "store",
        }
    }

    /// Whether every later call would fail the same way, so that the run
    /// should stop (the endpoint is down, the key or the model is wrong).
    pub fn stops_run(&self) -> bool {
        matches!(
            self,
            LlmError::Config(_)
                | LlmError::Auth(_)
                | LlmError::Unreachable(_)
                | LlmError::EndpointDown { .. }
                | LlmError::Store(_)
        )
    }
}

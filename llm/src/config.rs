//! What endpoint to talk to and how: provider, base URL, model, sampling,
//! limits, retries, prices. Read from a TOML file (`[llm]` table) with
//! flags on top. The API key is never part of the configuration: only the
//! name of the environment variable that holds it.

use std::path::Path;
use std::time::Duration;

use serde::{Deserialize, Serialize};

use crate::LlmError;

/// The wire format an endpoint speaks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    /// OpenAI chat completions: OpenAI, vLLM, Ollama, llama.cpp server, …
    #[default]
    Openai,
    /// Anthropic messages.
    Anthropic,
}

impl Provider {
    /// The provider named `s` (`openai`, `anthropic`).
    pub fn parse(s: &str) -> Result<Provider, LlmError> {
        match s.to_ascii_lowercase().as_str() {
            "openai" | "openai-compatible" | "vllm" | "ollama" => Ok(Provider::Openai),
            "anthropic" | "claude" => Ok(Provider::Anthropic),
            other => Err(LlmError::Config(format!(
                "unknown provider `{other}`: use `openai` (any OpenAI-compatible server) or `anthropic`"
            ))),
        }
    }

    /// The base URL used when none is configured.
    pub fn default_base_url(self) -> &'static str {
        match self {
            Provider::Openai => "https://api.openai.com/v1",
            Provider::Anthropic => "https://api.anthropic.com/v1",
        }
    }

    /// The environment variable the key is read from when none is named.
    pub fn default_key_env(self) -> &'static str {
        match self {
            Provider::Openai => "OPENAI_API_KEY",
            Provider::Anthropic => "ANTHROPIC_API_KEY",
        }
    }
}

/// The LLM configuration. Every field has a default; a file sets some, and
/// flags override the file.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct Config {
    /// Wire format.
    pub provider: Provider,
    /// Base URL, up to and including the API version (`…/v1`); empty for
    /// the provider's own.
    pub base_url: String,
    /// Model name as the endpoint knows it.
    pub model: String,
    /// Environment variable holding the API key; empty for the provider's
    /// usual one. A missing variable sends no key (local servers need none).
    pub api_key_env: String,
    /// Sampling temperature.
    pub temperature: f64,
    /// Most tokens in one reply.
    pub max_tokens: u32,
    /// Most requests in flight at once.
    pub concurrency: u32,
    /// Seconds before one request (connect, send, whole reply) is given up
    /// and retried.
    pub timeout_s: f64,
    /// Retries after the first attempt, on 429, 5xx, timeouts and dropped
    /// connections.
    pub retries: u32,
    /// First backoff delay, milliseconds; doubled per retry, with jitter.
    pub backoff_ms: u64,
    /// Longest wait between attempts, milliseconds (a longer `retry-after`
    /// is cut to it).
    pub max_backoff_ms: u64,
    /// Consecutive failed attempts after which the endpoint is taken as
    /// down and the run stops.
    pub breaker_after: u32,
    /// US dollars per million prompt tokens (0: not counted).
    pub price_in_per_mtok: f64,
    /// US dollars per million reply tokens (0: not counted).
    pub price_out_per_mtok: f64,
    /// Read and write the response cache in the store.
    pub cache: bool,
    /// Never call the endpoint: replies come from the cache only.
    pub offline: bool,
}

impl Default for Config {
    fn default() -> Config {
        Config {
            provider: Provider::Openai,
            base_url: String::new(),
            model: String::new(),
            api_key_env: String::new(),
            temperature: 0.2,
            max_tokens: 4096,
            concurrency: 4,
            timeout_s: 120.0,
            retries: 4,
            backoff_ms: 1000,
            max_backoff_ms: 60_000,
            breaker_after: 6,
            price_in_per_mtok: 0.0,
            price_out_per_mtok: 0.0,
            cache: true,
            offline: false,
        }
    }
}

/// The file's layout: an `[llm]` table (other tables are for other parts
/// of mtmc).
#[derive(Deserialize)]
struct File {
    llm: Option<Config>,
}

impl Config {
    /// The `[llm]` table of the TOML file at `path`.
    pub fn load(path: &Path) -> Result<Config, LlmError> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            LlmError::Config(format!(
                "cannot read the LLM config `{}`: {e}",
                path.display()
            ))
        })?;
        Config::parse(&text).map_err(|e| LlmError::Config(format!("in `{}`: {e}", path.display())))
    }

    /// The `[llm]` table of TOML text.
    pub fn parse(text: &str) -> Result<Config, String> {
        let file: File = toml::from_str(text).map_err(|e| e.to_string())?;
        file.llm
            .ok_or_else(|| "no [llm] table: put the settings under `[llm]`".to_string())
    }

    /// The base URL requests go to, without a trailing slash.
    pub fn base(&self) -> String {
        let b = if self.base_url.is_empty() {
            self.provider.default_base_url()
        } else {
            &self.base_url
        };
        b.trim_end_matches('/').to_string()
    }

    /// The environment variable the key is read from.
    pub fn key_env(&self) -> &str {
        if self.api_key_env.is_empty() {
            self.provider.default_key_env()
        } else {
            &self.api_key_env
        }
    }

    /// The request limit.
    pub fn timeout(&self) -> Duration {
        Duration::from_secs_f64(self.timeout_s.max(0.001))
    }

    /// Checks that the settings make sense, naming the one that does not.
    pub fn validate(&self) -> Result<(), LlmError> {
        let bad = |what: String| Err(LlmError::Config(what));
        if self.model.trim().is_empty() {
            return bad(
                "no model: set `model` under [llm] in the config file, or pass --model NAME".into(),
            );
        }
        if !(self.base().starts_with("http://") || self.base().starts_with("https://")) {
            return bad(format!(
                "base URL `{}` is not http:// or https://",
                self.base()
            ));
        }
        if !(0.0..=2.0).contains(&self.temperature) {
            return bad(format!(
                "temperature {} is outside 0 to 2",
                self.temperature
            ));
        }
        if self.max_tokens == 0 || self.concurrency == 0 || self.breaker_after == 0 {
            return bad("max_tokens, concurrency and breaker_after must be at least 1".into());
        }
        if self.timeout_s.is_nan() || self.timeout_s <= 0.0 {
            return bad(format!("timeout_s {} must be positive", self.timeout_s));
        }
        Ok(())
    }
}

/// An API key: shown as `***` by `Debug`, never written anywhere.
#[derive(Clone)]
pub struct Secret(String);

impl Secret {
    /// A key given directly (tests, or a caller that reads it elsewhere).
    pub fn new(key: impl Into<String>) -> Secret {
        Secret(key.into())
    }

    /// The key in environment variable `var`, when it is set and not empty.
    pub fn from_env(var: &str) -> Option<Secret> {
        std::env::var(var)
            .ok()
            .filter(|k| !k.trim().is_empty())
            .map(|k| Secret(k.trim().to_string()))
    }

    /// The key itself, for a request header only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("***")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_sets_some_fields_and_defaults_fill_the_rest() {
        let c = Config::parse(
            "[llm]\nprovider = \"anthropic\"\nmodel = \"claude-x\"\nmax_tokens = 2000\n",
        )
        .unwrap();
        assert_eq!(c.provider, Provider::Anthropic);
        assert_eq!(c.max_tokens, 2000);
        assert_eq!(c.base(), "https://api.anthropic.com/v1");
        assert_eq!(c.key_env(), "ANTHROPIC_API_KEY");
        assert_eq!(c.retries, Config::default().retries);
        c.validate().unwrap();
    }

    #[test]
    fn unknown_fields_and_missing_tables_are_named() {
        let e = Config::parse("[llm]\nmodle = \"x\"\n").unwrap_err();
        assert!(e.contains("modle"), "{e}");
        let e = Config::parse("model = \"x\"\n").unwrap_err();
        assert!(e.contains("[llm]"), "{e}");
        let e = Config::default().validate().unwrap_err().to_string();
        assert!(e.contains("--model"), "{e}");
    }

    #[test]
    fn the_key_never_shows_in_debug() {
        let s = Secret("sk-abc".into());
        assert_eq!(format!("{s:?}"), "***");
    }
}

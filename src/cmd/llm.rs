//! The LLM side of the CLI: the flags that configure an endpoint (on top
//! of the `[llm]` table of a config file), `mtmc llm-check`, `mtmc
//! llm-replay`, and free-text intents turned into the intent language.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use mtmc_llm::replay::{Server, Step};
use mtmc_llm::{Client, Config, Prompt, Provider, Store};

/// Flags that say which endpoint to use and how.
#[derive(clap::Args, Clone, Debug, Default)]
pub struct LlmArgs {
    /// A TOML file with an `[llm]` table (see docs/llm.md); flags override it.
    #[arg(long, env = "MTMC_LLM_CONFIG", value_name = "FILE")]
    pub llm_config: Option<PathBuf>,
    /// `openai` (any OpenAI-compatible server: vLLM, Ollama, llama.cpp) or `anthropic`.
    #[arg(long)]
    pub provider: Option<String>,
    /// Base URL up to the API version, e.g. http://localhost:8000/v1.
    #[arg(long, value_name = "URL")]
    pub base_url: Option<String>,
    /// Model name as the endpoint knows it.
    #[arg(long)]
    pub model: Option<String>,
    /// Environment variable holding the API key.
    #[arg(long, value_name = "VAR")]
    pub api_key_env: Option<String>,
    /// Sampling temperature.
    #[arg(long)]
    pub temperature: Option<f64>,
    /// Most tokens per reply.
    #[arg(long)]
    pub max_tokens: Option<u32>,
    /// Most requests in flight.
    #[arg(long)]
    pub concurrency: Option<u32>,
    /// Seconds before a request is given up and retried.
    #[arg(long, value_name = "SECONDS")]
    pub llm_timeout: Option<f64>,
    /// Never call the endpoint: replies come from the store's cache only
    /// (replay a run offline and for free).
    #[arg(long)]
    pub offline: bool,
    /// The SQLite store (response cache, call records); default
    /// `$MTMC_CACHE_DIR/store.sqlite`.
    #[arg(long, value_name = "FILE")]
    pub store: Option<PathBuf>,
}

impl LlmArgs {
    /// The configuration: the file's, with the flags on top.
    pub fn config(&self) -> Result<Config> {
        let mut c = match &self.llm_config {
            Some(path) => Config::load(path)?,
            None => Config::default(),
        };
        if let Some(p) = &self.provider {
            c.provider = Provider::parse(p)?;
        }
        if let Some(u) = &self.base_url {
            c.base_url = u.clone();
        }
        if let Some(m) = &self.model {
            c.model = m.clone();
        }
        if let Some(v) = &self.api_key_env {
            c.api_key_env = v.clone();
        }
        if let Some(t) = self.temperature {
            c.temperature = t;
        }
        if let Some(t) = self.max_tokens {
            c.max_tokens = t;
        }
        if let Some(n) = self.concurrency {
            c.concurrency = n;
        }
        if let Some(s) = self.llm_timeout {
            c.timeout_s = s;
        }
        c.offline |= self.offline;
        c.validate()?;
        Ok(c)
    }

    /// The flags given on the command line, by name (`--llm-config` not
    /// among them: it may come from `MTMC_LLM_CONFIG`, set for every run).
    pub fn given(&self) -> Vec<&'static str> {
        [
            (self.provider.is_some(), "--provider"),
            (self.base_url.is_some(), "--base-url"),
            (self.model.is_some(), "--model"),
            (self.api_key_env.is_some(), "--api-key-env"),
            (self.temperature.is_some(), "--temperature"),
            (self.max_tokens.is_some(), "--max-tokens"),
            (self.concurrency.is_some(), "--concurrency"),
            (self.llm_timeout.is_some(), "--llm-timeout"),
            (self.offline, "--offline"),
            (self.store.is_some(), "--store"),
        ]
        .into_iter()
        .filter_map(|(given, name)| given.then_some(name))
        .collect()
    }

    /// The store's path.
    pub fn store_path(&self) -> Result<PathBuf> {
        match &self.store {
            Some(p) => Ok(p.clone()),
            None => mtmc_search::source::cache_dir()
                .map(|d| d.join("store.sqlite"))
                .context("no store: pass --store FILE (neither MTMC_CACHE_DIR nor HOME is set)"),
        }
    }

    /// A client for run `run`, with the store opened.
    pub fn client(&self, run: &str) -> Result<Arc<Client>> {
        let config = self.config()?;
        let store = Store::open(&self.store_path()?)?;
        Ok(Arc::new(Client::new(config, Some(Arc::new(store)), run)?))
    }
}

/// A name for this run in the store: seconds since the epoch and the pid.
pub fn run_id() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    format!("{secs}-{}", std::process::id())
}

/// `mtmc llm-check`: one tiny request, and what works.
pub fn check(out: &mut dyn std::io::Write, args: &LlmArgs) -> Result<()> {
    let config = args.config()?;
    let client = Client::new(
        Config {
            retries: 0,
            cache: false,
            ..config.clone()
        },
        None,
        "llm-check",
    )?;
    writeln!(
        out,
        "endpoint: {} ({:?}), model `{}`",
        config.base(),
        config.provider,
        config.model
    )?;
    for line in client.check()? {
        writeln!(out, "{line}")?;
    }
    Ok(())
}

/// `mtmc llm-replay`: serves `reply` (a file's text) to every completion
/// request on loopback, in `provider`'s format, until killed.
pub fn replay(
    out: &mut dyn std::io::Write,
    port: u16,
    reply: &std::path::Path,
    provider: &str,
    model: &str,
) -> Result<()> {
    let text = std::fs::read_to_string(reply)
        .with_context(|| format!("cannot read the reply file `{}`", reply.display()))?;
    let provider = Provider::parse(provider)?;
    let server = Server::start(port, Vec::new(), Some(Step::text(provider, &text)), model)
        .with_context(|| format!("cannot listen on 127.0.0.1:{port}"))?;
    writeln!(out, "serving on {}", server.url())?;
    out.flush()?;
    server.wait();
    Ok(())
}

/// What the model is told about the intent language (the function list
/// is appended).
const INTENT_GUIDE: &str = "You translate a description of a tensor computation into mtmc's intent language. Reply with one ```mtmc code block and nothing else.\n\nThe language: declarations `name: f32[dim=size, ...]` give inputs their element type and named dims (every input needs one, with sizes, unless it reuses named dims: `w: f32[k, n=512]`). Statements `y = expression`, one per line. Operators `+ - * / ** @` (matrix product, batched over leading dims), unary `-`, `.T` (swap the last two dims). Reductions and softmax take dim=d (and keepdim=true|false): softmax(x, dim=n), sum(x, dim=-1). dims are named dims or indices (-1 is the last). Names never assigned are inputs; values no later statement reads are outputs.\n\nExample: \"gelu of x (4096x4096) times w (4096x1024) plus bias b\" becomes\n```mtmc\nx: f32[m=4096, k=4096]\nw: f32[k, n=1024]\nb: f32[n]\ny = gelu(x @ w + b)\n```";

/// The intent program for `text`, written by the model and checked by the
/// intent compiler (one repair round with its error).
pub fn intent_from_text(client: &Client, text: &str) -> Result<String> {
    let guide = format!(
        "{INTENT_GUIDE}\n\nThe functions: {}.",
        mtmc_actions::intent::FUNCTIONS.join(", ")
    );
    let mut prompt = Prompt::ask(guide, format!("Description: {text}"));
    let mut last_error = String::new();
    for round in 0..2 {
        let reply = client
            .complete(&prompt)
            .context("turning --intent-text into an intent")?;
        let program = mtmc_llm::extract::blocks(&reply.text)
            .into_iter()
            .last()
            .map(|b| b.code)
            .unwrap_or_else(|| reply.text.clone());
        let bindings = mtmc_actions::intent::Bindings {
            shapes: Default::default(),
            dtype: Some(mtmc_actions::DType::F32),
        };
        match mtmc_actions::intent::compile(&program, &bindings) {
            Ok(_) => return Ok(program.trim().to_string() + "\n"),
            Err(e) => {
                last_error = format!("{e}");
                if round == 0 {
                    prompt.messages.push(mtmc_llm::Message {
                        role: mtmc_llm::Role::Assistant,
                        content: reply.text,
                    });
                    prompt.messages.push(mtmc_llm::Message {
                        role: mtmc_llm::Role::User,
                        content: format!(
                            "The intent compiler rejected it: {e}\nReply with the corrected ```mtmc block."
                        ),
                    });
                }
            }
        }
    }
    bail!(
        "the model's intent does not compile ({last_error}); write it with --intent instead (docs/commands.md describes the language)"
    )
}

//! The SQLite store's LLM tables: the response cache, keyed by (model,
//! prompt hash), so that a run can be replayed offline and for free, and a
//! row per call with its tokens, cost, attempts and verdict. WAL mode: a
//! killed run keeps every row it finished. Nothing here ever holds a key.

use std::path::Path;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use rusqlite::{Connection, OptionalExtension, params};

use crate::LlmError;
use crate::message::{Finish, Reply, Usage};

/// An open store.
pub struct Store {
    conn: Mutex<Connection>,
}

/// One call as recorded.
#[derive(Clone, Debug, PartialEq)]
pub struct CallRow {
    /// The run that made it.
    pub run: String,
    /// Model.
    pub model: String,
    /// Prompt hash.
    pub prompt_hash: String,
    /// `ok`, `cached` or the error's kind.
    pub status: String,
    /// HTTP attempts (0 for a cache hit).
    pub attempts: u32,
    /// Prompt tokens.
    pub tokens_in: u64,
    /// Reply tokens.
    pub tokens_out: u64,
    /// Cost in US dollars.
    pub cost_usd: f64,
    /// The error, when the call failed.
    pub error: Option<String>,
}

fn store_err(what: &str, e: rusqlite::Error) -> LlmError {
    LlmError::Store(format!("{what}: {e}"))
}

fn now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl Store {
    /// Opens (creating when needed) the store at `path`.
    pub fn open(path: &Path) -> Result<Store, LlmError> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .map_err(|e| LlmError::Store(format!("cannot create `{}`: {e}", dir.display())))?;
        }
        let conn = Connection::open(path)
            .map_err(|e| store_err(&format!("cannot open `{}`", path.display()), e))?;
        conn.busy_timeout(std::time::Duration::from_secs(10))
            .map_err(|e| store_err("busy timeout", e))?;
        conn.pragma_update(None, "journal_mode", "WAL")
            .map_err(|e| store_err("WAL mode", e))?;
        conn.pragma_update(None, "synchronous", "NORMAL")
            .map_err(|e| store_err("synchronous", e))?;
        conn.execute_batch(
            "CREATE TABLE IF NOT EXISTS llm_cache (
                model TEXT NOT NULL,
                prompt_hash TEXT NOT NULL,
                prompt TEXT NOT NULL,
                reply TEXT NOT NULL,
                finish TEXT NOT NULL,
                tokens_in INTEGER NOT NULL,
                tokens_out INTEGER NOT NULL,
                created REAL NOT NULL,
                PRIMARY KEY (model, prompt_hash)
            );
            CREATE TABLE IF NOT EXISTS llm_calls (
                id INTEGER PRIMARY KEY,
                run TEXT NOT NULL,
                model TEXT NOT NULL,
                prompt_hash TEXT NOT NULL,
                status TEXT NOT NULL,
                attempts INTEGER NOT NULL,
                tokens_in INTEGER NOT NULL,
                tokens_out INTEGER NOT NULL,
                cost_usd REAL NOT NULL,
                latency_ms REAL NOT NULL,
                error TEXT,
                at REAL NOT NULL
            );",
        )
        .map_err(|e| store_err("cannot create the LLM tables", e))?;
        Ok(Store {
            conn: Mutex::new(conn),
        })
    }

    fn conn(&self) -> std::sync::MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The cached reply to `prompt_hash` from `model`.
    pub fn cached(&self, model: &str, prompt_hash: &str) -> Result<Option<Reply>, LlmError> {
        self.conn()
            .query_row(
                "SELECT reply, finish, tokens_in, tokens_out FROM llm_cache
                 WHERE model = ?1 AND prompt_hash = ?2",
                params![model, prompt_hash],
                |r| {
                    Ok(Reply {
                        text: r.get(0)?,
                        finish: Finish::from_name(&r.get::<_, String>(1)?),
                        usage: Usage {
                            input: r.get::<_, i64>(2)? as u64,
                            output: r.get::<_, i64>(3)? as u64,
                        },
                        cached: true,
                        attempts: 0,
                        latency_ms: 0.0,
                    })
                },
            )
            .optional()
            .map_err(|e| store_err("cache lookup", e))
    }

    /// Caches `reply` to `prompt` (its JSON) under `prompt_hash`.
    pub fn put(
        &self,
        model: &str,
        prompt_hash: &str,
        prompt: &str,
        reply: &Reply,
    ) -> Result<(), LlmError> {
        self.conn()
            .execute(
                "INSERT OR REPLACE INTO llm_cache
                 (model, prompt_hash, prompt, reply, finish, tokens_in, tokens_out, created)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8)",
                params![
                    model,
                    prompt_hash,
                    prompt,
                    reply.text,
                    reply.finish.name(),
                    reply.usage.input as i64,
                    reply.usage.output as i64,
                    now()
                ],
            )
            .map(|_| ())
            .map_err(|e| store_err("cache write", e))
    }

    /// Records one call.
    pub fn record(&self, row: &CallRow, latency_ms: f64) -> Result<(), LlmError> {
        self.conn()
            .execute(
                "INSERT INTO llm_calls
                 (run, model, prompt_hash, status, attempts, tokens_in, tokens_out, cost_usd,
                  latency_ms, error, at)
                 VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11)",
                params![
                    row.run,
                    row.model,
                    row.prompt_hash,
                    row.status,
                    row.attempts,
                    row.tokens_in as i64,
                    row.tokens_out as i64,
                    row.cost_usd,
                    latency_ms,
                    row.error,
                    now()
                ],
            )
            .map(|_| ())
            .map_err(|e| store_err("call record", e))
    }

    /// Every recorded call, oldest first.
    pub fn calls(&self) -> Result<Vec<CallRow>, LlmError> {
        let conn = self.conn();
        let mut stmt = conn
            .prepare(
                "SELECT run, model, prompt_hash, status, attempts, tokens_in, tokens_out,
                        cost_usd, error FROM llm_calls ORDER BY id",
            )
            .map_err(|e| store_err("call query", e))?;
        let rows = stmt
            .query_map([], |r| {
                Ok(CallRow {
                    run: r.get(0)?,
                    model: r.get(1)?,
                    prompt_hash: r.get(2)?,
                    status: r.get(3)?,
                    attempts: r.get(4)?,
                    tokens_in: r.get::<_, i64>(5)? as u64,
                    tokens_out: r.get::<_, i64>(6)? as u64,
                    cost_usd: r.get(7)?,
                    error: r.get(8)?,
                })
            })
            .map_err(|e| store_err("call query", e))?;
        rows.collect::<Result<_, _>>()
            .map_err(|e| store_err("call query", e))
    }

    /// Cached replies.
    pub fn cache_len(&self) -> Result<u64, LlmError> {
        self.conn()
            .query_row("SELECT COUNT(*) FROM llm_cache", [], |r| r.get::<_, i64>(0))
            .map(|n| n as u64)
            .map_err(|e| store_err("cache count", e))
    }

    /// SQLite's own check of the file: `ok` when it is sound.
    pub fn integrity(&self) -> Result<String, LlmError> {
        self.conn()
            .query_row("PRAGMA integrity_check", [], |r| r.get(0))
            .map_err(|e| store_err("integrity check", e))
    }
}

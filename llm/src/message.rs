//! What is said: a prompt and its messages, and a reply with why it
//! ended and what it cost.

use serde::Serialize;

/// Who says a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Role {
    /// The user (mtmc).
    User,
    /// The model (an earlier reply).
    Assistant,
}

/// One message of a conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Message {
    /// Who says it.
    pub role: Role,
    /// What is said.
    pub content: String,
}

/// A request: a system text and the conversation.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Prompt {
    /// Instructions that hold for the whole conversation.
    pub system: String,
    /// The messages, the last one the user's.
    pub messages: Vec<Message>,
}

impl Prompt {
    /// A one-question prompt.
    pub fn ask(system: impl Into<String>, question: impl Into<String>) -> Prompt {
        Prompt {
            system: system.into(),
            messages: vec![Message {
                role: Role::User,
                content: question.into(),
            }],
        }
    }
}

/// Why a reply ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model finished.
    Stop,
    /// The reply hit the token limit: it may be cut off.
    Length,
    /// Something else, as the endpoint named it.
    Other(String),
}

impl Finish {
    /// Its name, as stored.
    pub fn name(&self) -> &str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Other(s) => s,
        }
    }

    /// The finish named `s` by either wire format.
    pub fn from_name(s: &str) -> Finish {
        match s {
            "stop" | "end_turn" | "stop_sequence" => Finish::Stop,
            "length" | "max_tokens" => Finish::Length,
            other => Finish::Other(other.to_string()),
        }
    }
}

/// Tokens of one reply.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct Usage {
    /// Prompt tokens.
    pub input: u64,
    /// Reply tokens.
    pub output: u64,
}

/// A reply.
#[derive(Clone, Debug, PartialEq)]
pub struct Reply {
    /// The text.
    pub text: String,
    /// Why it ended.
    pub finish: Finish,
    /// Its tokens.
    pub usage: Usage,
    /// Whether it came from the cache (no request, no cost).
    pub cached: bool,
    /// HTTP attempts it took.
    pub attempts: u32,
    /// Wall time from the first attempt to the reply, milliseconds.
    pub latency_ms: f64,
}

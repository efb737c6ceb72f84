//! The intent language: a few lines that say what to compute.
//!
//! ```text
//! x: f32[m=4096, k=4096]      # optional declarations, with named dims
//! w: [k, n=4096]
//! y = gelu(x @ w + b)         # b gets its shape from --shape b=4096
//! s = softmax(y, dim=n)       # reductions and softmax over named dims
//! ```
//!
//! Statements are separated by new lines or `;`. Names used without being
//! assigned are inputs: declared in the program or given by `--shape`.
//! Values that no later statement reads are the outputs. Operators: `+ - * /`
//! with broadcasting, `**`, `@`, unary `-`, `.T`; functions are listed in
//! [`FUNCTIONS`]. Every error names the line and column and what was expected.

mod lower;
mod syntax;

use std::collections::BTreeMap;
use std::fmt;

use crate::dtype::DType;
use crate::graph::OpGraph;

pub use lower::FUNCTIONS;

/// A position in the intent text (1-based).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Pos {
    /// Line.
    pub line: usize,
    /// Column (in characters).
    pub column: usize,
}

/// What kind of mistake an [`IntentError`] reports.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorKind {
    /// A character that starts no token.
    Lex,
    /// The statement does not follow the grammar.
    Syntax,
    /// A call to a function the language does not have.
    UnknownFunction,
    /// An argument of the wrong kind, or an unknown keyword.
    BadArgument,
    /// An input without a shape.
    MissingShape,
    /// Shapes that do not fit the operation.
    ShapeMismatch,
    /// A dim name or index that does not exist.
    UnknownDim,
    /// A name assigned twice.
    Redefined,
    /// A `--shape` for a name the program does not use.
    UnknownName,
}

/// An error in an intent program, with its position.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("line {}, column {}: {message}", .pos.line, .pos.column)]
pub struct IntentError {
    /// Where.
    pub pos: Pos,
    /// What kind.
    pub kind: ErrorKind,
    /// What is wrong and what was expected.
    pub message: String,
}

impl IntentError {
    fn new(pos: Pos, kind: ErrorKind, message: impl Into<String>) -> IntentError {
        IntentError {
            pos,
            kind,
            message: message.into(),
        }
    }
}

/// Shapes and the default dtype for inputs the program does not declare.
#[derive(Clone, Debug, Default)]
pub struct Bindings {
    /// Input name → shape.
    pub shapes: BTreeMap<String, Vec<u64>>,
    /// Element type of undeclared inputs (and of declarations without one).
    pub dtype: Option<DType>,
}

/// A `--shape` list that does not parse.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("--shape `{item}`: {reason} (expected NAME=DIMxDIM..., e.g. x=4096x1024,b=1024)")]
pub struct ShapeFlagError {
    /// The offending item.
    pub item: String,
    /// What is wrong.
    pub reason: String,
}

/// Parses `x=4096x4096,w=4096x4096,b=4096` into shapes.
pub fn parse_shapes(flag: &str) -> Result<BTreeMap<String, Vec<u64>>, ShapeFlagError> {
    let mut out = BTreeMap::new();
    for item in flag.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = |reason: &str| ShapeFlagError {
            item: item.to_string(),
            reason: reason.to_string(),
        };
        let (name, dims) = item.split_once('=').ok_or_else(|| bad("missing `=`"))?;
        let name = name.trim();
        if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
            return Err(bad("the name must be letters, digits and `_`"));
        }
        let shape = dims
            .split(['x', 'X'])
            .map(|d| d.trim().parse::<u64>().ok().filter(|&d| d > 0))
            .collect::<Option<Vec<u64>>>()
            .ok_or_else(|| bad("each dim must be a positive integer"))?;
        if out.insert(name.to_string(), shape).is_some() {
            return Err(bad("the name is given twice"));
        }
    }
    Ok(out)
}

/// Parses and lowers an intent program to an op graph.
pub fn compile(src: &str, bindings: &Bindings) -> Result<OpGraph, IntentError> {
    let toks = syntax::lex(src)?;
    let stmts = syntax::Parser::new(toks).program()?;
    lower::Lowerer::new(&bindings.shapes, bindings.dtype.unwrap_or(DType::F32)).finish(&stmts)
}

impl fmt::Display for Pos {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.line, self.column)
    }
}

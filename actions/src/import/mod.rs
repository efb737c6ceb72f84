//! Import of torch traces (the JSON written by `env/python/trace_graph.py`)
//! into an [`OpGraph`].
//!
//! The trace records calls as the user wrote them (leaf `nn` modules, torch
//! functions, tensor methods) with the type of every result. The mapping from
//! those calls to [`Op`]s lives in `calls`; every call it does not know, or
//! whose arguments it cannot read, becomes an [`Op::Opaque`] node with the
//! traced types, so the graph never loses a step of the model.

mod calls;
mod composite;

use std::collections::{BTreeMap, HashMap};

use serde::Deserialize;
use serde_json::Value;

use crate::dtype::{DType, TensorType};
use crate::graph::{OpGraph, TensorRef};
use crate::op::Op;

/// The trace format version this importer reads.
pub const TRACE_SCHEMA: u32 = 1;

/// One problem's trace as the tracer writes it.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct Trace {
    /// Format version.
    pub schema: u32,
    /// KernelBench level, when traced from KernelBench.
    pub level: Option<u32>,
    /// Problem name (file name without `.py`).
    pub name: Option<String>,
    /// SHA-256 of the problem's source, hex: identifies which code was traced.
    #[serde(default)]
    pub code_sha256: String,
    /// torch version of the tracer.
    #[serde(default)]
    pub torch: String,
    /// `ok` or `error`.
    pub status: String,
    /// Why tracing failed.
    pub error: Option<String>,
    /// `fx`, `function_mode`, or `fx_partial` (fx with the submodules in
    /// `untraced` kept as calls of their own forward).
    pub method: Option<String>,
    /// Device the trace ran on (`meta`, `cuda`, `cpu`).
    pub device: Option<String>,
    /// Whether the model was in training mode (KernelBench never calls eval()).
    pub training: Option<bool>,
    /// Why earlier methods failed, when a fallback was used.
    #[serde(default)]
    pub fallback_reasons: Vec<String>,
    /// Submodules kept as calls of their own forward (a partial trace).
    #[serde(default)]
    pub untraced: Vec<UntracedModule>,
    /// Recorded calls in execution order.
    #[serde(default)]
    pub nodes: Vec<TraceNode>,
    /// The model's results (node references).
    #[serde(default)]
    pub outputs: Vec<Value>,
}

/// One recorded call.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct TraceNode {
    /// Unique name within the trace.
    pub name: String,
    /// `input`, `param`, `module`, `function` or `method`.
    pub op: String,
    /// Input name, parameter path, module path, function or method name.
    #[serde(default)]
    pub target: String,
    /// Class name of a called module.
    pub module: Option<String>,
    /// Whether a called module was in training mode.
    pub training: Option<bool>,
    /// Whether a parameter is an `nn.Parameter`.
    pub trainable: Option<bool>,
    /// A called module's hyperparameters.
    #[serde(default)]
    pub attrs: BTreeMap<String, Value>,
    /// A called module's submodules (for composite modules), by path.
    #[serde(default)]
    pub children: BTreeMap<String, ChildModule>,
    /// A called module's parameters and buffers, its children's included.
    #[serde(default)]
    pub params: BTreeMap<String, ParamMeta>,
    /// Positional arguments.
    #[serde(default)]
    pub args: Vec<Value>,
    /// Keyword arguments.
    #[serde(default)]
    pub kwargs: BTreeMap<String, Value>,
    /// Type of the result: `{"tensor": …}`, `{"tuple": […]}` or `{"value": …}`.
    #[serde(default)]
    pub out: Value,
    /// Why a called module was not traced into: it stays a call of its own
    /// forward whatever its class (set by a partial trace).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub opaque: Option<String>,
}

/// A submodule that a partial trace keeps as a call of its own forward.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct UntracedModule {
    /// Its path in the model (`blocks.0.gate`).
    pub module: String,
    /// Why it was not traced (its forward branches on a value, keeps state
    /// across calls, or does something else fx cannot trace).
    pub reason: String,
}

/// A submodule of a called module.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct ChildModule {
    /// Class name.
    pub module: String,
    /// Hyperparameters.
    #[serde(default)]
    pub attrs: BTreeMap<String, Value>,
}

/// A module parameter's type.
#[derive(Clone, Debug, Deserialize, serde::Serialize)]
pub struct ParamMeta {
    /// Shape.
    pub shape: Vec<u64>,
    /// torch dtype name.
    pub dtype: String,
    /// Parameter (true) or buffer (false).
    #[serde(default)]
    pub trainable: bool,
}

/// Why a trace could not become a graph.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The JSON does not have the trace shape.
    #[error("not a trace: {0}")]
    Json(#[from] serde_json::Error),
    /// Written by another version of the tracer.
    #[error(
        "trace schema {found} is not supported (this mtmc reads schema {TRACE_SCHEMA}); regenerate it"
    )]
    Schema {
        /// The version found.
        found: u32,
    },
    /// The tracer could not trace the problem.
    #[error("tracing failed: {0}")]
    Failed(String),
    /// The trace is inconsistent (a reference to an unknown node, a bad type).
    #[error("malformed trace at node `{node}`: {reason}")]
    Malformed {
        /// The node being read.
        node: String,
        /// What is wrong.
        reason: String,
    },
}

/// A traced graph and how faithfully it was imported.
#[derive(Clone, Debug)]
pub struct Imported {
    /// The graph.
    pub graph: OpGraph,
    /// How it was traced (`fx`, `function_mode` or `fx_partial`).
    pub method: String,
}

/// A value flowing through the trace: a tensor, a tuple of values, or a
/// constant known at trace time (sizes, flags, lists of ints).
#[derive(Clone, Debug)]
pub(crate) enum Val {
    Tensor(TensorRef),
    Tuple(Vec<Val>),
    Const(Value),
}

impl Val {
    fn tensors(&self, out: &mut Vec<TensorRef>) {
        match self {
            Val::Tensor(t) => out.push(*t),
            Val::Tuple(items) => items.iter().for_each(|v| v.tensors(out)),
            Val::Const(_) => {}
        }
    }
}

/// The traces of the 200 shared KernelBench problems, one JSON object a
/// line, regenerated with
/// `python3 env/python/trace_graph.py < problems.jsonl > traces/kernelbench.jsonl`.
pub const SHARED_TRACES: &str = include_str!("../../../traces/kernelbench.jsonl");

/// The graph of shared problem `name` (`34_ConvTranspose3d_…`) of
/// `level`, from [`SHARED_TRACES`]; `None` where there is no such trace or
/// it does not import.
pub fn shared_graph(level: u64, name: &str) -> Option<OpGraph> {
    let line = SHARED_TRACES.lines().find(|l| {
        serde_json::from_str::<serde_json::Value>(l)
            .is_ok_and(|v| v["level"] == level && v["name"] == name)
    })?;
    let trace = parse_trace(line).ok()?;
    import_trace(&trace).ok().map(|im| im.graph)
}

/// Parses a trace from JSON text.
pub fn parse_trace(json: &str) -> Result<Trace, ImportError> {
    let trace: Trace = serde_json::from_str(json)?;
    if trace.schema != TRACE_SCHEMA {
        return Err(ImportError::Schema {
            found: trace.schema,
        });
    }
    Ok(trace)
}

/// Builds the op graph of a successful trace.
pub fn import_trace(trace: &Trace) -> Result<Imported, ImportError> {
    if trace.status != "ok" {
        return Err(ImportError::Failed(
            trace
                .error
                .clone()
                .unwrap_or_else(|| format!("status {}", trace.status)),
        ));
    }
    let mut im = Importer {
        graph: OpGraph::new(),
        values: HashMap::new(),
        node: String::new(),
    };
    for node in &trace.nodes {
        im.node = node.name.clone();
        let val = im.import_node(node)?;
        im.values.insert(node.name.clone(), val);
    }
    let mut outputs = Vec::new();
    for out in &trace.outputs {
        im.decode(out)?.tensors(&mut outputs);
    }
    im.graph.set_outputs(outputs);
    crate::normalize::normalize(&mut im.graph);
    Ok(Imported {
        graph: im.graph,
        method: trace.method.clone().unwrap_or_default(),
    })
}

pub(crate) struct Importer {
    pub(crate) graph: OpGraph,
    values: HashMap<String, Val>,
    node: String,
}

/// The result types of one call: flat tensor types, and how they nest.
pub(crate) enum OutShape {
    Tensor,
    Tuple(Vec<OutShape>),
    Value(Value),
}

impl Importer {
    pub(crate) fn malformed(&self, reason: impl Into<String>) -> ImportError {
        ImportError::Malformed {
            node: self.node.clone(),
            reason: reason.into(),
        }
    }

    /// Turns a JSON argument into a value, resolving node references.
    pub(crate) fn decode(&self, v: &Value) -> Result<Val, ImportError> {
        match v {
            Value::Object(map) if map.len() == 1 && map.contains_key("node") => {
                let name = map["node"].as_str().unwrap_or_default();
                self.values
                    .get(name)
                    .cloned()
                    .ok_or_else(|| self.malformed(format!("reference to unknown node `{name}`")))
            }
            Value::Array(items) => {
                let vals = items
                    .iter()
                    .map(|i| self.decode(i))
                    .collect::<Result<Vec<_>, _>>()?;
                if vals.iter().all(|v| matches!(v, Val::Const(_))) {
                    Ok(Val::Const(Value::Array(
                        vals.into_iter()
                            .map(|v| match v {
                                Val::Const(c) => c,
                                _ => Value::Null,
                            })
                            .collect(),
                    )))
                } else {
                    Ok(Val::Tuple(vals))
                }
            }
            other => Ok(Val::Const(other.clone())),
        }
    }

    pub(crate) fn tensor_type(&self, meta: &Value) -> Result<TensorType, ImportError> {
        let shape = meta
            .get("shape")
            .and_then(Value::as_array)
            .ok_or_else(|| self.malformed("tensor type without a shape"))?
            .iter()
            .map(|d| {
                d.as_u64()
                    .ok_or_else(|| self.malformed(format!("dim {d} is not a size")))
            })
            .collect::<Result<Vec<u64>, _>>()?;
        let name = meta.get("dtype").and_then(Value::as_str).unwrap_or("");
        let dtype = DType::parse(name)
            .ok_or_else(|| self.malformed(format!("unsupported dtype `{name}`")))?;
        Ok(TensorType::new(shape, dtype))
    }

    /// Flattens a result type into tensor types plus its nesting.
    pub(crate) fn out_shape(
        &self,
        meta: &Value,
        flat: &mut Vec<TensorType>,
    ) -> Result<OutShape, ImportError> {
        if let Some(t) = meta.get("tensor") {
            flat.push(self.tensor_type(t)?);
            Ok(OutShape::Tensor)
        } else if let Some(items) = meta.get("tuple").and_then(Value::as_array) {
            Ok(OutShape::Tuple(
                items
                    .iter()
                    .map(|i| self.out_shape(i, flat))
                    .collect::<Result<_, _>>()?,
            ))
        } else if let Some(v) = meta.get("value") {
            Ok(OutShape::Value(v.clone()))
        } else {
            Err(self.malformed("result type is neither tensor, tuple nor value"))
        }
    }

    /// Adds a node producing the traced result types and returns the value
    /// that mirrors the result's nesting.
    pub(crate) fn emit(
        &mut self,
        name: &str,
        op: Op,
        inputs: &[TensorRef],
        out: &Value,
    ) -> Result<Val, ImportError> {
        let mut flat = Vec::new();
        let shape = self.out_shape(out, &mut flat)?;
        if flat.is_empty() {
            return Err(self.malformed("call produced no tensor"));
        }
        let id = self
            .graph
            .add(name, op, inputs, flat)
            .map_err(|e| self.malformed(e.to_string()))?;
        let mut next = 0;
        Ok(nest(&shape, id, &mut next))
    }

    fn import_node(&mut self, node: &TraceNode) -> Result<Val, ImportError> {
        // Calls whose result is not a tensor (x.size(0), x.shape) were
        // evaluated at trace time: their values are constants.
        if let Some(v) = node.out.get("value")
            && node.op != "input"
            && node.op != "param"
        {
            return Ok(Val::Const(v.clone()));
        }
        match node.op.as_str() {
            "input" => match node.out.get("tensor") {
                Some(_) => self.emit(
                    &node.name,
                    Op::Input {
                        name: node.target.clone(),
                    },
                    &[],
                    &node.out,
                ),
                None => Ok(Val::Const(
                    node.out.get("value").cloned().unwrap_or_default(),
                )),
            },
            "param" => self.emit(
                &node.name,
                Op::Param {
                    name: node.target.clone(),
                    trainable: node.trainable.unwrap_or(false),
                },
                &[],
                &node.out,
            ),
            "module" | "function" | "method" => calls::import_call(self, node),
            other => Err(self.malformed(format!("unknown node kind `{other}`"))),
        }
    }
}

fn nest(shape: &OutShape, node: crate::graph::NodeId, next: &mut usize) -> Val {
    match shape {
        OutShape::Tensor => {
            let t = TensorRef {
                node,
                output: *next,
            };
            *next += 1;
            Val::Tensor(t)
        }
        OutShape::Tuple(items) => Val::Tuple(items.iter().map(|s| nest(s, node, next)).collect()),
        OutShape::Value(v) => Val::Const(v.clone()),
    }
}

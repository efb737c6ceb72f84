//! What each traced call means as an [`Op`].
//!
//! A call's target is normalized here to a key (`F.conv2d`, `nn.Conv2d`,
//! `add`, `getitem`, …), and its arguments are decoded into a [`Call`].
//! [`vocabulary`] holds one `match` on the key: functional (`F.`),
//! `torch.` and method spellings of the same operation share an arm;
//! [`tensor`] and [`layers`] read the arguments of the longer arms. A
//! call that is not listed, or whose arguments do not have the expected
//! form, becomes an opaque node.
use std::collections::BTreeMap;

use serde_json::Value;

use super::{ImportError, Importer, TraceNode, Val};
use crate::dtype::TensorType;
use crate::graph::TensorRef;
use crate::op::{CallArg, CallKind, Op, OpaqueCall, Reduction};

mod layers;
mod tensor;
mod vocabulary;

use vocabulary::lower;

/// The outcome of reading one call.
enum Lowered {
    /// A new node with these inputs.
    Node(Op, Vec<TensorRef>),
    /// The call returns an existing value (no-op views, `detach`, tuple access).
    Alias(Val),
}

type Lower = Result<Lowered, String>;

/// Arguments of one call, with helpers that read them by position or name.
struct Call<'a> {
    key: String,
    args: Vec<Val>,
    kwargs: BTreeMap<String, Val>,
    attrs: &'a BTreeMap<String, Value>,
    params: BTreeMap<String, TensorRef>,
    training: bool,
    out: &'a Value,
}

fn num(v: &Value) -> Option<f64> {
    match v {
        Value::Number(n) => n.as_f64(),
        Value::Bool(b) => Some(f64::from(u8::from(*b))),
        Value::Object(m) => m
            .get("float")
            .and_then(Value::as_str)
            .and_then(|s| match s {
                "inf" => Some(f64::INFINITY),
                "-inf" => Some(f64::NEG_INFINITY),
                "nan" => Some(f64::NAN),
                _ => None,
            }),
        _ => None,
    }
}

fn ints(v: &Value) -> Option<Vec<i64>> {
    match v {
        Value::Number(n) => n.as_i64().map(|i| vec![i]),
        Value::Array(items) => items.iter().map(Value::as_i64).collect(),
        _ => None,
    }
}

impl Call<'_> {
    fn arg(&self, i: usize, name: &str) -> Option<&Val> {
        self.kwargs.get(name).or_else(|| self.args.get(i))
    }

    fn konst(&self, i: usize, name: &str) -> Option<&Value> {
        match self.arg(i, name) {
            Some(Val::Const(v)) if !v.is_null() => Some(v),
            _ => None,
        }
    }

    fn tensor(&self, i: usize, name: &str) -> Result<TensorRef, String> {
        match self.arg(i, name) {
            Some(Val::Tensor(t)) => Ok(*t),
            _ => Err(format!("argument {i} (`{name}`) is not a tensor")),
        }
    }

    fn opt_tensor(&self, i: usize, name: &str) -> Option<TensorRef> {
        match self.arg(i, name) {
            Some(Val::Tensor(t)) => Some(*t),
            _ => None,
        }
    }

    fn f64_or(&self, i: usize, name: &str, default: f64) -> Result<f64, String> {
        match self.konst(i, name) {
            None => Ok(default),
            Some(v) => num(v).ok_or_else(|| format!("`{name}` = {v} is not a number")),
        }
    }

    fn opt_f64(&self, i: usize, name: &str) -> Result<Option<f64>, String> {
        match self.konst(i, name) {
            None => Ok(None),
            Some(v) => num(v)
                .map(Some)
                .ok_or_else(|| format!("`{name}` = {v} is not a number")),
        }
    }

    fn bool_or(&self, i: usize, name: &str, default: bool) -> bool {
        self.konst(i, name)
            .and_then(Value::as_bool)
            .unwrap_or(default)
    }

    fn ints(&self, i: usize, name: &str) -> Result<Option<Vec<i64>>, String> {
        match self.konst(i, name) {
            None => Ok(None),
            Some(v) => ints(v)
                .map(Some)
                .ok_or_else(|| format!("`{name}` = {v} is not an int or list of ints")),
        }
    }

    fn attr(&self, name: &str) -> Option<&Value> {
        self.attrs.get(name).filter(|v| !v.is_null())
    }

    fn attr_f64(&self, name: &str, default: f64) -> f64 {
        self.attr(name).and_then(num).unwrap_or(default)
    }

    fn attr_bool(&self, name: &str, default: bool) -> bool {
        self.attr(name).and_then(Value::as_bool).unwrap_or(default)
    }

    fn attr_ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).and_then(ints)
    }

    fn param(&self, name: &str) -> Option<TensorRef> {
        self.params.get(name).copied()
    }

    /// The first traced output type.
    fn out_tensor(&self) -> Option<TensorType> {
        let t = self.out.get("tensor").or_else(|| {
            self.out
                .get("tuple")
                .and_then(|t| t.get(0))
                .and_then(|t| t.get("tensor"))
        })?;
        let shape = t
            .get("shape")?
            .as_array()?
            .iter()
            .map(Value::as_u64)
            .collect::<Option<Vec<u64>>>()?;
        let dtype = crate::dtype::DType::parse(t.get("dtype")?.as_str()?)?;
        Some(TensorType::new(shape, dtype))
    }

    /// Tensors anywhere in the arguments, in order.
    fn all_tensors(&self) -> Vec<TensorRef> {
        let mut out = Vec::new();
        for v in self.args.iter().chain(self.kwargs.values()) {
            v.tensors(&mut out);
        }
        out.extend(self.params.values().copied());
        out
    }
}

/// The call `node` made, its tensors numbered as [`Call::all_tensors`]
/// lists them (the node's inputs; a module's own parameters last, which
/// the call does not pass); `None` for a node that is no call.
fn opaque_call(node: &TraceNode, call: &Call<'_>) -> Option<Box<OpaqueCall>> {
    let kind = match node.op.as_str() {
        "module" => CallKind::Module,
        "function" => CallKind::Function,
        "method" => CallKind::Method,
        _ => return None,
    };
    fn arg(v: &Val, next: &mut usize) -> CallArg {
        match v {
            Val::Tensor(_) => {
                *next += 1;
                CallArg::Input(*next - 1)
            }
            Val::Tuple(items) => CallArg::Tuple(items.iter().map(|v| arg(v, next)).collect()),
            Val::Const(c) => CallArg::Const(c.clone()),
        }
    }
    let mut next = 0;
    let args = call.args.iter().map(|v| arg(v, &mut next)).collect();
    let kwargs = call
        .kwargs
        .iter()
        .map(|(k, v)| (k.clone(), arg(v, &mut next)))
        .collect();
    Some(Box::new(OpaqueCall {
        kind,
        target: node.target.clone(),
        args,
        kwargs,
        untraced: node.opaque.is_some(),
    }))
}

/// Normalizes a trace node's target to the key matched below.
fn call_key(node: &TraceNode) -> String {
    match node.op.as_str() {
        "module" => format!("nn.{}", node.module.as_deref().unwrap_or("?")),
        "method" => {
            let t = node.target.as_str();
            let t = t
                .strip_prefix("__")
                .and_then(|s| s.strip_suffix("__"))
                .unwrap_or(t);
            let t = t
                .strip_prefix('i')
                .filter(|_| is_inplace_dunder(&node.target))
                .unwrap_or(t);
            t.strip_suffix('_').unwrap_or(t).to_string()
        }
        _ => {
            let t = node.target.as_str();
            if let Some(rest) = t.strip_prefix("torch.nn.functional.") {
                format!("F.{rest}")
            } else if let Some(rest) = t.strip_prefix("torch.linalg.") {
                format!("linalg.{rest}")
            } else if let Some(rest) = t.strip_prefix("torch.special.") {
                format!("special.{rest}")
            } else if let Some(rest) = t.strip_prefix("torch.") {
                rest.strip_suffix('_').unwrap_or(rest).to_string()
            } else if let Some(rest) = t.strip_prefix("operator.") {
                rest.strip_prefix('i')
                    .filter(|r| {
                        ["add", "sub", "mul", "truediv", "floordiv", "pow", "matmul"].contains(r)
                    })
                    .unwrap_or(rest)
                    .to_string()
            } else if let Some(rest) = t.strip_prefix("builtins.") {
                rest.to_string()
            } else {
                t.to_string()
            }
        }
    }
}

fn is_inplace_dunder(target: &str) -> bool {
    matches!(
        target,
        "__iadd__"
            | "__isub__"
            | "__imul__"
            | "__itruediv__"
            | "__ifloordiv__"
            | "__ipow__"
            | "__imatmul__"
    )
}

pub(super) fn import_call(im: &mut Importer, node: &TraceNode) -> Result<Val, ImportError> {
    let args = node
        .args
        .iter()
        .map(|a| im.decode(a))
        .collect::<Result<Vec<_>, _>>()?;
    let kwargs = node
        .kwargs
        .iter()
        .map(|(k, v)| Ok((k.clone(), im.decode(v)?)))
        .collect::<Result<BTreeMap<_, _>, ImportError>>()?;
    // A module's own parameters become parameter nodes named by their path.
    let mut params = BTreeMap::new();
    for (pname, meta) in &node.params {
        let full = format!("{}.{pname}", node.target);
        let ty = im.tensor_type(&serde_json::json!({"shape": meta.shape, "dtype": meta.dtype}))?;
        let id = im
            .graph
            .add(
                full.clone(),
                Op::Param {
                    name: full,
                    trainable: meta.trainable,
                },
                &[],
                vec![ty],
            )
            .map_err(|e| im.malformed(e.to_string()))?;
        params.insert(pname.clone(), TensorRef::first(id));
    }
    let call = Call {
        key: call_key(node),
        args,
        kwargs,
        attrs: &node.attrs,
        params,
        training: node.training.unwrap_or(true),
        out: &node.out,
    };
    let lowered = if let Some(reason) = &node.opaque {
        // A submodule the tracer did not trace into: whatever its class,
        // only its own forward does what it does.
        Err(reason.clone())
    } else {
        match super::composite::expand(im, node, &call.args, &call.kwargs, &call.params) {
            Some(Ok(val)) => return Ok(val),
            Some(Err(reason)) => Err(format!("not expanded: {reason}")),
            None => lower(im, &call),
        }
    };
    match lowered {
        Ok(Lowered::Alias(v)) => Ok(v),
        Ok(Lowered::Node(op, inputs)) => im.emit(&node.name, op, &inputs, &node.out),
        Err(reason) => {
            let target = match node.op.as_str() {
                "module" if node.opaque.is_some() => format!(
                    "{} `{}`",
                    node.module.as_deref().unwrap_or("?"),
                    node.target
                ),
                "module" => format!("torch.nn.{}", node.module.as_deref().unwrap_or("?")),
                "method" => format!("Tensor.{}", node.target),
                _ => node.target.clone(),
            };
            let inputs = call.all_tensors();
            let call = opaque_call(node, &call);
            im.emit(
                &node.name,
                Op::Opaque {
                    target,
                    reason,
                    call,
                },
                &inputs,
                &node.out,
            )
        }
    }
}

fn norm_dim(d: i64, rank: usize) -> Result<usize, String> {
    let r = rank as i64;
    let n = if d < 0 { d + r } else { d };
    if (0..r.max(1)).contains(&n) {
        Ok(n as usize)
    } else {
        Err(format!("dim {d} is out of range for rank {rank}"))
    }
}

fn norm_dims(ds: &[i64], rank: usize) -> Result<Vec<usize>, String> {
    let mut out = ds
        .iter()
        .map(|&d| norm_dim(d, rank))
        .collect::<Result<Vec<_>, _>>()?;
    out.sort_unstable();
    out.dedup();
    Ok(out)
}

fn spatial(v: Option<Vec<i64>>, n: usize, default: u64) -> Vec<u64> {
    match v {
        None => vec![default; n],
        Some(v) if v.len() == 1 => vec![v[0].max(0) as u64; n],
        Some(v) => v.into_iter().map(|x| x.max(0) as u64).collect(),
    }
}

fn reduction(v: Option<&Value>) -> Result<Reduction, String> {
    match v.and_then(Value::as_str).unwrap_or("mean") {
        "mean" => Ok(Reduction::Mean),
        "sum" => Ok(Reduction::Sum),
        "none" => Ok(Reduction::None),
        "batchmean" => Ok(Reduction::BatchMean),
        other => Err(format!("unknown reduction `{other}`")),
    }
}

fn spatial_rank(key: &str) -> Option<usize> {
    ['1', '2', '3']
        .iter()
        .find(|c| key.ends_with(&format!("{c}d")))
        .and_then(|c| c.to_digit(10))
        .map(|d| d as usize)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn node(op: &str, target: &str) -> TraceNode {
        serde_json::from_value(serde_json::json!({"name": "n", "op": op, "target": target}))
            .unwrap()
    }

    #[test]
    fn spellings_of_one_operation_share_a_key() {
        assert_eq!(call_key(&node("function", "operator.add")), "add");
        assert_eq!(call_key(&node("function", "operator.iadd")), "add");
        assert_eq!(call_key(&node("method", "__add__")), "add");
        assert_eq!(call_key(&node("method", "add_")), "add");
        assert_eq!(call_key(&node("method", "__iadd__")), "add");
        assert_eq!(call_key(&node("method", "__radd__")), "radd");
        assert_eq!(call_key(&node("function", "torch.relu_")), "relu");
        assert_eq!(
            call_key(&node("function", "torch.nn.functional.relu")),
            "F.relu"
        );
        assert_eq!(call_key(&node("function", "operator.truediv")), "truediv");
        assert_eq!(call_key(&node("method", "__getitem__")), "getitem");
        assert_eq!(
            call_key(&node("function", "torch.linalg.vector_norm")),
            "linalg.vector_norm"
        );
    }
}

//! What each traced call means as an [`Op`].
//!
//! One `match` on a normalized call key (`F.conv2d`, `nn.Conv2d`, `add`,
//! `getitem`, …). Functional (`F.`), `torch.` and method spellings of the
//! same operation share an arm. A call that is not listed, or whose
//! arguments do not have the expected form, becomes an opaque node.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{ImportError, Importer, TraceNode, Val};
use crate::dtype::TensorType;
use crate::graph::TensorRef;
use crate::op::{
    AdaptivePool, Attention, BinaryOp, Conv, Fill, Layout, Loss, LossKind, MatMul, Norm, NormKind,
    Op, Pool, Reduce, ReduceOp, Reduction, Rnn, RnnCell, Scan, UnaryOp,
};

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
    let lowered = match super::composite::expand(im, node, &call.args, &call.kwargs, &call.params) {
        Some(Ok(val)) => return Ok(val),
        Some(Err(reason)) => Err(format!("not expanded: {reason}")),
        None => lower(im, &call),
    };
    match lowered {
        Ok(Lowered::Alias(v)) => Ok(v),
        Ok(Lowered::Node(op, inputs)) => im.emit(&node.name, op, &inputs, &node.out),
        Err(reason) => {
            let target = match node.op.as_str() {
                "module" => format!("torch.nn.{}", node.module.as_deref().unwrap_or("?")),
                "method" => format!("Tensor.{}", node.target),
                _ => node.target.clone(),
            };
            let inputs = call.all_tensors();
            im.emit(
                &node.name,
                Op::Opaque { target, reason },
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

fn unary(c: &Call, op: UnaryOp) -> Lower {
    Ok(Lowered::Node(Op::Unary(op), vec![c.tensor(0, "input")?]))
}

/// `clamp` and its one-sided forms, each bound at its position: numbers
/// are one clamp; a tensor bound (alone) is the elementwise maximum with
/// it (`min`) or the minimum (`max`).
fn clamp(c: &Call, min: Option<usize>, max: Option<usize>) -> Lower {
    let bound = |at: Option<usize>, name: &str| match at.and_then(|i| c.arg(i, name)) {
        Some(Val::Tensor(t)) => Ok(Some(*t)),
        Some(Val::Tuple(_)) => Err(format!("`{name}` is not a number or a tensor")),
        _ => Ok(None),
    };
    let number = |at: Option<usize>, name: &str| match at {
        Some(i) => c.opt_f64(i, name),
        None => Ok(None),
    };
    let x = c.tensor(0, "input")?;
    match (bound(min, "min")?, bound(max, "max")?) {
        (None, None) => unary(
            c,
            UnaryOp::Clamp {
                min: number(min, "min")?,
                max: number(max, "max")?,
            },
        ),
        (Some(t), None) if number(max, "max")?.is_none() => {
            Ok(Lowered::Node(Op::Binary(BinaryOp::Maximum), vec![x, t]))
        }
        (None, Some(t)) if number(min, "min")?.is_none() => {
            Ok(Lowered::Node(Op::Binary(BinaryOp::Minimum), vec![x, t]))
        }
        _ => Err("a clamp with a tensor bound and a second bound is not modelled".into()),
    }
}

fn binary(c: &Call, op: BinaryOp, reflected: bool) -> Lower {
    if let Some(alpha) = c.konst(2, "alpha").and_then(num)
        && alpha != 1.0
    {
        return Err(format!("alpha = {alpha} is not modelled"));
    }
    let a = c.arg(0, "input").ok_or("missing first operand")?;
    let b = c.arg(1, "other").ok_or("missing second operand")?;
    match (a, b) {
        (Val::Tensor(x), Val::Tensor(y)) => {
            let inputs = if reflected {
                vec![*y, *x]
            } else {
                vec![*x, *y]
            };
            Ok(Lowered::Node(Op::Binary(op), inputs))
        }
        (Val::Tensor(x), Val::Const(v)) | (Val::Const(v), Val::Tensor(x)) => {
            let value = num(v).ok_or_else(|| format!("scalar operand {v} is not a number"))?;
            let scalar_first = matches!(a, Val::Const(_)) != reflected;
            Ok(Lowered::Node(
                Op::Scalar {
                    op,
                    value,
                    scalar_first,
                },
                vec![*x],
            ))
        }
        _ => Err("operands are not tensors or numbers".into()),
    }
}

fn rank_of(im: &Importer, t: TensorRef) -> usize {
    im.graph.tensor(t).rank()
}

fn reduce(im: &Importer, c: &Call, op: ReduceOp) -> Lower {
    let x = c.tensor(0, "input")?;
    let rank = rank_of(im, x);
    let dims = match c.ints(1, "dim")? {
        None => (0..rank).collect(),
        Some(d) => norm_dims(&d, rank)?,
    };
    let keepdim = c.bool_or(2, "keepdim", false);
    Ok(Lowered::Node(
        Op::Reduce(Reduce { op, dims, keepdim }),
        vec![x],
    ))
}

/// `torch.max`/`torch.min`: over everything, along a dim with indices, or
/// elementwise against a second tensor.
fn extremum(im: &Importer, c: &Call, max: bool) -> Lower {
    if let Some(Val::Tensor(_)) = c.arg(1, "other") {
        let op = if max {
            BinaryOp::Maximum
        } else {
            BinaryOp::Minimum
        };
        return binary(c, op, false);
    }
    let indices = c.arg(1, "dim").is_some();
    let op = if max {
        ReduceOp::Max { indices }
    } else {
        ReduceOp::Min { indices }
    };
    reduce(im, c, op)
}

fn permute(im: &Importer, c: &Call, how: &str) -> Lower {
    let x = c.tensor(0, "input")?;
    let rank = rank_of(im, x);
    let mut perm: Vec<usize> = (0..rank).collect();
    match how {
        "transpose" | "swapaxes" | "swapdims" => {
            let a = norm_dim(c.ints(1, "dim0")?.ok_or("missing dim0")?[0], rank)?;
            let b = norm_dim(c.ints(2, "dim1")?.ok_or("missing dim1")?[0], rank)?;
            perm.swap(a, b);
        }
        "t" | "T" => perm.reverse(),
        "mT" if rank >= 2 => perm.swap(rank - 2, rank - 1),
        "permute" => {
            let dims: Vec<i64> = match c.args.get(1) {
                Some(Val::Const(Value::Array(_))) => c.ints(1, "dims")?.unwrap_or_default(),
                _ => c.args[1..]
                    .iter()
                    .map(|v| match v {
                        Val::Const(v) => v.as_i64().ok_or("permute dim is not an int"),
                        _ => Err("permute dim is not an int"),
                    })
                    .collect::<Result<_, _>>()?,
            };
            perm = dims
                .iter()
                .map(|&d| norm_dim(d, rank))
                .collect::<Result<_, _>>()?;
        }
        other => return Err(format!("cannot read `{other}` as a permutation")),
    }
    Ok(Lowered::Node(Op::Layout(Layout::Permute { perm }), vec![x]))
}

fn subscript(v: &Value) -> String {
    match v {
        Value::Null => "None".into(),
        Value::Array(items) => items.iter().map(subscript).collect::<Vec<_>>().join(", "),
        Value::Object(m) if m.contains_key("slice") => {
            let parts: Vec<String> = m["slice"]
                .as_array()
                .map(|a| {
                    a.iter()
                        .map(|p| {
                            if p.is_null() {
                                String::new()
                            } else {
                                p.to_string()
                            }
                        })
                        .collect()
                })
                .unwrap_or_default();
            let mut s = parts.join(":");
            if s.ends_with(':') && parts.len() == 3 {
                s.pop();
            }
            s
        }
        Value::Object(m) if m.contains_key("ellipsis") => "...".into(),
        other => other.to_string(),
    }
}

/// An index with tensors as written, each tensor a `#` in the order
/// `Val::tensors` lists them: `[#]`, `[:, #]`. `None` for what has no such
/// text: a list inside the index.
fn gather_subscript(index: &Val) -> Option<String> {
    let item = |v: &Val| match v {
        Val::Tensor(_) => Some("#".to_string()),
        Val::Const(Value::Array(_)) | Val::Tuple(_) => None,
        Val::Const(c) => Some(subscript(c)),
    };
    let text = match index {
        Val::Tuple(items) => items
            .iter()
            .map(item)
            .collect::<Option<Vec<_>>>()?
            .join(", "),
        other => item(other)?,
    };
    Some(format!("[{text}]"))
}

fn getitem(c: &Call) -> Lower {
    let index = c.args.get(1).ok_or("missing index")?;
    match c.args.first() {
        Some(Val::Tuple(items)) => match index {
            Val::Const(v) => {
                let i = v.as_i64().ok_or("tuple index is not an int")?;
                let n = items.len() as i64;
                let i = if i < 0 { i + n } else { i };
                items
                    .get(i as usize)
                    .cloned()
                    .map(Lowered::Alias)
                    .ok_or_else(|| format!("tuple index {i} out of range"))
            }
            _ => Err("tuple indexed by a tensor".into()),
        },
        Some(Val::Tensor(x)) => {
            let mut index_tensors = Vec::new();
            index.tensors(&mut index_tensors);
            if index_tensors.is_empty() {
                let text = match index {
                    Val::Const(v) => subscript(v),
                    _ => String::new(),
                };
                Ok(Lowered::Node(
                    Op::Layout(Layout::Slice {
                        subscript: format!("[{text}]"),
                    }),
                    vec![*x],
                ))
            } else {
                let mut inputs = vec![*x];
                inputs.extend(index_tensors);
                let subscript = gather_subscript(index).unwrap_or_default();
                Ok(Lowered::Node(
                    Op::Layout(Layout::Gather { subscript }),
                    inputs,
                ))
            }
        }
        _ => Err("indexing something that is not a tensor or tuple".into()),
    }
}

fn conv(im: &Importer, c: &Call, transposed: bool) -> Lower {
    let x = c.tensor(0, "input")?;
    let module = c.key.starts_with("nn.");
    let weight = if module {
        c.param("weight").ok_or("module has no weight")?
    } else {
        c.tensor(1, "weight")?
    };
    let bias = if module {
        c.param("bias")
    } else {
        c.opt_tensor(2, "bias")
    };
    let w = im.graph.tensor(weight).clone();
    let n = spatial_rank(&c.key).unwrap_or(w.rank().saturating_sub(2));
    let kernel = w.shape[2..].to_vec();
    let (stride, padding, dilation, output_padding, groups) = if module {
        (
            c.attr_ints("stride"),
            c.attr("padding").cloned(),
            c.attr_ints("dilation"),
            c.attr_ints("output_padding"),
            c.attr("groups").and_then(Value::as_u64).unwrap_or(1),
        )
    } else if transposed {
        (
            c.ints(3, "stride")?,
            c.konst(4, "padding").cloned(),
            c.ints(7, "dilation")?,
            c.ints(5, "output_padding")?,
            c.konst(6, "groups").and_then(Value::as_u64).unwrap_or(1),
        )
    } else {
        (
            c.ints(3, "stride")?,
            c.konst(4, "padding").cloned(),
            c.ints(5, "dilation")?,
            None,
            c.konst(6, "groups").and_then(Value::as_u64).unwrap_or(1),
        )
    };
    let dilation = spatial(dilation, n, 1);
    let padding = match padding {
        Some(Value::String(s)) if s == "valid" => vec![0; n],
        Some(Value::String(s)) if s == "same" => kernel
            .iter()
            .zip(&dilation)
            .map(|(k, d)| d * (k - 1) / 2)
            .collect(),
        Some(v) => spatial(Some(ints(&v).ok_or("padding is not ints")?), n, 0),
        None => vec![0; n],
    };
    if module
        && c.attr("padding_mode")
            .and_then(Value::as_str)
            .unwrap_or("zeros")
            != "zeros"
    {
        return Err("non-zero padding modes are not modelled".into());
    }
    let mut inputs = vec![x, weight];
    inputs.extend(bias);
    Ok(Lowered::Node(
        Op::Conv(Conv {
            spatial: n,
            transposed,
            kernel,
            stride: spatial(stride, n, 1),
            padding,
            dilation,
            output_padding: spatial(output_padding, n, 0),
            groups,
            bias: bias.is_some(),
        }),
        inputs,
    ))
}

fn pool(c: &Call, max: bool) -> Lower {
    let x = c.tensor(0, "input")?;
    let n = spatial_rank(&c.key).ok_or("pool without a spatial rank")?;
    let module = c.key.starts_with("nn.");
    let (kernel, stride, padding, dilation, ceil_mode, count_include_pad) = if module {
        (
            c.attr_ints("kernel_size"),
            c.attr_ints("stride"),
            c.attr_ints("padding"),
            c.attr_ints("dilation"),
            c.attr_bool("ceil_mode", false),
            c.attr_bool("count_include_pad", true),
        )
    } else if max {
        (
            c.ints(1, "kernel_size")?,
            c.ints(2, "stride")?,
            c.ints(3, "padding")?,
            c.ints(4, "dilation")?,
            c.bool_or(5, "ceil_mode", false),
            true,
        )
    } else {
        (
            c.ints(1, "kernel_size")?,
            c.ints(2, "stride")?,
            c.ints(3, "padding")?,
            None,
            c.bool_or(4, "ceil_mode", false),
            c.bool_or(5, "count_include_pad", true),
        )
    };
    let kernel = spatial(Some(kernel.ok_or("pool without kernel_size")?), n, 1);
    let stride = match stride {
        Some(s) if !s.is_empty() => spatial(Some(s), n, 1),
        _ => kernel.clone(),
    };
    Ok(Lowered::Node(
        Op::Pool(Pool {
            max,
            spatial: n,
            kernel,
            stride,
            padding: spatial(padding, n, 0),
            dilation: spatial(dilation, n, 1),
            ceil_mode,
            count_include_pad,
            channels_last: false,
        }),
        vec![x],
    ))
}

fn adaptive_pool(c: &Call, max: bool) -> Lower {
    let x = c.tensor(0, "input")?;
    let n = spatial_rank(&c.key).ok_or("pool without a spatial rank")?;
    let out = c.out_tensor().ok_or("pool result is not a tensor")?;
    if out.rank() < n {
        return Err("pool result has fewer dims than spatial dims".into());
    }
    Ok(Lowered::Node(
        Op::AdaptivePool(AdaptivePool {
            max,
            output: out.shape[out.rank() - n..].to_vec(),
        }),
        vec![x],
    ))
}

fn norm(c: &Call, kind: NormKind) -> Lower {
    let x = c.tensor(0, "input")?;
    let module = c.key.starts_with("nn.");
    let mut inputs = vec![x];
    let (eps, weight, bias, batch_stats, stats_inputs) = if module {
        let track = c.attr_bool("track_running_stats", false);
        let batch_stats = match kind {
            NormKind::Batch | NormKind::Instance => c.training || !track,
            _ => true,
        };
        let stats: Vec<TensorRef> = if batch_stats {
            vec![]
        } else {
            ["running_mean", "running_var"]
                .iter()
                .filter_map(|p| c.param(p))
                .collect()
        };
        (
            c.attr_f64("eps", 1e-5),
            c.param("weight"),
            c.param("bias"),
            batch_stats,
            stats,
        )
    } else {
        match c.key.as_str() {
            "F.layer_norm" => (
                c.f64_or(4, "eps", 1e-5)?,
                c.opt_tensor(2, "weight"),
                c.opt_tensor(3, "bias"),
                true,
                vec![],
            ),
            "F.rms_norm" => (
                c.f64_or(3, "eps", 1e-6)?,
                c.opt_tensor(2, "weight"),
                None,
                true,
                vec![],
            ),
            "F.group_norm" => (
                c.f64_or(4, "eps", 1e-5)?,
                c.opt_tensor(2, "weight"),
                c.opt_tensor(3, "bias"),
                true,
                vec![],
            ),
            // Both take (input, running_mean, running_var, weight, bias,
            // use-batch-statistics flag, momentum, eps).
            "F.batch_norm" | "F.instance_norm" => {
                let batch_stats = if c.key == "F.batch_norm" {
                    c.bool_or(5, "training", false)
                } else {
                    c.bool_or(5, "use_input_stats", true)
                };
                let stats = if batch_stats {
                    vec![]
                } else {
                    [
                        c.opt_tensor(1, "running_mean"),
                        c.opt_tensor(2, "running_var"),
                    ]
                    .into_iter()
                    .flatten()
                    .collect()
                };
                (
                    c.f64_or(7, "eps", 1e-5)?,
                    c.opt_tensor(3, "weight"),
                    c.opt_tensor(4, "bias"),
                    batch_stats,
                    stats,
                )
            }
            other => return Err(format!("`{other}` is not a norm")),
        }
    };
    inputs.extend(weight);
    inputs.extend(bias);
    inputs.extend(stats_inputs);
    Ok(Lowered::Node(
        Op::Norm(Norm {
            kind,
            eps,
            affine: weight.is_some(),
            bias: bias.is_some(),
            batch_stats,
        }),
        inputs,
    ))
}

fn loss(c: &Call, kind: LossKind, operands: usize, reduction_pos: usize) -> Lower {
    let mut inputs = Vec::new();
    for i in 0..operands {
        // Keyword names: (input, target), an anchor's (anchor, positive,
        // negative), a pair's (input1, input2, target).
        let names = match c.key.as_str() {
            "F.cosine_embedding_loss" => ["input1", "input2", "target"],
            _ => ["input", "target", "negative"],
        };
        inputs.push(c.tensor(i, names[i.min(2)])?);
    }
    let red = if c.key.starts_with("nn.") {
        c.attr("reduction").cloned()
    } else {
        c.konst(reduction_pos, "reduction").cloned()
    };
    Ok(Lowered::Node(
        Op::Loss(Loss {
            kind,
            reduction: reduction(red.as_ref())?,
        }),
        inputs,
    ))
}

/// A recurrent module's weights in the order `torch.lstm` and its kin
/// take them (the module's `_flat_weights`): per layer, per direction,
/// `weight_ih`, `weight_hh`, then `bias_ih`, `bias_hh`.
fn flat_weights(
    c: &Call,
    layers: u64,
    bidirectional: bool,
    bias: bool,
) -> Result<Vec<TensorRef>, String> {
    let directions: &[&str] = if bidirectional {
        &["", "_reverse"]
    } else {
        &[""]
    };
    let kinds: &[&str] = if bias {
        &["weight_ih", "weight_hh", "bias_ih", "bias_hh"]
    } else {
        &["weight_ih", "weight_hh"]
    };
    let mut out = Vec::new();
    for layer in 0..layers {
        for direction in directions {
            for kind in kinds {
                let name = format!("{kind}_l{layer}{direction}");
                out.push(
                    c.param(&name)
                        .ok_or_else(|| format!("the recurrent module has no `{name}`"))?,
                );
            }
        }
    }
    if out.len() != c.params.len() {
        return Err(format!(
            "the recurrent module has {} parameters, {} of them its gates' (projections are not read yet)",
            c.params.len(),
            out.len()
        ));
    }
    Ok(out)
}

fn rnn(im: &Importer, c: &Call, cell: RnnCell) -> Lower {
    let x = c.tensor(0, "input")?;
    let mut inputs = vec![x];
    if let Some(h) = c.arg(1, "hx") {
        h.tensors(&mut inputs);
    }
    let op = if c.key.starts_with("nn.") {
        let cell = match c.attr("nonlinearity").and_then(Value::as_str) {
            Some("relu") => RnnCell::Relu,
            _ => cell,
        };
        let layers = c.attr("num_layers").and_then(Value::as_u64).unwrap_or(1);
        let bidirectional = c.attr_bool("bidirectional", false);
        let bias = c.attr_bool("bias", true);
        inputs.extend(flat_weights(c, layers, bidirectional, bias)?);
        Rnn {
            cell,
            input_size: c
                .attr("input_size")
                .and_then(Value::as_u64)
                .ok_or("no input_size")?,
            hidden_size: c
                .attr("hidden_size")
                .and_then(Value::as_u64)
                .ok_or("no hidden_size")?,
            layers,
            bidirectional,
            batch_first: c.attr_bool("batch_first", false),
            bias,
        }
    } else {
        // torch.lstm(input, hx, params, has_biases, num_layers, dropout, train, bidirectional, batch_first)
        if let Some(p) = c.arg(2, "params") {
            p.tensors(&mut inputs);
        }
        let hidden = match c.arg(1, "hx") {
            Some(Val::Tuple(h)) => match h.first() {
                Some(Val::Tensor(t)) => im.graph.tensor(*t).shape.last().copied(),
                _ => None,
            },
            Some(Val::Tensor(t)) => im.graph.tensor(*t).shape.last().copied(),
            _ => None,
        }
        .ok_or("cannot read the hidden size")?;
        Rnn {
            cell,
            input_size: im.graph.tensor(x).shape.last().copied().unwrap_or(0),
            hidden_size: hidden,
            layers: c
                .konst(4, "num_layers")
                .and_then(Value::as_u64)
                .unwrap_or(1),
            bidirectional: c.bool_or(7, "bidirectional", false),
            batch_first: c.bool_or(8, "batch_first", false),
            bias: c.bool_or(3, "has_biases", true),
        }
    };
    Ok(Lowered::Node(Op::Rnn(op), inputs))
}

/// Whether a random call draws from the global generator of the device
/// its tensor-valued arguments live on: no generator of its own, and a
/// `device=` or a tensor to be like.
fn same_generator(c: &Call) -> bool {
    let own = !matches!(
        c.kwargs.get("generator"),
        None | Some(Val::Const(Value::Null))
    );
    !own && (c.kwargs.contains_key("device") || c.key.ends_with("_like"))
}

fn constant(fill: Fill) -> Lower {
    Ok(Lowered::Node(Op::Constant { fill }, vec![]))
}

fn tensors_arg(c: &Call) -> Result<Vec<TensorRef>, String> {
    let mut out = Vec::new();
    c.arg(0, "tensors")
        .ok_or("missing tensors")?
        .tensors(&mut out);
    Ok(out)
}

/// Same type in and out: the call returns its input unchanged.
fn passthrough(im: &Importer, c: &Call) -> Option<Val> {
    let x = c.opt_tensor(0, "input")?;
    let out = c.out_tensor()?;
    (im.graph.tensor(x) == &out).then_some(Val::Tensor(x))
}

fn lower(im: &Importer, c: &Call) -> Lower {
    use BinaryOp as B;
    use UnaryOp as U;
    let key = c.key.as_str();
    match key {
        // Arithmetic.
        "add" | "F.add" => binary(c, B::Add, false),
        "radd" => binary(c, B::Add, true),
        "sub" | "subtract" => binary(c, B::Sub, false),
        "rsub" => binary(c, B::Sub, true),
        "mul" | "multiply" => binary(c, B::Mul, false),
        "rmul" => binary(c, B::Mul, true),
        "truediv" | "div" | "divide" => binary(c, B::Div, false),
        "rtruediv" | "rdiv" => binary(c, B::Div, true),
        "floordiv" | "floor_divide" => binary(c, B::FloorDiv, false),
        "pow" => binary(c, B::Pow, false),
        "rpow" => binary(c, B::Pow, true),
        "maximum" => binary(c, B::Maximum, false),
        "minimum" => binary(c, B::Minimum, false),
        "eq" => binary(c, B::Eq, false),
        "ne" => binary(c, B::Ne, false),
        "lt" => binary(c, B::Lt, false),
        "le" => binary(c, B::Le, false),
        "gt" => binary(c, B::Gt, false),
        "ge" => binary(c, B::Ge, false),
        "neg" | "negative" => unary(c, U::Neg),
        "square" => Ok(Lowered::Node(
            Op::Scalar {
                op: B::Pow,
                value: 2.0,
                scalar_first: false,
            },
            vec![c.tensor(0, "input")?],
        )),

        // Activations and elementwise math.
        "relu" | "F.relu" | "nn.ReLU" => unary(c, U::Relu),
        "F.relu6" | "nn.ReLU6" => unary(c, U::Relu6),
        "F.leaky_relu" => unary(
            c,
            U::LeakyRelu {
                slope: c.f64_or(1, "negative_slope", 0.01)?,
            },
        ),
        "nn.LeakyReLU" => unary(
            c,
            U::LeakyRelu {
                slope: c.attr_f64("negative_slope", 0.01),
            },
        ),
        "F.gelu" | "gelu" => unary(
            c,
            U::Gelu {
                tanh: c.konst(1, "approximate").and_then(Value::as_str) == Some("tanh"),
            },
        ),
        "nn.GELU" => unary(
            c,
            U::Gelu {
                tanh: c.attr("approximate").and_then(Value::as_str) == Some("tanh"),
            },
        ),
        "sigmoid" | "F.sigmoid" | "nn.Sigmoid" | "special.expit" => unary(c, U::Sigmoid),
        "tanh" | "F.tanh" | "nn.Tanh" => unary(c, U::Tanh),
        "F.silu" | "nn.SiLU" => unary(c, U::Silu),
        "F.mish" | "nn.Mish" => unary(c, U::Mish),
        "F.hardswish" | "nn.Hardswish" => unary(c, U::Hardswish),
        "F.hardsigmoid" | "nn.Hardsigmoid" => unary(c, U::Hardsigmoid),
        "F.hardtanh" => unary(
            c,
            U::Hardtanh {
                min: c.f64_or(1, "min_val", -1.0)?,
                max: c.f64_or(2, "max_val", 1.0)?,
            },
        ),
        "nn.Hardtanh" => unary(
            c,
            U::Hardtanh {
                min: c.attr_f64("min_val", -1.0),
                max: c.attr_f64("max_val", 1.0),
            },
        ),
        "F.softplus" => unary(
            c,
            U::Softplus {
                beta: c.f64_or(1, "beta", 1.0)?,
                threshold: c.f64_or(2, "threshold", 20.0)?,
            },
        ),
        "nn.Softplus" => unary(
            c,
            U::Softplus {
                beta: c.attr_f64("beta", 1.0),
                threshold: c.attr_f64("threshold", 20.0),
            },
        ),
        "F.softsign" | "nn.Softsign" => unary(c, U::Softsign),
        "F.elu" => unary(
            c,
            U::Elu {
                alpha: c.f64_or(1, "alpha", 1.0)?,
            },
        ),
        "nn.ELU" => unary(
            c,
            U::Elu {
                alpha: c.attr_f64("alpha", 1.0),
            },
        ),
        "selu" | "F.selu" | "nn.SELU" => unary(c, U::Selu),
        "clamp" | "clip" => clamp(c, Some(1), Some(2)),
        "clamp_min" => clamp(c, Some(1), None),
        "clamp_max" => clamp(c, None, Some(1)),
        "exp" => unary(c, U::Exp),
        "log" => unary(c, U::Log),
        "abs" => unary(c, U::Abs),
        "sqrt" => unary(c, U::Sqrt),
        "rsqrt" => unary(c, U::Rsqrt),
        "reciprocal" => unary(c, U::Reciprocal),
        "erf" | "special.erf" => unary(c, U::Erf),
        "sin" => unary(c, U::Sin),
        "cos" => unary(c, U::Cos),
        "sign" => unary(c, U::Sign),
        "invert" | "logical_not" | "bitwise_not" => unary(c, U::Not),

        // Matrix products.
        "matmul" | "mm" | "bmm" => Ok(Lowered::Node(
            Op::MatMul(MatMul {
                trans_a: false,
                trans_b: false,
                bias: false,
            }),
            vec![c.tensor(0, "input")?, c.tensor(1, "other")?],
        )),
        "rmatmul" => Ok(Lowered::Node(
            Op::MatMul(MatMul {
                trans_a: false,
                trans_b: false,
                bias: false,
            }),
            vec![c.tensor(1, "other")?, c.tensor(0, "input")?],
        )),
        "F.linear" | "nn.Linear" => {
            let x = c.tensor(0, "input")?;
            let (w, b) = if key == "nn.Linear" {
                (c.param("weight").ok_or("no weight")?, c.param("bias"))
            } else {
                (c.tensor(1, "weight")?, c.opt_tensor(2, "bias"))
            };
            let mut inputs = vec![x, w];
            inputs.extend(b);
            Ok(Lowered::Node(
                Op::MatMul(MatMul {
                    trans_a: false,
                    trans_b: true,
                    bias: b.is_some(),
                }),
                inputs,
            ))
        }
        "addmm" => Ok(Lowered::Node(
            Op::MatMul(MatMul {
                trans_a: false,
                trans_b: false,
                bias: true,
            }),
            vec![
                c.tensor(1, "mat1")?,
                c.tensor(2, "mat2")?,
                c.tensor(0, "input")?,
            ],
        )),
        "einsum" => {
            let equation = c
                .konst(0, "equation")
                .and_then(Value::as_str)
                .ok_or("einsum without an equation")?
                .to_string();
            let mut inputs = Vec::new();
            for v in &c.args[1..] {
                v.tensors(&mut inputs);
            }
            Ok(Lowered::Node(Op::Einsum { equation }, inputs))
        }

        // Convolutions.
        "F.conv1d" | "F.conv2d" | "F.conv3d" | "conv1d" | "conv2d" | "conv3d" | "nn.Conv1d"
        | "nn.Conv2d" | "nn.Conv3d" => conv(im, c, false),
        "F.conv_transpose1d" | "F.conv_transpose2d" | "F.conv_transpose3d" | "conv_transpose1d"
        | "conv_transpose2d" | "conv_transpose3d" | "nn.ConvTranspose1d" | "nn.ConvTranspose2d"
        | "nn.ConvTranspose3d" => conv(im, c, true),

        // Reductions.
        "sum" => reduce(im, c, ReduceOp::Sum),
        "mean" => reduce(im, c, ReduceOp::Mean),
        "prod" => reduce(im, c, ReduceOp::Prod),
        "amax" => reduce(im, c, ReduceOp::Max { indices: false }),
        "amin" => reduce(im, c, ReduceOp::Min { indices: false }),
        "max" => extremum(im, c, true),
        "min" => extremum(im, c, false),
        "argmax" => reduce(im, c, ReduceOp::ArgMax),
        "argmin" => reduce(im, c, ReduceOp::ArgMin),
        "logsumexp" => reduce(im, c, ReduceOp::LogSumExp),
        "var" | "std" => {
            let correction = match c.kwargs.get("correction") {
                Some(Val::Const(v)) => num(v).unwrap_or(1.0),
                _ => {
                    if c.bool_or(usize::MAX, "unbiased", true) {
                        1.0
                    } else {
                        0.0
                    }
                }
            };
            let op = if key == "var" {
                ReduceOp::Var { correction }
            } else {
                ReduceOp::Std { correction }
            };
            reduce(im, c, op)
        }
        "norm" | "linalg.vector_norm" | "linalg.norm" => {
            let p_name = if key == "norm" { "p" } else { "ord" };
            let p = match c.konst(1, p_name) {
                None => 2.0,
                Some(Value::String(s)) if s == "fro" => 2.0,
                Some(v) => num(v).ok_or_else(|| format!("norm order {v} is not modelled"))?,
            };
            let x = c.tensor(0, "input")?;
            let rank = rank_of(im, x);
            let dims = match c.ints(2, "dim")? {
                None => (0..rank).collect(),
                Some(d) => norm_dims(&d, rank)?,
            };
            Ok(Lowered::Node(
                Op::Reduce(Reduce {
                    op: ReduceOp::Norm { p },
                    dims,
                    keepdim: c.bool_or(3, "keepdim", false),
                }),
                vec![x],
            ))
        }
        "F.normalize" => {
            let x = c.tensor(0, "input")?;
            let dim = norm_dim(c.ints(2, "dim")?.map_or(1, |d| d[0]), rank_of(im, x))?;
            Ok(Lowered::Node(
                Op::Norm(Norm {
                    kind: NormKind::Lp {
                        p: c.f64_or(1, "p", 2.0)?,
                        dim,
                    },
                    eps: c.f64_or(3, "eps", 1e-12)?,
                    affine: false,
                    bias: false,
                    batch_stats: true,
                }),
                vec![x],
            ))
        }

        // Scans.
        "cumsum" | "cumprod" => {
            let x = c.tensor(0, "input")?;
            let dim = norm_dim(
                c.ints(1, "dim")?.ok_or("scan without dim")?[0],
                rank_of(im, x),
            )?;
            Ok(Lowered::Node(
                Op::Scan(Scan {
                    prod: key == "cumprod",
                    dim,
                    reverse: false,
                    exclusive: false,
                }),
                vec![x],
            ))
        }

        // Softmax.
        "softmax" | "F.softmax" | "log_softmax" | "F.log_softmax" | "nn.Softmax"
        | "nn.LogSoftmax" => {
            let x = c.tensor(0, "input")?;
            let rank = rank_of(im, x);
            let dim = if key.starts_with("nn.") {
                c.attr("dim").and_then(Value::as_i64)
            } else {
                c.ints(1, "dim")?.map(|d| d[0])
            };
            // torch's legacy implicit dim for softmax without one.
            let dim = dim.unwrap_or(if matches!(rank, 0 | 1 | 3) { 0 } else { 1 });
            Ok(Lowered::Node(
                Op::Softmax {
                    dim: norm_dim(dim, rank)?,
                    log: key.contains("og"),
                },
                vec![x],
            ))
        }

        // Normalization.
        "nn.LayerNorm" => norm(
            c,
            NormKind::Layer {
                dims: c.attr_ints("normalized_shape").map_or(1, |v| v.len()),
            },
        ),
        "F.layer_norm" => norm(
            c,
            NormKind::Layer {
                dims: c.ints(1, "normalized_shape")?.map_or(1, |v| v.len()),
            },
        ),
        "nn.RMSNorm" => norm(
            c,
            NormKind::Rms {
                dims: c.attr_ints("normalized_shape").map_or(1, |v| v.len()),
            },
        ),
        "F.rms_norm" => norm(
            c,
            NormKind::Rms {
                dims: c.ints(1, "normalized_shape")?.map_or(1, |v| v.len()),
            },
        ),
        "nn.BatchNorm1d" | "nn.BatchNorm2d" | "nn.BatchNorm3d" | "F.batch_norm" => {
            norm(c, NormKind::Batch)
        }
        "nn.InstanceNorm1d" | "nn.InstanceNorm2d" | "nn.InstanceNorm3d" | "F.instance_norm" => {
            norm(c, NormKind::Instance)
        }
        "nn.GroupNorm" => norm(
            c,
            NormKind::Group {
                groups: c
                    .attr("num_groups")
                    .and_then(Value::as_u64)
                    .ok_or("no num_groups")?,
            },
        ),
        "F.group_norm" => norm(
            c,
            NormKind::Group {
                groups: c
                    .konst(1, "num_groups")
                    .and_then(Value::as_u64)
                    .ok_or("no num_groups")?,
            },
        ),

        // Pooling.
        "nn.MaxPool1d" | "nn.MaxPool2d" | "nn.MaxPool3d" | "F.max_pool1d" | "F.max_pool2d"
        | "F.max_pool3d" | "max_pool1d" | "max_pool2d" | "max_pool3d" => pool(c, true),
        "nn.AvgPool1d" | "nn.AvgPool2d" | "nn.AvgPool3d" | "F.avg_pool1d" | "F.avg_pool2d"
        | "F.avg_pool3d" | "avg_pool1d" => pool(c, false),
        "nn.AdaptiveAvgPool1d"
        | "nn.AdaptiveAvgPool2d"
        | "nn.AdaptiveAvgPool3d"
        | "F.adaptive_avg_pool1d"
        | "F.adaptive_avg_pool2d"
        | "F.adaptive_avg_pool3d"
        | "adaptive_avg_pool1d" => adaptive_pool(c, false),
        "nn.AdaptiveMaxPool1d"
        | "nn.AdaptiveMaxPool2d"
        | "nn.AdaptiveMaxPool3d"
        | "F.adaptive_max_pool1d"
        | "F.adaptive_max_pool2d"
        | "F.adaptive_max_pool3d" => adaptive_pool(c, true),

        // Dropout.
        "nn.Dropout" | "nn.Dropout1d" | "nn.Dropout2d" | "nn.Dropout3d" => {
            let p = c.attr_f64("p", 0.5);
            Ok(Lowered::Node(
                Op::Dropout {
                    p,
                    active: c.training && p > 0.0,
                },
                vec![c.tensor(0, "input")?],
            ))
        }
        "F.dropout" | "dropout" | "F.dropout1d" | "F.dropout2d" | "F.dropout3d" => {
            let p = c.f64_or(1, "p", 0.5)?;
            let training = c.bool_or(
                2,
                if key == "dropout" {
                    "train"
                } else {
                    "training"
                },
                true,
            );
            Ok(Lowered::Node(
                Op::Dropout {
                    p,
                    active: training && p > 0.0,
                },
                vec![c.tensor(0, "input")?],
            ))
        }

        // Losses.
        "F.mse_loss" | "nn.MSELoss" => loss(c, LossKind::Mse, 2, 4),
        "F.smooth_l1_loss" => loss(
            c,
            LossKind::SmoothL1 {
                beta: c.f64_or(5, "beta", 1.0)?,
            },
            2,
            4,
        ),
        "nn.SmoothL1Loss" => loss(
            c,
            LossKind::SmoothL1 {
                beta: c.attr_f64("beta", 1.0),
            },
            2,
            0,
        ),
        "F.huber_loss" => loss(
            c,
            LossKind::Huber {
                delta: c.f64_or(3, "delta", 1.0)?,
            },
            2,
            2,
        ),
        "nn.HuberLoss" => loss(
            c,
            LossKind::Huber {
                delta: c.attr_f64("delta", 1.0),
            },
            2,
            0,
        ),
        "F.cross_entropy" | "nn.CrossEntropyLoss" => loss(c, LossKind::CrossEntropy, 2, 5),
        "F.hinge_embedding_loss" => loss(
            c,
            LossKind::Hinge {
                margin: c.f64_or(2, "margin", 1.0)?,
            },
            2,
            5,
        ),
        "nn.HingeEmbeddingLoss" => loss(
            c,
            LossKind::Hinge {
                margin: c.attr_f64("margin", 1.0),
            },
            2,
            0,
        ),
        "F.triplet_margin_loss" => loss(
            c,
            LossKind::TripletMargin {
                margin: c.f64_or(3, "margin", 1.0)?,
                p: c.f64_or(4, "p", 2.0)?,
            },
            3,
            9,
        ),
        "nn.TripletMarginLoss" => loss(
            c,
            LossKind::TripletMargin {
                margin: c.attr_f64("margin", 1.0),
                p: c.attr_f64("p", 2.0),
            },
            3,
            0,
        ),
        "F.kl_div" => loss(
            c,
            LossKind::KlDiv {
                log_target: c.bool_or(5, "log_target", false),
            },
            2,
            4,
        ),
        "nn.KLDivLoss" => loss(
            c,
            LossKind::KlDiv {
                log_target: c.attr_bool("log_target", false),
            },
            2,
            0,
        ),
        "F.cosine_embedding_loss" => loss(
            c,
            LossKind::Cosine {
                margin: c.f64_or(3, "margin", 0.0)?,
            },
            3,
            6,
        ),
        "nn.CosineEmbeddingLoss" => loss(
            c,
            LossKind::Cosine {
                margin: c.attr_f64("margin", 0.0),
            },
            3,
            0,
        ),

        // Attention and recurrent layers.
        "F.scaled_dot_product_attention" => {
            let mut inputs = vec![
                c.tensor(0, "query")?,
                c.tensor(1, "key")?,
                c.tensor(2, "value")?,
            ];
            let mask = c.opt_tensor(3, "attn_mask");
            inputs.extend(mask);
            if c.f64_or(4, "dropout_p", 0.0)? > 0.0 {
                return Err("attention dropout is not modelled".into());
            }
            Ok(Lowered::Node(
                Op::Attention(Attention {
                    causal: c.bool_or(5, "is_causal", false),
                    scale: c.opt_f64(6, "scale")?,
                    mask: mask.is_some(),
                }),
                inputs,
            ))
        }
        "nn.LSTM" | "lstm" => rnn(im, c, RnnCell::Lstm),
        "nn.GRU" | "gru" => rnn(im, c, RnnCell::Gru),
        "nn.RNN" | "rnn_tanh" => rnn(im, c, RnnCell::Tanh),
        "rnn_relu" => rnn(im, c, RnnCell::Relu),

        // Layout.
        "view" | "reshape" | "flatten" | "unflatten" | "squeeze" | "unsqueeze" | "view_as"
        | "reshape_as" | "ravel" | "nn.Flatten" | "nn.Unflatten" => {
            if let Some(v) = passthrough(im, c) {
                return Ok(Lowered::Alias(v));
            }
            Ok(Lowered::Node(
                Op::Layout(Layout::Reshape),
                vec![c.tensor(0, "input")?],
            ))
        }
        "transpose" | "swapaxes" | "swapdims" | "permute" | "t" => permute(im, c, key),
        "getattr" => {
            let attr = c.konst(1, "name").and_then(Value::as_str).unwrap_or("");
            // `torch.max(x, dim)` returns a named tuple (values, indices).
            if let Some(Val::Tuple(items)) = c.args.first() {
                let index = match attr {
                    "values" => 0,
                    "indices" => 1,
                    _ => return Err(format!("tuple attribute `{attr}` is not modelled")),
                };
                return items
                    .get(index)
                    .cloned()
                    .map(Lowered::Alias)
                    .ok_or_else(|| format!("tuple has no `{attr}`"));
            }
            permute(im, c, attr)
        }
        "expand" | "expand_as" | "broadcast_to" => Ok(Lowered::Node(
            Op::Layout(Layout::Expand),
            vec![c.tensor(0, "input")?],
        )),
        "contiguous" => {
            let x = c.tensor(0, "input")?;
            let strided = matches!(
                im.graph.node(x.node).op,
                Op::Layout(Layout::Permute { .. } | Layout::Expand | Layout::Slice { .. })
            );
            if strided {
                Ok(Lowered::Node(Op::Layout(Layout::Copy), vec![x]))
            } else {
                Ok(Lowered::Alias(Val::Tensor(x)))
            }
        }
        "clone" => Ok(Lowered::Node(
            Op::Layout(Layout::Copy),
            vec![c.tensor(0, "input")?],
        )),
        "detach" | "requires_grad" | "cuda" | "cpu" | "nn.Identity" => {
            Ok(Lowered::Alias(Val::Tensor(c.tensor(0, "input")?)))
        }
        "to" | "type" | "type_as" | "float" | "double" | "half" | "bfloat16" | "long" | "int"
        | "bool" => {
            if let Some(v) = passthrough(im, c) {
                return Ok(Lowered::Alias(v));
            }
            let to = c.out_tensor().ok_or("cast result is not a tensor")?.dtype;
            Ok(Lowered::Node(
                Op::Layout(Layout::Cast { to }),
                vec![c.tensor(0, "input")?],
            ))
        }
        "getitem" => getitem(c),
        "narrow" | "select" | "chunk" | "split" | "unbind" | "tensor_split" | "diagonal" => {
            let x = c.tensor(0, "input")?;
            let rest: Vec<String> = c.args[1..]
                .iter()
                .map(|v| match v {
                    Val::Const(v) => v.to_string(),
                    _ => "tensor".into(),
                })
                .chain(c.kwargs.iter().map(|(k, v)| match v {
                    Val::Const(v) => format!("{k}={v}"),
                    _ => format!("{k}=tensor"),
                }))
                .collect();
            Ok(Lowered::Node(
                Op::Layout(Layout::Slice {
                    subscript: format!("{key}({})", rest.join(", ")),
                }),
                vec![x],
            ))
        }
        "cat" | "concat" | "concatenate" | "stack" => {
            let inputs = tensors_arg(c)?;
            let rank = c.out_tensor().ok_or("result is not a tensor")?.rank();
            let dim = norm_dim(c.ints(1, "dim")?.map_or(0, |d| d[0]), rank)?;
            let layout = if key == "stack" {
                Layout::Stack { dim }
            } else {
                Layout::Concat { dim }
            };
            Ok(Lowered::Node(Op::Layout(layout), inputs))
        }
        "flip" => {
            let x = c.tensor(0, "input")?;
            let dims = norm_dims(
                &c.ints(1, "dims")?.ok_or("flip without dims")?,
                rank_of(im, x),
            )?;
            Ok(Lowered::Node(Op::Layout(Layout::Flip { dims }), vec![x]))
        }
        "roll" => {
            let x = c.tensor(0, "input")?;
            let shifts = c.ints(1, "shifts")?.ok_or("roll without shifts")?;
            let dims = match c.ints(2, "dims")? {
                Some(d) => d
                    .iter()
                    .map(|&d| norm_dim(d, rank_of(im, x)))
                    .collect::<Result<_, _>>()?,
                None => vec![],
            };
            Ok(Lowered::Node(
                Op::Layout(Layout::Roll { shifts, dims }),
                vec![x],
            ))
        }
        "F.pad" => {
            let x = c.tensor(0, "input")?;
            let mode = c
                .konst(2, "mode")
                .and_then(Value::as_str)
                .unwrap_or("constant");
            if mode != "constant" {
                return Err(format!("`{mode}` padding is not modelled"));
            }
            let pads = c.ints(1, "pad")?.ok_or("pad without sizes")?;
            Ok(Lowered::Node(Op::Layout(Layout::Pad { pads }), vec![x]))
        }
        "repeat" | "tile" | "repeat_interleave" => Ok(Lowered::Node(
            Op::Layout(Layout::Repeat),
            vec![c.tensor(0, "input")?],
        )),
        "diag" | "diag_embed" => {
            let x = c.tensor(0, "input")?;
            if rank_of(im, x) == 1 || key == "diag_embed" {
                Ok(Lowered::Node(Op::Layout(Layout::DiagEmbed), vec![x]))
            } else {
                Ok(Lowered::Node(
                    Op::Layout(Layout::Slice {
                        subscript: "diag()".into(),
                    }),
                    vec![x],
                ))
            }
        }
        "masked_fill" => {
            let x = c.tensor(0, "input")?;
            let mask = c.tensor(1, "mask")?;
            match c.arg(2, "value") {
                Some(Val::Const(v)) => Ok(Lowered::Node(
                    Op::Where {
                        fill: Some(num(v).ok_or("fill value is not a number")?),
                    },
                    vec![x, mask],
                )),
                Some(Val::Tensor(v)) => {
                    Ok(Lowered::Node(Op::Where { fill: None }, vec![mask, *v, x]))
                }
                _ => Err("masked_fill without a value".into()),
            }
        }
        "where" => {
            let mut inputs = Vec::new();
            for i in 0..3 {
                if let Some(Val::Tensor(t)) = c.args.get(i) {
                    inputs.push(*t);
                }
            }
            if inputs.len() != 3 {
                return Err("where with scalar operands is not modelled".into());
            }
            Ok(Lowered::Node(Op::Where { fill: None }, inputs))
        }
        "triu" | "tril" => Ok(Lowered::Node(
            Op::Triangular {
                upper: key == "triu",
                diagonal: c.ints(1, "diagonal")?.map_or(0, |d| d[0]),
            },
            vec![c.tensor(0, "input")?],
        )),

        // Tensors created in forward.
        "zeros" | "zeros_like" | "new_zeros" | "empty" | "empty_like" | "new_empty" => {
            constant(Fill::Full(0.0))
        }
        "ones" | "ones_like" | "new_ones" => constant(Fill::Full(1.0)),
        "full" | "full_like" | "new_full" => {
            let v = c
                .konst(1, "fill_value")
                .and_then(num)
                .ok_or("fill value is not a number")?;
            constant(Fill::Full(v))
        }
        // Drawn from torch's global generator on the inputs' device (a
        // `device=` the call names, or a `_like` tensor's), the numbers a
        // program draws the same way, in the same order, are the Model's.
        // Drawn on the default device, they are not rendered.
        "randn" | "randn_like" if same_generator(c) => constant(Fill::RandomNormal),
        "rand" | "rand_like" if same_generator(c) => constant(Fill::RandomUniform),
        "randn" | "rand" | "randn_like" | "rand_like" | "randint" | "normal" => {
            constant(Fill::Random)
        }
        "arange" => constant(Fill::Arange),
        // A number is a full tensor of no dims; a list stays a literal.
        "tensor" | "as_tensor" => match c.konst(0, "data").and_then(num) {
            Some(v) => constant(Fill::Full(v)),
            None => constant(Fill::Literal),
        },

        _ => Err(format!("`{key}` is not in the op vocabulary")),
    }
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

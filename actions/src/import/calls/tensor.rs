//! Calls on tensors: pointwise arithmetic and activations, reductions,
//! layouts and views, indexing, and constants.

use serde_json::Value;

use crate::graph::TensorRef;
use crate::import::{Importer, Val};
use crate::op::{BinaryOp, Fill, Layout, Op, Reduce, ReduceOp, UnaryOp};

use super::{Call, Lower, Lowered, norm_dim, norm_dims, num};

pub(super) fn unary(c: &Call, op: UnaryOp) -> Lower {
    Ok(Lowered::Node(Op::Unary(op), vec![c.tensor(0, "input")?]))
}

/// `clamp` and its one-sided forms, each bound at its position: numbers
/// are one clamp; a tensor bound (alone) is the elementwise maximum with
/// it (`min`) or the minimum (`max`).
pub(super) fn clamp(c: &Call, min: Option<usize>, max: Option<usize>) -> Lower {
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

pub(super) fn binary(c: &Call, op: BinaryOp, reflected: bool) -> Lower {
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

pub(super) fn rank_of(im: &Importer, t: TensorRef) -> usize {
    im.graph.tensor(t).rank()
}

pub(super) fn reduce(im: &Importer, c: &Call, op: ReduceOp) -> Lower {
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
pub(super) fn extremum(im: &Importer, c: &Call, max: bool) -> Lower {
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

pub(super) fn permute(im: &Importer, c: &Call, how: &str) -> Lower {
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

pub(super) fn subscript(v: &Value) -> String {
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

pub(super) fn getitem(c: &Call) -> Lower {
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

/// Whether a random call draws from the global generator of the device
/// its tensor-valued arguments live on: no generator of its own, and a
/// `device=` or a tensor to be like.
pub(super) fn same_generator(c: &Call) -> bool {
    let own = !matches!(
        c.kwargs.get("generator"),
        None | Some(Val::Const(Value::Null))
    );
    !own && (c.kwargs.contains_key("device") || c.key.ends_with("_like"))
}

pub(super) fn constant(fill: Fill) -> Lower {
    Ok(Lowered::Node(Op::Constant { fill }, vec![]))
}

pub(super) fn tensors_arg(c: &Call) -> Result<Vec<TensorRef>, String> {
    let mut out = Vec::new();
    c.arg(0, "tensors")
        .ok_or("missing tensors")?
        .tensors(&mut out);
    Ok(out)
}

/// Same type in and out: the call returns its input unchanged.
pub(super) fn passthrough(im: &Importer, c: &Call) -> Option<Val> {
    let x = c.opt_tensor(0, "input")?;
    let out = c.out_tensor()?;
    (im.graph.tensor(x) == &out).then_some(Val::Tensor(x))
}

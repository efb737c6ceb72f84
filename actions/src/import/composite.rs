//! Composite `nn` modules expanded into the ops they compute:
//! `MultiheadAttention` and `TransformerEncoderLayer`; and
//! `F.cosine_similarity`, as torch computes it.
//!
//! An expansion first checks everything it relies on (ranks, head split,
//! parameters, no masks) and that the types it predicts equal the traced
//! ones; only then does it add nodes. When a check fails the module is kept
//! as an opaque node by the caller, never approximated.

use std::collections::BTreeMap;

use serde_json::Value;

use super::{Importer, TraceNode, Val};
use crate::dtype::TensorType;
use crate::graph::TensorRef;
use crate::op::{
    Attention, BinaryOp, Layout, MatMul, Norm, NormKind, Op, Reduce, ReduceOp, UnaryOp,
};

/// Expands `node` when it is a known composite module; `None` otherwise.
pub(super) fn expand(
    im: &mut Importer,
    node: &TraceNode,
    args: &[Val],
    kwargs: &BTreeMap<String, Val>,
    params: &BTreeMap<String, TensorRef>,
) -> Option<Result<Val, String>> {
    if node.op == "function"
        && matches!(
            node.target.as_str(),
            "torch.nn.functional.cosine_similarity" | "torch.cosine_similarity"
        )
    {
        return Some(cosine_similarity(im, node, args, kwargs));
    }
    let module = node.module.as_deref()?;
    let training = node.training.unwrap_or(true);
    Some(match module {
        "MultiheadAttention" => multihead(im, node, args, kwargs, params, training),
        "TransformerEncoderLayer" => encoder_layer(im, node, args, kwargs, params, training),
        _ => return None,
    })
}

fn tensor_arg(
    args: &[Val],
    kwargs: &BTreeMap<String, Val>,
    i: usize,
    name: &str,
) -> Result<TensorRef, String> {
    match kwargs.get(name).or_else(|| args.get(i)) {
        Some(Val::Tensor(t)) => Ok(*t),
        _ => Err(format!("argument `{name}` is not a tensor")),
    }
}

fn no_tensor_kwargs(kwargs: &BTreeMap<String, Val>, names: &[&str]) -> Result<(), String> {
    for n in names {
        if let Some(Val::Tensor(_)) = kwargs.get(*n) {
            return Err(format!("`{n}` is not modelled in the expansion"));
        }
    }
    Ok(())
}

fn attr_u64(attrs: &BTreeMap<String, Value>, name: &str) -> Result<u64, String> {
    attrs
        .get(name)
        .and_then(Value::as_u64)
        .ok_or_else(|| format!("no `{name}`"))
}

fn attr_f64(attrs: &BTreeMap<String, Value>, name: &str, default: f64) -> f64 {
    attrs.get(name).and_then(Value::as_f64).unwrap_or(default)
}

fn attr_bool(attrs: &BTreeMap<String, Value>, name: &str) -> bool {
    attrs.get(name).and_then(Value::as_bool).unwrap_or(false)
}

/// The shape of one multi-head attention, checked before any node is added.
struct MhaPlan {
    embed: u64,
    heads: u64,
    batch_first: bool,
    dropout: f64,
    /// (batch, target length, source length)
    n: u64,
    l: u64,
    s: u64,
    weights: Option<bool>,
    in_w: TensorRef,
    in_b: Option<TensorRef>,
    out_w: TensorRef,
    out_b: Option<TensorRef>,
}

impl MhaPlan {
    #[allow(clippy::too_many_arguments)]
    fn new(
        im: &Importer,
        attrs: &BTreeMap<String, Value>,
        params: &BTreeMap<String, TensorRef>,
        prefix: &str,
        q: TensorRef,
        k: TensorRef,
        weights: Option<bool>,
    ) -> Result<MhaPlan, String> {
        let embed = attr_u64(attrs, "embed_dim")?;
        let heads = attr_u64(attrs, "num_heads")?;
        if heads == 0 || embed % heads != 0 {
            return Err(format!(
                "embed_dim {embed} does not split into {heads} heads"
            ));
        }
        for (name, expected) in [("kdim", embed), ("vdim", embed)] {
            if attrs
                .get(name)
                .and_then(Value::as_u64)
                .is_some_and(|d| d != expected)
            {
                return Err(format!("`{name}` differs from embed_dim"));
            }
        }
        if attr_bool(attrs, "add_zero_attn") || attrs.get("bias_k").is_some_and(|v| !v.is_null()) {
            return Err("add_zero_attn and bias_k/bias_v are not modelled".into());
        }
        let batch_first = attr_bool(attrs, "batch_first");
        let (tq, tk) = (im.graph.tensor(q), im.graph.tensor(k));
        if tq.rank() != 3 || tk.rank() != 3 || tq.shape[2] != embed || tk.shape[2] != embed {
            return Err("only batched (3-d) inputs of width embed_dim are modelled".into());
        }
        let (n, l, s) = if batch_first {
            (tq.shape[0], tq.shape[1], tk.shape[1])
        } else {
            (tq.shape[1], tq.shape[0], tk.shape[0])
        };
        let p = |name: &str| params.get(&format!("{prefix}{name}")).copied();
        Ok(MhaPlan {
            embed,
            heads,
            batch_first,
            dropout: attr_f64(attrs, "dropout", 0.0),
            n,
            l,
            s,
            weights,
            in_w: p("in_proj_weight")
                .ok_or("separate q/k/v projection weights are not modelled")?,
            in_b: p("in_proj_bias"),
            out_w: p("out_proj.weight").ok_or("no out_proj.weight")?,
            out_b: p("out_proj.bias"),
        })
    }

    fn seq(&self, len: u64) -> Vec<u64> {
        if self.batch_first {
            vec![self.n, len, self.embed]
        } else {
            vec![len, self.n, self.embed]
        }
    }

    /// Result types: the attention output and, when asked for, the weights
    /// (averaged over heads or per head).
    fn types(&self, like: &TensorType) -> Vec<TensorType> {
        let mut out = vec![TensorType::new(self.seq(self.l), like.dtype)];
        match self.weights {
            Some(true) => out.push(TensorType::new(vec![self.n, self.l, self.s], like.dtype)),
            Some(false) => out.push(TensorType::new(
                vec![self.n, self.heads, self.l, self.s],
                like.dtype,
            )),
            None => {}
        }
        out
    }
}

/// Adds nodes named after the module, with types given explicitly.
struct Builder<'a> {
    im: &'a mut Importer,
    prefix: String,
}

impl Builder<'_> {
    fn add(&mut self, step: &str, op: Op, inputs: &[TensorRef], shape: Vec<u64>) -> TensorRef {
        let dtype = self.im.graph.tensor(inputs[0]).dtype;
        let id = self
            .im
            .graph
            .add(
                format!("{}.{step}", self.prefix),
                op,
                inputs,
                vec![TensorType::new(shape, dtype)],
            )
            .expect("inputs are outputs of this graph");
        TensorRef::first(id)
    }

    fn shape(&self, t: TensorRef) -> Vec<u64> {
        self.im.graph.tensor(t).shape.clone()
    }

    fn linear(
        &mut self,
        step: &str,
        x: TensorRef,
        w: TensorRef,
        b: Option<TensorRef>,
    ) -> TensorRef {
        let mut shape = self.shape(x);
        *shape.last_mut().expect("rank checked") = self.shape(w)[0];
        let mut inputs = vec![x, w];
        inputs.extend(b);
        let op = Op::MatMul(MatMul {
            trans_a: false,
            trans_b: true,
            bias: b.is_some(),
        });
        self.add(step, op, &inputs, shape)
    }

    fn slice(&mut self, step: &str, t: TensorRef, start: u64, end: u64) -> TensorRef {
        let mut shape = self.shape(t);
        shape[0] = end - start;
        self.add(
            step,
            Op::Layout(Layout::Slice {
                subscript: format!("[{start}:{end}]"),
            }),
            &[t],
            shape,
        )
    }

    fn permute(&mut self, step: &str, t: TensorRef, perm: Vec<usize>) -> TensorRef {
        let from = self.shape(t);
        let shape = perm.iter().map(|&p| from[p]).collect();
        self.add(step, Op::Layout(Layout::Permute { perm }), &[t], shape)
    }

    fn dropout(&mut self, step: &str, t: TensorRef, p: f64, training: bool) -> TensorRef {
        if training && p > 0.0 {
            let shape = self.shape(t);
            self.add(step, Op::Dropout { p, active: true }, &[t], shape)
        } else {
            t
        }
    }

    /// [seq…, E] → [N, H, len, D]
    fn split_heads(&mut self, step: &str, t: TensorRef, plan: &MhaPlan, len: u64) -> TensorRef {
        let d = plan.embed / plan.heads;
        let (shape, perm) = if plan.batch_first {
            (vec![plan.n, len, plan.heads, d], vec![0, 2, 1, 3])
        } else {
            (vec![len, plan.n, plan.heads, d], vec![1, 2, 0, 3])
        };
        let r = self.add(
            &format!("{step}_heads"),
            Op::Layout(Layout::Reshape),
            &[t],
            shape,
        );
        self.permute(&format!("{step}_bhld"), r, perm)
    }

    /// The whole attention block; returns the output and the weights if asked.
    fn multihead(
        &mut self,
        plan: &MhaPlan,
        q: TensorRef,
        k: TensorRef,
        v: TensorRef,
        training: bool,
    ) -> (TensorRef, Option<TensorRef>) {
        let e = plan.embed;
        let (wq, wk, wv) = (
            self.slice("w_q", plan.in_w, 0, e),
            self.slice("w_k", plan.in_w, e, 2 * e),
            self.slice("w_v", plan.in_w, 2 * e, 3 * e),
        );
        let (bq, bk, bv) = match plan.in_b {
            Some(b) => (
                Some(self.slice("b_q", b, 0, e)),
                Some(self.slice("b_k", b, e, 2 * e)),
                Some(self.slice("b_v", b, 2 * e, 3 * e)),
            ),
            None => (None, None, None),
        };
        let q = self.linear("q_proj", q, wq, bq);
        let k = self.linear("k_proj", k, wk, bk);
        let v = self.linear("v_proj", v, wv, bv);
        let q = self.split_heads("q", q, plan, plan.l);
        let k = self.split_heads("k", k, plan, plan.s);
        let v = self.split_heads("v", v, plan, plan.s);
        let d = e / plan.heads;
        let (n, h, l, s) = (plan.n, plan.heads, plan.l, plan.s);
        let (o, weights) = match plan.weights {
            // Weights asked for: torch takes the explicit path.
            Some(average) => {
                let scale = 1.0 / (d as f64).sqrt();
                let qs = self.add(
                    "q_scaled",
                    Op::Scalar {
                        op: BinaryOp::Mul,
                        value: scale,
                        scalar_first: false,
                    },
                    &[q],
                    vec![n, h, l, d],
                );
                let scores = self.add(
                    "scores",
                    Op::MatMul(MatMul {
                        trans_a: false,
                        trans_b: true,
                        bias: false,
                    }),
                    &[qs, k],
                    vec![n, h, l, s],
                );
                let probs = self.add(
                    "softmax",
                    Op::Softmax { dim: 3, log: false },
                    &[scores],
                    vec![n, h, l, s],
                );
                let dropped = self.dropout("attn_dropout", probs, plan.dropout, training);
                let o = self.add(
                    "context",
                    Op::MatMul(MatMul {
                        trans_a: false,
                        trans_b: false,
                        bias: false,
                    }),
                    &[dropped, v],
                    vec![n, h, l, d],
                );
                let w = if average {
                    self.add(
                        "weights",
                        Op::Reduce(Reduce {
                            op: ReduceOp::Mean,
                            dims: vec![1],
                            keepdim: false,
                        }),
                        &[probs],
                        vec![n, l, s],
                    )
                } else {
                    probs
                };
                (o, Some(w))
            }
            None => {
                let o = self.add(
                    "attention",
                    Op::Attention(Attention {
                        causal: false,
                        scale: None,
                        mask: false,
                    }),
                    &[q, k, v],
                    vec![n, h, l, d],
                );
                (
                    self.dropout("attn_dropout", o, plan.dropout, training),
                    None,
                )
            }
        };
        let (perm, merged) = if plan.batch_first {
            (vec![0, 2, 1, 3], vec![n, l, e])
        } else {
            (vec![2, 0, 1, 3], vec![l, n, e])
        };
        let o = self.permute("merge_heads", o, perm);
        let o = self.add("merged", Op::Layout(Layout::Reshape), &[o], merged);
        let out = self.linear("out_proj", o, plan.out_w, plan.out_b);
        (out, weights)
    }
}

fn kw_bool(
    kwargs: &BTreeMap<String, Val>,
    args: &[Val],
    i: usize,
    name: &str,
    default: bool,
) -> bool {
    match kwargs.get(name).or_else(|| args.get(i)) {
        Some(Val::Const(Value::Bool(b))) => *b,
        _ => default,
    }
}

/// `cosine_similarity(x1, x2, dim, eps)` as torch computes it: each input
/// divided by its L2 norm along `dim` (at least `eps`), the quotients
/// multiplied and summed along `dim`. Inputs of one shape only.
fn cosine_similarity(
    im: &mut Importer,
    node: &TraceNode,
    args: &[Val],
    kwargs: &BTreeMap<String, Val>,
) -> Result<Val, String> {
    let x1 = tensor_arg(args, kwargs, 0, "x1")?;
    let x2 = tensor_arg(args, kwargs, 1, "x2")?;
    let number = |i: usize, name: &str| match kwargs.get(name).or_else(|| args.get(i)) {
        None => Ok(None),
        Some(Val::Const(v)) => v
            .as_f64()
            .map(Some)
            .ok_or_else(|| format!("`{name}` is not a number")),
        Some(_) => Err(format!("`{name}` is not a constant")),
    };
    let shape = im.graph.tensor(x1).shape.clone();
    if im.graph.tensor(x2) != im.graph.tensor(x1) || shape.is_empty() {
        return Err("inputs of different shapes (broadcast) are not modelled".into());
    }
    let rank = shape.len() as i64;
    let dim = number(2, "dim")?.unwrap_or(1.0) as i64;
    if !(-rank..rank).contains(&dim) {
        return Err(format!("dim {dim} is out of range"));
    }
    let dim = dim.rem_euclid(rank) as usize;
    let eps = number(3, "eps")?.unwrap_or(1e-8);
    let mut kept = shape.clone();
    kept[dim] = 1;
    let mut out = shape.clone();
    out.remove(dim);
    let dtype = im.graph.tensor(x1).dtype;
    if traced_types(im, &node.out)? != [TensorType::new(out.clone(), dtype)] {
        return Err("the expansion's types differ from the traced ones".into());
    }
    let mut b = Builder {
        im,
        prefix: node.name.clone(),
    };
    let unit = |b: &mut Builder, k: usize, x: TensorRef| {
        let norm = Op::Reduce(Reduce {
            op: ReduceOp::Norm { p: 2.0 },
            dims: vec![dim],
            keepdim: true,
        });
        let n = b.add(&format!("norm{k}"), norm, &[x], kept.clone());
        let clamp = Op::Unary(UnaryOp::Clamp {
            min: Some(eps),
            max: None,
        });
        let n = b.add(&format!("clamp{k}"), clamp, &[n], kept.clone());
        b.add(
            &format!("unit{k}"),
            Op::Binary(BinaryOp::Div),
            &[x, n],
            shape.clone(),
        )
    };
    let u1 = unit(&mut b, 1, x1);
    let u2 = unit(&mut b, 2, x2);
    let product = b.add(
        "product",
        Op::Binary(BinaryOp::Mul),
        &[u1, u2],
        shape.clone(),
    );
    let sum = Op::Reduce(Reduce {
        op: ReduceOp::Sum,
        dims: vec![dim],
        keepdim: false,
    });
    Ok(Val::Tensor(b.add("sum", sum, &[product], out)))
}

fn traced_types(im: &Importer, out: &Value) -> Result<Vec<TensorType>, String> {
    let mut flat = Vec::new();
    im.out_shape(out, &mut flat).map_err(|e| e.to_string())?;
    Ok(flat)
}

fn multihead(
    im: &mut Importer,
    node: &TraceNode,
    args: &[Val],
    kwargs: &BTreeMap<String, Val>,
    params: &BTreeMap<String, TensorRef>,
    training: bool,
) -> Result<Val, String> {
    let q = tensor_arg(args, kwargs, 0, "query")?;
    let k = tensor_arg(args, kwargs, 1, "key")?;
    let v = tensor_arg(args, kwargs, 2, "value")?;
    no_tensor_kwargs(kwargs, &["key_padding_mask", "attn_mask"])?;
    if matches!(args.get(3), Some(Val::Tensor(_))) || matches!(args.get(5), Some(Val::Tensor(_))) {
        return Err("attention masks are not modelled".into());
    }
    if kw_bool(kwargs, args, 7, "is_causal", false) {
        return Err("causal attention through the module is not modelled".into());
    }
    let weights = kw_bool(kwargs, args, 4, "need_weights", true)
        .then(|| kw_bool(kwargs, args, 6, "average_attn_weights", true));
    let plan = MhaPlan::new(im, &node.attrs, params, "", q, k, weights)?;
    if im.graph.tensor(v) != im.graph.tensor(k) {
        return Err("value and key shapes differ".into());
    }
    let predicted = plan.types(im.graph.tensor(q));
    if traced_types(im, &node.out)? != predicted {
        return Err("the expansion's types differ from the traced ones".into());
    }
    let mut b = Builder {
        im,
        prefix: node.name.clone(),
    };
    let (out, w) = b.multihead(&plan, q, k, v, training);
    Ok(Val::Tuple(vec![
        Val::Tensor(out),
        w.map_or(Val::Const(Value::Null), Val::Tensor),
    ]))
}

fn encoder_layer(
    im: &mut Importer,
    node: &TraceNode,
    args: &[Val],
    kwargs: &BTreeMap<String, Val>,
    params: &BTreeMap<String, TensorRef>,
    training: bool,
) -> Result<Val, String> {
    let x = tensor_arg(args, kwargs, 0, "src")?;
    no_tensor_kwargs(kwargs, &["src_mask", "src_key_padding_mask"])?;
    if args.iter().skip(1).any(|a| matches!(a, Val::Tensor(_))) {
        return Err("masks are not modelled".into());
    }
    let children = &node.children;
    let child = |name: &str| {
        children
            .get(name)
            .map(|c| &c.attrs)
            .ok_or_else(|| format!("no child module `{name}`"))
    };
    let activation = match node
        .attrs
        .get("activation_relu_or_gelu")
        .and_then(Value::as_u64)
    {
        Some(1) => UnaryOp::Relu,
        Some(2) => UnaryOp::Gelu { tanh: false },
        _ => return Err("a custom activation is not modelled".into()),
    };
    let norm_first = attr_bool(&node.attrs, "norm_first");
    let plan = MhaPlan::new(im, child("self_attn")?, params, "self_attn.", x, x, None)?;
    let p = |name: &str| {
        params
            .get(name)
            .copied()
            .ok_or_else(|| format!("no parameter `{name}`"))
    };
    let (w1, w2) = (p("linear1.weight")?, p("linear2.weight")?);
    let (b1, b2) = (
        params.get("linear1.bias").copied(),
        params.get("linear2.bias").copied(),
    );
    let norms = [
        (
            p("norm1.weight")?,
            params.get("norm1.bias").copied(),
            attr_f64(child("norm1")?, "eps", 1e-5),
        ),
        (
            p("norm2.weight")?,
            params.get("norm2.bias").copied(),
            attr_f64(child("norm2")?, "eps", 1e-5),
        ),
    ];
    let drop = |name: &str| child(name).map(|a| attr_f64(a, "p", 0.0));
    let (p_ff, p1, p2) = (drop("dropout")?, drop("dropout1")?, drop("dropout2")?);
    let xt = im.graph.tensor(x).clone();
    if traced_types(im, &node.out)? != vec![xt.clone()] {
        return Err("the expansion's types differ from the traced ones".into());
    }
    let mut b = Builder {
        im,
        prefix: node.name.clone(),
    };
    let norm = |b: &mut Builder,
                step: &str,
                t: TensorRef,
                (w, bias, eps): (TensorRef, Option<TensorRef>, f64)| {
        let mut inputs = vec![t, w];
        inputs.extend(bias);
        let op = Op::Norm(Norm {
            kind: NormKind::Layer { dims: 1 },
            eps,
            affine: true,
            bias: bias.is_some(),
            batch_stats: true,
        });
        b.add(step, op, &inputs, xt.shape.clone())
    };
    let self_attention = |b: &mut Builder, t: TensorRef| {
        let (o, _) = b.multihead(&plan, t, t, t, training);
        b.dropout("dropout1", o, p1, training)
    };
    let feed_forward = |b: &mut Builder, t: TensorRef| {
        let h = b.linear("linear1", t, w1, b1);
        let shape = b.shape(h);
        let h = b.add("activation", Op::Unary(activation.clone()), &[h], shape);
        let h = b.dropout("dropout", h, p_ff, training);
        let o = b.linear("linear2", h, w2, b2);
        b.dropout("dropout2", o, p2, training)
    };
    let add = |b: &mut Builder, step: &str, a: TensorRef, c: TensorRef| {
        b.add(step, Op::Binary(BinaryOp::Add), &[a, c], xt.shape.clone())
    };
    let out = if norm_first {
        let n1 = norm(&mut b, "norm1", x, norms[0]);
        let sa = self_attention(&mut b, n1);
        let x1 = add(&mut b, "residual1", x, sa);
        let n2 = norm(&mut b, "norm2", x1, norms[1]);
        let ff = feed_forward(&mut b, n2);
        add(&mut b, "residual2", x1, ff)
    } else {
        let sa = self_attention(&mut b, x);
        let r1 = add(&mut b, "residual1", x, sa);
        let x1 = norm(&mut b, "norm1", r1, norms[0]);
        let ff = feed_forward(&mut b, x1);
        let r2 = add(&mut b, "residual2", x1, ff);
        norm(&mut b, "norm2", r2, norms[1])
    };
    Ok(Val::Tensor(out))
}

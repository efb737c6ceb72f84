//! The ops no fragment covers, written as torch calls (the call-library
//! action): matrix products, convolutions, attention and RNNs by their
//! functional form, every other op by its torch spelling, and the Python
//! literals they take.

use mtmc_actions::op::{CallArg, CallKind, Conv, MatMul, Op, OpaqueCall, Rnn, RnnCell};

use super::{channels_last_views, torch_dtype};

/// A Python tuple literal (`()` for a scalar's shape).
pub(super) fn tuple(v: &[u64]) -> String {
    if v.is_empty() {
        return "()".into();
    }
    let items: Vec<String> = v.iter().map(u64::to_string).collect();
    format!("({},)", items.join(", "))
}

/// The torch expression computing `op` from `ins` (Python names).
pub(super) fn torch_call(
    op: &Op,
    ins: &[String],
    out: &mtmc_actions::dtype::TensorType,
) -> Option<String> {
    Some(match op {
        Op::MatMul(MatMul {
            trans_a,
            trans_b,
            bias,
        }) => {
            if !trans_a && *trans_b && *bias {
                format!("F.linear({}, {}, {})", ins[0], ins[1], ins[2])
            } else {
                let a = if *trans_a {
                    format!("{}.mT", ins[0])
                } else {
                    ins[0].clone()
                };
                let b = if *trans_b {
                    format!("{}.mT", ins[1])
                } else {
                    ins[1].clone()
                };
                if *bias {
                    format!("(torch.matmul({a}, {b}) + {})", ins[2])
                } else {
                    format!("torch.matmul({a}, {b})")
                }
            }
        }
        Op::Conv(Conv {
            spatial,
            transposed,
            stride,
            padding,
            dilation,
            output_padding,
            groups,
            bias,
            ..
        }) => {
            let b = if *bias { ins[2].clone() } else { "None".into() };
            if *transposed {
                format!(
                    "F.conv_transpose{spatial}d({}, {}, {b}, {}, {}, {}, {groups}, {})",
                    ins[0],
                    ins[1],
                    tuple(stride),
                    tuple(padding),
                    tuple(output_padding),
                    tuple(dilation)
                )
            } else {
                format!(
                    "F.conv{spatial}d({}, {}, {b}, {}, {}, {}, {groups})",
                    ins[0],
                    ins[1],
                    tuple(stride),
                    tuple(padding),
                    tuple(dilation)
                )
            }
        }
        Op::Attention(a) => {
            let mut call = format!(
                "F.scaled_dot_product_attention({}, {}, {}",
                ins[0], ins[1], ins[2]
            );
            if a.mask {
                call += &format!(", attn_mask={}", ins[3]);
            }
            if a.causal {
                call += ", is_causal=True";
            }
            if let Some(scale) = a.scale {
                call += &format!(", scale={scale:e}");
            }
            call + ")"
        }
        Op::Opaque { call: Some(c), .. } => opaque_call(c, ins)?,
        other => return torch_fallback(other, ins, out),
    })
}

/// A call the op vocabulary does not model, made again as the problem's
/// code made it: a submodule of the problem's own model (the `ModelNew`
/// holds it, with its parameters), a torch function, or a method of its
/// first argument. `None` where an argument has no Python spelling here
/// (a device, a tensor no traced op produced) or a function is not torch's.
pub(super) fn opaque_call(c: &OpaqueCall, ins: &[String]) -> Option<String> {
    let arg = |a: &CallArg| call_arg(a, ins);
    let mut args: Vec<String> = c.args.iter().map(arg).collect::<Option<_>>()?;
    for (k, a) in &c.kwargs {
        args.push(format!("{k}={}", arg(a)?));
    }
    let ident = |s: &str| {
        !s.is_empty()
            && s.split('.').all(|part| {
                part.chars()
                    .all(|ch| ch.is_ascii_alphanumeric() || ch == '_')
                    && !part.is_empty()
            })
    };
    if !ident(&c.target) {
        return None;
    }
    Some(match c.kind {
        CallKind::Module => format!(
            "self.reference_parameters.get_submodule({:?})({})",
            c.target,
            args.join(", ")
        ),
        CallKind::Function if c.target.starts_with("torch.") => {
            format!("{}({})", c.target, args.join(", "))
        }
        CallKind::Function => return None,
        CallKind::Method => {
            let (this, rest) = args.split_first()?;
            format!("{this}.{}({})", c.target, rest.join(", "))
        }
    })
}

/// An argument of an [`OpaqueCall`] in Python.
fn call_arg(a: &CallArg, ins: &[String]) -> Option<String> {
    match a {
        CallArg::Input(k) => ins.get(*k).cloned(),
        CallArg::Tuple(items) => {
            let items: Vec<String> = items
                .iter()
                .map(|a| call_arg(a, ins))
                .collect::<Option<_>>()?;
            Some(python_tuple(&items))
        }
        CallArg::Const(v) => python_const(v),
    }
}

/// A constant the trace encoded (`trace_graph.py`'s `encode`) in Python.
fn python_const(v: &serde_json::Value) -> Option<String> {
    use serde_json::Value;
    Some(match v {
        Value::Null => "None".into(),
        Value::Bool(b) => if *b { "True" } else { "False" }.into(),
        Value::Number(n) if n.is_i64() || n.is_u64() => n.to_string(),
        Value::Number(n) => py(n.as_f64()?),
        Value::String(s) => serde_json::to_string(s).ok()?,
        Value::Array(items) => {
            let items: Vec<String> = items.iter().map(python_const).collect::<Option<_>>()?;
            python_tuple(&items)
        }
        Value::Object(o) => {
            let (key, inner) = o.iter().next().filter(|_| o.len() == 1)?;
            match (key.as_str(), inner) {
                ("float", Value::String(f)) => match f.as_str() {
                    "inf" => "float('inf')".into(),
                    "-inf" => "float('-inf')".into(),
                    "nan" => "float('nan')".into(),
                    _ => return None,
                },
                ("dtype", Value::String(d)) if d.chars().all(|c| c.is_ascii_alphanumeric()) => {
                    format!("torch.{d}")
                }
                ("ellipsis", _) => "...".into(),
                ("slice", Value::Array(parts)) if parts.len() == 3 => {
                    let parts: Vec<String> =
                        parts.iter().map(python_const).collect::<Option<_>>()?;
                    format!("slice({})", parts.join(", "))
                }
                ("dict", Value::Object(d)) => {
                    let items: Vec<String> = d
                        .iter()
                        .map(|(k, v)| {
                            Some(format!(
                                "{}: {}",
                                serde_json::to_string(k).ok()?,
                                python_const(v)?
                            ))
                        })
                        .collect::<Option<_>>()?;
                    format!("{{{}}}", items.join(", "))
                }
                _ => return None,
            }
        }
    })
}

/// A Python tuple of these items (one item keeps its comma).
fn python_tuple(items: &[String]) -> String {
    match items {
        [one] => format!("({one},)"),
        _ => format!("({})", items.join(", ")),
    }
}

/// A Python float literal.
pub(super) fn py(v: f64) -> String {
    if v.is_finite() {
        format!("{v:e}")
    } else if v.is_nan() {
        "float('nan')".into()
    } else if v > 0.0 {
        "float('inf')".into()
    } else {
        "float('-inf')".into()
    }
}

/// A Python list of integers.
fn int_list(v: &[i64]) -> String {
    let items: Vec<String> = v.iter().map(i64::to_string).collect();
    format!("[{}]", items.join(", "))
}

/// A Python tuple of dims.
pub(super) fn dims_tuple(d: &[usize]) -> String {
    tuple(&d.iter().map(|&x| x as u64).collect::<Vec<_>>())
}

/// The torch expression for an op the call-library action keeps as a
/// torch call when no kernel is written for it (the whole program as
/// library calls, reported as such).
fn torch_fallback(
    op: &Op,
    ins: &[String],
    out: &mtmc_actions::dtype::TensorType,
) -> Option<String> {
    use mtmc_actions::op::{
        AdaptivePool, BinaryOp as B, Layout, Loss, LossKind, Norm, NormKind, Pool, Reduce,
        ReduceOp as R, Reduction, Scan, UnaryOp as U,
    };
    if let Op::Constant { fill } = op {
        use mtmc_actions::op::Fill;
        let (shape, dtype) = (tuple(&out.shape), torch_dtype(out.dtype).ok()?);
        return match fill {
            Fill::Full(v) => Some(format!(
                "torch.full({shape}, {}, dtype=torch.{dtype}, device=_device)",
                py(*v)
            )),
            Fill::RandomNormal => Some(format!(
                "torch.randn({shape}, dtype=torch.{dtype}, device=_device)"
            )),
            Fill::RandomUniform => Some(format!(
                "torch.rand({shape}, dtype=torch.{dtype}, device=_device)"
            )),
            Fill::Random | Fill::Literal | Fill::Arange => None,
        };
    }
    let x = ins.first()?;
    let binary = |op: B, a: &str, b: &str| -> Option<String> {
        Some(match op {
            B::Maximum => format!("torch.maximum(torch.as_tensor({a}), torch.as_tensor({b}))"),
            B::Minimum => format!("torch.minimum(torch.as_tensor({a}), torch.as_tensor({b}))"),
            _ => format!("({a} {} {b})", op.symbol()),
        })
    };
    Some(match op {
        Op::Unary(u) => match u {
            U::Relu => format!("F.relu({x})"),
            U::Relu6 => format!("F.relu6({x})"),
            U::LeakyRelu { slope } => format!("F.leaky_relu({x}, {})", py(*slope)),
            U::Gelu { tanh } => format!(
                "F.gelu({x}, approximate={:?})",
                if *tanh { "tanh" } else { "none" }
            ),
            U::Sigmoid => format!("torch.sigmoid({x})"),
            U::Tanh => format!("torch.tanh({x})"),
            U::Silu => format!("F.silu({x})"),
            U::Mish => format!("F.mish({x})"),
            U::Hardswish => format!("F.hardswish({x})"),
            U::Hardsigmoid => format!("F.hardsigmoid({x})"),
            U::Hardtanh { min, max } => format!("F.hardtanh({x}, {}, {})", py(*min), py(*max)),
            U::Softplus { beta, threshold } => {
                format!("F.softplus({x}, {}, {})", py(*beta), py(*threshold))
            }
            U::Softsign => format!("F.softsign({x})"),
            U::Elu { alpha } => format!("F.elu({x}, {})", py(*alpha)),
            U::Selu => format!("F.selu({x})"),
            U::Clamp { min, max } => format!(
                "torch.clamp({x}, {}, {})",
                min.map_or("None".into(), py),
                max.map_or("None".into(), py)
            ),
            U::Exp => format!("torch.exp({x})"),
            U::Log => format!("torch.log({x})"),
            U::Abs => format!("torch.abs({x})"),
            U::Neg => format!("(-{x})"),
            U::Sqrt => format!("torch.sqrt({x})"),
            U::Rsqrt => format!("torch.rsqrt({x})"),
            U::Reciprocal => format!("torch.reciprocal({x})"),
            U::Erf => format!("torch.erf({x})"),
            U::Sin => format!("torch.sin({x})"),
            U::Cos => format!("torch.cos({x})"),
            U::Sign => format!("torch.sign({x})"),
            U::Not => format!("torch.logical_not({x})"),
        },
        Op::Binary(b) => binary(*b, x, ins.get(1)?)?,
        Op::Scalar {
            op,
            value,
            scalar_first,
        } => {
            let c = py(*value);
            if *scalar_first {
                binary(*op, &c, x)?
            } else {
                binary(*op, x, &c)?
            }
        }
        Op::Einsum { equation } => format!("torch.einsum({equation:?}, {})", ins.join(", ")),
        Op::Where { fill: Some(v) } => format!("{x}.masked_fill({}, {})", ins.get(1)?, py(*v)),
        Op::Where { fill: None } => {
            format!("torch.where({x}, {}, {})", ins.get(1)?, ins.get(2)?)
        }
        Op::Triangular { upper, diagonal } => format!(
            "torch.{}({x}, {diagonal})",
            if *upper { "triu" } else { "tril" }
        ),
        Op::Reduce(Reduce { op, dims, keepdim }) => {
            let k = if *keepdim { "True" } else { "False" };
            let d = dims_tuple(dims);
            match op {
                R::Sum => format!("torch.sum({x}, dim={d}, keepdim={k})"),
                R::Mean => format!("torch.mean({x}, dim={d}, keepdim={k})"),
                R::Max { .. } => format!("torch.amax({x}, dim={d}, keepdim={k})"),
                R::Min { .. } => format!("torch.amin({x}, dim={d}, keepdim={k})"),
                R::LogSumExp => format!("torch.logsumexp({x}, dim={d}, keepdim={k})"),
                R::Prod if dims.len() == 1 => {
                    format!("torch.prod({x}, dim={}, keepdim={k})", dims[0])
                }
                R::ArgMax if dims.len() == 1 => {
                    format!("torch.argmax({x}, dim={}, keepdim={k})", dims[0])
                }
                R::ArgMin if dims.len() == 1 => {
                    format!("torch.argmin({x}, dim={}, keepdim={k})", dims[0])
                }
                R::Norm { p } => format!(
                    "torch.linalg.vector_norm({x}, {}, dim={d}, keepdim={k})",
                    py(*p)
                ),
                R::Var { correction } => {
                    format!(
                        "torch.var({x}, dim={d}, correction={}, keepdim={k})",
                        py(*correction)
                    )
                }
                R::Std { correction } => {
                    format!(
                        "torch.std({x}, dim={d}, correction={}, keepdim={k})",
                        py(*correction)
                    )
                }
                _ => return None,
            }
        }
        Op::Softmax { dim, log } => format!(
            "torch.{}({x}, dim={dim})",
            if *log { "log_softmax" } else { "softmax" }
        ),
        Op::Scan(Scan {
            prod,
            dim,
            reverse,
            exclusive,
        }) => {
            let f = if *prod { "cumprod" } else { "cumsum" };
            let mut s = if *reverse {
                format!("{x}.flip({dim})")
            } else {
                x.to_string()
            };
            if *exclusive {
                // The inclusive scan of the input shifted one place along
                // the scan, the identity first.
                let identity = if *prod { "1.0" } else { "0.0" };
                s = format!(
                    "torch.cat([torch.full_like({s}.narrow({dim}, 0, 1), {identity}), {s}.narrow({dim}, 0, {s}.size({dim}) - 1)], dim={dim})"
                );
            }
            let scanned = format!("torch.{f}({s}, dim={dim})");
            if *reverse {
                format!("{scanned}.flip({dim})")
            } else {
                scanned
            }
        }
        Op::Norm(Norm {
            kind,
            eps,
            affine,
            bias,
            batch_stats,
        }) => {
            // (x, weight, bias, running mean and variance), those present.
            let mut rest = ins[1..].iter();
            let mut next = |present: bool| -> Option<String> {
                Some(if present {
                    rest.next()?.clone()
                } else {
                    "None".into()
                })
            };
            let w = next(*affine)?;
            let b = next(*bias)?;
            let running = (!*batch_stats)
                .then(|| Some(format!("{}, {}", next(true)?, next(true)?)))
                .flatten();
            let eps = py(*eps);
            match kind {
                NormKind::Layer { dims } => {
                    format!("F.layer_norm({x}, {x}.shape[-{dims}:], {w}, {b}, {eps})")
                }
                NormKind::Rms { dims } => {
                    format!("F.rms_norm({x}, {x}.shape[-{dims}:], {w}, {eps})")
                }
                NormKind::Group { groups } => {
                    format!("F.group_norm({x}, {groups}, {w}, {b}, {eps})")
                }
                NormKind::Lp { p, dim } => format!("F.normalize({x}, {}, {dim}, {eps})", py(*p)),
                NormKind::RmsAt { dim } => {
                    format!("({x} / torch.sqrt({x}.pow(2).mean({dim}, keepdim=True) + {eps}))")
                }
                NormKind::Instance if *batch_stats => {
                    format!("F.instance_norm({x}, None, None, {w}, {b}, True, 0.1, {eps})")
                }
                NormKind::Batch if *batch_stats => {
                    format!("F.batch_norm({x}, None, None, {w}, {b}, True, 0.1, {eps})")
                }
                // Running statistics (eval mode), read and not updated.
                NormKind::Batch => {
                    format!(
                        "F.batch_norm({x}, {}, {w}, {b}, False, 0.0, {eps})",
                        running?
                    )
                }
                NormKind::Instance => {
                    format!(
                        "F.instance_norm({x}, {}, {w}, {b}, False, 0.0, {eps})",
                        running?
                    )
                }
            }
        }
        Op::Pool(Pool {
            max,
            spatial,
            kernel,
            stride,
            padding,
            dilation,
            ceil_mode,
            count_include_pad,
            channels_last,
        }) => {
            let ceil = if *ceil_mode { "True" } else { "False" };
            // Channels last: torch pools the NC… view of the dense
            // channels-last tensor and keeps its layout, which the permute
            // back reads densely.
            let (to, back) = channels_last_views(*channels_last, spatial + 2);
            let x = &format!("{x}{to}");
            let call = if *max {
                let dilation = if dilation.is_empty() {
                    tuple(&vec![1; *spatial])
                } else {
                    tuple(dilation)
                };
                format!(
                    "F.max_pool{spatial}d({x}, {}, {}, {}, {dilation}, {ceil})",
                    tuple(kernel),
                    tuple(stride),
                    tuple(padding)
                )
            } else {
                format!(
                    "F.avg_pool{spatial}d({x}, {}, {}, {}, {ceil}, {})",
                    tuple(kernel),
                    tuple(stride),
                    tuple(padding),
                    if *count_include_pad { "True" } else { "False" }
                )
            };
            format!("{call}{back}")
        }
        Op::AdaptivePool(AdaptivePool { max, output }) => format!(
            "F.adaptive_{}_pool{}d({x}, {})",
            if *max { "max" } else { "avg" },
            output.len(),
            tuple(output)
        ),
        Op::Dropout { p, active } => format!(
            "F.dropout({x}, {}, training={})",
            py(*p),
            if *active { "True" } else { "False" }
        ),
        Op::Loss(Loss { kind, reduction }) => {
            let r = match reduction {
                Reduction::None => "none",
                Reduction::Mean => "mean",
                Reduction::Sum => "sum",
                Reduction::BatchMean => "batchmean",
            };
            let y = ins.get(1)?;
            match kind {
                LossKind::Mse => format!("F.mse_loss({x}, {y}, reduction={r:?})"),
                LossKind::Huber { delta } => {
                    format!(
                        "F.huber_loss({x}, {y}, reduction={r:?}, delta={})",
                        py(*delta)
                    )
                }
                LossKind::SmoothL1 { beta } => {
                    format!(
                        "F.smooth_l1_loss({x}, {y}, reduction={r:?}, beta={})",
                        py(*beta)
                    )
                }
                LossKind::CrossEntropy => format!("F.cross_entropy({x}, {y}, reduction={r:?})"),
                LossKind::TripletMargin { margin, p } => format!(
                    "F.triplet_margin_loss({x}, {y}, {}, margin={}, p={}, reduction={r:?})",
                    ins.get(2)?,
                    py(*margin),
                    py(*p)
                ),
                LossKind::Hinge { margin } => format!(
                    "F.hinge_embedding_loss({x}, {y}, margin={}, reduction={r:?})",
                    py(*margin)
                ),
                LossKind::Cosine { margin } => format!(
                    "F.cosine_embedding_loss({x}, {y}, {}, margin={}, reduction={r:?})",
                    ins.get(2)?,
                    py(*margin)
                ),
                LossKind::KlDiv { log_target } => format!(
                    "F.kl_div({x}, {y}, reduction={r:?}, log_target={})",
                    if *log_target { "True" } else { "False" }
                ),
            }
        }
        Op::Layout(l) => match l {
            Layout::Permute { perm } => format!("{x}.permute{}", dims_tuple(perm)),
            Layout::Copy => format!("{x}.clone()"),
            Layout::Flip { dims } => format!("torch.flip({x}, {})", dims_tuple(dims)),
            Layout::Concat { dim } => format!("torch.cat([{}], dim={dim})", ins.join(", ")),
            Layout::Stack { dim } => format!("torch.stack([{}], dim={dim})", ins.join(", ")),
            Layout::Expand => format!("{x}.expand{}", tuple(&out.shape)),
            Layout::Roll { shifts, dims } => {
                format!(
                    "torch.roll({x}, {}, {})",
                    int_list(shifts),
                    dims_tuple(dims)
                )
            }
            // The tracer records constant padding (F.pad's default mode).
            Layout::Pad { pads } => format!("F.pad({x}, {})", int_list(pads)),
            Layout::Cast { to } => format!("{x}.to(torch.{})", torch_dtype(*to).ok()?),
            // The tracer writes basic indexing as Python: a subscript, or a
            // narrow / select call (split makes several tensors: not here).
            Layout::Slice { subscript } if subscript.starts_with('[') => format!("{x}{subscript}"),
            Layout::Slice { subscript }
                if subscript.starts_with("narrow(") || subscript.starts_with("select(") =>
            {
                format!("{x}.{subscript}")
            }
            Layout::Gather { subscript } => gather_call(x, subscript, &ins[1..])?,
            _ => return None,
        },
        _ => return None,
    })
}

/// `x` indexed by the tensors `index` where the gather's subscript has
/// its `#`s; a subscript left empty (a graph made before subscripts were
/// kept) reads as `[#]`.
fn gather_call(x: &str, subscript: &str, index: &[String]) -> Option<String> {
    let subscript = if subscript.is_empty() {
        "[#]"
    } else {
        subscript
    };
    if subscript.matches('#').count() != index.len() {
        return None;
    }
    let mut out = x.to_string();
    let mut tensors = index.iter();
    for c in subscript.chars() {
        match c {
            '#' => out.push_str(tensors.next()?),
            c => out.push(c),
        }
    }
    Some(out)
}

/// The torch call of a recurrent layer stack, which returns its output
/// sequence, then the last hidden state (and an LSTM's last cell state):
/// `torch.lstm`, `torch.gru`, `torch.rnn_tanh`, `torch.rnn_relu`, the
/// functions `nn.LSTM` and its kin call. `ins` is the input, the initial
/// states when given (zeros like the last ones otherwise), then the
/// weights in the order those take them; `hidden` is the last hidden
/// state's type. Without dropout: the graph keeps none.
pub(super) fn rnn_call(
    r: &Rnn,
    ins: &[String],
    hidden: &mtmc_actions::dtype::TensorType,
) -> Option<String> {
    let py = |b: bool| if b { "True" } else { "False" };
    let directions = if r.bidirectional { 2 } else { 1 };
    let per = if r.bias { 4 } else { 2 };
    let weights = usize::try_from(r.layers * directions * per).ok()?;
    let x = ins.first()?;
    let states = ins.len().checked_sub(1 + weights)?;
    let zeros = format!("{x}.new_zeros({})", tuple(&hidden.shape));
    let hx = match (r.cell, states) {
        (RnnCell::Lstm, 2) => format!("[{}, {}]", ins[1], ins[2]),
        (RnnCell::Lstm, 0) => format!("[{zeros}, {zeros}]"),
        (RnnCell::Lstm, _) | (_, 2..) => return None,
        (_, 1) => ins[1].clone(),
        (_, _) => zeros,
    };
    let f = match r.cell {
        RnnCell::Lstm => "lstm",
        RnnCell::Gru => "gru",
        RnnCell::Tanh => "rnn_tanh",
        RnnCell::Relu => "rnn_relu",
    };
    Some(format!(
        "torch.{f}({x}, {hx}, [{}], {}, {}, 0.0, False, {}, {})",
        ins[1 + states..].join(", "),
        py(r.bias),
        r.layers,
        py(r.bidirectional),
        py(r.batch_first)
    ))
}

//! The op vocabulary: one `match` on a call's normalized key, each arm
//! reading the call's arguments into an [`Op`] (or an alias of a value
//! the graph already has).

use serde_json::Value;

use crate::import::{Importer, Val};
use crate::op::{
    Attention, BinaryOp, Fill, Layout, LossKind, MatMul, Norm, NormKind, Op, Reduce, ReduceOp,
    RnnCell, Scan, UnaryOp,
};

use super::layers::{adaptive_pool, conv, loss, norm, pool, rnn};
use super::tensor::{
    binary, clamp, constant, extremum, getitem, passthrough, permute, rank_of, reduce,
    same_generator, tensors_arg, unary,
};
use super::{Call, Lower, Lowered, norm_dim, norm_dims, num};

pub(super) fn lower(im: &Importer, c: &Call) -> Lower {
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

//! Layers read from their functional or module spelling: convolutions,
//! pooling, norms, losses and recurrent networks.

use serde_json::Value;

use crate::graph::TensorRef;
use crate::import::{Importer, Val};
use crate::op::{AdaptivePool, Conv, Loss, LossKind, Norm, NormKind, Op, Pool, Rnn, RnnCell};

use super::{Call, Lower, Lowered, ints, reduction, spatial, spatial_rank};

pub(super) fn conv(im: &Importer, c: &Call, transposed: bool) -> Lower {
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

pub(super) fn pool(c: &Call, max: bool) -> Lower {
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

pub(super) fn adaptive_pool(c: &Call, max: bool) -> Lower {
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

pub(super) fn norm(c: &Call, kind: NormKind) -> Lower {
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

pub(super) fn loss(c: &Call, kind: LossKind, operands: usize, reduction_pos: usize) -> Lower {
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

pub(super) fn rnn(im: &Importer, c: &Call, cell: RnnCell) -> Lower {
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

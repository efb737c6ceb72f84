//! A program as a KernelBench `ModelNew` file: the same constructor and
//! forward signature as the problem's `Model`, its fragments compiled with
//! NVRTC through cupy and launched on torch's current stream, and the ops
//! no fragment covers kept as torch calls (the call-library action,
//! reported as such by the evaluator).
//!
//! Parameters come from an instance of the problem's own `Model`, built
//! with the same arguments in the constructor, so they are initialized
//! exactly as the reference's are; its forward is never called.

use std::collections::HashMap;
use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{Conv, Layout, MatMul, Op, Rnn, RnnCell};

use crate::program::{Lang, Program};

/// Whether the exporter can write `op` as a torch call.
pub fn library_op(op: &Op) -> bool {
    matches!(op, Op::MatMul(_) | Op::Conv(_) | Op::Attention(_))
}

/// The nodes computed from parameters and constants of one value alone (no
/// forward input reaches them), by torch calls or views, each with one
/// result that is not a graph output: the weights a rewrite derives, say.
/// The export keeps them between calls until a parameter they read
/// changes; `covered` (the nodes kernels compute) are left out.
pub fn derived_from_parameters(
    g: &OpGraph,
    covered: &std::collections::BTreeSet<NodeId>,
) -> std::collections::HashSet<NodeId> {
    let mut derived = std::collections::HashSet::new();
    for &id in g.order() {
        let node = g.node(id);
        let ins = g.inputs(id);
        // A constant filled with one value is the same on every call;
        // random ones are not.
        let full = matches!(
            node.op,
            Op::Constant {
                fill: mtmc_actions::op::Fill::Full(_)
            }
        );
        let from_parameters = full
            || !ins.is_empty()
                && ins.iter().all(|i| {
                    matches!(g.node(i.node).op, Op::Param { .. }) || derived.contains(&i.node)
                });
        if from_parameters
            && !covered.contains(&id)
            && node.outputs.len() == 1
            && !g.outputs().iter().any(|t| t.node == id)
            && !matches!(node.op, Op::Input { .. } | Op::Param { .. })
        {
            derived.insert(id);
        }
    }
    derived
}

/// A Python tuple literal (`()` for a scalar's shape).
fn tuple(v: &[u64]) -> String {
    if v.is_empty() {
        return "()".into();
    }
    let items: Vec<String> = v.iter().map(u64::to_string).collect();
    format!("({},)", items.join(", "))
}

/// The torch expression computing `op` from `ins` (Python names).
fn torch_call(op: &Op, ins: &[String], out: &mtmc_actions::dtype::TensorType) -> Option<String> {
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
        other => return torch_fallback(other, ins, out),
    })
}

/// A Python float literal.
fn py(v: f64) -> String {
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
fn dims_tuple(d: &[usize]) -> String {
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
fn rnn_call(r: &Rnn, ins: &[String], hidden: &mtmc_actions::dtype::TensorType) -> Option<String> {
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

/// The transpose of a dense `[N, C, S]` float32 tensor into its dense
/// channels-last copy `[N, S, C]`, for the input of a convolution that
/// runs channels-last: 32x32 tiles through shared memory (padded against
/// bank conflicts), read along `S` and written along `C`, both coalesced;
/// a block of 32x8 threads per tile and image. torch's own copy of a
/// strided tensor reaches about 60 % of the copy bandwidth.
pub const CHANNELS_LAST: &str = r#"// mtmc_to_channels_last: [N, C, S] -> [N, S, C], 32x32 tiles in shared memory
extern "C" __global__ void __launch_bounds__(256) mtmc_to_channels_last(const float* __restrict__ x, float* __restrict__ y, long long C, long long S) {
    __shared__ float tile[32][33];
    const long long image = (long long)blockIdx.z * C * S;
    const long long s0 = (long long)blockIdx.x * 32, c0 = (long long)blockIdx.y * 32;
    for (int j = threadIdx.y; j < 32; j += 8) {
        const long long c = c0 + j, s = s0 + threadIdx.x;
        if (c < C && s < S) tile[j][threadIdx.x] = x[image + c * S + s];
    }
    __syncthreads();
    for (int j = threadIdx.y; j < 32; j += 8) {
        const long long s = s0 + j, c = c0 + threadIdx.x;
        if (c < C && s < S) y[image + s * C + c] = tile[threadIdx.x][j];
    }
}
"#;

/// The Python side of [`CHANNELS_LAST`]: `_channels_last(x)`, which
/// returns `x`'s dense channels-last copy, the module compiled at its
/// first call on the GPU (torch's own copy off the GPU, or where the grid
/// cannot hold the batch).
const CHANNELS_LAST_PY: &str = r#"_LAYOUT = []


def _channels_last(x):
    memory_format = torch.channels_last if x.dim() == 4 else torch.channels_last_3d
    if not x.is_cuda or x.dtype != torch.float32 or x.shape[0] > 65535 or not x.is_contiguous():
        return x.contiguous(memory_format=memory_format)
    import cupy
    if not _LAYOUT:
        _LAYOUT.append(cupy.RawModule(code=_LAYOUT_SOURCE, options=("--std=c++17",)).get_function("mtmc_to_channels_last"))
    n, c = x.shape[0], x.shape[1]
    s = x[0, 0].numel()
    y = torch.empty_like(x, memory_format=memory_format)
    with cupy.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
        _LAYOUT[0](((s + 31) // 32, (c + 31) // 32, n), (32, 8, 1), (cupy.uint64(x.data_ptr()), cupy.uint64(y.data_ptr()), cupy.int64(c), cupy.int64(s)))
    return y


"#;

/// The CUDA-graph launcher of a `ModelNew` whose program has
/// `cuda_graph` set: `forward` replays a graph of `_forward` captured for
/// the arguments' storage, shapes, strides and devices, the parameters'
/// and buffers' storage and versions, and torch's precision switches;
/// when any of them changes, the graph is captured again. The graph reads
/// the inputs where they lie, so new values in the same tensors are
/// computed on; the outputs are copied out of the graph's memory, which
/// the next replay overwrites. Before a capture, one eager run on a side
/// stream does the lazy work a capture cannot hold (module loads,
/// library workspaces); buffers it wrote (running statistics) are put
/// back, so a call changes them once.
const CUDA_GRAPH_PY: &str = r#"def _arg_key(v):
    if isinstance(v, torch.Tensor):
        return (v.data_ptr(), tuple(v.shape), v.stride(), v.dtype, v.device)
    return repr(v)


# Counts every parameter, buffer and submodule registered on any module
# (assigned, registered or loaded with assign=True), so that the graph's
# key can read a list of the model's tensors made once instead of walking
# its modules on every call. One count per process, kept on torch's module
# module: its hooks are registered by the first program loaded, not again
# by each (a hook holds its program's namespace).
_REGISTRATIONS = getattr(torch.nn.modules.module, "_mtmc_registrations", None)
if _REGISTRATIONS is None:
    _REGISTRATIONS = torch.nn.modules.module._mtmc_registrations = [0]

    def _registered(*_, count=_REGISTRATIONS):
        count[0] += 1

    torch.nn.modules.module.register_module_parameter_registration_hook(_registered)
    torch.nn.modules.module.register_module_buffer_registration_hook(_registered)
    torch.nn.modules.module.register_module_module_registration_hook(_registered)


def _graph_key(model, args, kwargs):
    if model._graph_tensors is None or model._graph_tensors[0] != _REGISTRATIONS[0]:
        model._graph_tensors = (
            _REGISTRATIONS[0],
            list(model.parameters()) + list(model.buffers()),
        )
    return (
        tuple(_arg_key(v) for v in args),
        tuple(sorted((k, _arg_key(v)) for k, v in kwargs.items())),
        model._graph_tensors[0],
        tuple((t.data_ptr(), t._version) for t in model._graph_tensors[1]),
        torch.backends.cuda.matmul.allow_tf32,
        torch.backends.cudnn.allow_tf32,
        torch.backends.cudnn.enabled,
        torch.backends.cudnn.deterministic,
        torch.get_float32_matmul_precision(),
    )


def _copy_out(v):
    if isinstance(v, torch.Tensor):
        return v.clone()
    if isinstance(v, (tuple, list)):
        return type(v)(_copy_out(x) for x in v)
    return v


def _replay(model, args, kwargs):
    on_gpu = [v.is_cuda for v in list(args) + list(kwargs.values()) if isinstance(v, torch.Tensor)]
    if not on_gpu or not all(on_gpu):
        return model._forward(*args, **kwargs)
    with torch.no_grad():
        if model._graph_key != _graph_key(model, args, kwargs):
            model._graph = model._graph_out = model._graph_key = None
            kept = [b.clone() for b in model.buffers()]
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                model._forward(*args, **kwargs)
            torch.cuda.current_stream().wait_stream(side)
            for b, k in zip(model.buffers(), kept):
                b.copy_(k)
            del kept
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = model._forward(*args, **kwargs)
            model._graph, model._graph_out = graph, out
            model._graph_key = _graph_key(model, args, kwargs)
        model._graph.replay()
        return _copy_out(model._graph_out)


"#;

/// The views that read a dense channels-last tensor of rank `rank` in
/// NC… order and back (`.permute(…)` each), or nothing.
fn channels_last_views(channels_last: bool, rank: usize) -> (String, String) {
    if !channels_last {
        return (String::new(), String::new());
    }
    let last = mtmc_actions::rewrite::channels_last_perm(rank);
    (
        format!(
            ".permute{}",
            dims_tuple(&mtmc_actions::rewrite::inverse(&last))
        ),
        format!(".permute{}", dims_tuple(&last)),
    )
}

/// torch's name for an element type a fragment writes.
fn torch_dtype(d: mtmc_actions::DType) -> Result<&'static str, String> {
    use mtmc_actions::DType;
    Ok(match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::Bool => "bool",
        other => return Err(format!("no torch dtype for {other:?}")),
    })
}

/// A Python identifier from a node name.
fn ident(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        format!("_{s}")
    } else {
        s
    }
}

/// The `ModelNew` source, or why the program cannot be exported yet.
pub fn to_model_new(g: &OpGraph, p: &Program, problem_code: &str) -> Result<String, String> {
    let covered = p.covered();
    // Whether a convolution's input goes channels-last through the
    // transpose kernel ([`CHANNELS_LAST`]).
    let mut layout_kernel = false;
    let mut var: HashMap<TensorRef, String> = HashMap::new();
    let mut forward_args = Vec::new();
    let mut params = Vec::new();
    let mut body = String::new();
    // The fragment each node belongs to, launched at its region's last node.
    let mut last_node: HashMap<NodeId, usize> = HashMap::new();
    for (k, f) in p.fragments.iter().enumerate() {
        let last = f
            .region
            .iter()
            .max_by_key(|n| g.order().iter().position(|o| o == *n))
            .copied()
            .ok_or("a fragment with an empty region")?;
        last_node.insert(last, k);
    }
    let derived = derived_from_parameters(g, &covered);
    // Inputs and parameters first, then what derives from parameters alone
    // (its lines are the first of `body`), then the rest in graph order.
    let source = |id: NodeId| matches!(g.node(id).op, Op::Input { .. } | Op::Param { .. });
    let ids: Vec<NodeId> = g.nodes().map(|(id, _)| id).collect();
    let order: Vec<NodeId> = ids
        .iter()
        .filter(|&&id| source(id))
        .chain(ids.iter().filter(|id| derived.contains(id)))
        .chain(
            ids.iter()
                .filter(|&&id| !source(id) && !derived.contains(&id)),
        )
        .copied()
        .collect();
    let mut derived_end = None;
    for id in order {
        let node = g.node(id);
        if !derived.contains(&id) && !source(id) && derived_end.is_none() {
            derived_end = Some(body.len());
        }
        let t = TensorRef::first(id);
        match &node.op {
            Op::Input { name } => {
                let v = format!("in_{}", ident(name));
                forward_args.push((v.clone(), name.clone()));
                var.insert(t, v);
                continue;
            }
            Op::Param { name, trainable } => {
                let v = format!("p_{}", ident(name));
                params.push((v.clone(), name.clone(), *trainable));
                var.insert(t, v);
                continue;
            }
            op if op.is_view() => {
                // Dense memory under a new shape: a torch view, no kernel.
                let input = g.inputs(id)[0];
                let v = var.get(&input).ok_or_else(|| {
                    format!(
                        "`{}` is read before it is computed",
                        g.node(input.node).name
                    )
                })?;
                let view = format!("t{}", id.index());
                let _ = writeln!(
                    body,
                    "        {view} = {v}.view({})",
                    tuple(&node.outputs[0].shape)
                );
                var.insert(t, view);
                continue;
            }
            _ => {}
        }
        if covered.contains(&id) {
            if let Some(&k) = last_node.get(&id) {
                let f = &p.fragments[k];
                // CUDA kernels take raw pointers; Triton kernels tensors.
                let triton = f.lang == Lang::Triton;
                let pointer = |v: &str| {
                    if triton {
                        v.to_string()
                    } else {
                        format!("_ptr({v})")
                    }
                };
                let mut args = Vec::new();
                for input in &f.inputs {
                    let v = var.get(input).ok_or_else(|| {
                        format!(
                            "{} reads `{}` before it is computed",
                            f.name,
                            g.node(input.node).name
                        )
                    })?;
                    args.push(pointer(v));
                }
                for out in &f.outputs {
                    let v = format!("t{}", out.node.index());
                    let tensor = g.tensor(*out);
                    let _ = writeln!(
                        body,
                        "        {v} = torch.empty({}, dtype=torch.{}, device=_device)",
                        tuple(&tensor.shape),
                        torch_dtype(tensor.dtype)?
                    );
                    args.push(pointer(&v));
                    var.insert(*out, v);
                }
                for (kernel, launch) in f.launches() {
                    if triton {
                        let mut args = args.clone();
                        args.extend(launch.sizes.iter().map(|n| n.to_string()));
                        let _ = writeln!(
                            body,
                            "        {kernel}[({},)]({}, num_warps={})",
                            launch.grid,
                            args.join(", "),
                            launch.warps()
                        );
                        continue;
                    }
                    let mut args = args.clone();
                    args.extend(launch.sizes.iter().map(|n| format!("cp.int64({n})")));
                    let shared = if launch.shared > 0 {
                        format!(", shared_mem={}", launch.shared)
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        body,
                        "        _KERNELS[{kernel:?}](({},), ({},), ({},){shared})",
                        launch.grid,
                        launch.block,
                        args.join(", ")
                    );
                }
            }
            continue;
        }
        let ins: Vec<String> = g
            .inputs(id)
            .iter()
            .map(|i| {
                var.get(i).cloned().ok_or_else(|| {
                    format!("`{}` is read before it is computed", g.node(i.node).name)
                })
            })
            .collect::<Result<_, _>>()?;
        // A convolution read only through its channels-last view runs on
        // channels-last operands and keeps torch's channels-last result,
        // which that view reads densely; a permute that only graph outputs
        // and torch's convolutions read stays a view (a kernel takes a raw
        // pointer, and reads dense memory in the tensor's own order).
        let rank = node.outputs[0].shape.len();
        let read_channels_last = matches!(node.op, Op::Conv(_))
            && (rank == 4 || rank == 5)
            && !g.outputs().iter().any(|t| t.node == id)
            && g.consumers(id).iter().all(|&c| {
                matches!(&g.node(c).op, Op::Layout(Layout::Permute { perm })
                    if *perm == mtmc_actions::rewrite::channels_last_perm(rank))
            });
        let output_view = matches!(node.op, Op::Layout(Layout::Permute { .. }))
            && mtmc_actions::rewrite::reads_as_view(g, id)
            && !g.consumers(id).iter().any(|c| covered.contains(c));
        let mut ins = ins;
        if read_channels_last {
            let format = if rank == 4 {
                "channels_last"
            } else {
                "channels_last_3d"
            };
            // The input by the transpose kernel where its tiles fill (32
            // channels or more, float32), torch's copy otherwise; the
            // weights (small) by torch.
            let x = g.tensor(g.inputs(id)[0]);
            let tiled = x.dtype == mtmc_actions::DType::F32
                && x.shape.get(1).is_some_and(|&c| c >= 32)
                && !p.fragments.iter().any(|f| f.lang == Lang::Triton);
            for (slot, x) in ins[..2].iter_mut().enumerate() {
                *x = if slot == 0 && tiled {
                    layout_kernel = true;
                    format!("_channels_last({x})")
                } else {
                    format!("{x}.contiguous(memory_format=torch.{format})")
                };
            }
        }
        // `split` and recurrent stacks make several tensors: the tuple,
        // then each part.
        let several = match &node.op {
            Op::Layout(Layout::Slice { subscript }) if subscript.starts_with("split(") => {
                Some(format!("{}.{subscript}", ins[0]))
            }
            Op::Rnn(r) => Some(
                node.outputs
                    .get(1)
                    .and_then(|hidden| rnn_call(r, &ins, hidden))
                    .ok_or_else(|| {
                        format!(
                            "`{}` ({}) takes inputs that have no torch rendering yet",
                            node.name, node.op
                        )
                    })?,
            ),
            _ => None,
        };
        if let Some(call) = several {
            let v = format!("t{}", id.index());
            let _ = writeln!(body, "        {v} = {call}");
            for output in 0..node.outputs.len() {
                let part = format!("{v}_{output}");
                let _ = writeln!(body, "        {part} = {v}[{output}].contiguous()");
                var.insert(TensorRef { node: id, output }, part);
            }
            continue;
        }
        let call = torch_call(&node.op, &ins, &node.outputs[0]).ok_or_else(|| {
            format!(
                "no fragment computes `{}` ({}) and it has no torch rendering yet",
                node.name, node.op
            )
        })?;
        let v = format!("t{}", id.index());
        // A result only returned keeps torch's strides: no kernel reads it,
        // and the reference returns the same call's result (attention's
        // comes head-major from the memory-efficient kernel: making it
        // dense was a copy of the whole output). Views and copies stay
        // dense, so nothing returned aliases what the caller passed in.
        let returned_only = !matches!(node.op, Op::Layout(_))
            && !node.op.is_view()
            && g.consumers(id).is_empty()
            && g.outputs().iter().any(|t| t.node == id);
        if read_channels_last || output_view || returned_only {
            let _ = writeln!(body, "        {v} = {call}");
        } else {
            let _ = writeln!(body, "        {v} = {call}.contiguous()");
        }
        var.insert(t, v);
    }
    let (derived_body, body) = body.split_at(derived_end.unwrap_or(body.len()));
    // An output that is a view of kept tensors is copied: the caller may
    // write into what it gets.
    let aliases_kept = |t: &TensorRef| {
        let mut at = t.node;
        while g.node(at).op.is_view() && !derived.contains(&at) {
            match g.inputs(at).first() {
                Some(i) => at = i.node,
                None => return false,
            }
        }
        derived.contains(&at)
    };
    let outs: Vec<String> = g
        .outputs()
        .iter()
        .map(|t| {
            let v = var
                .get(t)
                .cloned()
                .ok_or("an output is never computed".to_string())?;
            Ok(if aliases_kept(t) {
                format!("{v}.clone()")
            } else {
                v
            })
        })
        .collect::<Result<_, String>>()?;
    let device_of = forward_args
        .first()
        .map(|(v, _)| v.clone())
        .unwrap_or_else(|| "torch.empty(0, device='cuda')".into());

    let mut py = String::new();
    let (triton, cuda): (Vec<_>, Vec<_>) = p.fragments.iter().partition(|f| f.lang == Lang::Triton);
    if !triton.is_empty() {
        py.push_str("# Generated by mtmc: custom kernels written in Triton, launched on torch's\n# current stream");
        if !cuda.is_empty() {
            py.push_str(", and in CUDA, compiled with NVRTC through cupy");
        }
        py.push_str("; ops without a kernel are torch calls.\n");
    } else {
        py.push_str("# Generated by mtmc: custom kernels compiled with NVRTC through cupy and\n");
        py.push_str(
            "# launched on torch's current stream; ops without a kernel are torch calls.\n",
        );
    }
    let kernels = !cuda.is_empty();
    if kernels {
        py.push_str("import cupy as cp\n");
    }
    py.push_str("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n");
    if !triton.is_empty() {
        py.push_str("import triton\nimport triton.language as tl\n");
    }
    py.push('\n');
    for f in &triton {
        py.push('\n');
        py.push_str(&f.source);
        py.push('\n');
    }
    let source: String = cuda
        .iter()
        .map(|f| f.source.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let _ = writeln!(
        py,
        "_SOURCE = {}",
        serde_json::to_string(&source).expect("a string serializes")
    );
    let names: Vec<String> = cuda
        .iter()
        .flat_map(|f| f.launches().map(|(k, _)| format!("{k:?}")))
        .collect();
    if p.fragments.is_empty() {
        py.push_str("# Every op is a library call: no kernel to compile.\n_KERNELS = {}\n");
    } else if cuda.is_empty() {
        py.push_str("# No CUDA kernel: every kernel is a Triton function above.\n_KERNELS = {}\n");
    } else {
        // Hopper's arch-specific target where the GPU is one (kernels guard
        // what only it has); cupy names the plain target after it.
        py.push_str(
            "_OPTIONS = (\"--std=c++17\",) + ((\"-arch=sm_90a\",) if cp.cuda.Device().compute_capability == \"90\" else ())\n",
        );
        py.push_str("_MODULE = cp.RawModule(code=_SOURCE, options=_OPTIONS)\n");
        let _ = writeln!(
            py,
            "_KERNELS = {{name: _MODULE.get_function(name) for name in [{}]}}",
            names.join(", ")
        );
        // Past 48 KiB of dynamic shared memory a kernel opts in.
        for (kernel, launch) in cuda.iter().flat_map(|f| f.launches()) {
            if launch.shared > 48 * 1024 {
                let _ = writeln!(
                    py,
                    "_KERNELS[{kernel:?}].max_dynamic_shared_size_bytes = {}",
                    launch.shared
                );
            }
        }
    }
    py.push_str("\n# The problem's Model, for its parameters only (built exactly as the\n# reference builds its own); its forward is never called.\n");
    let _ = writeln!(
        py,
        "_PROBLEM = {}",
        serde_json::to_string(problem_code).expect("a string serializes")
    );
    py.push_str("_PROBLEM_NS = {\"__name__\": \"mtmc_problem\"}\nexec(compile(_PROBLEM, \"problem.py\", \"exec\"), _PROBLEM_NS)\n\n\n");
    if kernels {
        py.push_str("def _ptr(t):\n    return cp.uint64(t.data_ptr())\n\n\n");
    }
    if layout_kernel {
        let _ = writeln!(
            py,
            "_LAYOUT_SOURCE = {}",
            serde_json::to_string(CHANNELS_LAST).expect("a string serializes")
        );
        py.push_str(CHANNELS_LAST_PY);
    }
    // Constants torch.fx lifted out of the forward (`torch.tensor(c)`) are
    // no attributes of the Model: they are read from a trace of it, once.
    let lifted: Vec<&String> = params
        .iter()
        .map(|(_, name, _)| name)
        .filter(|n| n.starts_with("_tensor_constant"))
        .collect();
    if !lifted.is_empty() {
        py.push_str("def _lifted_constants(model, names):\n    holder = nn.Module()\n    traced = torch.fx.symbolic_trace(model)\n    for k, name in enumerate(names):\n        holder.register_buffer(f\"c{k}\", getattr(traced, name).detach().clone())\n    return holder\n\n\n");
    }
    if p.cuda_graph {
        py.push_str(CUDA_GRAPH_PY);
    }
    // The forward takes the Model's arguments by position and reads the
    // tensors the graph uses by name (a Python scalar argument is a
    // constant of the traced graph).
    py.push_str("import inspect\n_FORWARD = list(inspect.signature(_PROBLEM_NS[\"Model\"].forward).parameters)[1:]\n\n\n");
    py.push_str("class ModelNew(nn.Module):\n    def __init__(self, *args, **kwargs):\n        super().__init__()\n");
    py.push_str("        self.reference_parameters = _PROBLEM_NS[\"Model\"](*args, **kwargs)\n");
    if !lifted.is_empty() {
        let names: Vec<String> = lifted.iter().map(|n| format!("{n:?}")).collect();
        let _ = writeln!(
            py,
            "        self.lifted_constants = _lifted_constants(self.reference_parameters, [{}])",
            names.join(", ")
        );
    }
    if p.cuda_graph {
        py.push_str(
            "        self._graph = self._graph_out = self._graph_key = self._graph_tensors = None\n",
        );
        py.push_str("\n    def forward(self, *args, **kwargs):\n        return _replay(self, args, kwargs)\n");
        py.push_str("\n    def _forward(self, *args, **kwargs):\n");
    } else {
        py.push_str("\n    def forward(self, *args, **kwargs):\n");
    }
    py.push_str("        bound = dict(zip(_FORWARD, args))\n        bound.update(kwargs)\n");
    for (v, name) in &forward_args {
        let _ = writeln!(py, "        {v} = bound[{name:?}].contiguous()");
    }
    // Each parameter as the Model holds it (the cache key reads these).
    let mut held = HashMap::new();
    for (v, name, trainable) in &params {
        let tensor = if let Some(k) = lifted.iter().position(|n| *n == name) {
            format!("self.lifted_constants.c{k}")
        } else {
            let getter = if *trainable {
                "get_parameter"
            } else {
                "get_buffer"
            };
            format!("self.reference_parameters.{getter}({name:?})")
        };
        let _ = writeln!(py, "        {v} = {tensor}.contiguous()");
        held.insert(v.clone(), tensor);
    }
    let _ = writeln!(py, "        _device = {device_of}.device");
    if !derived_body.is_empty() {
        // What derives from parameters alone is kept until one of them
        // changes: its storage, or its version counter (which every
        // in-place write through the tensor moves).
        let mut read: Vec<&String> = Vec::new();
        for &id in &derived {
            for i in g.inputs(id) {
                if let Some(v) = var.get(&i)
                    && let Some(tensor) = held.get(v)
                    && !read.contains(&tensor)
                {
                    read.push(tensor);
                }
            }
        }
        read.sort();
        let key: Vec<String> = read
            .iter()
            .map(|t| format!("({t}.data_ptr(), {t}._version)"))
            .collect();
        let kept: Vec<String> = g
            .order()
            .iter()
            .filter(|id| derived.contains(id))
            .filter_map(|&id| var.get(&TensorRef::first(id)).cloned())
            .collect();
        // The device too: constants are made on the inputs' device.
        let _ = writeln!(py, "        _key = (_device, {})", key.join(", "));
        py.push_str("        if getattr(self, \"_derived_key\", None) != _key:\n");
        for line in derived_body.lines() {
            let _ = writeln!(py, "    {line}");
        }
        let _ = writeln!(py, "            self._derived = ({},)", kept.join(", "));
        py.push_str("            self._derived_key = _key\n");
        let _ = writeln!(py, "        {}, = self._derived", kept.join(", "));
    }
    if kernels {
        py.push_str(
            "        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n",
        );
        for line in body.lines() {
            let _ = writeln!(py, "    {line}");
        }
    } else {
        py.push_str(body);
    }
    if outs.len() == 1 {
        let _ = writeln!(py, "        return {}", outs[0]);
    } else {
        let _ = writeln!(py, "        return ({},)", outs.join(", "));
    }
    Ok(py)
}

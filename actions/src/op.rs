//! The operator vocabulary of the op graph.
//!
//! Operators are what a KernelBench model computes, at the level a kernel
//! author reasons about them (a `Conv` with its stride, not its im2col). An
//! operator this vocabulary does not know is kept as [`Op::Opaque`], never
//! dropped, so a graph always accounts for every step of the model.

use std::fmt;

use crate::dtype::DType;

/// One operation in the graph.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Op {
    /// A forward input of the model.
    Input {
        /// The argument's name.
        name: String,
    },
    /// A parameter or buffer of the model (weights, running statistics).
    Param {
        /// Dotted path of the parameter in the module tree.
        name: String,
        /// Whether it is an `nn.Parameter` (as opposed to a buffer or constant).
        trainable: bool,
    },
    /// A tensor created inside `forward` (zeros, a literal, random numbers).
    Constant {
        /// What fills it.
        fill: Fill,
    },
    /// Matrix product, batched or not, optionally with bias (linear).
    MatMul(MatMul),
    /// Convolution or transposed convolution over 1, 2 or 3 spatial dims.
    Conv(Conv),
    /// Elementwise function of one tensor.
    Unary(UnaryOp),
    /// Elementwise function of two tensors, with broadcasting.
    Binary(BinaryOp),
    /// Elementwise function of a tensor and a scalar constant.
    Scalar {
        /// The operation.
        op: BinaryOp,
        /// The constant operand.
        value: f64,
        /// True when the constant is the left operand (`1 - x`).
        scalar_first: bool,
    },
    /// `where(cond, a, b)`; with `fill`, `masked_fill(x, mask, fill)`.
    Where {
        /// The constant written where the mask holds, for `masked_fill`.
        fill: Option<f64>,
    },
    /// Keeps the upper or lower triangle of the last two dims (`triu`, `tril`).
    Triangular {
        /// Upper (`triu`) or lower (`tril`).
        upper: bool,
        /// Diagonal offset.
        diagonal: i64,
    },
    /// Reduction over some dims.
    Reduce(Reduce),
    /// Cumulative scan along one dim.
    Scan(Scan),
    /// Softmax or log-softmax along one dim.
    Softmax {
        /// The normalized dim.
        dim: usize,
        /// log_softmax rather than softmax.
        log: bool,
    },
    /// Normalization layers.
    Norm(Norm),
    /// Windowed pooling.
    Pool(Pool),
    /// Adaptive pooling to a fixed output size (global pooling when all ones).
    AdaptivePool(AdaptivePool),
    /// Dropout; `active` is false in eval mode or when `p` is 0.
    Dropout {
        /// Drop probability.
        p: f64,
        /// Whether it changes the values (training mode and p > 0).
        active: bool,
    },
    /// Loss functions.
    Loss(Loss),
    /// Scaled dot-product attention on (…, L, E) query/key/value.
    Attention(Attention),
    /// Recurrent layers (LSTM, GRU, Elman RNN).
    Rnn(Rnn),
    /// `einsum` with its equation.
    Einsum {
        /// The equation, e.g. `bij,bjk->bik`.
        equation: String,
    },
    /// Data movement: views, copies, concatenation, padding, casts.
    Layout(Layout),
    /// An operation this vocabulary does not model; kept as a library call.
    Opaque {
        /// What was called (e.g. `torch.nn.TransformerEncoderLayer`).
        target: String,
        /// Why it is opaque.
        reason: String,
        /// The call as the trace recorded it, for the export to make it
        /// again (`None` where the graph did not come from a trace).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        call: Option<Box<OpaqueCall>>,
    },
}

/// A traced call the op vocabulary does not model, as it was made: the
/// problem's own code for that part of the graph.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct OpaqueCall {
    /// How it was called.
    pub kind: CallKind,
    /// A module's path in the model (`blocks.0.attn`), a function's
    /// qualified name (`torch.special.bessel_j0`), or a method's name
    /// (`unfold`, called on the first argument).
    pub target: String,
    /// Positional arguments.
    pub args: Vec<CallArg>,
    /// Keyword arguments, in the trace's order.
    pub kwargs: Vec<(String, CallArg)>,
    /// A submodule the tracer did not trace into (its forward branches on
    /// a value or keeps state across calls): it must run as Python on
    /// every call, never be replayed from a CUDA graph or cached.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub untraced: bool,
}

/// How an [`OpaqueCall`] was made.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallKind {
    /// A submodule of the model, called.
    Module,
    /// A function.
    Function,
    /// A method of its first argument.
    Method,
}

/// One argument of an [`OpaqueCall`].
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CallArg {
    /// The node's input of this index (a tensor of the graph).
    Input(usize),
    /// A tuple or list of arguments.
    Tuple(Vec<CallArg>),
    /// A constant as the trace encodes it (a number, string, bool, null,
    /// or an object such as `{"dtype": "float32"}` or `{"slice": [...]}`).
    Const(serde_json::Value),
}

/// What a [`Op::Constant`] holds.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Fill {
    /// Every element equal to this value.
    Full(f64),
    /// Random numbers of another kind (`randint`, `normal`, drawn from a
    /// generator of their own or on the default device).
    Random,
    /// Standard normal numbers from the global generator of the device
    /// the call names, or of its `_like` tensor's (`randn`, `randn_like`).
    RandomNormal,
    /// Uniform numbers in [0, 1), drawn as `RandomNormal`'s are (`rand`,
    /// `rand_like`).
    RandomUniform,
    /// A literal from the source (`torch.tensor([...])`).
    Literal,
    /// `arange`.
    Arange,
}

/// Matrix product `out = op(A) · op(B) (+ bias)`, batched over leading dims.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct MatMul {
    /// A is used transposed.
    pub trans_a: bool,
    /// B is used transposed (true for `linear`, whose weight is `[out, in]`).
    pub trans_b: bool,
    /// A third input is added as a bias over the last dim.
    pub bias: bool,
}

/// Convolution hyperparameters.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Conv {
    /// Spatial dims: 1, 2 or 3.
    pub spatial: usize,
    /// Transposed (fractionally strided) convolution.
    pub transposed: bool,
    /// Kernel extent per spatial dim.
    pub kernel: Vec<u64>,
    /// Stride per spatial dim.
    pub stride: Vec<u64>,
    /// Zero padding per spatial dim.
    pub padding: Vec<u64>,
    /// Dilation per spatial dim.
    pub dilation: Vec<u64>,
    /// Output padding per spatial dim (transposed only).
    pub output_padding: Vec<u64>,
    /// Channel groups.
    pub groups: u64,
    /// Whether a bias is added.
    pub bias: bool,
}

impl Conv {
    /// A convolution over `kernel.len()` spatial dims with unit stride and
    /// dilation, no padding, one channel group and no bias.
    pub fn dense(kernel: &[u64]) -> Conv {
        let ones = vec![1; kernel.len()];
        Conv {
            spatial: kernel.len(),
            transposed: false,
            kernel: kernel.to_vec(),
            stride: ones.clone(),
            padding: vec![0; kernel.len()],
            dilation: ones,
            output_padding: vec![0; kernel.len()],
            groups: 1,
            bias: false,
        }
    }
}

/// Elementwise functions of one tensor.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnaryOp {
    /// max(x, 0)
    Relu,
    /// min(max(x, 0), 6)
    Relu6,
    /// x if x > 0 else slope·x
    LeakyRelu {
        /// Negative slope.
        slope: f64,
    },
    /// Gaussian error linear unit, exact (erf) or tanh approximation.
    Gelu {
        /// Uses the tanh approximation.
        tanh: bool,
    },
    /// 1 / (1 + e^-x)
    Sigmoid,
    /// tanh(x)
    Tanh,
    /// x · sigmoid(x) (swish)
    Silu,
    /// x · tanh(softplus(x))
    Mish,
    /// x · relu6(x + 3) / 6
    Hardswish,
    /// relu6(x + 3) / 6
    Hardsigmoid,
    /// clamp(x, min, max) as an activation
    Hardtanh {
        /// Lower bound.
        min: f64,
        /// Upper bound.
        max: f64,
    },
    /// log(1 + e^(βx)) / β, linear above the threshold
    Softplus {
        /// β
        beta: f64,
        /// Linear above this (in units of βx).
        threshold: f64,
    },
    /// x / (1 + |x|)
    Softsign,
    /// x if x > 0 else α(e^x − 1)
    Elu {
        /// α
        alpha: f64,
    },
    /// Scaled ELU with the fixed SELU constants.
    Selu,
    /// Clamp to optional bounds.
    Clamp {
        /// Lower bound.
        min: Option<f64>,
        /// Upper bound.
        max: Option<f64>,
    },
    /// e^x
    Exp,
    /// ln x
    Log,
    /// |x|
    Abs,
    /// −x
    Neg,
    /// √x
    Sqrt,
    /// 1/√x
    Rsqrt,
    /// 1/x
    Reciprocal,
    /// erf(x)
    Erf,
    /// sin(x)
    Sin,
    /// cos(x)
    Cos,
    /// sign(x)
    Sign,
    /// Logical not of a boolean tensor (`~mask`).
    Not,
}

/// Elementwise functions of two operands.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BinaryOp {
    /// a + b
    Add,
    /// a − b
    Sub,
    /// a · b
    Mul,
    /// a / b
    Div,
    /// floor(a / b)
    FloorDiv,
    /// a^b
    Pow,
    /// max(a, b)
    Maximum,
    /// min(a, b)
    Minimum,
    /// a == b
    Eq,
    /// a != b
    Ne,
    /// a < b
    Lt,
    /// a <= b
    Le,
    /// a > b
    Gt,
    /// a >= b
    Ge,
}

impl BinaryOp {
    /// Whether the result is boolean.
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
        )
    }

    /// The infix symbol or function name.
    pub fn symbol(self) -> &'static str {
        match self {
            BinaryOp::Add => "+",
            BinaryOp::Sub => "-",
            BinaryOp::Mul => "*",
            BinaryOp::Div => "/",
            BinaryOp::FloorDiv => "//",
            BinaryOp::Pow => "**",
            BinaryOp::Maximum => "maximum",
            BinaryOp::Minimum => "minimum",
            BinaryOp::Eq => "==",
            BinaryOp::Ne => "!=",
            BinaryOp::Lt => "<",
            BinaryOp::Le => "<=",
            BinaryOp::Gt => ">",
            BinaryOp::Ge => ">=",
        }
    }
}

/// A reduction over a set of dims.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Reduce {
    /// What is computed.
    pub op: ReduceOp,
    /// Reduced dims, sorted, of the input.
    pub dims: Vec<usize>,
    /// Whether reduced dims stay as size-1 dims.
    pub keepdim: bool,
}

/// The function a [`Reduce`] computes.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReduceOp {
    /// Σx
    Sum,
    /// Σx / n
    Mean,
    /// max x (with `indices`, also its position: two outputs)
    Max {
        /// Also returns the argmax (`torch.max(x, dim)`).
        indices: bool,
    },
    /// min x (with `indices`, also its position: two outputs)
    Min {
        /// Also returns the argmin.
        indices: bool,
    },
    /// Πx
    Prod,
    /// Position of the maximum.
    ArgMax,
    /// Position of the minimum.
    ArgMin,
    /// log Σ e^x
    LogSumExp,
    /// p-norm (p = 2: L2/Frobenius, p = 1: L1, p = ∞: max |x|).
    Norm {
        /// The order p.
        p: f64,
    },
    /// Variance with Bessel correction `correction`.
    Var {
        /// Subtracted from n in the denominator.
        correction: f64,
    },
    /// Standard deviation with Bessel correction `correction`.
    Std {
        /// Subtracted from n in the denominator.
        correction: f64,
    },
}

/// A cumulative scan along one dim.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Scan {
    /// Product rather than sum.
    pub prod: bool,
    /// Scanned dim.
    pub dim: usize,
    /// Runs from the end of the dim towards its start.
    pub reverse: bool,
    /// Element i excludes element i itself.
    pub exclusive: bool,
}

/// A normalization layer.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Norm {
    /// Which normalization.
    pub kind: NormKind,
    /// ε added to the variance.
    pub eps: f64,
    /// Learned scale (and shift, when `bias`).
    pub affine: bool,
    /// Learned shift.
    pub bias: bool,
    /// Statistics from the batch (training mode) or from running buffers
    /// (eval mode). Matters for batch norm, and for instance norm with
    /// `track_running_stats`.
    pub batch_stats: bool,
}

/// The normalization a [`Norm`] performs.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormKind {
    /// Over the last `dims` dims.
    Layer {
        /// Number of trailing normalized dims.
        dims: usize,
    },
    /// Root-mean-square norm over the last `dims` dims (no mean subtraction).
    Rms {
        /// Number of trailing normalized dims.
        dims: usize,
    },
    /// Root-mean-square norm along one dim, without scale: `x /
    /// sqrt(mean(x², dim) + ε)`, as a model writes it out over the channels
    /// (dim 1 of `N, C, …`).
    RmsAt {
        /// The normalized dim.
        dim: usize,
    },
    /// Per channel (dim 1) over batch and spatial dims.
    Batch,
    /// Per (sample, group of channels).
    Group {
        /// Channel groups.
        groups: u64,
    },
    /// Per (sample, channel) over spatial dims.
    Instance,
    /// x / max(‖x‖_p, ε) along one dim (`F.normalize`).
    Lp {
        /// The order p.
        p: f64,
        /// The normalized dim.
        dim: usize,
    },
}

/// Windowed pooling.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Pool {
    /// Max or average.
    pub max: bool,
    /// Spatial dims: 1, 2 or 3.
    pub spatial: usize,
    /// Window per spatial dim.
    pub kernel: Vec<u64>,
    /// Stride per spatial dim.
    pub stride: Vec<u64>,
    /// Padding per spatial dim.
    pub padding: Vec<u64>,
    /// Dilation per spatial dim (max pooling).
    pub dilation: Vec<u64>,
    /// Output size rounds up.
    pub ceil_mode: bool,
    /// Padding counts in the average's denominator.
    pub count_include_pad: bool,
    /// The channels are the last dim (`N, spatial…, C`) rather than the
    /// second (a pool moved into a channels-last layout).
    #[serde(default)]
    pub channels_last: bool,
}

/// Adaptive pooling to a fixed output size.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct AdaptivePool {
    /// Max or average.
    pub max: bool,
    /// Output extent per spatial dim.
    pub output: Vec<u64>,
}

impl AdaptivePool {
    /// Global pooling: every spatial dim reduced to one element.
    pub fn is_global(&self) -> bool {
        self.output.iter().all(|&o| o == 1)
    }
}

/// A loss function.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Loss {
    /// Which loss.
    pub kind: LossKind,
    /// How per-element losses are combined.
    pub reduction: Reduction,
}

/// The loss a [`Loss`] computes.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum LossKind {
    /// (a − b)²
    Mse,
    /// Huber with threshold δ (smooth L1 is Huber / β with δ = β).
    Huber {
        /// δ
        delta: f64,
    },
    /// Smooth L1 with threshold β.
    SmoothL1 {
        /// β
        beta: f64,
    },
    /// Cross entropy over class logits with integer targets.
    CrossEntropy,
    /// Hinge embedding: `a` where `b` is 1, max(0, margin − a) where `b`
    /// is −1 (`F.hinge_embedding_loss`).
    Hinge {
        /// Margin.
        margin: f64,
    },
    /// max(d(a, p) − d(a, n) + margin, 0)
    TripletMargin {
        /// Margin.
        margin: f64,
        /// Order of the distance.
        p: f64,
    },
    /// Cosine embedding of rows `a` and `b` with labels `y` (a third
    /// operand): 1 − cos(a, b) where `y` is 1, max(0, cos(a, b) − margin)
    /// where `y` is −1 (`F.cosine_embedding_loss`).
    Cosine {
        /// Margin.
        margin: f64,
    },
    /// Kullback–Leibler divergence.
    KlDiv {
        /// The target is given as log-probabilities.
        log_target: bool,
    },
}

/// How a loss combines its per-element values.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reduction {
    /// Per-element output.
    None,
    /// Mean over elements.
    Mean,
    /// Sum over elements.
    Sum,
    /// Sum divided by the batch size (`kl_div` with `batchmean`).
    BatchMean,
}

/// Scaled dot-product attention.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Attention {
    /// Causal (lower-triangular) mask.
    pub causal: bool,
    /// Explicit scale; default 1/√E.
    pub scale: Option<f64>,
    /// An additive or boolean mask is the fourth input.
    pub mask: bool,
}

/// A recurrent layer stack.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct Rnn {
    /// LSTM, GRU or Elman cell.
    pub cell: RnnCell,
    /// Features per input step.
    pub input_size: u64,
    /// Hidden features.
    pub hidden_size: u64,
    /// Stacked layers.
    pub layers: u64,
    /// Runs both directions.
    pub bidirectional: bool,
    /// Input is (batch, seq, feature) rather than (seq, batch, feature).
    pub batch_first: bool,
    /// Gates have biases.
    pub bias: bool,
}

/// The cell of an [`Rnn`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RnnCell {
    /// Long short-term memory (4 gates).
    Lstm,
    /// Gated recurrent unit (3 gates).
    Gru,
    /// Elman RNN with tanh (1 gate).
    Tanh,
    /// Elman RNN with relu (1 gate).
    Relu,
}

impl RnnCell {
    /// Gate matrices per layer and direction.
    pub fn gates(self) -> u64 {
        match self {
            RnnCell::Lstm => 4,
            RnnCell::Gru => 3,
            RnnCell::Tanh | RnnCell::Relu => 1,
        }
    }
}

/// Data movement without arithmetic.
#[derive(Clone, Debug, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case", tag = "kind")]
pub enum Layout {
    /// Same elements, new shape (view, reshape, flatten, squeeze, unsqueeze).
    Reshape,
    /// Dims reordered (transpose, permute, `.T`): a strided view.
    Permute {
        /// Output dim i is input dim `perm[i]`.
        perm: Vec<usize>,
    },
    /// Broadcast view (`expand`).
    Expand,
    /// Materializes a strided view densely (`contiguous`, `clone`).
    Copy,
    /// Basic indexing: slices, integer indices, new axes (`x[:, -1]`, narrow,
    /// select, chunk, split).
    Slice {
        /// Human-readable subscript, e.g. `[:, -1, 0:4]`.
        subscript: String,
    },
    /// Advanced indexing with tensors (gather).
    Gather {
        /// The index as written, each index tensor a `#` in the order of
        /// the node's inputs after the first: `[#]`, `[:, #]`, `[#, #]`.
        /// Empty in graphs made before it was kept: those render only
        /// `x[index]` with one index tensor.
        #[serde(default)]
        subscript: String,
    },
    /// Concatenation along a dim.
    Concat {
        /// The joined dim.
        dim: usize,
    },
    /// Stacking along a new dim.
    Stack {
        /// The new dim.
        dim: usize,
    },
    /// Reverses the order along dims.
    Flip {
        /// Flipped dims.
        dims: Vec<usize>,
    },
    /// Circular shift.
    Roll {
        /// Shift per dim.
        shifts: Vec<i64>,
        /// Rolled dims.
        dims: Vec<usize>,
    },
    /// Constant or reflective padding.
    Pad {
        /// Padding pairs from the last dim backwards, as `F.pad` takes them.
        pads: Vec<i64>,
    },
    /// Element type conversion.
    Cast {
        /// Target type.
        to: DType,
    },
    /// Tiles the tensor (`repeat`).
    Repeat,
    /// Embeds a vector as the diagonal of a square matrix (`torch.diag`).
    DiagEmbed,
}

impl Layout {
    /// A view only changes strides or shape metadata: it moves no bytes by
    /// itself (the consumer reads the original memory).
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Layout::Reshape | Layout::Permute { .. } | Layout::Expand | Layout::Slice { .. }
        )
    }
}

/// Coarse operator classes, for listings and for the planner's features.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum OpClass {
    /// Inputs, parameters and constants.
    Source,
    /// Matrix products, einsum.
    Matmul,
    /// Convolutions.
    Conv,
    /// Elementwise unary, binary, scalar, where, triangular masks.
    Pointwise,
    /// Reductions.
    Reduction,
    /// Scans.
    Scan,
    /// Softmax and log-softmax.
    Softmax,
    /// Normalization layers.
    Norm,
    /// Pooling.
    Pool,
    /// Dropout.
    Dropout,
    /// Losses.
    Loss,
    /// Attention.
    Attention,
    /// Recurrent layers.
    Rnn,
    /// Data movement.
    Layout,
    /// Unknown operations.
    Opaque,
}

impl OpClass {
    /// Short lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            OpClass::Source => "source",
            OpClass::Matmul => "matmul",
            OpClass::Conv => "conv",
            OpClass::Pointwise => "pointwise",
            OpClass::Reduction => "reduce",
            OpClass::Scan => "scan",
            OpClass::Softmax => "softmax",
            OpClass::Norm => "norm",
            OpClass::Pool => "pool",
            OpClass::Dropout => "dropout",
            OpClass::Loss => "loss",
            OpClass::Attention => "attention",
            OpClass::Rnn => "rnn",
            OpClass::Layout => "layout",
            OpClass::Opaque => "opaque",
        }
    }
}

impl Op {
    /// The operator's class.
    pub fn class(&self) -> OpClass {
        match self {
            Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => OpClass::Source,
            Op::MatMul(_) | Op::Einsum { .. } => OpClass::Matmul,
            Op::Conv(_) => OpClass::Conv,
            Op::Unary(_)
            | Op::Binary(_)
            | Op::Scalar { .. }
            | Op::Where { .. }
            | Op::Triangular { .. } => OpClass::Pointwise,
            Op::Reduce(_) => OpClass::Reduction,
            Op::Scan(_) => OpClass::Scan,
            Op::Softmax { .. } => OpClass::Softmax,
            Op::Norm(_) => OpClass::Norm,
            Op::Pool(_) | Op::AdaptivePool(_) => OpClass::Pool,
            Op::Dropout { .. } => OpClass::Dropout,
            Op::Loss(_) => OpClass::Loss,
            Op::Attention(_) => OpClass::Attention,
            Op::Rnn(_) => OpClass::Rnn,
            Op::Layout(_) => OpClass::Layout,
            Op::Opaque { .. } => OpClass::Opaque,
        }
    }

    /// Whether the op is a graph source (no inputs).
    pub fn is_source(&self) -> bool {
        self.class() == OpClass::Source
    }

    /// Whether the op's output is its first input's elements, in the same
    /// order, under a new shape: a view of dense memory that costs no
    /// kernel (reshape and its kin, a copy of a dense tensor, inactive
    /// dropout).
    pub fn is_view(&self) -> bool {
        matches!(
            self,
            Op::Layout(Layout::Reshape | Layout::Copy) | Op::Dropout { active: false, .. }
        )
    }

    /// Whether the op is a submodule the tracer did not trace into (its
    /// forward branches on a value or keeps state across calls): it runs
    /// as Python on every call, so it is never cached or replayed.
    pub fn is_untraced(&self) -> bool {
        matches!(self, Op::Opaque { call: Some(c), .. } if c.untraced)
    }

    /// Whether running the op draws random numbers (random fills, active
    /// dropout): a forward with one computes other values from the same
    /// seed wherever something else draws before it.
    pub fn draws_random(&self) -> bool {
        matches!(
            self,
            Op::Constant {
                fill: Fill::Random | Fill::RandomNormal | Fill::RandomUniform
            } | Op::Dropout { active: true, .. }
        )
    }
}

fn dims(v: &[u64]) -> String {
    v.iter().map(u64::to_string).collect::<Vec<_>>().join("x")
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Op::Input { name } => write!(f, "input {name}"),
            Op::Param { name, trainable } => {
                write!(f, "{} {name}", if *trainable { "param" } else { "buffer" })
            }
            Op::Constant { fill } => write!(f, "constant {fill:?}"),
            Op::MatMul(m) => {
                write!(f, "matmul")?;
                if m.trans_a {
                    write!(f, " Aᵀ")?;
                }
                if m.trans_b {
                    write!(f, " Bᵀ")?;
                }
                if m.bias {
                    write!(f, " +bias")?;
                }
                Ok(())
            }
            Op::Conv(c) => write!(
                f,
                "conv{}d{} k={} s={} p={} d={} g={}{}",
                c.spatial,
                if c.transposed { "ᵀ" } else { "" },
                dims(&c.kernel),
                dims(&c.stride),
                dims(&c.padding),
                dims(&c.dilation),
                c.groups,
                if c.bias { " +bias" } else { "" }
            ),
            Op::Unary(u) => write!(f, "{}", unary_name(u)),
            Op::Binary(b) => write!(f, "{}", b.symbol()),
            Op::Scalar {
                op,
                value,
                scalar_first,
            } => {
                if *scalar_first {
                    write!(f, "{value} {} x", op.symbol())
                } else {
                    write!(f, "x {} {value}", op.symbol())
                }
            }
            Op::Where { fill: None } => write!(f, "where"),
            Op::Where { fill: Some(v) } => write!(f, "masked_fill {v}"),
            Op::Triangular { upper, diagonal } => {
                write!(f, "{}({diagonal})", if *upper { "triu" } else { "tril" })
            }
            Op::Reduce(r) => write!(
                f,
                "{} dims={:?}{}",
                reduce_name(&r.op),
                r.dims,
                if r.keepdim { " keepdim" } else { "" }
            ),
            Op::Scan(s) => write!(
                f,
                "cum{} dim={}{}{}",
                if s.prod { "prod" } else { "sum" },
                s.dim,
                if s.reverse { " reverse" } else { "" },
                if s.exclusive { " exclusive" } else { "" }
            ),
            Op::Softmax { dim, log } => {
                write!(f, "{}softmax dim={dim}", if *log { "log_" } else { "" })
            }
            Op::Norm(n) => {
                let kind = match &n.kind {
                    NormKind::Layer { dims } => format!("layer_norm over {dims} dims"),
                    NormKind::Rms { dims } => format!("rms_norm over {dims} dims"),
                    NormKind::RmsAt { dim } => format!("rms_norm dim={dim}"),
                    NormKind::Batch => "batch_norm".to_string(),
                    NormKind::Group { groups } => format!("group_norm groups={groups}"),
                    NormKind::Instance => "instance_norm".to_string(),
                    NormKind::Lp { p, dim } => format!("normalize p={p} dim={dim}"),
                };
                write!(f, "{kind} eps={}", n.eps)?;
                if matches!(n.kind, NormKind::Batch | NormKind::Instance) {
                    let stats = if n.batch_stats { "batch" } else { "running" };
                    write!(f, " stats={stats}")?;
                }
                if n.affine {
                    write!(f, " affine")?;
                }
                Ok(())
            }
            Op::Pool(p) => write!(
                f,
                "{}pool{}d k={} s={} p={}{}",
                if p.max { "max" } else { "avg" },
                p.spatial,
                dims(&p.kernel),
                dims(&p.stride),
                dims(&p.padding),
                if p.channels_last {
                    " channels-last"
                } else {
                    ""
                }
            ),
            Op::AdaptivePool(p) => write!(
                f,
                "{}{}pool → {}",
                if p.is_global() {
                    "global "
                } else {
                    "adaptive "
                },
                if p.max { "max" } else { "avg" },
                dims(&p.output)
            ),
            Op::Dropout { p, active } => {
                write!(
                    f,
                    "dropout p={p}{}",
                    if *active { "" } else { " (inactive)" }
                )
            }
            Op::Loss(l) => write!(f, "{:?} loss ({:?})", l.kind, l.reduction),
            Op::Attention(a) => write!(
                f,
                "attention{}{}",
                if a.causal { " causal" } else { "" },
                if a.mask { " masked" } else { "" }
            ),
            Op::Rnn(r) => write!(
                f,
                "{:?} in={} hidden={} layers={}{}",
                r.cell,
                r.input_size,
                r.hidden_size,
                r.layers,
                if r.bidirectional {
                    " bidirectional"
                } else {
                    ""
                }
            ),
            Op::Einsum { equation } => write!(f, "einsum {equation}"),
            Op::Layout(l) => match l {
                Layout::Permute { perm } => write!(f, "permute {perm:?}"),
                Layout::Slice { subscript } => write!(f, "slice {subscript}"),
                Layout::Gather { subscript } if subscript.is_empty() => write!(f, "gather"),
                Layout::Gather { subscript } => write!(f, "gather {subscript}"),
                Layout::Concat { dim } => write!(f, "concat dim={dim}"),
                Layout::Stack { dim } => write!(f, "stack dim={dim}"),
                Layout::Flip { dims } => write!(f, "flip {dims:?}"),
                Layout::Roll { shifts, dims } => write!(f, "roll {shifts:?} {dims:?}"),
                Layout::Pad { pads } => write!(f, "pad {pads:?}"),
                Layout::Cast { to } => write!(f, "cast {to}"),
                other => write!(f, "{}", format!("{other:?}").to_lowercase()),
            },
            Op::Opaque { target, .. } => write!(f, "opaque {target}"),
        }
    }
}

fn unary_name(u: &UnaryOp) -> String {
    match u {
        UnaryOp::LeakyRelu { slope } => format!("leaky_relu({slope})"),
        UnaryOp::Gelu { tanh: true } => "gelu(tanh)".to_string(),
        UnaryOp::Gelu { tanh: false } => "gelu".to_string(),
        UnaryOp::Hardtanh { min, max } => format!("hardtanh({min}, {max})"),
        UnaryOp::Softplus { beta, threshold } => format!("softplus(β={beta}, t={threshold})"),
        UnaryOp::Elu { alpha } => format!("elu({alpha})"),
        UnaryOp::Clamp { min, max } => format!(
            "clamp({}, {})",
            min.map_or("-".to_string(), |v| v.to_string()),
            max.map_or("-".to_string(), |v| v.to_string())
        ),
        other => {
            let s = format!("{other:?}");
            let mut out = String::new();
            for (i, c) in s.chars().enumerate() {
                if c.is_uppercase() && i > 0 {
                    out.push('_');
                }
                out.push(c.to_ascii_lowercase());
            }
            out
        }
    }
}

fn reduce_name(r: &ReduceOp) -> String {
    match r {
        ReduceOp::Max { indices: true } => "max+argmax".to_string(),
        ReduceOp::Max { .. } => "max".to_string(),
        ReduceOp::Min { indices: true } => "min+argmin".to_string(),
        ReduceOp::Min { .. } => "min".to_string(),
        ReduceOp::Norm { p } => format!("norm(p={p})"),
        ReduceOp::Var { correction } => format!("var(correction={correction})"),
        ReduceOp::Std { correction } => format!("std(correction={correction})"),
        other => format!("{other:?}").to_lowercase(),
    }
}

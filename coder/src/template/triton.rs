//! Triton fragments: the same families as the CUDA templates, written as
//! `@triton.jit` functions. A fragment's source assumes `triton` and `tl`
//! (`triton.language`) in scope, as the exported file and the compile
//! helper provide; it uses only `tl` (no libdevice), so that Triton's CPU
//! interpreter runs it too.
//!
//! - pointwise chains with broadcasting (and triu/tril): a program per
//!   `BLOCK = block × vector` elements, `block / 32` warps;
//! - reductions (sum, mean, max, min, L2 norm, logsumexp, argmax, argmin,
//!   global pooling) and softmax / log_softmax over a run of adjacent
//!   dims, seen as `[outer, K, inner]`: a program per row when `inner ==
//!   1`, else a program per `(outer, tile of columns)` over `[BK, BI]`
//!   tiles; a row of up to [`WHOLE_ROW`] elements is read once; a sum,
//!   mean, max or min over few long lines cuts each line into runs
//!   combined atomically ([`Split`]);
//! - layer, RMS, group and instance norm (batch statistics) with their
//!   scale and shift, and L1 / L2 normalization over the last dim, a
//!   program per normalized group; batch norm with
//!   batch statistics, a program per channel over its `N × spatial`
//!   elements, or per tile of channels for `[N, C]`;
//! - fp32 GEMMs (batched or not, either operand transposed) with their
//!   bias and the pointwise chain after them, a program per `128 × 128`
//!   (8 warps or more) or `64 × 64` output tile, `tl.dot` at `tf32x3`
//!   (fp32 accuracy);
//! - a pointwise chain fused in front of a row kernel: a jit function
//!   computing the chain's value at the offsets the kernel reads;
//! - max and average pooling over 1–3 spatial dims, channels first or
//!   last: a program per `BLOCK` outputs, each walking its window;
//! - cumsum and cumprod, forward or reverse, inclusive or exclusive: a
//!   program per row scanning tiles with a carry, or per block of columns
//!   stepping along the scanned dim;
//! - losses (mse, huber, smooth L1, cross-entropy, triplet margin) reduced
//!   to their mean or sum: a pass zeroing the result, then a fixed number
//!   of programs each adding its partial atomically.
//!
//! Loops run to the reduced extent written as a constant (shapes are
//! static): the interpreter cannot loop to a scalar argument.
//!
//! Everything else is refused with the reason (it stays a torch call).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{BinaryOp, LossKind, Norm, NormKind, Op, Reduction, Scan, UnaryOp};

use super::loss::LossView;
use super::pointwise::{boundary, broadcast_offset, broadcasts, shape};
use super::pool::Window;
use super::rows::{Kind, row_view};
use super::scan;
use super::{Refusal, f32_input};
use crate::MicroCoder;
use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Lang, Launch, Pass, Program};

/// Rows up to this long are loaded once into registers (softmax and norms
/// then make no second pass over memory).
pub const WHOLE_ROW: u64 = 8192;

/// Elements of one tile of a looping row kernel.
const TILE: u64 = 4096;

/// The Triton coder.
#[derive(Clone, Debug, Default)]
pub struct TritonCoder;

impl MicroCoder for TritonCoder {
    fn realize(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
    ) -> Result<Fragment, Refusal> {
        let nodes = action.nodes();
        if nodes.is_empty() {
            return Err(Refusal::new("the region is empty"));
        }
        let name = match action.kind {
            ActionKind::CallLibrary => {
                return Err(Refusal::new(super::LIBRARY));
            }
            ActionKind::FixCompile | ActionKind::FixCorrectness => {
                return Err(Refusal::new(super::REPAIRS));
            }
            ActionKind::CustomKernel if nodes.len() != 1 => {
                return Err(Refusal::new(super::ONE_OP));
            }
            ActionKind::Retile | ActionKind::Vectorize => program
                .fragments
                .iter()
                .find(|f| f.region.iter().any(|n| nodes.contains(n)))
                .map(|f| f.name.clone())
                .ok_or_else(|| Refusal::new("no kernel covers this region yet"))?,
            _ => format!("t{}_triton", program.fragments.len()),
        };
        let warps = warps(action)?;
        let position = |n: &NodeId| g.order().iter().position(|o| o == n);
        let last = *nodes
            .iter()
            .max_by_key(|n| position(n))
            .expect("the region is not empty");
        let first = *nodes
            .iter()
            .min_by_key(|n| position(n))
            .expect("the region is not empty");
        if matches!(g.node(first).op, Op::MatMul(_)) {
            let mut region = nodes.clone();
            region.sort_by_key(|n| position(n));
            let mut f = gemm(g, &region, &name, warps)?;
            f.action = action.clone();
            return Ok(f);
        }
        if matches!(g.node(last).op, Op::Pool(_) | Op::Scan(_) | Op::Loss(_)) {
            if nodes.len() > 1 {
                return Err(Refusal::new(format!(
                    "a Triton {} kernel covers that op alone: write the ops before it as a kernel of their own",
                    g.node(last).op
                )));
            }
            let mut f = match &g.node(last).op {
                Op::Pool(_) => pool(g, last, &name, warps, action.params.vector)?,
                Op::Loss(_) => loss(g, last, &name, warps, action.params.vector)?,
                _ => scan(g, last, &name, warps)?,
            };
            f.launch.block = warps * 32;
            f.action = action.clone();
            return Ok(f);
        }
        if !row_op(&g.node(last).op) {
            return pointwise(g, action, &name, warps);
        }
        let mut chain: Vec<NodeId> = nodes.iter().copied().filter(|&n| n != last).collect();
        chain.sort_by_key(|n| position(n));
        let input = g.inputs(last)[0];
        let wide = g.tensor(input).numel() >= 1 << 31;
        let loader = if chain.is_empty() {
            Loader::plain(&name, input)
        } else {
            Loader::chain(g, &chain, last, &name, wide)?
        };
        let mut f = match &g.node(last).op {
            Op::Norm(_) => norm(g, last, &name, loader, wide)?,
            _ => rows(g, last, &name, loader, wide)?,
        };
        f.launch.block = warps * 32;
        f.action = action.clone();
        let mut region = chain;
        region.push(last);
        f.region = region;
        Ok(f)
    }
}

/// Whether `op` is read by a row kernel (reduction, softmax, norm, global
/// pooling).
fn row_op(op: &Op) -> bool {
    match op {
        Op::Reduce(_) | Op::Softmax { .. } | Op::Norm(_) => true,
        Op::AdaptivePool(a) => a.is_global(),
        _ => false,
    }
}

/// The warps of a program: the action's block over 32, a power of two
/// from 1 to 32.
fn warps(action: &Action) -> Result<u32, Refusal> {
    let block = action.params.block;
    if !block.is_power_of_two() || !(32..=1024).contains(&block) {
        return Err(Refusal::new(format!(
            "block {block} is not a power of two from 32 to 1024 (Triton takes warps, block / 32)"
        )));
    }
    Ok(block / 32)
}

/// A Python float literal that reads back as the same float32.
fn lit(v: f64) -> Result<String, Refusal> {
    if v.is_nan() {
        return Err(Refusal::new(format!(
            "the constant {v} has no float literal"
        )));
    }
    if v.is_infinite() {
        return Ok(format!("float('{}inf')", if v > 0.0 { "" } else { "-" }));
    }
    let s = format!("{:?}", v as f32);
    Ok(if s.contains(['.', 'e', 'E']) {
        s
    } else {
        format!("{s}.0")
    })
}

/// `x` raised to the constant `p`: products for small integers, a square
/// root for ½, else through exp2 and log2 (NaN for negative `x`, as torch).
fn power(x: &str, p: f64) -> Result<String, Refusal> {
    Ok(match p {
        0.0 => format!("({x} * 0.0 + 1.0)"),
        1.0 => x.to_string(),
        2.0 => format!("({x} * {x})"),
        3.0 => format!("({x} * {x} * {x})"),
        4.0 => format!("(({x} * {x}) * ({x} * {x}))"),
        -1.0 => format!("(1.0 / {x})"),
        -2.0 => format!("(1.0 / ({x} * {x}))"),
        0.5 => format!("tl.sqrt_rn({x})"),
        _ => format!("tl.exp2({} * tl.log2({x}))", lit(p)?),
    })
}

/// tanh from exp: `sign(x) (1 − e^{−2|x|}) / (1 + e^{−2|x|})`.
fn tanh(x: &str) -> String {
    format!(
        "tl.where({x} >= 0.0, 1.0, -1.0) * (1.0 - tl.exp(-2.0 * tl.abs({x}))) / (1.0 + tl.exp(-2.0 * tl.abs({x})))"
    )
}

/// The Triton expression of a unary op applied to `x` (an identifier).
fn unary(u: &UnaryOp, x: &str) -> Result<String, Refusal> {
    Ok(match u {
        UnaryOp::Relu => format!("tl.maximum({x}, 0.0)"),
        UnaryOp::Relu6 => format!("tl.minimum(tl.maximum({x}, 0.0), 6.0)"),
        UnaryOp::LeakyRelu { slope } => format!("tl.where({x} > 0.0, {x}, {x} * {})", lit(*slope)?),
        UnaryOp::Gelu { tanh: false } => {
            format!("(0.5 * {x} * (1.0 + tl.erf({x} * 0.7071067811865476)))")
        }
        UnaryOp::Gelu { tanh: true } => format!(
            "(0.5 * {x} * (1.0 + {}))",
            tanh(&format!(
                "(0.7978845608028654 * ({x} + 0.044715 * {x} * {x} * {x}))"
            ))
        ),
        UnaryOp::Sigmoid => format!("tl.sigmoid({x})"),
        UnaryOp::Tanh => tanh(x),
        UnaryOp::Silu => format!("({x} * tl.sigmoid({x}))"),
        UnaryOp::Mish => format!(
            "({x} * {})",
            tanh(&format!(
                "tl.where({x} > 20.0, {x}, tl.log(1.0 + tl.exp({x})))"
            ))
        ),
        UnaryOp::Hardswish => {
            format!("({x} * tl.minimum(tl.maximum({x} + 3.0, 0.0), 6.0) / 6.0)")
        }
        UnaryOp::Hardsigmoid => format!("(tl.minimum(tl.maximum({x} + 3.0, 0.0), 6.0) / 6.0)"),
        UnaryOp::Hardtanh { min, max } => {
            format!(
                "tl.minimum(tl.maximum({x}, {}), {})",
                lit(*min)?,
                lit(*max)?
            )
        }
        UnaryOp::Softplus { beta, threshold } => {
            let (b, t) = (lit(*beta)?, lit(*threshold)?);
            format!("tl.where({b} * {x} > {t}, {x}, tl.log(1.0 + tl.exp({b} * {x})) / {b})")
        }
        UnaryOp::Softsign => format!("({x} / (1.0 + tl.abs({x})))"),
        UnaryOp::Elu { alpha } => {
            format!(
                "tl.where({x} > 0.0, {x}, {} * (tl.exp({x}) - 1.0))",
                lit(*alpha)?
            )
        }
        UnaryOp::Selu => format!(
            "(1.0507009873554805 * tl.where({x} > 0.0, {x}, 1.6732632423543772 * (tl.exp({x}) - 1.0)))"
        ),
        UnaryOp::Clamp { min, max } => {
            let mut e = x.to_string();
            if let Some(lo) = min {
                e = format!("tl.maximum({e}, {})", lit(*lo)?);
            }
            if let Some(hi) = max {
                e = format!("tl.minimum({e}, {})", lit(*hi)?);
            }
            e
        }
        UnaryOp::Exp => format!("tl.exp({x})"),
        UnaryOp::Log => format!("tl.log({x})"),
        UnaryOp::Abs => format!("tl.abs({x})"),
        UnaryOp::Neg => format!("(-{x})"),
        UnaryOp::Sqrt => format!("tl.sqrt_rn({x})"),
        UnaryOp::Rsqrt => format!("(1.0 / tl.sqrt_rn({x}))"),
        UnaryOp::Reciprocal => format!("(1.0 / {x})"),
        UnaryOp::Erf => format!("tl.erf({x})"),
        UnaryOp::Sin => format!("tl.sin({x})"),
        UnaryOp::Cos => format!("tl.cos({x})"),
        UnaryOp::Sign => format!("tl.where({x} > 0.0, 1.0, tl.where({x} < 0.0, -1.0, 0.0))"),
        UnaryOp::Not => {
            return Err(Refusal::new(
                "logical not makes a boolean tensor; only float32 chains are generated",
            ));
        }
    })
}

/// The Triton expression of a binary op.
fn binary(b: BinaryOp, x: &str, y: &str) -> Result<String, Refusal> {
    Ok(match b {
        BinaryOp::Add => format!("({x} + {y})"),
        BinaryOp::Sub => format!("({x} - {y})"),
        BinaryOp::Mul => format!("({x} * {y})"),
        BinaryOp::Div => format!("({x} / {y})"),
        BinaryOp::FloorDiv => format!("tl.floor({x} / {y})"),
        BinaryOp::Maximum => format!("tl.maximum({x}, {y})"),
        BinaryOp::Minimum => format!("tl.minimum({x}, {y})"),
        BinaryOp::Pow => {
            return Err(Refusal::new(
                "a tensor raised to a tensor has no Triton template (only constant exponents)",
            ));
        }
        // An int1, which only a where reads (see `pointwise::conditions`).
        cmp => format!("({x} {} {y})", cmp.symbol()),
    })
}

/// The Triton expression computing pointwise node `n` from its operands
/// `ins`, with coordinates `c{d}` of `full` in scope for triu and tril.
fn node_expr(g: &OpGraph, n: NodeId, ins: &[String], full: &[u64]) -> Result<String, Refusal> {
    Ok(match &g.node(n).op {
        Op::Unary(u) => unary(u, &ins[0])?,
        Op::Binary(b) => binary(*b, &ins[0], &ins[1])?,
        Op::Scalar {
            op: BinaryOp::Pow,
            value,
            scalar_first: false,
        } => power(&ins[0], *value)?,
        Op::Scalar {
            op: BinaryOp::Pow,
            value,
            scalar_first: true,
        } => {
            if *value <= 0.0 {
                return Err(Refusal::new(
                    "a non-positive constant raised to a tensor has no Triton template",
                ));
            }
            format!("tl.exp2({} * {})", ins[0], lit(value.log2())?)
        }
        Op::Scalar {
            op,
            value,
            scalar_first,
        } => {
            let c = lit(*value)?;
            if *scalar_first {
                binary(*op, &c, &ins[0])?
            } else {
                binary(*op, &ins[0], &c)?
            }
        }
        Op::Triangular { upper, diagonal } => {
            let (row, col) = (full.len() - 2, full.len() - 1);
            let keep = if *upper { ">=" } else { "<=" };
            format!(
                "tl.where(c{col} - c{row} {keep} {diagonal}, {}, 0.0)",
                ins[0]
            )
        }
        // masked_fill(x, mask, fill): the fill where the mask holds.
        Op::Where { fill: Some(v) } => format!("tl.where({}, {}, {})", ins[1], lit(*v)?, ins[0]),
        Op::Where { fill: None } => format!("tl.where({}, {}, {})", ins[0], ins[1], ins[2]),
        other => {
            return Err(Refusal::new(format!(
                "`{}` ({other}) is not a pointwise op this template writes",
                g.node(n).name
            )));
        }
    })
}

/// Lines (each with `indent`) computing `chain`'s values at the flat
/// offsets `i` of `full` under the mask `m`, reading input `k` through
/// pointer `ptrs[k]`; and the name each tensor's value has.
fn chain_body(
    g: &OpGraph,
    chain: &[NodeId],
    inputs: &[TensorRef],
    ptrs: &[String],
    full: &[u64],
    indent: &str,
) -> Result<(String, HashMap<TensorRef, String>), Refusal> {
    chain_lines(g, chain, inputs, ptrs, full, indent, None)
}

/// [`chain_body`] for a chain after a kernel that holds `given`'s value
/// at `i` in a variable (a GEMM's accumulator), at one level of indent.
fn chain_body_after(
    g: &OpGraph,
    chain: &[NodeId],
    inputs: &[TensorRef],
    ptrs: &[String],
    full: &[u64],
    given: (TensorRef, &str),
) -> Result<(String, HashMap<TensorRef, String>), Refusal> {
    chain_lines(g, chain, inputs, ptrs, full, "    ", Some(given))
}

/// The lines of a chain body: coordinates, loads of `inputs`, then one
/// line per node; `given` names a value already held.
fn chain_lines(
    g: &OpGraph,
    chain: &[NodeId],
    inputs: &[TensorRef],
    ptrs: &[String],
    full: &[u64],
    indent: &str,
    given: Option<(TensorRef, &str)>,
) -> Result<(String, HashMap<TensorRef, String>), Refusal> {
    let mut src = String::new();
    let mut coords = HashSet::new();
    // `i * 0` where every element reads the same one: zeros shaped as `i`.
    let offsets: Vec<String> = inputs
        .iter()
        .map(|&t| broadcast_offset(&shape(g, t), full, &mut coords, "", "i * 0"))
        .collect();
    if chain
        .iter()
        .any(|&n| matches!(g.node(n).op, Op::Triangular { .. }))
    {
        coords.extend([full.len() - 2, full.len() - 1]);
    }
    let mut coords: Vec<usize> = coords.into_iter().collect();
    coords.sort_unstable();
    for d in coords {
        let inner: u64 = full[d + 1..].iter().product();
        let _ = writeln!(src, "{indent}c{d} = (i // {inner}) % {}", full[d]);
    }
    let mut names: HashMap<TensorRef, String> = HashMap::new();
    if let Some((t, var)) = given {
        names.insert(t, var.to_string());
    }
    for (k, (&t, off)) in inputs.iter().zip(&offsets).enumerate() {
        // A boolean (a where's condition) loads as int1.
        let other = if g.tensor(t).dtype == DType::Bool {
            "0"
        } else {
            "0.0"
        };
        let _ = writeln!(
            src,
            "{indent}v{k} = tl.load({} + {off}, mask=m, other={other})",
            ptrs[k]
        );
        names.insert(t, format!("v{k}"));
    }
    for &n in chain {
        let ins: Vec<String> = g.inputs(n).iter().map(|t| names[t].clone()).collect();
        let var = format!("t{}", n.index());
        let _ = writeln!(src, "{indent}{var} = {}", node_expr(g, n, &ins, full)?);
        names.insert(TensorRef::first(n), var);
    }
    Ok((src, names))
}

/// Checks that `region` is pointwise ops that broadcast to `full`, float32
/// but for comparisons and boolean inputs read as a where's condition.
fn check_pointwise(g: &OpGraph, region: &[NodeId], full: &[u64]) -> Result<(), Refusal> {
    for &n in region {
        let node = g.node(n);
        if !matches!(
            node.op,
            Op::Unary(_)
                | Op::Binary(_)
                | Op::Scalar { .. }
                | Op::Where { .. }
                | Op::Triangular { .. }
        ) {
            return Err(Refusal::new(format!(
                "`{}` ({}) is not a pointwise op this template writes",
                node.name, node.op
            )));
        }
        if !broadcasts(&shape(g, TensorRef::first(n)), full) {
            return Err(Refusal::new(format!(
                "`{}` does not broadcast to the region's shape",
                node.name
            )));
        }
        if matches!(node.op, Op::Triangular { .. })
            && (full.len() < 2 || shape(g, TensorRef::first(n)) != full)
        {
            return Err(Refusal::new(
                "triu and tril need a matrix at the region's full shape",
            ));
        }
    }
    super::pointwise::conditions(g, region, &boundary(g, region).0)?;
    Ok(())
}

/// The program's flat index: int64 when the tensor is too large for int32.
fn program_id(wide: bool) -> &'static str {
    if wide {
        "tl.program_id(0).to(tl.int64)"
    } else {
        "tl.program_id(0)"
    }
}

/// A fused pointwise chain.
fn pointwise(g: &OpGraph, action: &Action, name: &str, warps: u32) -> Result<Fragment, Refusal> {
    let region = action.nodes();
    let (inputs, outputs) = boundary(g, &region);
    if outputs.is_empty() {
        return Err(Refusal::new("nothing reads the region's results"));
    }
    let full = shape(g, outputs[0]);
    if let Some(t) = outputs.iter().find(|&&t| shape(g, t) != full) {
        return Err(Refusal::new(format!(
            "the region's outputs differ in shape ({} and {}): split it",
            g.tensor(outputs[0]),
            g.tensor(*t)
        )));
    }
    check_pointwise(g, &region, &full)?;
    let vector = action.params.vector;
    vector_width(vector)?;
    let numel: u64 = full.iter().product();
    let block = u64::from(warps * 32 * vector);
    let ptrs: Vec<String> = (0..inputs.len()).map(|k| format!("in{k}")).collect();
    let (body, names) = chain_body(g, &region, &inputs, &ptrs, &full, "    ")?;
    let params: Vec<String> = ptrs
        .iter()
        .cloned()
        .chain((0..outputs.len()).map(|k| format!("out{k}")))
        .chain(["n".to_string()])
        .collect();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {} fused pointwise op(s) over {numel} elements, {block} per program",
        region.len()
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    let wide = numel + block >= 1 << 31;
    let _ = writeln!(
        src,
        "    i = {} * {block} + tl.arange(0, {block})",
        program_id(wide)
    );
    src.push_str("    m = i < n\n");
    src.push_str(&body);
    for (k, t) in outputs.iter().enumerate() {
        let _ = writeln!(src, "    tl.store(out{k} + i, {}, mask=m)", names[t]);
    }
    Ok(Fragment {
        name: name.to_string(),
        action: action.clone(),
        lang: Lang::Triton,
        source: src,
        inputs,
        outputs,
        region,
        launch: Launch {
            shared: 0,
            grid: grid(numel.div_ceil(block))?,
            block: warps * 32,
            sizes: vec![numel as i64],
        },
        before: Vec::new(),
    })
}

/// Refuses a vector width other than 1, 2 or 4.
fn vector_width(vector: u32) -> Result<(), Refusal> {
    if [1, 2, 4].contains(&vector) {
        Ok(())
    } else {
        Err(Refusal::new(format!(
            "vector width {vector} is not 1, 2 or 4"
        )))
    }
}

/// A grid of `programs`, within what one launch dimension holds.
fn grid(programs: u64) -> Result<u32, Refusal> {
    u32::try_from(programs.max(1))
        .ok()
        .filter(|&p| p < i32::MAX as u32)
        .ok_or_else(|| Refusal::new(format!("{programs} programs do not fit one grid")))
}

/// How a row kernel reads its input at offsets `o` under mask `m`: a jit
/// function `{name}_x(o, m, …)` with the kernel's leading pointer
/// parameters.
struct Loader {
    /// The jit function's source.
    source: String,
    /// The kernel's leading pointer parameters (passed on to the function).
    params: Vec<String>,
    /// The tensors they point to.
    inputs: Vec<TensorRef>,
    /// The function's name.
    function: String,
}

impl Loader {
    /// Reads the input from memory.
    fn plain(name: &str, input: TensorRef) -> Loader {
        let function = format!("{name}_x");
        Loader {
            source: format!(
                "@triton.jit\ndef {function}(i, m, x):\n    return tl.load(x + i, mask=m, other=0.0)\n"
            ),
            params: vec!["x".into()],
            inputs: vec![input],
            function,
        }
    }

    /// Computes the pointwise `chain` (read by nothing but `reader`) where
    /// the kernel reads its result.
    fn chain(
        g: &OpGraph,
        chain: &[NodeId],
        reader: NodeId,
        name: &str,
        wide: bool,
    ) -> Result<Loader, Refusal> {
        let (inputs, outputs) = boundary(g, chain);
        let read_elsewhere = chain.iter().any(|&n| {
            g.consumers(n)
                .iter()
                .any(|c| *c != reader && !chain.contains(c))
        });
        let (&[output], false) = (&outputs[..], read_elsewhere) else {
            return Err(Refusal::new(
                "a fused prologue must have one result, read only by the kernel after it",
            ));
        };
        if g.outputs().contains(&output) || g.inputs(reader).first() != Some(&output) {
            return Err(Refusal::new(
                "the prologue's result must be the row kernel's input and no graph output",
            ));
        }
        let full = shape(g, output);
        // Float32 inputs, and booleans only a where's condition reads.
        check_pointwise(g, chain, &full)?;
        let params: Vec<String> = (0..inputs.len()).map(|k| format!("px{k}")).collect();
        let (body, names) = chain_body(g, chain, &inputs, &params, &full, "    ")?;
        let function = format!("{name}_x");
        let mut source = format!(
            "# {function}: {} pointwise op(s) fused in front of {name}{}\n",
            chain.len(),
            if wide { " (int64 offsets)" } else { "" }
        );
        let _ = writeln!(
            source,
            "@triton.jit\ndef {function}(i, m, {}):",
            params.join(", ")
        );
        source.push_str(&body);
        let _ = writeln!(source, "    return {}", names[&output]);
        Ok(Loader {
            source,
            params,
            inputs,
            function,
        })
    }

    /// The expression loading offsets `o` under mask `m`.
    fn load(&self, o: &str, m: &str) -> String {
        format!("{}({o}, {m}, {})", self.function, self.params.join(", "))
    }
}

/// Identity, the update of the accumulator `acc` with element `v`, and
/// the reduction that ends the one-pass reductions of `kind`.
fn monoid(kind: Kind) -> Option<(&'static str, &'static str, &'static str)> {
    Some(match kind {
        Kind::Sum | Kind::Mean => ("0.0", "acc + v", "tl.sum"),
        Kind::Norm2 => ("0.0", "acc + v * v", "tl.sum"),
        Kind::Max => ("float(\"-inf\")", "tl.maximum(acc, v)", "tl.max"),
        Kind::Min => ("float(\"inf\")", "tl.minimum(acc, v)", "tl.min"),
        _ => return None,
    })
}

/// The next power of two at or above `n`.
fn pow2(n: u64) -> u64 {
    n.max(1).next_power_of_two()
}

/// A reduction, softmax or global pooling over `[outer, K, inner]`.
fn rows(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    loader: Loader,
    wide: bool,
) -> Result<Fragment, Refusal> {
    let n = g.node(node);
    let input = g.inputs(node)[0];
    let shape = g.tensor(input).shape.clone();
    if n.outputs.len() > 1
        && (g.outputs().iter().any(|t| t.node == node && t.output > 0)
            || g.consumers(node)
                .iter()
                .any(|&c| g.inputs(c).iter().any(|t| t.node == node && t.output > 0)))
    {
        return Err(Refusal::new(format!(
            "`{}`'s indices are read; no Triton row kernel writes indices yet",
            n.name
        )));
    }
    let (kind, dims) = Kind::of(&n.op, shape.len(), &n.name, "Triton row kernel")?;
    let out_dtype = if matches!(kind, Kind::Arg { .. }) {
        DType::I64
    } else {
        DType::F32
    };
    if g.tensor(input).dtype != DType::F32 || n.outputs[0].dtype != out_dtype {
        return Err(Refusal::new(format!(
            "`{}` is not float32 in and {} out",
            n.name,
            if out_dtype == DType::I64 {
                "int64"
            } else {
                "float32"
            }
        )));
    }
    if matches!(kind, Kind::Arg { .. }) && dims.len() > 1 {
        return Err(Refusal::new("argmax and argmin run over one dim"));
    }
    let (outer, k, inner) = row_view(&shape, &dims)?;
    let columns = inner > 1;
    // Tile: [BK] along a row, or [BK, BI] with BI neighbouring columns.
    let bi = if columns { pow2(inner).min(64) } else { 1 };
    let bk = pow2(k).min((TILE / bi).max(1));
    let whole = !columns && k <= WHOLE_ROW;
    let bk = if whole { pow2(k) } else { bk };
    let tiles = inner.div_ceil(bi);
    let split = Split::of(kind, outer * tiles, k, bk);
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {kind:?} over [{outer}, {k}, {inner}] (outer, reduced, inner), tiles of [{bk}, {bi}]{}",
        split.map_or(String::new(), |s| format!(
            ", each line cut into {} runs of {} combined atomically",
            s.parts, s.run
        ))
    );
    if let Some(s) = split {
        s.init(&mut src, name, &loader.params, kind, columns);
    }
    src.push_str(&loader.source);
    let mut params = loader.params.clone();
    params.push("y".into());
    params.extend(if columns {
        vec!["OUTER".to_string(), "K".into(), "INNER".into()]
    } else {
        vec!["R".to_string(), "K".into()]
    });
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    let pid = program_id(wide);
    // A split line: program `pid` takes run `s` of line `pid // parts`.
    let (pid, k0, k_end) = match split {
        Some(s) => {
            let _ = writeln!(src, "    q = {pid}");
            let _ = writeln!(src, "    s = q % {}", s.parts);
            (
                format!("q // {}", s.parts),
                format!("s * {} + ", s.run),
                s.run,
            )
        }
        None => (pid.to_string(), String::new(), k),
    };
    // Per kind, the shapes: `kk` the tile's steps along K, `mask` the
    // tile's mask, `at` its offsets; `out` where a row's result goes.
    let (step, mask, at, out, out_mask, axis_shape) = if columns {
        let _ = writeln!(src, "    pid = {pid}");
        let _ = writeln!(src, "    o = pid // {tiles}");
        let _ = writeln!(src, "    c = (pid % {tiles}) * {bi} + tl.arange(0, {bi})");
        src.push_str("    cm = c < INNER\n");
        src.push_str("    base = o * K * INNER + c\n");
        let _ = writeln!(src, "    k = tl.arange(0, {bk})");
        (
            format!("kk = {k0}k0 + k"),
            "(kk < K)[:, None] & cm[None, :]".to_string(),
            "base[None, :] + kk[:, None] * INNER".to_string(),
            "y + o * INNER + c".to_string(),
            ", mask=cm".to_string(),
            format!("[{bk}, {bi}]"),
        )
    } else {
        let _ = writeln!(src, "    r = {pid}");
        src.push_str("    base = r * K\n");
        let _ = writeln!(src, "    k = tl.arange(0, {bk})");
        (
            format!("kk = {k0}k0 + k"),
            "kk < K".to_string(),
            "base + kk".to_string(),
            "y + r".to_string(),
            String::new(),
            format!("[{bk}]"),
        )
    };
    let tile = |src: &mut String, ident: &str| {
        let _ = writeln!(src, "        {step}");
        let _ = writeln!(src, "        m = {mask}");
        let _ = writeln!(
            src,
            "        v = tl.where(m, {}, {ident})",
            loader.load(&at, "m")
        );
    };
    let finish = |acc: &str| match kind {
        Kind::Mean => format!("{acc} / K"),
        Kind::Norm2 => format!("tl.sqrt_rn({acc})"),
        _ => acc.to_string(),
    };
    if let Some((ident, update, reduce)) = monoid(kind) {
        let _ = writeln!(src, "    acc = tl.full({axis_shape}, {ident}, tl.float32)");
        let _ = writeln!(src, "    for k0 in range(0, {k_end}, {bk}):");
        tile(&mut src, ident);
        let _ = writeln!(src, "        acc = {update}");
        let _ = writeln!(src, "    res = {reduce}(acc, axis=0)");
        match split {
            Some(_) => {
                let _ = writeln!(
                    src,
                    "    {}({out}, {}{out_mask})",
                    Split::combine(kind),
                    finish("res")
                );
            }
            None => {
                let _ = writeln!(src, "    tl.store({out}, {}{out_mask})", finish("res"));
            }
        }
    } else if let Kind::Arg { max } = kind {
        let (ident, better) = if max {
            ("float(\"-inf\")", ">")
        } else {
            ("float(\"inf\")", "<")
        };
        let _ = writeln!(src, "    best = tl.full({axis_shape}, {ident}, tl.float32)");
        let _ = writeln!(src, "    at = tl.full({axis_shape}, 0, tl.int64)");
        let _ = writeln!(src, "    for k0 in range(0, {k}, {bk}):");
        tile(&mut src, ident);
        // Each lane keeps its first best (strictly better replaces); the
        // lowest index among the lanes holding the best wins, as in torch.
        let _ = writeln!(src, "        better = v {better} best");
        src.push_str("        best = tl.where(better, v, best)\n");
        let steps = if columns {
            "(kk[:, None] + c[None, :] * 0).to(tl.int64)".to_string()
        } else {
            "kk.to(tl.int64)".to_string()
        };
        let _ = writeln!(src, "        at = tl.where(better, {steps}, at)");
        let _ = writeln!(
            src,
            "    top = {}(best, axis=0)",
            if max { "tl.max" } else { "tl.min" }
        );
        let top = if columns { "top[None, :]" } else { "top" };
        let _ = writeln!(
            src,
            "    res = tl.min(tl.where(best == {top}, at, K), axis=0)"
        );
        let _ = writeln!(src, "    tl.store({out}, res{out_mask})");
    } else if whole {
        // The whole row in registers: one read.
        src.push_str("    m = k < K\n");
        let _ = writeln!(
            src,
            "    v = tl.where(m, {}, float(\"-inf\"))",
            loader.load("base + k", "m")
        );
        src.push_str("    top = tl.max(v, axis=0)\n");
        src.push_str("    e = tl.where(m, tl.exp(v - top), 0.0)\n");
        src.push_str("    s = tl.sum(e, axis=0)\n");
        match kind {
            Kind::LogSumExp => src.push_str("    tl.store(y + r, top + tl.log(s))\n"),
            Kind::Softmax { log: false } => {
                src.push_str("    tl.store(y + base + k, e / s, mask=m)\n")
            }
            _ => src.push_str("    tl.store(y + base + k, v - top - tl.log(s), mask=m)\n"),
        }
    } else {
        // One online pass for the maximum and the sum of exponentials
        // (each lane rescales its sum when its maximum grows), then one
        // pass for the output. A lane that has seen only -inf keeps 0.
        let _ = writeln!(
            src,
            "    mx = tl.full({axis_shape}, float(\"-inf\"), tl.float32)"
        );
        let _ = writeln!(src, "    sv = tl.zeros({axis_shape}, tl.float32)");
        let _ = writeln!(src, "    for k0 in range(0, {k}, {bk}):");
        tile(&mut src, "float(\"-inf\")");
        src.push_str(
            "        nm = tl.maximum(mx, v)
",
        );
        src.push_str("        sv = sv * tl.exp(tl.where(nm == float(\"-inf\"), 0.0, mx - nm)) + tl.where(v == float(\"-inf\"), 0.0, tl.exp(v - nm))
");
        src.push_str(
            "        mx = nm
",
        );
        src.push_str(
            "    top = tl.max(mx, axis=0)
",
        );
        let top = if columns { "top[None, :]" } else { "top" };
        let _ = writeln!(
            src,
            "    s = tl.sum(tl.where(mx == float(\"-inf\"), 0.0, sv * tl.exp(mx - {top})), axis=0)"
        );
        let s = if columns { "s[None, :]" } else { "s" };
        match kind {
            Kind::LogSumExp => {
                let _ = writeln!(src, "    tl.store({out}, top + tl.log(s){out_mask})");
            }
            Kind::Softmax { log } => {
                let _ = writeln!(src, "    for k0 in range(0, {k}, {bk}):");
                tile(&mut src, "float(\"-inf\")");
                let value = if log {
                    format!("v - {top} - tl.log({s})")
                } else {
                    format!("tl.exp(v - {top}) / {s}")
                };
                let _ = writeln!(src, "        tl.store(y + {at}, {value}, mask=m)");
            }
            _ => unreachable!("only softmax and logsumexp are left"),
        }
    }
    let (programs, sizes) = if columns {
        (outer * tiles, vec![outer as i64, k as i64, inner as i64])
    } else {
        (outer, vec![outer as i64, k as i64])
    };
    let parts = split.map_or(1, |s| s.parts);
    let mut f = node_fragment(
        name,
        node,
        src,
        loader.inputs,
        grid(programs * parts)?,
        sizes.clone(),
    )?;
    if split.is_some() {
        f.before = vec![Pass {
            kernel: format!("{name}_init"),
            launch: Launch {
                shared: 0,
                grid: grid((outer * inner).div_ceil(INIT_BLOCK))?,
                block: 128,
                sizes,
            },
        }];
    }
    Ok(f)
}

/// Lines (rows, or tiles of columns) below this many are cut into runs
/// along the reduced dim, so that the GPU has work for every SM.
const SPLIT_BELOW: u64 = 132 * 2;

/// Programs a split reduction aims at.
const SPLIT_PROGRAMS: u64 = 132 * 8;

/// Outputs one program of a split reduction's first pass sets.
const INIT_BLOCK: u64 = 1024;

/// A reduction whose lines are few and long, each cut into `parts` runs of
/// `run` elements (a multiple of the tile): a pass sets every output to the
/// identity, then a program per run combines its partial into the output
/// with an atomic add, max or min.
#[derive(Clone, Copy, Debug)]
struct Split {
    parts: u64,
    run: u64,
}

impl Split {
    /// The split of `lines` lines of `k` reduced elements in tiles of `bk`,
    /// if the kind combines atomically (sum, mean, max, min) and the lines
    /// are too few to fill the GPU.
    fn of(kind: Kind, lines: u64, k: u64, bk: u64) -> Option<Split> {
        if !matches!(kind, Kind::Sum | Kind::Mean | Kind::Max | Kind::Min)
            || lines >= SPLIT_BELOW
            || k < 4 * bk
        {
            return None;
        }
        let tiles = k.div_ceil(bk);
        let want = SPLIT_PROGRAMS.div_ceil(lines).min(tiles);
        let run = tiles.div_ceil(want) * bk;
        let parts = k.div_ceil(run);
        (parts > 1).then_some(Split { parts, run })
    }

    /// The atomic that combines a run's partial into the output.
    fn combine(kind: Kind) -> &'static str {
        match kind {
            Kind::Max => "tl.atomic_max",
            Kind::Min => "tl.atomic_min",
            _ => "tl.atomic_add",
        }
    }

    /// The first pass, `{name}_init`: every output set to the identity of
    /// `kind`, [`INIT_BLOCK`] outputs a program.
    fn init(self, src: &mut String, name: &str, params: &[String], kind: Kind, columns: bool) {
        let ident = match kind {
            Kind::Max => "float(\"-inf\")",
            Kind::Min => "float(\"inf\")",
            _ => "0.0",
        };
        let (sizes, outs) = if columns {
            ("OUTER, K, INNER", "OUTER * INNER")
        } else {
            ("R, K", "R")
        };
        let _ = writeln!(
            src,
            "@triton.jit\ndef {name}_init({}, y, {sizes}):\n    i = tl.program_id(0) * {INIT_BLOCK} + tl.arange(0, {INIT_BLOCK})\n    tl.store(y + i, tl.full([{INIT_BLOCK}], {ident}, tl.float32), mask=i < {outs})",
            params.join(", ")
        );
    }
}

/// The fragment of a kernel computing the one node `node`: a custom kernel
/// on that node, `programs` programs; the launch's warps are set by
/// `realize`, from the action.
fn node_fragment(
    name: &str,
    node: NodeId,
    source: String,
    inputs: Vec<TensorRef>,
    programs: u32,
    sizes: Vec<i64>,
) -> Result<Fragment, Refusal> {
    Ok(Fragment {
        name: name.to_string(),
        action: Action {
            kind: ActionKind::CustomKernel,
            region: vec![node.index() as u32],
            params: Default::default(),
        },
        lang: Lang::Triton,
        source,
        inputs,
        outputs: vec![TensorRef::first(node)],
        region: vec![node],
        launch: Launch {
            shared: 0,
            grid: programs,
            block: 0,
            sizes,
        },
        before: Vec::new(),
    })
}

/// Layer, RMS, group and instance norm (batch statistics), and L1 / L2
/// normalization over any dim: a program per normalized group (a
/// contiguous row; for L1 / L2 over an inner dim, a line whose elements
/// lie the inner extent apart), the mean (not for RMS and Lp), then the
/// sum of the squared deviations (of the absolute values for L1), then the
/// scaled and shifted output.
fn norm(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    loader: Loader,
    wide: bool,
) -> Result<Fragment, Refusal> {
    let n = g.node(node);
    let Op::Norm(Norm {
        kind,
        eps,
        affine,
        bias,
        batch_stats,
    }) = &n.op
    else {
        return Err(Refusal::new(format!("`{}` is not a norm", n.name)));
    };
    let ins = g.inputs(node);
    if ins.iter().any(|&t| g.tensor(t).dtype != DType::F32) || n.outputs[0].dtype != DType::F32 {
        return Err(Refusal::new(format!("`{}` is not float32", n.name)));
    }
    let shape = g.tensor(ins[0]).shape.clone();
    if matches!(kind, NormKind::Batch) && *batch_stats && shape.len() >= 2 {
        return batch_norm(g, node, name, loader, wide, (*eps, *affine, *bias));
    }
    // (rows, K, the affine index from r and kk); a row's elements lie
    // `inner` apart.
    let mut inner = 1;
    let (rows, k, channel) = match kind {
        NormKind::Layer { dims } | NormKind::Rms { dims } => {
            let split = shape.len() - dims;
            (
                shape[..split].iter().product::<u64>(),
                shape[split..].iter().product::<u64>(),
                "kk".to_string(),
            )
        }
        NormKind::Group { groups } if *batch_stats => {
            if shape.len() < 2 || !shape[1].is_multiple_of(*groups) {
                return Err(Refusal::new(
                    "group norm needs [N, C, ...] with C divisible by the groups",
                ));
            }
            let spatial: u64 = shape[2..].iter().product();
            let per_group = shape[1] / groups;
            (
                shape[0] * groups,
                per_group * spatial,
                format!("(r % {groups}) * {per_group} + kk // {spatial}"),
            )
        }
        NormKind::Instance if *batch_stats && shape.len() >= 3 => (
            shape[0] * shape[1],
            shape[2..].iter().product(),
            format!("r % {} + kk * 0", shape[1]),
        ),
        NormKind::Lp { p, dim } if (*p == 1.0 || *p == 2.0) && *dim < shape.len() => {
            inner = shape[dim + 1..].iter().product::<u64>();
            (
                shape[..*dim].iter().product::<u64>() * inner,
                shape[*dim],
                "kk".to_string(),
            )
        }
        other => {
            return Err(Refusal::new(format!(
                "no Triton norm kernel yet for {other:?}{}",
                if *batch_stats {
                    ""
                } else {
                    " with running statistics"
                }
            )));
        }
    };
    // Uncentred (RMS, Lp) or not; each element's term of the sum; the
    // factor `rstd` from the sum.
    let eps = lit(*eps)?;
    let (rms, term, rstd) = match kind {
        NormKind::Lp { p, .. } => (
            true,
            if *p == 1.0 { "tl.abs(d)" } else { "d * d" },
            if *p == 1.0 {
                format!("1.0 / tl.maximum(SUM, {eps})")
            } else {
                format!("1.0 / tl.maximum(tl.sqrt_rn(SUM), {eps})")
            },
        ),
        _ => (
            matches!(kind, NormKind::Rms { .. }),
            "d * d",
            format!("1.0 / tl.sqrt_rn(SUM / K + {eps})"),
        ),
    };
    let whole = k <= WHOLE_ROW;
    let bk = if whole { pow2(k) } else { TILE };
    let (mut src, inputs) = norm_head(
        name,
        &format!("{kind:?} over {rows} rows of {k} (eps {eps}), tiles of {bk}"),
        &loader,
        &ins,
        (*affine, *bias),
    );
    let _ = writeln!(src, "    r = {}", program_id(wide));
    // The row's first element, and element kk's offset from it.
    let at = if inner == 1 {
        src.push_str("    base = r * K\n");
        "base + kk".to_string()
    } else {
        let _ = writeln!(
            src,
            "    base = (r // {inner}) * {} + r % {inner}",
            k * inner
        );
        format!("base + kk * {inner}")
    };
    let _ = writeln!(src, "    k = tl.arange(0, {bk})");
    let mut out = "d * rstd".to_string();
    if *affine {
        out += &format!(" * tl.load(w + {channel}, mask=m, other=0.0)");
    }
    if *bias {
        out += &format!(" + tl.load(b + {channel}, mask=m, other=0.0)");
    }
    let load = loader.load(&at, "m");
    if whole {
        src.push_str("    kk = k\n    m = kk < K\n");
        let _ = writeln!(src, "    v = tl.where(m, {load}, 0.0)");
        if rms {
            src.push_str("    mean = 0.0\n");
        } else {
            src.push_str("    mean = tl.sum(v, axis=0) / K\n");
        }
        src.push_str("    d = tl.where(m, v - mean, 0.0)\n");
        let _ = writeln!(src, "    ss = tl.sum({term}, axis=0)");
        let _ = writeln!(src, "    rstd = {}", rstd.replace("SUM", "ss"));
        let _ = writeln!(src, "    tl.store(y + {at}, {out}, mask=m)");
    } else {
        let pass = |src: &mut String| {
            let _ = writeln!(src, "    for k0 in range(0, {k}, {bk}):");
            src.push_str("        kk = k0 + k\n        m = kk < K\n");
            let _ = writeln!(src, "        v = tl.where(m, {load}, 0.0)");
        };
        if rms {
            src.push_str("    mean = 0.0\n");
        } else {
            let _ = writeln!(src, "    sv = tl.zeros([{bk}], tl.float32)");
            pass(&mut src);
            src.push_str("        sv += v\n");
            src.push_str("    mean = tl.sum(sv, axis=0) / K\n");
        }
        let _ = writeln!(src, "    qv = tl.zeros([{bk}], tl.float32)");
        pass(&mut src);
        let _ = writeln!(
            src,
            "        d = tl.where(m, v - mean, 0.0)\n        qv += {term}"
        );
        let _ = writeln!(
            src,
            "    rstd = {}",
            rstd.replace("SUM", "tl.sum(qv, axis=0)")
        );
        pass(&mut src);
        src.push_str("        d = v - mean\n");
        let _ = writeln!(src, "        tl.store(y + {at}, {out}, mask=m)");
    }
    node_fragment(
        name,
        node,
        src,
        inputs,
        grid(rows)?,
        vec![rows as i64, k as i64],
    )
}

/// Max and average pooling over 1–3 spatial dims, channels first or last:
/// a program per `BLOCK = block × vector` outputs, each walking its window
/// (taps outside the input masked off), dividing as torch does with and
/// without `count_include_pad`.
fn pool(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    warps: u32,
    vector: u32,
) -> Result<Fragment, Refusal> {
    let n = g.node(node);
    let Op::Pool(p) = &n.op else {
        return Err(Refusal::new(format!("`{}` is not a pooling op", n.name)));
    };
    let input = f32_input(g, node)?;
    let in_shape = g.tensor(input).shape.clone();
    let out_shape = n.outputs[0].shape.clone();
    let Window {
        kernel,
        stride,
        padding,
        dilation,
    } = Window::of(p, in_shape.len(), out_shape.len())?;
    vector_width(vector)?;
    let (max, count_include_pad, channels_last, dims) =
        (&p.max, &p.count_include_pad, &p.channels_last, p.spatial);
    let first = if *channels_last { 1 } else { 2 };
    let channels = if *channels_last {
        in_shape[dims + 1]
    } else {
        1
    };
    let in_sp = &in_shape[first..first + dims];
    let out_sp = &out_shape[first..first + dims];
    let numel: u64 = out_shape.iter().product();
    let block = u64::from(warps * 32 * vector);
    let wide = numel + block >= 1 << 31 || g.tensor(input).numel() >= 1 << 31;
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {} pool {in_sp:?}{} (kernel {kernel:?}, stride {stride:?}, padding {padding:?}, dilation {dilation:?}), {block} outputs a program",
        if *max { "max" } else { "average" },
        if *channels_last { " channels-last" } else { "" },
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}(x, y, n):");
    let _ = writeln!(
        src,
        "    i = {} * {block} + tl.arange(0, {block})\n    m = i < n\n    rest = i",
        program_id(wide)
    );
    if *channels_last {
        let _ = writeln!(
            src,
            "    c = rest % {channels}\n    rest = rest // {channels}"
        );
    }
    for d in (0..dims).rev() {
        let _ = writeln!(
            src,
            "    s{d} = (rest % {}) * {} - {}\n    rest = rest // {}",
            out_sp[d], stride[d], padding[d], out_sp[d]
        );
    }
    let plane: u64 = in_sp.iter().product::<u64>() * channels;
    let _ = writeln!(
        src,
        "    base = rest * {plane}{}",
        if *channels_last { " + c" } else { "" }
    );
    let pad = if *max { "float(\"-inf\")" } else { "0.0" };
    let _ = writeln!(src, "    acc = tl.full([{block}], {pad}, tl.float32)");
    if !*max && !*count_include_pad {
        let _ = writeln!(src, "    inside = tl.zeros([{block}], tl.int32)");
    }
    let mut indent = "    ".to_string();
    let mut ok = vec!["m".to_string()];
    for d in 0..dims {
        let _ = writeln!(src, "{indent}for k{d} in range({}):", kernel[d]);
        indent.push_str("    ");
        let _ = writeln!(
            src,
            "{indent}p{d} = s{d} + k{d} * {}\n{indent}ok{d} = (p{d} >= 0) & (p{d} < {})",
            dilation[d], in_sp[d]
        );
        ok.push(format!("ok{d}"));
    }
    let mut offset = "p0".to_string();
    for (d, &extent) in in_sp.iter().enumerate().skip(1) {
        offset = format!("({offset}) * {extent} + p{d}");
    }
    if *channels_last {
        offset = format!("({offset}) * {channels}");
    }
    let _ = writeln!(
        src,
        "{indent}ok = {}\n{indent}v = tl.load(x + base + {offset}, mask=ok, other={pad})",
        ok.join(" & ")
    );
    if *max {
        let _ = writeln!(src, "{indent}acc = tl.maximum(acc, v)");
    } else {
        let _ = writeln!(src, "{indent}acc += v");
        if !*count_include_pad {
            let _ = writeln!(src, "{indent}inside += ok.to(tl.int32)");
        }
    }
    let value = if *max {
        "acc".to_string()
    } else if *count_include_pad {
        // The window clipped to the padded input.
        let mut terms = Vec::new();
        for d in 0..dims {
            let _ = writeln!(
                src,
                "    e{d} = tl.minimum(s{d} + {}, {})",
                kernel[d],
                in_sp[d] + padding[d]
            );
            terms.push(format!("(e{d} - s{d})"));
        }
        format!("acc / ({}).to(tl.float32)", terms.join(" * "))
    } else {
        "acc / tl.maximum(inside, 1).to(tl.float32)".to_string()
    };
    let _ = writeln!(src, "    tl.store(y + i, {value}, mask=m)");
    node_fragment(
        name,
        node,
        src,
        vec![input],
        grid(numel.div_ceil(block))?,
        vec![numel as i64],
    )
}

/// Cumulative sums and products over one dim, forward or reverse,
/// inclusive or exclusive, seen as `[outer, K, inner]`: a program per row
/// scanning tiles of up to [`TILE`] with `tl.cumsum`/`tl.cumprod` and a
/// carry between tiles when `inner == 1`; else a program per `(outer,
/// BLOCK columns)` stepping along the dim. An exclusive scan is the
/// inclusive scan of the input shifted one place (the identity first).
fn scan(g: &OpGraph, node: NodeId, name: &str, warps: u32) -> Result<Fragment, Refusal> {
    let (
        Scan {
            prod,
            dim,
            reverse,
            exclusive,
        },
        input,
        [outer, k, inner],
    ) = scan::view(g, node)?;
    let shape = g.tensor(input).shape.clone();
    let wide = g.tensor(input).numel() >= 1 << 31;
    let (identity, op, scan_fn) = if prod {
        ("1.0", "*", "tl.cumprod")
    } else {
        ("0.0", "+", "tl.cumsum")
    };
    // Position in the dim of scan step `t`, and of the input it reads.
    let at = |t: &str| {
        if reverse {
            format!("({} - 1 - {t})", k)
        } else {
            t.to_string()
        }
    };
    let from = |t: &str| match (exclusive, reverse) {
        (false, _) => at(t),
        (true, false) => format!("({t} - 1)"),
        (true, true) => format!("({k} - {t})"),
    };
    let mut src = String::new();
    let direction = format!(
        "{}{}",
        if reverse { ", reverse" } else { "" },
        if exclusive { ", exclusive" } else { "" }
    );
    let what = if prod { "cumprod" } else { "cumsum" };
    let (programs, sizes) = if inner == 1 {
        let bk = pow2(k).min(TILE);
        let _ = writeln!(
            src,
            "# {name}: {what} over {outer} rows of {k}{direction}, tiles of {bk}"
        );
        let _ = writeln!(src, "@triton.jit\ndef {name}(x, y, R, K):");
        let _ = writeln!(
            src,
            "    base = {} * {k}\n    t = tl.arange(0, {bk})\n    carry = {identity}",
            program_id(wide)
        );
        let _ = writeln!(src, "    for t0 in range(0, {k}, {bk}):");
        let _ = writeln!(
            src,
            "        tt = t0 + t\n        m = tt < {k}\n        src = {}\n        ok = m & (src >= 0) & (src < {k})",
            from("tt")
        );
        let _ = writeln!(
            src,
            "        v = tl.load(x + base + src, mask=ok, other={identity})\n        c = {scan_fn}(v, 0) {op} carry\n        tl.store(y + base + {}, c, mask=m)\n        carry = tl.sum(tl.where(t == {} - 1, c, 0.0), axis=0)",
            at("tt"),
            bk
        );
        (outer, vec![outer as i64, k as i64])
    } else {
        let bi = u64::from(warps * 32);
        let tiles = inner.div_ceil(bi);
        let _ = writeln!(
            src,
            "# {name}: {what} over dim {dim} of {shape:?}{direction}, {bi} columns a program"
        );
        let _ = writeln!(src, "@triton.jit\ndef {name}(x, y, R, K):");
        let _ = writeln!(
            src,
            "    p = {}\n    col = (p % {tiles}) * {bi} + tl.arange(0, {bi})\n    m = col < {inner}\n    base = (p // {tiles}) * {} + col\n    acc = tl.full([{bi}], {identity}, tl.float32)",
            program_id(wide),
            k * inner
        );
        let _ = writeln!(src, "    for t in range({k}):");
        let src_pos = from("t");
        let _ = writeln!(
            src,
            "        s = {src_pos}\n        ok = m & (s >= 0) & (s < {k})\n        acc = acc {op} tl.load(x + base + s * {inner}, mask=ok, other={identity})\n        tl.store(y + base + {} * {inner}, acc, mask=m)",
            at("t")
        );
        (outer * tiles, vec![outer as i64, k as i64])
    };
    node_fragment(name, node, src, vec![input], grid(programs)?, sizes)
}

/// Programs a loss kernel spreads its items over (each adds its partial
/// to the result once, atomically).
const LOSS_PROGRAMS: u64 = 132 * 4;

/// Losses reduced to their mean or sum: a pass that zeroes the result,
/// then `G` programs, each taking every `G`-th block of elements
/// (elementwise losses: mse, huber, smooth L1) or row (cross-entropy over
/// class logits with int64 targets, triplet margin with p = 2) and adding
/// its partial to the result with one atomic add.
fn loss(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    warps: u32,
    vector: u32,
) -> Result<Fragment, Refusal> {
    vector_width(vector)?;
    let LossView {
        kind,
        reduction,
        ins,
        shape,
        numel,
        same,
    } = LossView::of(g, node, "the Triton loss kernels")?;
    let batch = shape.first().copied().unwrap_or(1);
    let wide = numel >= 1 << 31;
    let rows = |what: &str| -> Result<(u64, u64), Refusal> {
        if shape.len() != 2 || shape[1] > WHOLE_ROW {
            return Err(Refusal::new(format!(
                "the Triton {what} kernel takes [N, D] rows of at most {WHOLE_ROW}"
            )));
        }
        Ok((shape[0], shape[1]))
    };
    // (parameters, items, what the sum is divided by, per-item lines
    // leaving the masked term in `term`, lanes of a block)
    let elementwise = |term: String| -> Result<_, Refusal> {
        if !same {
            return Err(Refusal::new(
                "elementwise losses need their inputs float32 at one shape",
            ));
        }
        let block = u64::from(warps * 32 * vector);
        Ok((
            "a, b",
            numel,
            numel,
            format!(
                "        i = (it * G + pid) * {block} + tl.arange(0, {block})\n        m = i < {numel}\n        av = tl.load(a + i, mask=m, other=0.0)\n        bv = tl.load(b + i, mask=m, other=0.0)\n        d = av - bv\n        term = tl.sum(tl.where(m, {term}, 0.0), axis=0)\n"
            ),
            block,
        ))
    };
    let (params, items, count, body, per) = match kind {
        LossKind::Mse => elementwise("d * d".into())?,
        LossKind::Huber { delta } => {
            let delta = lit(*delta)?;
            elementwise(format!(
                "tl.where(tl.abs(d) < {delta}, 0.5 * d * d, {delta} * (tl.abs(d) - 0.5 * {delta}))"
            ))?
        }
        LossKind::SmoothL1 { beta } if *beta <= 0.0 => elementwise("tl.abs(d)".into())?,
        LossKind::SmoothL1 { beta } => {
            let beta = lit(*beta)?;
            elementwise(format!(
                "tl.where(tl.abs(d) < {beta}, 0.5 * d * d / {beta}, tl.abs(d) - 0.5 * {beta})"
            ))?
        }
        // torch's xlogy(b, b) - b·a: 0 where b is 0.
        LossKind::KlDiv { log_target: false } => {
            elementwise("tl.where(bv == 0.0, 0.0, bv * tl.log(bv)) - bv * av".into())?
        }
        LossKind::KlDiv { log_target: true } => elementwise("tl.exp(bv) * (bv - av)".into())?,
        LossKind::CrossEntropy => {
            let (n_rows, d) = rows("cross-entropy")?;
            let t = g.tensor(ins[1]);
            if t.dtype != DType::I64 || t.shape != [n_rows] {
                return Err(Refusal::new(
                    "cross-entropy needs [N, C] float32 logits and [N] int64 class targets",
                ));
            }
            let bd = pow2(d);
            (
                "x, t",
                n_rows,
                n_rows,
                format!(
                    "        r = it * G + pid\n        live = r < {n_rows}\n        k = tl.arange(0, {bd})\n        mk = (k < {d}) & live\n        v = tl.load(x + r * {d} + k, mask=mk, other=float(\"-inf\"))\n        mx = tl.max(v, axis=0)\n        s = tl.sum(tl.where(mk, tl.exp(v - mx), 0.0), axis=0)\n        xt = tl.load(x + r * {d} + tl.load(t + r, mask=live, other=0), mask=live, other=0.0)\n        term = tl.where(live, mx + tl.log(s) - xt, 0.0)\n"
                ),
                1,
            )
        }
        LossKind::TripletMargin { margin, p } => {
            let (n_rows, d) = rows("triplet")?;
            if *p != 2.0 || !same {
                return Err(Refusal::new(
                    "the Triton triplet kernel takes p = 2 and three float32 [N, D] inputs",
                ));
            }
            let bd = pow2(d);
            // torch's pairwise distance adds eps = 1e-6 to the difference.
            (
                "a, p, q",
                n_rows,
                n_rows,
                format!(
                    "        r = it * G + pid\n        live = r < {n_rows}\n        k = tl.arange(0, {bd})\n        mk = (k < {d}) & live\n        va = tl.load(a + r * {d} + k, mask=mk, other=0.0)\n        u = va - tl.load(p + r * {d} + k, mask=mk, other=0.0) + 1e-6\n        w = va - tl.load(q + r * {d} + k, mask=mk, other=0.0) + 1e-6\n        dp = tl.sum(tl.where(mk, u * u, 0.0), axis=0)\n        dn = tl.sum(tl.where(mk, w * w, 0.0), axis=0)\n        term = tl.where(live, tl.maximum(tl.sqrt(dp) - tl.sqrt(dn) + {}, 0.0), 0.0)\n",
                    lit(*margin)?
                ),
                1,
            )
        }
        other => {
            return Err(Refusal::new(format!(
                "no Triton loss kernel yet for {other:?}"
            )));
        }
    };
    let blocks = items.div_ceil(per);
    let programs = blocks.clamp(1, LOSS_PROGRAMS);
    let iters = blocks.div_ceil(programs);
    let scale = match reduction {
        Reduction::Mean => format!(" / {count}.0"),
        Reduction::BatchMean => format!(" / {batch}.0"),
        Reduction::Sum | Reduction::None => String::new(),
    };
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {kind:?} loss ({reduction:?}) over {items} item(s), {programs} programs of {iters} step(s)"
    );
    let _ = writeln!(
        src,
        "@triton.jit\ndef {name}_zero({params}, y, n):\n    tl.store(y, 0.0)"
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}({params}, y, n):");
    let _ = writeln!(
        src,
        "    G = {programs}\n    pid = {}\n    acc = tl.zeros([1], tl.float32)\n    for it in range({iters}):",
        program_id(wide)
    );
    src.push_str(&body);
    src.push_str("        acc += term\n");
    let _ = writeln!(src, "    tl.atomic_add(y, tl.sum(acc, axis=0){scale})");
    let mut f = node_fragment(name, node, src, ins, grid(programs)?, vec![items as i64])?;
    f.before = vec![Pass {
        kernel: format!("{name}_zero"),
        launch: Launch {
            shared: 0,
            grid: 1,
            block: 32,
            sizes: vec![items as i64],
        },
    }];
    Ok(f)
}

/// A norm kernel's comment, its loader and its `def` line (the loader's
/// pointers, the scale `w` and shift `b` where the norm has them, `y`, `R`,
/// `K`), and the tensors its pointers point to.
fn norm_head(
    name: &str,
    what: &str,
    loader: &Loader,
    ins: &[TensorRef],
    (affine, bias): (bool, bool),
) -> (String, Vec<TensorRef>) {
    let mut params = loader.params.clone();
    let mut inputs = loader.inputs.clone();
    if affine {
        params.push("w".into());
        inputs.push(ins[1]);
    }
    if bias {
        params.push("b".into());
        inputs.push(ins[2]);
    }
    params.extend(["y".to_string(), "R".into(), "K".into()]);
    let mut src = format!("# {name}: {what}\n");
    src.push_str(&loader.source);
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    (src, inputs)
}

/// Batch norm with batch statistics over `[N, C, spatial…]`: a program per
/// channel, its `N × S` elements (`S` the spatial size) taken as one run
/// `j` at `(j / S) · C · S + c · S + j % S`, in tiles: the mean, then the
/// variance of the deviations, then the scaled and shifted output.
fn batch_norm(
    g: &OpGraph,
    node: NodeId,
    name: &str,
    loader: Loader,
    wide: bool,
    (eps, affine, bias): (f64, bool, bool),
) -> Result<Fragment, Refusal> {
    let ins = g.inputs(node);
    let shape = g.tensor(ins[0]).shape.clone();
    let (n, c) = (shape[0], shape[1]);
    let spatial: u64 = shape[2..].iter().product();
    if spatial == 1 {
        return batch_norm_columns(
            node,
            name,
            (loader, &ins),
            wide,
            (n, c),
            (eps, affine, bias),
        );
    }
    let count = n * spatial;
    let bj = pow2(count).min(TILE);
    let (mut src, inputs) = norm_head(
        name,
        &format!("batch norm over {c} channels of {n} x {spatial} (eps {eps}), tiles of {bj}"),
        &loader,
        &ins,
        (affine, bias),
    );
    let _ = writeln!(
        src,
        "    c = {}\n    j = tl.arange(0, {bj})",
        program_id(wide)
    );
    let tile = format!(
        "    for j0 in range(0, {count}, {bj}):\n        jj = j0 + j\n        m = jj < {count}\n        at = (jj // {spatial}) * {} + c * {spatial} + jj % {spatial}\n        v = tl.where(m, {}, 0.0)\n",
        c * spatial,
        loader.load("at", "m")
    );
    batch_norm_passes(
        &mut src,
        &tile,
        (&format!("[{bj}]"), ""),
        count,
        eps,
        (
            affine.then_some("tl.load(w + c)"),
            bias.then_some("tl.load(b + c)"),
        ),
    )?;
    node_fragment(
        name,
        node,
        src,
        inputs,
        grid(c)?,
        vec![c as i64, count as i64],
    )
}

/// Batch norm with batch statistics over `[N, C]`: a program per `BC`
/// neighbouring channels, stepping down the rows in `[BJ, BC]` tiles (a
/// channel's elements lie `C` apart, so a program per channel would read a
/// float per line): the means, the variances of the deviations, then the
/// output. `BC` is the widest of 64, 32, 16, 8 that leaves 264 programs.
fn batch_norm_columns(
    node: NodeId,
    name: &str,
    (loader, ins): (Loader, &[TensorRef]),
    wide: bool,
    (n, c): (u64, u64),
    (eps, affine, bias): (f64, bool, bool),
) -> Result<Fragment, Refusal> {
    let mut bc = 64.min(pow2(c));
    while bc > 8 && c.div_ceil(bc) < SPLIT_BELOW {
        bc /= 2;
    }
    let bj = pow2(n).min(TILE / bc);
    let (mut src, inputs) = norm_head(
        name,
        &format!(
            "batch norm over {c} channels of {n} rows (eps {eps}), {bc} channels a program, tiles of [{bj}, {bc}]"
        ),
        &loader,
        ins,
        (affine, bias),
    );
    let _ = writeln!(
        src,
        "    c = {} * {bc} + tl.arange(0, {bc})\n    cm = c < {c}\n    j = tl.arange(0, {bj})",
        program_id(wide)
    );
    let tile = format!(
        "    for j0 in range(0, {n}, {bj}):\n        jj = j0 + j\n        m = (jj < {n})[:, None] & cm[None, :]\n        at = jj[:, None] * {c} + c[None, :]\n        v = tl.where(m, {}, 0.0)\n",
        loader.load("at", "m")
    );
    batch_norm_passes(
        &mut src,
        &tile,
        (&format!("[{bj}, {bc}]"), "[None, :]"),
        n,
        eps,
        (
            affine.then_some("tl.load(w + c, mask=cm, other=0.0)"),
            bias.then_some("tl.load(b + c, mask=cm, other=0.0)"),
        ),
    )?;
    node_fragment(
        name,
        node,
        src,
        inputs,
        grid(c.div_ceil(bc))?,
        vec![c as i64, n as i64],
    )
}

/// The three passes of a batch norm over `count` elements a channel, each
/// looping over `tile` (lines ending with the masked tile `v`, its mask
/// `m` and offsets `at`): the sum into a `shape` accumulator for the mean,
/// the squared deviations for the variance, then the output, scaled by
/// `w` and shifted by `b` where given. `per` broadcasts a program's
/// per-channel values over its tile.
fn batch_norm_passes(
    src: &mut String,
    tile: &str,
    (shape, per): (&str, &str),
    count: u64,
    eps: f64,
    (w, b): (Option<&str>, Option<&str>),
) -> Result<(), Refusal> {
    let _ = writeln!(src, "    sv = tl.zeros({shape}, tl.float32)");
    src.push_str(tile);
    src.push_str("        sv += v\n");
    let _ = writeln!(src, "    mean = tl.sum(sv, axis=0) / {count}.0");
    let _ = writeln!(src, "    qv = tl.zeros({shape}, tl.float32)");
    src.push_str(tile);
    let _ = writeln!(
        src,
        "        d = tl.where(m, v - mean{per}, 0.0)\n        qv += d * d"
    );
    let _ = writeln!(
        src,
        "    rstd = 1.0 / tl.sqrt_rn(tl.sum(qv, axis=0) / {count}.0 + {})",
        lit(eps)?
    );
    let _ = writeln!(
        src,
        "    sc = rstd{}",
        w.map_or(String::new(), |w| format!(" * {w}"))
    );
    src.push_str(tile);
    let _ = writeln!(
        src,
        "        tl.store(y + at, (v - mean{per}) * sc{per}{}, mask=m)",
        b.map_or(String::new(), |b| format!(" + {b}{per}"))
    );
    Ok(())
}

/// Output tile of a Triton GEMM (rows and columns), and its depth step:
/// the first for programs of 8 warps or more, the second for fewer.
const GEMM_TILES: [(u64, u64, u64); 2] = [(128, 128, 32), (64, 64, 32)];

/// An fp32 GEMM (`matmul`/`linear`, batched or not, either operand
/// transposed) with its bias and the pointwise chain after it fused into
/// the store: a program per `128 × 128` output tile (and batch) with 8
/// warps or more, else per `64 × 64` tile, stepping 32 deep with `tl.dot`
/// at fp32 accuracy on the tensor cores: `tf32x3`, each operand split into
/// a TF32 value and a TF32 remainder and the three largest cross products
/// summed (not TF32 alone), as the CUDA GEMM does.
fn gemm(g: &OpGraph, region: &[NodeId], name: &str, warps: u32) -> Result<Fragment, Refusal> {
    let mm = region[0];
    let Op::MatMul(m) = &g.node(mm).op else {
        return Err(Refusal::new("a GEMM region starts with a matrix product"));
    };
    super::gemm::float32_only(g, mm, "Triton GEMM")?;
    let ins = g.inputs(mm);
    let out = TensorRef::first(mm);
    let (sa, sb, so) = (shape(g, ins[0]), shape(g, ins[1]), shape(g, out));
    if sa.len() < 2 || sb.len() < 2 || so.len() < 2 {
        return Err(Refusal::new(
            "a matrix-vector product has no Triton GEMM (operands of rank 1)",
        ));
    }
    let (ra, ro) = (sa.len(), so.len());
    let (rows, cols) = (so[ro - 2], so[ro - 1]);
    let depth = if m.trans_a { sa[ra - 2] } else { sa[ra - 1] };
    let batch_dims = &so[..ro - 2];
    let batch: u64 = batch_dims.iter().product();
    // Each operand's batch stride: 0 when one matrix serves every batch.
    let stride = |s: &[u64]| -> Result<u64, Refusal> {
        let matrix: u64 = s[s.len() - 2..].iter().product();
        if s.len() == 2 {
            Ok(0)
        } else if s[..s.len() - 2] == *batch_dims {
            Ok(matrix)
        } else {
            Err(Refusal::new(
                "operands whose batch dims broadcast have no Triton GEMM",
            ))
        }
    };
    let (za, zb) = (stride(&sa)?, stride(&sb)?);
    // Element (row, k) of A and (k, column) of B.
    let (am, ak) = if m.trans_a { (1, rows) } else { (depth, 1) };
    let (bk, bn) = if m.trans_b { (1, depth) } else { (cols, 1) };
    let bias = m.bias.then(|| ins[2]);
    if let Some(t) = bias
        && shape(g, t) != [cols]
    {
        return Err(Refusal::new("the bias is not one value per output column"));
    }
    let chain: Vec<NodeId> = region[1..].to_vec();
    let result = if chain.is_empty() {
        out
    } else {
        check_pointwise(g, &chain, &so)?;
        let (_, outputs) = boundary(g, region);
        let &[result] = &outputs[..] else {
            return Err(Refusal::new(
                "a fused epilogue must have one result (the others are read elsewhere)",
            ));
        };
        if shape(g, result) != so {
            return Err(Refusal::new(
                "the epilogue's result does not have the product's shape",
            ));
        }
        result
    };
    if g.outputs().contains(&out) && result != out
        || g.consumers(mm).iter().any(|c| !chain.contains(c)) && !chain.is_empty()
    {
        return Err(Refusal::new(
            "the product is read outside the chain fused after it",
        ));
    }
    let (chain_inputs, _) = boundary(g, &chain);
    // Float32, or booleans only a where's condition reads (`check_pointwise`).
    let extra: Vec<TensorRef> = chain_inputs.into_iter().filter(|&t| t != out).collect();
    let (bm, bnn, bkk) = GEMM_TILES[usize::from(warps < 8)];
    let (tm, tn) = (rows.div_ceil(bm), cols.div_ceil(bnn));
    let wide = so.iter().product::<u64>() >= 1 << 31
        || sa.iter().product::<u64>() >= 1 << 31
        || sb.iter().product::<u64>() >= 1 << 31;
    let ptrs: Vec<String> = (0..extra.len()).map(|k| format!("pe{k}")).collect();
    let mut params: Vec<String> = vec!["a".into(), "b".into()];
    let mut inputs = vec![ins[0], ins[1]];
    if let Some(t) = bias {
        params.push("bias".into());
        inputs.push(t);
    }
    params.extend(ptrs.iter().cloned());
    inputs.extend(extra.iter().copied());
    params.extend(["y".to_string(), "n".into()]);
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {batch} x [{rows} x {depth}] @ [{depth} x {cols}] (fp32, 3xTF32 dot), tiles of {bm} x {bnn} x {bkk}{}",
        if chain.is_empty() {
            String::new()
        } else {
            format!(", {} pointwise op(s) fused after", chain.len())
        }
    );
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    let _ = writeln!(
        src,
        "    p = {}\n    tn = p % {tn}\n    tm = (p // {tn}) % {tm}\n    z = p // {}",
        program_id(wide),
        tm * tn
    );
    let _ = writeln!(
        src,
        "    rm = tm * {bm} + tl.arange(0, {bm})\n    rn = tn * {bnn} + tl.arange(0, {bnn})\n    rk = tl.arange(0, {bkk})\n    acc = tl.zeros([{bm}, {bnn}], tl.float32)"
    );
    let _ = writeln!(src, "    for k0 in range(0, {depth}, {bkk}):");
    let _ = writeln!(
        src,
        "        kk = k0 + rk\n        ta = tl.load(a + z * {za} + rm[:, None] * {am} + kk[None, :] * {ak}, mask=(rm[:, None] < {rows}) & (kk[None, :] < {depth}), other=0.0)\n        tb = tl.load(b + z * {zb} + kk[:, None] * {bk} + rn[None, :] * {bn}, mask=(kk[:, None] < {depth}) & (rn[None, :] < {cols}), other=0.0)\n        acc += tl.dot(ta, tb, input_precision=\"tf32x3\")"
    );
    if bias.is_some() {
        let _ = writeln!(
            src,
            "    acc += tl.load(bias + rn, mask=rn < {cols}, other=0.0)[None, :]"
        );
    }
    let _ = writeln!(
        src,
        "    i = z * {} + rm[:, None] * {cols} + rn[None, :]\n    m = (rm[:, None] < {rows}) & (rn[None, :] < {cols})",
        rows * cols
    );
    let value = if chain.is_empty() {
        "acc".to_string()
    } else {
        let (body, names) = chain_body_after(g, &chain, &extra, &ptrs, &so, (out, "acc"))?;
        src.push_str(&body);
        names[&result].clone()
    };
    let _ = writeln!(src, "    tl.store(y + i, {value}, mask=m)");
    let mut region_nodes = vec![mm];
    region_nodes.extend(chain.iter().copied());
    Ok(Fragment {
        name: name.to_string(),
        action: Action {
            kind: ActionKind::Fuse,
            region: region_nodes.iter().map(|n| n.index() as u32).collect(),
            params: Default::default(),
        },
        lang: Lang::Triton,
        source: src,
        inputs,
        outputs: vec![result],
        region: region_nodes,
        launch: Launch {
            shared: 0,
            grid: grid(batch * tm * tn)?,
            block: warps * 32,
            sizes: vec![(batch * rows * cols) as i64],
        },
        before: Vec::new(),
    })
}

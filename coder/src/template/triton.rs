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
//!   tiles; a row of up to [`WHOLE_ROW`] elements is read once;
//! - layer, RMS, group and instance norm (batch statistics) with their
//!   scale and shift, a program per normalized group;
//! - a pointwise chain fused in front of a row kernel: a jit function
//!   computing the chain's value at the offsets the kernel reads.
//!
//! Loops run to the reduced extent written as a constant (shapes are
//! static): the interpreter cannot loop to a scalar argument.
//!
//! Everything else is refused with the reason (it stays a torch call).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{BinaryOp, Norm, NormKind, Op, UnaryOp};

use super::Refusal;
use super::pointwise::{boundary, broadcast_offset, broadcasts, shape};
use super::rows::{Kind, row_view};
use crate::MicroCoder;
use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Lang, Launch, Program};

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
    if !v.is_finite() {
        return Err(Refusal::new(format!(
            "the constant {v} has no float literal"
        )));
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
        other => {
            return Err(Refusal::new(format!(
                "the comparison `{}` makes a boolean tensor; only float32 chains are generated",
                other.symbol()
            )));
        }
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
    for (k, (&t, off)) in inputs.iter().zip(&offsets).enumerate() {
        let _ = writeln!(
            src,
            "{indent}v{k} = tl.load({} + {off}, mask=m, other=0.0)",
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

/// Checks that `region` is float32 pointwise ops that broadcast to `full`.
fn check_pointwise(g: &OpGraph, region: &[NodeId], full: &[u64]) -> Result<(), Refusal> {
    for &n in region {
        let node = g.node(n);
        if !matches!(
            node.op,
            Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Triangular { .. }
        ) {
            return Err(Refusal::new(format!(
                "`{}` ({}) is not a pointwise op this template writes",
                node.name, node.op
            )));
        }
        if node.outputs.iter().any(|t| t.dtype != DType::F32) {
            return Err(Refusal::new(format!("`{}` is not float32", node.name)));
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
    if let Some(t) = inputs.iter().find(|&&t| g.tensor(t).dtype != DType::F32) {
        return Err(Refusal::new(format!(
            "input `{}` is not float32",
            g.node(t.node).name
        )));
    }
    let vector = action.params.vector;
    if ![1, 2, 4].contains(&vector) {
        return Err(Refusal::new(format!(
            "vector width {vector} is not 1, 2 or 4"
        )));
    }
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
        if let Some(t) = inputs.iter().find(|&&t| g.tensor(t).dtype != DType::F32) {
            return Err(Refusal::new(format!(
                "input `{}` is not float32",
                g.node(t.node).name
            )));
        }
        let full = shape(g, output);
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
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {kind:?} over [{outer}, {k}, {inner}] (outer, reduced, inner), tiles of [{bk}, {bi}]"
    );
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
            "kk = k0 + k".to_string(),
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
            "kk = k0 + k".to_string(),
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
        let _ = writeln!(src, "    for k0 in range(0, {k}, {bk}):");
        tile(&mut src, ident);
        let _ = writeln!(src, "        acc = {update}");
        let _ = writeln!(src, "    res = {reduce}(acc, axis=0)");
        let _ = writeln!(src, "    tl.store({out}, {}{out_mask})", finish("res"));
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
    node_fragment(name, node, src, loader.inputs, grid(programs)?, sizes)
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

/// Layer, RMS, group and instance norm (batch statistics): a program per
/// normalized group (a contiguous row), the mean, then the variance of the
/// deviations, then the scaled and shifted output.
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
    // (rows, K, the affine index from r and kk)
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
    let rms = matches!(kind, NormKind::Rms { .. });
    let whole = k <= WHOLE_ROW;
    let bk = if whole { pow2(k) } else { TILE };
    let mut params = loader.params.clone();
    let mut inputs = loader.inputs.clone();
    if *affine {
        params.push("w".into());
        inputs.push(ins[1]);
    }
    if *bias {
        params.push("b".into());
        inputs.push(ins[2]);
    }
    params.extend(["y".to_string(), "R".into(), "K".into()]);
    let mut src = String::new();
    let _ = writeln!(
        src,
        "# {name}: {kind:?} over {rows} rows of {k} (eps {eps}), tiles of {bk}"
    );
    src.push_str(&loader.source);
    let _ = writeln!(src, "@triton.jit\ndef {name}({}):", params.join(", "));
    let _ = writeln!(src, "    r = {}", program_id(wide));
    src.push_str("    base = r * K\n");
    let _ = writeln!(src, "    k = tl.arange(0, {bk})");
    let eps = lit(*eps)?;
    let mut out = "d * rstd".to_string();
    if *affine {
        out += &format!(" * tl.load(w + {channel}, mask=m, other=0.0)");
    }
    if *bias {
        out += &format!(" + tl.load(b + {channel}, mask=m, other=0.0)");
    }
    let load = loader.load("base + kk", "m");
    if whole {
        src.push_str("    kk = k\n    m = kk < K\n");
        let _ = writeln!(src, "    v = tl.where(m, {load}, 0.0)");
        if rms {
            src.push_str("    mean = 0.0\n");
        } else {
            src.push_str("    mean = tl.sum(v, axis=0) / K\n");
        }
        src.push_str("    d = tl.where(m, v - mean, 0.0)\n");
        src.push_str("    var = tl.sum(d * d, axis=0) / K\n");
        let _ = writeln!(src, "    rstd = 1.0 / tl.sqrt_rn(var + {eps})");
        let _ = writeln!(src, "    tl.store(y + base + kk, {out}, mask=m)");
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
        src.push_str("        d = tl.where(m, v - mean, 0.0)\n        qv += d * d\n");
        let _ = writeln!(
            src,
            "    rstd = 1.0 / tl.sqrt_rn(tl.sum(qv, axis=0) / K + {eps})"
        );
        pass(&mut src);
        src.push_str("        d = v - mean\n");
        let _ = writeln!(src, "        tl.store(y + base + kk, {out}, mask=m)");
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

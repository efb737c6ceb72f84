//! Triton expressions: literals, unary and binary ops, a node's value, and
//! the lines of a pointwise chain.

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{BinaryOp, Op, UnaryOp};

use crate::template::Refusal;
use crate::template::pointwise::{boundary, broadcast_offset, broadcasts, shape};

/// A Python float literal that reads back as the same float32.
pub(super) fn lit(v: f64) -> Result<String, Refusal> {
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
pub(super) fn power(x: &str, p: f64) -> Result<String, Refusal> {
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
pub(super) fn chain_body(
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
pub(super) fn chain_body_after(
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
pub(super) fn check_pointwise(g: &OpGraph, region: &[NodeId], full: &[u64]) -> Result<(), Refusal> {
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
    crate::template::pointwise::conditions(g, region, &boundary(g, region).0)?;
    Ok(())
}

//! Pointwise chains with broadcasting, fused into one pass: every element
//! of the region's output is computed from the region's inputs, read at
//! their broadcast offsets, with the chain's intermediate values kept in
//! registers.
//!
//! The kernel is a grid-stride loop over the output's elements. With
//! `vector` 2 or 4, each trip loads and stores `float2` / `float4` (a
//! broadcast input lane by lane).

use std::collections::{HashMap, HashSet};
use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{BinaryOp, Op, UnaryOp};

use super::{Refusal, lit};
use crate::action::{Action, Params};
use crate::program::{Fragment, Launch};

/// The CUDA expression of a unary op applied to `x` (an identifier).
fn unary(u: &UnaryOp, x: &str) -> Result<String, Refusal> {
    Ok(match u {
        UnaryOp::Relu => format!("fmaxf({x}, 0.0f)"),
        UnaryOp::Relu6 => format!("fminf(fmaxf({x}, 0.0f), 6.0f)"),
        UnaryOp::LeakyRelu { slope } => format!("({x} > 0.0f ? {x} : {x} * {})", lit(*slope)?),
        UnaryOp::Gelu { tanh: false } => {
            format!("(0.5f * {x} * (1.0f + erff({x} * 0.70710678118654752f)))")
        }
        UnaryOp::Gelu { tanh: true } => format!(
            "(0.5f * {x} * (1.0f + tanhf(0.79788456080286536f * ({x} + 0.044715f * {x} * {x} * {x}))))"
        ),
        UnaryOp::Sigmoid => format!("(1.0f / (1.0f + expf(-{x})))"),
        UnaryOp::Tanh => format!("tanhf({x})"),
        UnaryOp::Silu => format!("({x} / (1.0f + expf(-{x})))"),
        UnaryOp::Mish => format!("({x} * tanhf({x} > 20.0f ? {x} : log1pf(expf({x}))))"),
        UnaryOp::Hardswish => format!("({x} * fminf(fmaxf({x} + 3.0f, 0.0f), 6.0f) / 6.0f)"),
        UnaryOp::Hardsigmoid => format!("(fminf(fmaxf({x} + 3.0f, 0.0f), 6.0f) / 6.0f)"),
        UnaryOp::Hardtanh { min, max } => {
            format!("fminf(fmaxf({x}, {}), {})", lit(*min)?, lit(*max)?)
        }
        UnaryOp::Softplus { beta, threshold } => {
            let (b, t) = (lit(*beta)?, lit(*threshold)?);
            format!("({b} * {x} > {t} ? {x} : log1pf(expf({b} * {x})) / {b})")
        }
        UnaryOp::Softsign => format!("({x} / (1.0f + fabsf({x})))"),
        UnaryOp::Elu { alpha } => format!("({x} > 0.0f ? {x} : {} * expm1f({x}))", lit(*alpha)?),
        UnaryOp::Selu => format!(
            "(1.0507009873554805f * ({x} > 0.0f ? {x} : 1.6732632423543772f * expm1f({x})))"
        ),
        UnaryOp::Clamp { min, max } => {
            let mut e = x.to_string();
            if let Some(lo) = min {
                e = format!("fmaxf({e}, {})", lit(*lo)?);
            }
            if let Some(hi) = max {
                e = format!("fminf({e}, {})", lit(*hi)?);
            }
            e
        }
        UnaryOp::Exp => format!("expf({x})"),
        UnaryOp::Log => format!("logf({x})"),
        UnaryOp::Abs => format!("fabsf({x})"),
        UnaryOp::Neg => format!("(-{x})"),
        UnaryOp::Sqrt => format!("sqrtf({x})"),
        UnaryOp::Rsqrt => format!("(1.0f / sqrtf({x}))"),
        UnaryOp::Reciprocal => format!("(1.0f / {x})"),
        UnaryOp::Erf => format!("erff({x})"),
        UnaryOp::Sin => format!("sinf({x})"),
        UnaryOp::Cos => format!("cosf({x})"),
        UnaryOp::Sign => format!("(float)(({x} > 0.0f) - ({x} < 0.0f))"),
        UnaryOp::Not => {
            return Err(Refusal::new(
                "logical not makes a boolean tensor; only float32 chains are generated",
            ));
        }
    })
}

/// The CUDA expression of a binary op.
fn binary(b: BinaryOp, x: &str, y: &str) -> Result<String, Refusal> {
    Ok(match b {
        BinaryOp::Add => format!("({x} + {y})"),
        BinaryOp::Sub => format!("({x} - {y})"),
        BinaryOp::Mul => format!("({x} * {y})"),
        BinaryOp::Div => format!("({x} / {y})"),
        BinaryOp::FloorDiv => format!("floorf({x} / {y})"),
        BinaryOp::Pow => format!("powf({x}, {y})"),
        BinaryOp::Maximum => format!("fmaxf({x}, {y})"),
        BinaryOp::Minimum => format!("fminf({x}, {y})"),
        // A `bool`, which only a where reads (see `conditions`).
        cmp => format!("({x} {} {y})", cmp.symbol()),
    })
}

pub(super) fn shape(g: &OpGraph, t: TensorRef) -> Vec<u64> {
    g.tensor(t).shape.clone()
}

/// Whether `small` broadcasts to `full` (numpy rules, right-aligned).
pub(super) fn broadcasts(small: &[u64], full: &[u64]) -> bool {
    small.len() <= full.len()
        && small
            .iter()
            .rev()
            .zip(full.iter().rev())
            .all(|(&s, &f)| s == f || s == 1)
}

/// The offset expression of an input of `small` shape for output index
/// coordinates `c{d}` of `full`.
fn offset(small: &[u64], full: &[u64], coords: &mut HashSet<usize>) -> String {
    broadcast_offset(small, full, coords, "LL", "0")
}

/// The offset expression of an input of `small` shape read at flat
/// offsets `i` of `full` through coordinates `c{d}` (noted in `coords`),
/// with `wide` after each stride literal and `zero` where every element
/// reads the same one.
pub(super) fn broadcast_offset(
    small: &[u64],
    full: &[u64],
    coords: &mut HashSet<usize>,
    wide: &str,
    zero: &str,
) -> String {
    if small == full {
        return "i".into();
    }
    let lead = full.len() - small.len();
    let mut terms = Vec::new();
    let mut stride = 1u64;
    for k in (0..small.len()).rev() {
        if small[k] != 1 {
            coords.insert(lead + k);
            terms.push(if stride == 1 {
                format!("c{}", lead + k)
            } else {
                format!("c{} * {stride}{wide}", lead + k)
            });
        }
        stride *= small[k];
    }
    if terms.is_empty() {
        zero.into()
    } else {
        terms.join(" + ")
    }
}

/// The CUDA expression computing pointwise node `n` from its operands
/// `ins` (identifiers), inside a loop over the elements of `full` with
/// coordinates `c{d}` in scope for triu and tril.
fn node_expr(g: &OpGraph, n: NodeId, ins: &[String], full: &[u64]) -> Result<String, Refusal> {
    Ok(match &g.node(n).op {
        Op::Unary(u) => unary(u, &ins[0])?,
        Op::Binary(b) => binary(*b, &ins[0], &ins[1])?,
        Op::Scalar {
            op,
            value,
            scalar_first,
        } => {
            let c = lit(*value)?;
            if *op == BinaryOp::Pow && *value == 2.0 && !scalar_first {
                // Squares are exact products; powf is not always.
                format!("({} * {})", ins[0], ins[0])
            } else if *scalar_first {
                binary(*op, &c, &ins[0])?
            } else {
                binary(*op, &ins[0], &c)?
            }
        }
        Op::Triangular { upper, diagonal } => {
            let (row, col) = (full.len() - 2, full.len() - 1);
            let keep = if *upper { ">=" } else { "<=" };
            format!("(c{col} - c{row} {keep} {diagonal}LL) ? {} : 0.0f", ins[0])
        }
        // masked_fill(x, mask, fill): the fill where the mask holds.
        Op::Where { fill: Some(v) } => format!("({} ? {} : {})", ins[1], lit(*v)?, ins[0]),
        Op::Where { fill: None } => format!("({} ? {} : {})", ins[0], ins[1], ins[2]),
        other => {
            return Err(Refusal::new(format!(
                "`{}` ({other}) is not a pointwise op this template writes",
                g.node(n).name
            )));
        }
    })
}

/// A pointwise chain fused in front of a kernel that reads its result:
/// a device function `{name}_x(i, px0, …)` computing element `i` of the
/// chain's output from the chain's inputs (`px0`, … in order).
pub struct Prologue {
    /// The device function's source.
    pub source: String,
    /// The chain's inputs, in parameter order.
    pub inputs: Vec<TensorRef>,
    /// The kernel parameters reading them (`const float* __restrict__
    /// px0`; a boolean, a where's condition, as `const bool*`).
    pub params: Vec<String>,
    /// The tensor it stands for.
    pub output: TensorRef,
}

/// Refuses a chain with an op other than unary, binary, scalar ops and
/// wheres, which a chain fused `place` a kernel is made of: float32 but
/// for the booleans a where's condition reads (`conditions`).
fn fusable_chain(g: &OpGraph, chain: &[NodeId], place: &str) -> Result<(), Refusal> {
    for &n in chain {
        let node = g.node(n);
        if !matches!(
            node.op,
            Op::Unary(_) | Op::Binary(_) | Op::Scalar { .. } | Op::Where { .. }
        ) {
            return Err(Refusal::new(format!(
                "`{}` ({}) cannot be fused {place} a kernel",
                node.name, node.op
            )));
        }
    }
    Ok(())
}

/// The C type a kernel holds `t`'s elements in: `bool` for a boolean (a
/// where's condition, as `conditions` admits), else `float`.
fn c_type(g: &OpGraph, t: TensorRef) -> &'static str {
    if g.tensor(t).dtype == DType::Bool {
        "bool"
    } else {
        "float"
    }
}

/// The kernel parameters `{ptr}0`, … reading `inputs`, each a
/// `const T* __restrict__` of its `c_type`.
fn pointer_params(g: &OpGraph, inputs: &[TensorRef], ptr: &str) -> Vec<String> {
    inputs
        .iter()
        .enumerate()
        .map(|(k, &t)| format!("const {}* __restrict__ {ptr}{k}", c_type(g, t)))
        .collect()
}

/// The inputs and the one result of `chain`, fused in front of `reader`:
/// refused unless the chain has one result and nothing but `reader` (and
/// the chain itself) reads any of its values.
pub(crate) fn prologue_boundary(
    g: &OpGraph,
    chain: &[NodeId],
    reader: NodeId,
) -> Result<(Vec<TensorRef>, TensorRef), Refusal> {
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
    Ok((inputs, output))
}

/// The prologue for `chain`, whose only result must be read by nothing
/// but the kernel it is fused into.
pub fn prologue(
    g: &OpGraph,
    chain: &[NodeId],
    reader: NodeId,
    name: &str,
) -> Result<Prologue, Refusal> {
    fusable_chain(g, chain, "in front of")?;
    let (inputs, output) = prologue_boundary(g, chain, reader)?;
    if g.outputs().contains(&output) {
        return Err(Refusal::new("the prologue's result is a graph output"));
    }
    let full = shape(g, output);
    for &n in chain {
        if !broadcasts(&shape(g, TensorRef::first(n)), &full) {
            return Err(Refusal::new(format!(
                "`{}` does not broadcast to the prologue's shape",
                g.node(n).name
            )));
        }
    }
    conditions(g, chain, &inputs)?;
    let params = pointer_params(g, &inputs, "px");
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}_x: {} pointwise op(s) fused in front of {name}",
        chain.len()
    );
    let _ = writeln!(
        src,
        "__device__ __forceinline__ float {name}_x(long long i, {}) {{",
        params.join(", ")
    );
    src += &chain_lines(g, chain, &inputs, (None, None), "px", &full)?;
    let _ = writeln!(src, "    return t{};\n}}", output.node.index());
    Ok(Prologue {
        source: src,
        inputs,
        params,
        output,
    })
}

/// Coordinate `(index / inner) % extent` of a flat index into a tensor of
/// shape `full`, as C: in 32-bit unsigned arithmetic when every index
/// fits (a division by a constant is then a multiply-high and a shift, in
/// 64 bits a long sequence), else in 64 bits.
fn coord(index: &str, inner: u64, extent: u64, full: &[u64]) -> String {
    if full.iter().product::<u64>() <= u64::from(u32::MAX) {
        format!("(long long)((unsigned)({index}) / {inner}u % {extent}u)")
    } else {
        format!("(({index}) / {inner}LL) % {extent}LL")
    }
}

/// The body of a device function computing element `i` of `chain`'s
/// values at the flat offsets of `full`: input `k` read through pointer
/// `{ptr}{k}`, except `given`, whose value is `v`, and `raw`, whose value
/// is `xv`; node `n`'s value is `t{n}`; each of its `c_type`.
fn chain_lines(
    g: &OpGraph,
    chain: &[NodeId],
    inputs: &[TensorRef],
    (given, raw): (Option<TensorRef>, Option<TensorRef>),
    ptr: &str,
    full: &[u64],
) -> Result<String, Refusal> {
    let mut src = String::new();
    let mut coords = HashSet::new();
    let offsets: Vec<String> = inputs
        .iter()
        .map(|&t| offset(&shape(g, t), full, &mut coords))
        .collect();
    let mut coords: Vec<usize> = coords.into_iter().collect();
    coords.sort_unstable();
    for d in coords {
        let inner: u64 = full[d + 1..].iter().product();
        let _ = writeln!(
            src,
            "    long long c{d} = {};",
            coord("i", inner, full[d], full)
        );
    }
    let mut names: HashMap<TensorRef, String> = HashMap::new();
    if let Some(t) = given {
        names.insert(t, "v".into());
    }
    if let Some(t) = raw {
        names.insert(t, "xv".into());
    }
    for (k, (&t, off)) in inputs.iter().zip(&offsets).enumerate() {
        let _ = writeln!(src, "    {} v{k} = {ptr}{k}[{off}];", c_type(g, t));
        names.insert(t, format!("v{k}"));
    }
    for &n in chain {
        let ins: Vec<String> = g.inputs(n).iter().map(|t| names[t].clone()).collect();
        let var = format!("t{}", n.index());
        let ty = c_type(g, TensorRef::first(n));
        let _ = writeln!(src, "    {ty} {var} = {};", node_expr(g, n, &ins, full)?);
        names.insert(TensorRef::first(n), var);
    }
    Ok(src)
}

/// A pointwise chain fused after a kernel whose result `given` it reads:
/// a device function `{name}_e(i, v, pe0, …)` computing element `i` of
/// the chain's result from `v`, element `i` of `given`, and the chain's
/// other inputs (`pe0`, … in order). When the chain also reads element
/// `i` of the kernel's own input (a residual), the kernel passes that
/// value, which it holds, as `xv`: `{name}_e(i, v, xv, pe0, …)`.
pub struct Epilogue {
    /// The device function's source.
    pub source: String,
    /// The chain's inputs other than `given` (and the kernel's input
    /// when it comes as `xv`), in parameter order.
    pub inputs: Vec<TensorRef>,
    /// The kernel parameters reading them (`const float* __restrict__
    /// pe0`; a boolean, a where's condition, as `const bool*`).
    pub params: Vec<String>,
    /// Whether the function takes the kernel's input value `xv`.
    pub raw: bool,
    /// The chain's result, which the fused kernel writes.
    pub output: TensorRef,
}

/// The epilogue for `chain` (in order) after the kernel computing
/// `given`, which only the chain reads; the chain's one result has
/// `given`'s shape. `raw` is the kernel's input when the kernel can pass
/// its element `i` (it has `given`'s shape, element for element).
pub fn epilogue(
    g: &OpGraph,
    chain: &[NodeId],
    given: TensorRef,
    raw: Option<TensorRef>,
    name: &str,
) -> Result<Epilogue, Refusal> {
    fusable_chain(g, chain, "after")?;
    if g.outputs().contains(&given) || g.consumers(given.node).iter().any(|c| !chain.contains(c)) {
        return Err(Refusal::new(format!(
            "`{}` is read outside the chain fused after it",
            g.node(given.node).name
        )));
    }
    let (inputs, outputs) = boundary(g, chain);
    let full = shape(g, given);
    let &[output] = &outputs[..] else {
        return Err(Refusal::new(
            "a fused epilogue must have one result (the others are read elsewhere)",
        ));
    };
    if shape(g, output) != full {
        return Err(Refusal::new(format!(
            "the epilogue's result {} does not have the shape of what it follows",
            g.tensor(output)
        )));
    }
    let raw = raw.filter(|&t| inputs.contains(&t) && t != given && shape(g, t) == full);
    let inputs: Vec<TensorRef> = inputs
        .into_iter()
        .filter(|&t| t != given && Some(t) != raw)
        .collect();
    for &t in &inputs {
        if !broadcasts(&shape(g, t), &full) {
            return Err(Refusal::new(format!(
                "input `{}` does not broadcast to {:?}",
                g.node(t.node).name,
                full
            )));
        }
    }
    // `given` and `raw` are float32 results of the kernel and its input.
    conditions(g, chain, &inputs)?;
    let pointers = pointer_params(g, &inputs, "pe");
    let params: Vec<String> = ["long long i", "float v"]
        .into_iter()
        .chain(raw.map(|_| "float xv"))
        .map(str::to_string)
        .chain(pointers.iter().cloned())
        .collect();
    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}_e: {} pointwise op(s) fused after {name}",
        chain.len()
    );
    let _ = writeln!(
        src,
        "__device__ __forceinline__ float {name}_e({}) {{",
        params.join(", ")
    );
    src += &chain_lines(g, chain, &inputs, (Some(given), raw), "pe", &full)?;
    let _ = writeln!(src, "    return t{};\n}}", output.node.index());
    Ok(Epilogue {
        source: src,
        inputs,
        params: pointers,
        raw: raw.is_some(),
        output,
    })
}

/// `expr` with coordinate `c{d}` (a whole word) renamed to `to`.
fn rename_coord(expr: &str, d: usize, to: &str) -> String {
    let from = format!("c{d}");
    let mut out = String::new();
    let mut rest = expr;
    while let Some(at) = rest.find(&from) {
        let after = &rest[at + from.len()..];
        let whole = !after.starts_with(|c: char| c.is_ascii_alphanumeric() || c == '_');
        out.push_str(&rest[..at]);
        out.push_str(if whole { to } else { &from });
        rest = after;
    }
    out.push_str(rest);
    out
}

/// A region's inputs and outputs ([`boundary`]), and the shape its
/// outputs share.
pub(super) type Edges = (Vec<TensorRef>, Vec<TensorRef>, Vec<u64>);

/// A pointwise region's [`boundary`] and the shape every output has, or
/// why no pointwise kernel writes the region: nothing reads its results,
/// or its outputs differ in shape.
pub(super) fn one_shape_boundary(g: &OpGraph, region: &[NodeId]) -> Result<Edges, Refusal> {
    let (inputs, outputs) = boundary(g, region);
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
    Ok((inputs, outputs, full))
}

/// The region's tensors read from outside it, and its outputs: tensors
/// read outside it or that are graph outputs.
pub(crate) fn boundary(g: &OpGraph, region: &[NodeId]) -> (Vec<TensorRef>, Vec<TensorRef>) {
    let inside: HashSet<NodeId> = region.iter().copied().collect();
    let mut inputs = Vec::new();
    for &n in region {
        for t in g.inputs(n) {
            if !inside.contains(&t.node) && !inputs.contains(&t) {
                inputs.push(t);
            }
        }
    }
    let mut outputs = Vec::new();
    for &n in region {
        let t = TensorRef::first(n);
        let read_outside = g.consumers(n).iter().any(|c| !inside.contains(c));
        if read_outside || g.outputs().contains(&t) {
            outputs.push(t);
        }
    }
    (inputs, outputs)
}

/// Whether node `n` reads tensor `t` only as a `where`'s condition (a
/// `masked_fill`'s mask), or not at all.
fn reads_as_condition(g: &OpGraph, n: NodeId, t: TensorRef) -> bool {
    g.inputs(n).iter().enumerate().all(|(slot, &i)| {
        i != t
            || matches!(
                (&g.node(n).op, slot),
                (Op::Where { fill: Some(_) }, 1) | (Op::Where { fill: None }, 0)
            )
    })
}

/// Whether node `n` is a comparison (`x > 0.5`, `a == b`): a boolean
/// value a kernel keeps as a `bool`.
fn comparison(g: &OpGraph, n: NodeId) -> bool {
    match g.node(n).op {
        Op::Binary(b) | Op::Scalar { op: b, .. } => b.is_comparison(),
        _ => false,
    }
}

/// Checks the booleans of `region` and its `inputs`: a boolean, a
/// region's input or a comparison inside it, is read only as a `where`'s
/// condition (a `masked_fill`'s mask), which a kernel keeps as a `bool`
/// (`c_type`), and is no result of the region; any other input or result
/// that is not float32 is refused.
pub(super) fn conditions(
    g: &OpGraph,
    region: &[NodeId],
    inputs: &[TensorRef],
) -> Result<(), Refusal> {
    let (_, outputs) = boundary(g, region);
    let only_conditions = |t: TensorRef| {
        if region.iter().all(|&n| reads_as_condition(g, n, t)) {
            Ok(())
        } else {
            Err(Refusal::new(format!(
                "the boolean `{}` is read other than as a where's condition",
                g.node(t.node).name
            )))
        }
    };
    for &n in region {
        let t = TensorRef::first(n);
        let dtype = g.tensor(t).dtype;
        if dtype == DType::Bool && comparison(g, n) {
            if outputs.contains(&t) {
                return Err(Refusal::new(format!(
                    "`{}` is a boolean result: kernels write float32 (leave the comparison to torch)",
                    g.node(n).name
                )));
            }
            only_conditions(t)?;
        } else if dtype != DType::F32 {
            return Err(Refusal::new(format!("`{}` is not float32", g.node(n).name)));
        }
    }
    for &t in inputs {
        if g.tensor(t).dtype == DType::Bool {
            only_conditions(t)?;
        } else if g.tensor(t).dtype != DType::F32 {
            return Err(Refusal::new(format!(
                "input `{}` is not float32",
                g.node(t.node).name
            )));
        }
    }
    Ok(())
}

/// Generates the fused kernel for `action`'s region.
pub fn generate(g: &OpGraph, action: &Action, name: &str) -> Result<Fragment, Refusal> {
    let region = action.nodes();
    if region.is_empty() {
        return Err(Refusal::new("the region is empty"));
    }
    for &n in &region {
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
    }
    let (inputs, outputs, full) = one_shape_boundary(g, &region)?;
    for &n in &region {
        let s = shape(g, TensorRef::first(n));
        if !broadcasts(&s, &full) {
            return Err(Refusal::new(format!(
                "`{}` does not broadcast to the region's shape",
                g.node(n).name
            )));
        }
    }
    conditions(g, &region, &inputs)?;
    let numel: u64 = full.iter().product();
    let Params { block, vector } = action.params;
    if ![32, 64, 128, 256, 512, 1024].contains(&block) {
        return Err(Refusal::new(format!(
            "block {block} is not a power of two from 32 to 1024"
        )));
    }
    // triu / tril keep elements by their row and column in the last two
    // dims of the region's shape.
    let triangular = region
        .iter()
        .any(|&n| matches!(g.node(n).op, Op::Triangular { .. }));
    if triangular
        && (full.len() < 2
            || region.iter().any(|&n| {
                matches!(g.node(n).op, Op::Triangular { .. })
                    && shape(g, TensorRef::first(n)) != full
            }))
    {
        return Err(Refusal::new(
            "triu and tril need a matrix at the region's full shape",
        ));
    }
    let vector: u32 = match vector {
        1 => 1,
        2 | 4 if triangular => {
            return Err(Refusal::new(
                "triu and tril read each element's row and column: one element per thread",
            ));
        }
        w @ (2 | 4) if numel.is_multiple_of(u64::from(w)) => w,
        w @ (2 | 4) => {
            return Err(Refusal::new(format!(
                "float{w} needs a multiple of {w} elements"
            )));
        }
        v => {
            return Err(Refusal::new(format!("vector width {v} is not 1, 2 or 4")));
        }
    };

    let mut src = String::new();
    let _ = writeln!(
        src,
        "// {name}: {} fused pointwise op(s) over {} elements",
        region.len(),
        numel
    );
    let params: Vec<String> = pointer_params(g, &inputs, "in")
        .into_iter()
        .chain((0..outputs.len()).map(|k| format!("float* __restrict__ out{k}")))
        .chain(["long long n".to_string()])
        .collect();
    let _ = writeln!(
        src,
        "extern \"C\" __global__ void {name}({}) {{",
        params.join(", ")
    );
    let lanes: Vec<&str> = match vector {
        4 => vec!["x", "y", "z", "w"],
        2 => vec!["x", "y"],
        _ => vec![""],
    };
    let trips = if vector > 1 {
        format!("n / {vector}")
    } else {
        "n".to_string()
    };
    let _ = writeln!(
        src,
        "    long long stride = (long long)gridDim.x * blockDim.x;"
    );
    let _ = writeln!(
        src,
        "    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < {trips}; i += stride) {{"
    );
    // Coordinates of the output index that broadcast inputs need. With
    // `vector` lanes (float2 / float4), element `i * vector + l` is lane
    // `l`; a coordinate whose inner extent is a multiple of `vector` is the
    // same for every lane.
    let mut coords = HashSet::new();
    let offsets: Vec<String> = inputs
        .iter()
        .map(|&t| offset(&shape(g, t), &full, &mut coords))
        .collect();
    if triangular {
        coords.extend([full.len() - 2, full.len() - 1]);
    }
    let mut coords: Vec<usize> = coords.into_iter().collect();
    coords.sort_unstable();
    let shared = |d: usize| {
        full[d + 1..]
            .iter()
            .product::<u64>()
            .is_multiple_of(u64::from(vector))
    };
    for &d in &coords {
        let inner: u64 = full[d + 1..].iter().product();
        if vector == 1 {
            let _ = writeln!(
                src,
                "        long long c{d} = {};",
                coord("i", inner, full[d], &full)
            );
        } else if shared(d) {
            let _ = writeln!(
                src,
                "        long long c{d} = {};",
                coord(&format!("i * {vector}"), inner, full[d], &full)
            );
        } else {
            for (l, lane) in lanes.iter().enumerate() {
                let _ = writeln!(
                    src,
                    "        long long c{d}_{lane} = {};",
                    coord(&format!("i * {vector} + {l}"), inner, full[d], &full)
                );
            }
        }
    }
    // Loads: an input at the full shape as one float2 / float4; a broadcast one
    // lane by lane, or once when its offset is the same for every lane.
    let mut lane_names: Vec<Vec<String>> = Vec::new();
    for (k, off) in offsets.iter().enumerate() {
        let full_shape = shape(g, inputs[k]) == full;
        let ty = c_type(g, inputs[k]);
        if vector == 1 {
            let _ = writeln!(src, "        {ty} v{k} = in{k}[{off}];");
            lane_names.push(vec![format!("v{k}")]);
        } else if full_shape && g.tensor(inputs[k]).dtype == DType::Bool {
            // Booleans lane by lane (a byte each: no float-wide load).
            let mut names = Vec::new();
            for (l, lane) in lanes.iter().enumerate() {
                let _ = writeln!(src, "        bool v{k}_{lane} = in{k}[i * {vector} + {l}];");
                names.push(format!("v{k}_{lane}"));
            }
            lane_names.push(names);
        } else if full_shape {
            let _ = writeln!(
                src,
                "        float{vector} v{k} = reinterpret_cast<const float{vector}*>(in{k})[i];"
            );
            lane_names.push(lanes.iter().map(|l| format!("v{k}.{l}")).collect());
        } else {
            let used: Vec<usize> = coords
                .iter()
                .copied()
                .filter(|&d| rename_coord(off, d, "@") != *off)
                .collect();
            if used.iter().all(|&d| shared(d)) {
                let _ = writeln!(src, "        {ty} v{k} = in{k}[{off}];");
                lane_names.push(vec![format!("v{k}"); lanes.len()]);
            } else {
                let mut names = Vec::new();
                for lane in &lanes {
                    let mut lane_off = off.clone();
                    for &d in &used {
                        if !shared(d) {
                            lane_off = rename_coord(&lane_off, d, &format!("c{d}_{lane}"));
                        }
                    }
                    let _ = writeln!(src, "        {ty} v{k}_{lane} = in{k}[{lane_off}];");
                    names.push(format!("v{k}_{lane}"));
                }
                lane_names.push(names);
            }
        }
    }
    let mut results = Vec::new();
    for lane in &lanes {
        let suffix = if lane.is_empty() {
            String::new()
        } else {
            format!("_{lane}")
        };
        let mut names: HashMap<TensorRef, String> = HashMap::new();
        for (k, &t) in inputs.iter().enumerate() {
            let l = lanes.iter().position(|x| x == lane).unwrap_or(0);
            names.insert(t, lane_names[k][l.min(lane_names[k].len() - 1)].clone());
        }
        for &n in &region {
            let ins: Vec<String> = g.inputs(n).iter().map(|t| names[t].clone()).collect();
            let expr = node_expr(g, n, &ins, &full)?;
            let var = format!("t{}{suffix}", n.index());
            let ty = c_type(g, TensorRef::first(n));
            let _ = writeln!(src, "        {ty} {var} = {expr};");
            names.insert(TensorRef::first(n), var);
        }
        results.push(names);
    }
    for (k, &t) in outputs.iter().enumerate() {
        if vector > 1 {
            let parts: Vec<&str> = results.iter().map(|r| r[&t].as_str()).collect();
            let _ = writeln!(
                src,
                "        reinterpret_cast<float{vector}*>(out{k})[i] = make_float{vector}({});",
                parts.join(", ")
            );
        } else {
            let _ = writeln!(src, "        out{k}[i] = {};", results[0][&t]);
        }
    }
    src.push_str("    }\n}\n");
    let items = numel.div_ceil(u64::from(vector));
    // A thread per item: a grid-stride loop over a grid of a few waves
    // ran at 93 % of a copy's bandwidth on an H100, a grid that covers
    // the items once at the copy's. The loop stays for grids past CUDA's
    // limit.
    let grid = items.div_ceil(u64::from(block)).clamp(1, (1 << 31) - 1) as u32;
    Ok(Fragment {
        name: name.to_string(),
        action: action.clone(),
        lang: crate::program::Lang::Cuda,
        source: src,
        inputs,
        outputs,
        region,
        launch: Launch {
            shared: 0,
            grid,
            block,
            sizes: vec![numel as i64],
        },
        before: Vec::new(),
    })
}

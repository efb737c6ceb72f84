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
//!   combined atomically (`rows::Split`);
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

use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::Op;

use super::Refusal;
use super::pointwise::{prologue_boundary, shape};
use crate::MicroCoder;
use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Lang, Launch, Program};

mod cumulative;
mod expr;
mod gemm;
mod loss;
mod norm;
mod pointwise;
mod pool;
mod rows;

use cumulative::scan;
use expr::{chain_body, check_pointwise};
use gemm::gemm;
use loss::loss;
use norm::norm;
use pointwise::pointwise;
use pool::pool;
use rows::rows;

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

/// The program's flat index: int64 when the tensor is too large for int32.
fn program_id(wide: bool) -> &'static str {
    if wide {
        "tl.program_id(0).to(tl.int64)"
    } else {
        "tl.program_id(0)"
    }
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
        let (inputs, output) = prologue_boundary(g, chain, reader)?;
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

/// The next power of two at or above `n`.
fn pow2(n: u64) -> u64 {
    n.max(1).next_power_of_two()
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

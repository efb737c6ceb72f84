//! The template coder: fragments from rules, no LLM, no network.
//!
//! Families so far (CUDA): pointwise chains with broadcasting; reductions
//! (argmax and argmin included) and softmax over a run of adjacent dims,
//! few long rows split across blocks; layer, RMS, group, instance and
//! batch norm; max and average pooling (1–3-d, and global); cumulative
//! sums and products, forward or reverse; losses (mse, huber, smooth L1,
//! cross-entropy, triplet margin) reduced to their mean or sum; fp32
//! matrix products and convolutions (implicit GEMMs) on the tensor cores
//! (3xTF32) with a pointwise chain fused after them. Each family refuses,
//! with the reason, what it cannot write.
//!
//! Triton (`triton::TritonCoder`): pointwise chains, row reductions,
//! softmax, global pooling and layer / RMS / group / instance norm.

pub(crate) use pointwise::boundary;

/// Whether a template family computes `op` as a product with a pointwise
/// chain fused after it (an fp32 GEMM or an implicit-GEMM convolution),
/// the alternative to its library call.
pub fn product(op: &mtmc_actions::op::Op) -> bool {
    matches!(op, mtmc_actions::op::Op::MatMul(_)) || conv::computes(op)
}

mod conv;
mod gemm;
mod loss;
mod pointwise;
mod pool;
mod rows;
mod scan;
pub mod triton;

use mtmc_actions::graph::OpGraph;

use crate::MicroCoder;
pub use crate::Refusal;
use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Program};

/// Blocks a grid-stride loop is sized for: eight per SM of an H100.
const WAVES: u64 = 132 * 8;

/// The blocks a row kernel takes: a power of two from 64 to 1024 threads.
const ROW_BLOCKS: [u32; 5] = [64, 128, 256, 512, 1024];

/// The block size of a kernel that reads one element per thread per trip:
/// one of [`ROW_BLOCKS`], at vector width 1.
fn one_per_thread(action: &Action, family: &str) -> Result<u32, Refusal> {
    let block = action.params.block;
    if !ROW_BLOCKS.contains(&block) || action.params.vector != 1 {
        return Err(Refusal::new(format!(
            "{family} kernels take a block of 64 to 1024 threads (a power of two) and read one element per thread per trip (vector width 1)"
        )));
    }
    Ok(block)
}

/// How a kernel reads element `i` of its input `x` when nothing is fused
/// in front of it.
const LOAD_X: &str = "#define LOAD_X(i) (x[(i)])";

/// How a kernel writes element `i` of its result `y` when nothing is
/// fused after it (norms, softmax). A kernel holding element `i` of its
/// input may write through `STORE_YX(i, v, xv)` instead, so that a chain
/// after it that reads the input there (a residual) need not load it;
/// `EPI_Y(i, v, xv)` is the value either writes (for kernels that store
/// 16 bytes at a time).
const STORE_Y: &str = "#define STORE_Y(i, v) (y[(i)] = (v))\n#define STORE_YX(i, v, xv) STORE_Y(i, v)\n#define EPI_Y(i, v, xv) (v)";

/// The first input of `node`, when it and the node's first result are
/// float32.
fn f32_input(
    g: &mtmc_actions::graph::OpGraph,
    node: mtmc_actions::graph::NodeId,
) -> Result<mtmc_actions::graph::TensorRef, Refusal> {
    let n = g.node(node);
    let input = g.inputs(node)[0];
    if g.tensor(input).dtype != mtmc_actions::DType::F32
        || n.outputs[0].dtype != mtmc_actions::DType::F32
    {
        return Err(Refusal::new(format!("`{}` is not float32", n.name)));
    }
    Ok(input)
}

/// A float literal CUDA reads back exactly (as f32); an infinity as its
/// bits.
fn lit(v: f64) -> Result<String, Refusal> {
    if v.is_nan() {
        return Err(Refusal::new(format!(
            "the constant {v} has no float literal"
        )));
    }
    if v.is_infinite() {
        // No literal: the bits of an IEEE infinity (device code).
        let bits = if v > 0.0 { "0x7f800000" } else { "0xff800000" };
        return Ok(format!("__int_as_float({bits})"));
    }
    Ok(format!("{:e}f", v as f32))
}

/// The fragment of a kernel that computes the one node `node` from
/// `inputs`.
fn one_node(
    name: &str,
    action: &Action,
    source: String,
    inputs: Vec<mtmc_actions::graph::TensorRef>,
    node: mtmc_actions::graph::NodeId,
    launch: crate::program::Launch,
) -> Fragment {
    // Kernels read their input through `LOAD_X(index)`, so that a
    // pointwise prologue can be fused in by redefining it.
    let source = if source.contains("LOAD_X(") {
        format!("{LOAD_X}\n{source}#undef LOAD_X\n#undef MTMC_PROLOGUE\n")
    } else {
        source
    };
    // Norms and softmax write through `STORE_Y(index, value)` (or
    // `STORE_YX`, `EPI_Y`), so that a pointwise epilogue can be fused in
    // by redefining them.
    let source = if source.contains("STORE_Y") || source.contains("EPI_Y(") {
        format!(
            "{STORE_Y}\n{source}#undef STORE_Y\n#undef STORE_YX\n#undef EPI_Y\n#undef MTMC_EPILOGUE\n"
        )
    } else {
        source
    };
    Fragment {
        name: name.to_string(),
        action: action.clone(),
        lang: crate::program::Lang::Cuda,
        source,
        inputs,
        outputs: vec![mtmc_actions::graph::TensorRef::first(node)],
        region: vec![node],
        launch,
        before: Vec::new(),
    }
}

impl TemplateCoder {
    /// A region that is a pointwise chain followed by the row kernel (a
    /// reduction, softmax, norm, scan or global pooling) that alone reads
    /// it, and for a norm or softmax, a pointwise chain after it that alone
    /// reads it: the row kernel, with the chain in front computed where the
    /// kernel reads its input (`LOAD_X`) and the chain after it where it
    /// writes (`STORE_Y`). `None` when the region is not of that
    /// shape.
    fn with_chains(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
    ) -> Option<Result<Fragment, Refusal>> {
        use mtmc_actions::op::Op;
        let nodes = action.nodes();
        if nodes.len() < 2 || !matches!(action.kind, ActionKind::Fuse) {
            return None;
        }
        let position = |n: &mtmc_actions::graph::NodeId| g.order().iter().position(|o| o == n);
        let mut ordered = nodes.clone();
        ordered.sort_by_key(|n| position(n));
        let is_row = |n: &mtmc_actions::graph::NodeId| match &g.node(*n).op {
            Op::Reduce(_) | Op::Softmax { .. } | Op::Norm(_) | Op::Scan(_) => true,
            Op::AdaptivePool(a) => a.is_global(),
            _ => false,
        };
        let at = ordered.iter().position(is_row)?;
        let row = ordered[at];
        let (before, after) = (&ordered[..at], &ordered[at + 1..]);
        let writes_through = matches!(g.node(row).op, Op::Norm(_) | Op::Softmax { .. });
        if after.iter().any(is_row) || (!after.is_empty() && !writes_through) {
            return None;
        }
        let single = Action {
            kind: ActionKind::CustomKernel,
            region: vec![row.index() as u32],
            params: action.params,
        };
        Some(self.realize(program, g, &single).and_then(|mut f| {
            if !before.is_empty() {
                let pro = pointwise::prologue(g, before, row, &f.name)?;
                f = fuse_prologue(f, pro, before.to_vec(), action)?;
            }
            if !after.is_empty() {
                let given = mtmc_actions::graph::TensorRef::first(row);
                let input = g.inputs(row).first().copied();
                let epi = pointwise::epilogue(g, after, given, input, &f.name)?;
                f = fuse_epilogue(f, epi, after.to_vec(), action)?;
            }
            Ok(f)
        }))
    }
}

/// The norm or softmax kernel `f` writing through the epilogue `epi` (the
/// chain after it) instead of to memory.
fn fuse_epilogue(
    mut f: Fragment,
    epi: pointwise::Epilogue,
    chain: Vec<mtmc_actions::graph::NodeId>,
    action: &Action,
) -> Result<Fragment, Refusal> {
    let decl = "float* __restrict__ y";
    if f.outputs.len() != 1 || !f.source.contains(STORE_Y) || !f.source.contains(decl) {
        return Err(Refusal::new(format!(
            "{} does not write its one result `y` through STORE_Y",
            f.name
        )));
    }
    // The chain's inputs come after the kernel's own, before `y`.
    let params: String = epi.params.iter().map(|p| format!("{p}, ")).collect();
    let args: String = (0..epi.inputs.len()).map(|k| format!(", pe{k}")).collect();
    let name = &f.name;
    // A chain that reads the kernel's input at `i` takes it from the
    // kernel (`STORE_YX`'s `xv`, or `LOAD_X(i)`, which the kernel has
    // mostly just read itself).
    if epi.raw && !f.source.contains("LOAD_X(") {
        return Err(Refusal::new(format!(
            "{} does not read its input through LOAD_X, which the chain after it reads",
            f.name
        )));
    }
    let store = if epi.raw {
        format!(
            "#define EPI_Y(i, v, xv) {name}_e((i), (v), (xv){args})\n#define STORE_YX(i, v, xv) (y[(i)] = EPI_Y(i, v, xv))\n#define STORE_Y(i, v) STORE_YX(i, v, LOAD_X(i))\n#define MTMC_EPILOGUE"
        )
    } else {
        format!(
            "#define EPI_Y(i, v, xv) {name}_e((i), (v){args})\n#define STORE_Y(i, v) (y[(i)] = EPI_Y(i, v, 0.0f))\n#define STORE_YX(i, v, xv) STORE_Y(i, v)\n#define MTMC_EPILOGUE"
        )
    };
    f.source = format!(
        "{}{}",
        epi.source,
        f.source
            .replace(decl, &format!("{params}{decl}"))
            .replace(STORE_Y, &store)
    );
    f.inputs.extend(epi.inputs);
    f.outputs = vec![epi.output];
    f.region.extend(chain);
    f.action = action.clone();
    Ok(f)
}

/// The row kernel `f` reading its input through `pro` instead of from
/// memory.
fn fuse_prologue(
    mut f: Fragment,
    pro: pointwise::Prologue,
    chain: Vec<mtmc_actions::graph::NodeId>,
    action: &Action,
) -> Result<Fragment, Refusal> {
    if f.inputs.first() != Some(&pro.output) || !f.source.contains(LOAD_X) {
        return Err(Refusal::new(format!(
            "{} does not read the chain's result through LOAD_X",
            f.name
        )));
    }
    let decl = "const float* __restrict__ x,";
    if !f.source.contains(decl) {
        return Err(Refusal::new(format!("{} has no input `x`", f.name)));
    }
    let params: Vec<String> = pro.params.iter().map(|p| format!("{p},")).collect();
    let args: Vec<String> = (0..pro.inputs.len()).map(|k| format!("px{k}")).collect();
    f.source = format!(
        "{}{}",
        pro.source,
        f.source.replace(decl, &params.join(" ")).replace(
            LOAD_X,
            // Kernels that read 16 bytes at a time where nothing is
            // fused in read element by element under MTMC_PROLOGUE.
            &format!(
                "#define LOAD_X(i) {}_x((i), {})\n#define MTMC_PROLOGUE",
                f.name,
                args.join(", ")
            )
        )
    );
    let mut inputs = pro.inputs;
    inputs.extend(f.inputs.drain(1..));
    f.inputs = inputs;
    let mut region = chain;
    region.append(&mut f.region);
    f.region = region;
    f.action = action.clone();
    Ok(f)
}

/// Why a coder writes no fragment for the call-library action.
pub(crate) const LIBRARY: &str =
    "library calls are kept as torch ops in the ModelNew export, not as fragments";

/// Why a custom kernel over several ops is refused.
pub(crate) const ONE_OP: &str = "a custom kernel covers one op; fuse covers several";

/// Why the template coders refuse repairs.
const REPAIRS: &str = "repairs are written by the LLM coder; the template coder writes each kernel anew from the graph";

/// The template coder.
#[derive(Clone, Debug, Default)]
pub struct TemplateCoder;

impl MicroCoder for TemplateCoder {
    fn realize(
        &self,
        program: &Program,
        g: &OpGraph,
        action: &Action,
    ) -> Result<Fragment, Refusal> {
        use mtmc_actions::op::Op;
        if let Some(fragment) = self.with_chains(program, g, action) {
            return fragment;
        }
        let single = match &action.nodes()[..] {
            [n] => Some(&g.node(*n).op),
            _ => None,
        };
        let rows = matches!(single, Some(Op::Reduce(_) | Op::Softmax { .. }))
            || matches!(single, Some(Op::AdaptivePool(a)) if a.is_global());
        let norm = matches!(single, Some(Op::Norm(_)));
        let pool = matches!(single, Some(Op::Pool(_) | Op::AdaptivePool(_))) && !rows;
        let scan = matches!(single, Some(Op::Scan(_)));
        let loss = matches!(single, Some(Op::Loss(_)));
        // A product family is chosen by the region's first node.
        let first = action.nodes().first().map(|&n| &g.node(n).op);
        let gemm = matches!(first, Some(Op::MatMul(_)));
        let conv = matches!(first, Some(Op::Conv(_)));
        let family = if gemm {
            "gemm"
        } else if conv {
            "conv"
        } else if rows || norm {
            "rows"
        } else if pool {
            "pool"
        } else if scan {
            "scan"
        } else if loss {
            "loss"
        } else {
            "pointwise"
        };
        let name = format!("k{}_{family}", program.fragments.len());
        match action.kind {
            ActionKind::CustomKernel
            | ActionKind::Fuse
            | ActionKind::Retile
            | ActionKind::Vectorize => {
                if action.kind == ActionKind::CustomKernel && action.region.len() != 1 {
                    return Err(Refusal::new(ONE_OP));
                }
                // A kernel-level action rewrites the kernel that covers the
                // region now, under its name.
                let name = match action.kind {
                    ActionKind::Retile | ActionKind::Vectorize => program
                        .fragments
                        .iter()
                        .find(|f| f.region.iter().any(|n| action.nodes().contains(n)))
                        .map(|f| f.name.clone())
                        .ok_or_else(|| Refusal::new("no kernel covers this region yet"))?,
                    _ => name,
                };
                if gemm {
                    gemm::generate(g, action, &name)
                } else if conv {
                    conv::generate(g, action, &name)
                } else if pool {
                    pool::generate(g, action, &name)
                } else if scan {
                    scan::generate(g, action, &name)
                } else if loss {
                    loss::generate(g, action, &name)
                } else if norm {
                    rows::norm(g, action, &name)
                } else if rows {
                    rows::generate(g, action, &name)
                } else {
                    pointwise::generate(g, action, &name)
                }
            }
            ActionKind::CallLibrary => Err(Refusal::new(LIBRARY)),
            ActionKind::FixCompile | ActionKind::FixCorrectness => Err(Refusal::new(REPAIRS)),
        }
    }
}

//! The graph cut into regions, and the program built from them a
//! fragment at a time (each compiled alone, rolled back on failure).

use anyhow::{Result, bail};
use mtmc_actions::graph::{NodeId, OpGraph};
use mtmc_actions::op::{Layout, Op, OpClass};
use mtmc_coder::MicroCoder;
use mtmc_coder::action::{Action, Params};
use mtmc_coder::program::Program;
use mtmc_coder::session::{Failure, Session, Stage};
use mtmc_coder::template::product;
use mtmc_env::nvrtc::Arch;

/// How a variant computes products: matrix products, and the
/// convolutions the convolution family writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Gemm {
    /// Library calls (torch, cuBLAS).
    Library,
    /// GEMM kernels with their epilogue fused; a product the template
    /// refuses stays a library call.
    Kernel,
    /// GEMM kernels only (a program with no library, such as an intent's):
    /// a refusal fails the variant.
    KernelOnly,
}

/// An op of `g` that no template family computes and that is not a library
/// op (a concatenation, say): in a `ModelNew` it stays a torch call.
pub(crate) fn torch_only(g: &OpGraph, id: NodeId) -> bool {
    let op = &g.node(id).op;
    !(op.is_source()
        || op.is_view()
        || mtmc_coder::export::library_op(op)
        || matches!(op, Op::Layout(Layout::Permute { .. }))
        || op.class() == OpClass::Pointwise
        || row_op(g, id.index() as u32))
}

/// Whether the node at `index` is computed by a kernel of its own that
/// reads one element per thread (rows, norms, pooling).
fn row_op(g: &OpGraph, index: u32) -> bool {
    matches!(
        g.node(NodeId::new(index as usize)).op.class(),
        OpClass::Reduction
            | OpClass::Softmax
            | OpClass::Norm
            | OpClass::Pool
            | OpClass::Scan
            | OpClass::Loss
    )
}

/// The program with one fragment per region at `params` (row kernels other
/// than pooling read one element per thread), or the first failure. With `leave_refused`, a
/// region the coder refuses stays torch calls (the refusals are returned)
/// instead of failing the program.
pub(crate) fn build<C: MicroCoder>(
    g: &OpGraph,
    regions: &[Vec<u32>],
    params: Params,
    fuse: bool,
    gemm: Gemm,
    coder: C,
    leave_refused: bool,
) -> Result<(Program, Vec<Failure>), Failure> {
    let with_products;
    let regions = if gemm == Gemm::Library {
        regions
    } else {
        with_products = with_gemms(g, regions);
        &with_products[..]
    };
    let mut refused = Vec::new();
    let mut session = Session::new(g, coder, Arch::SM90);
    let action = |region: &[u32]| {
        // Row kernels read one element per thread per trip; a pooling's
        // vector width is the outputs a thread walks together.
        let row = region
            .iter()
            .any(|&n| row_op(g, n) && g.node(NodeId::new(n as usize)).op.class() != OpClass::Pool);
        let params = if row {
            Params {
                vector: 1,
                ..params
            }
        } else {
            params
        };
        Action::kernel_for(region.to_vec(), params)
    };
    let mut k = 0;
    while k < regions.len() {
        // A pointwise chain read only by the row kernel after it is fused
        // in front of it, and one that alone reads a norm or softmax after
        // it; when that step fails it is rolled back and tried with less
        // fused, down to the regions written apart.
        if fuse {
            let front = fusable(g, regions, k);
            let back = epilogue_of(g, regions, front.unwrap_or(k));
            let mut spans = Vec::new();
            if let (Some(_), Some(end)) = (front, back) {
                spans.push(end);
            }
            spans.extend(front.or(back));
            let mut fused = false;
            for end in spans {
                let span: Vec<u32> = regions[k..=end].concat();
                if let Ok(p) = session.propose(&action(&span)) {
                    session.accept(p);
                    k = end + 1;
                    fused = true;
                    break;
                }
            }
            if fused {
                continue;
            }
        }
        match session.propose(&action(&regions[k])) {
            Ok(next) => session.accept(next),
            Err(f) if leave_refused && f.stage == Stage::Refused => refused.push(f),
            Err(f) => {
                // A product with its epilogue failed: the product alone,
                // then the chain after it apart; with library calls
                // allowed, a product no kernel computes stays one.
                let [product, chain @ ..] = &regions[k][..] else {
                    return Err(f);
                };
                if gemm == Gemm::Library || !is_product(g, *product) {
                    return Err(f);
                }
                match session.propose(&action(&[*product])) {
                    Ok(next) => session.accept(next),
                    Err(f) if gemm == Gemm::Kernel => refused.push(f),
                    Err(f) => return Err(f),
                }
                if !chain.is_empty() {
                    match session.propose(&action(chain)) {
                        Ok(next) => session.accept(next),
                        Err(f) if leave_refused && f.stage == Stage::Refused => refused.push(f),
                        Err(f) => return Err(f),
                    }
                }
            }
        }
        k += 1;
    }
    Ok((session.good().clone(), refused))
}

/// Whether a fragment of `program` computes a product of `g` (a GEMM or
/// convolution kernel, CUDA or Triton: its region starts with the
/// product).
pub(super) fn has_gemm(g: &OpGraph, program: &Program) -> bool {
    program
        .fragments
        .iter()
        .any(|f| f.region.first().is_some_and(|&n| product(&g.node(n).op)))
}

/// Whether a fragment of `program` computes a convolution.
pub(super) fn has_conv(program: &Program) -> bool {
    program.fragments.iter().any(|f| f.name.ends_with("_conv"))
}

/// Whether the node at `index` is a product a template kernel computes
/// (a matrix product, or a convolution of the convolution family).
fn is_product(g: &OpGraph, index: u32) -> bool {
    product(&g.node(NodeId::new(index as usize)).op)
}

/// `regions` with each product a template kernel computes (matrix product,
/// convolution) added: at the head of the pointwise region that alone reads
/// it (its epilogue), else as a region of its own; in graph order.
fn with_gemms(g: &OpGraph, regions: &[Vec<u32>]) -> Vec<Vec<u32>> {
    let mut out = regions.to_vec();
    for (id, _) in g.nodes().filter(|(_, n)| product(&n.op)) {
        let index = id.index() as u32;
        let readers = g.consumers(id);
        let host = out.iter().position(|r| {
            !r.iter().any(|&n| row_op(g, n) || is_product(g, n))
                && !readers.is_empty()
                && readers.iter().all(|c| r.contains(&(c.index() as u32)))
        });
        match host {
            Some(k) if !g.outputs().iter().any(|t| t.node == id) => out[k].insert(0, index),
            _ => out.push(vec![index]),
        }
    }
    out.sort_by_key(|r| r.iter().copied().min());
    out
}

/// The index of the region (right after `k`) holding the single row op
/// that alone reads pointwise region `k`'s results.
fn fusable(g: &OpGraph, regions: &[Vec<u32>], k: usize) -> Option<usize> {
    let region = &regions[k];
    if region.iter().any(|&n| row_op(g, n) || is_product(g, n)) {
        return None;
    }
    let next = k + 1;
    let [row] = regions.get(next)?[..] else {
        return None;
    };
    if !row_op(g, row) {
        return None;
    }
    let inside = |n: NodeId| region.contains(&(n.index() as u32));
    let readers_ok = region.iter().all(|&n| {
        let id = NodeId::new(n as usize);
        !g.outputs().iter().any(|t| t.node == id)
            && g.consumers(id)
                .iter()
                .all(|&c| inside(c) || c.index() as u32 == row)
    });
    let feeds = g
        .inputs(NodeId::new(row as usize))
        .first()
        .is_some_and(|t| inside(t.node));
    (readers_ok && feeds).then_some(next)
}

/// The index of the pointwise region (right after `k`) that alone reads
/// the single norm or softmax of region `k`, to be fused after it.
fn epilogue_of(g: &OpGraph, regions: &[Vec<u32>], k: usize) -> Option<usize> {
    let [norm] = regions[k][..] else {
        return None;
    };
    let id = NodeId::new(norm as usize);
    if !matches!(g.node(id).op, Op::Norm(_) | Op::Softmax { .. })
        || g.outputs().iter().any(|t| t.node == id)
    {
        return None;
    }
    let next = k + 1;
    let chain = regions.get(next)?;
    if chain.iter().any(|&n| row_op(g, n) || is_product(g, n)) {
        return None;
    }
    let readers = g.consumers(id);
    (!readers.is_empty() && readers.iter().all(|c| chain.contains(&(c.index() as u32))))
        .then_some(next)
}

/// The regions a graph is cut into: connected pointwise chains (each a
/// fused kernel) and single reductions, softmaxes and norms (row kernels);
/// matmuls and convolutions stay library calls, and permutes torch views
/// and what derives from parameters alone torch calls the export keeps
/// where the program runs beside torch (`torch_views`: a ModelNew). Other
/// ops are regions of their own with `others` (an LLM writes them), else
/// torch calls beside torch ([`torch_only`]), else an error.
pub(crate) fn regions(g: &OpGraph, torch_views: bool, others: bool) -> Result<Vec<Vec<u32>>> {
    let mut region_of: std::collections::HashMap<NodeId, usize> = Default::default();
    let mut regions: Vec<Vec<u32>> = Vec::new();
    let mut other = Vec::new();
    // In a ModelNew, what derives from parameters alone (folded weights)
    // stays torch calls that the export keeps between calls.
    let derived = if torch_views {
        mtmc_coder::export::derived_from_parameters(g, &Default::default())
    } else {
        Default::default()
    };
    for (id, n) in g.nodes() {
        // In a ModelNew, permutes are torch views (made dense by torch
        // where a kernel reads them).
        if n.op.is_source()
            || n.op.is_view()
            || mtmc_coder::export::library_op(&n.op)
            || (torch_views && matches!(n.op, Op::Layout(Layout::Permute { .. })))
            || derived.contains(&id)
        {
            continue;
        }
        if row_op(g, id.index() as u32) {
            regions.push(vec![id.index() as u32]);
            region_of.insert(id, usize::MAX);
            continue;
        }
        if n.op.class() != OpClass::Pointwise && others {
            regions.push(vec![id.index() as u32]);
            region_of.insert(id, usize::MAX);
            continue;
        }
        if n.op.class() != OpClass::Pointwise {
            // Beside torch, an op no family computes stays a torch call
            // (the call-library action), listed with the library calls.
            if !torch_views {
                other.push(format!("{} ({})", n.name, n.op));
            }
            continue;
        }
        // Join the region of a pointwise producer when this node is its only
        // reader, so that chains fuse and branches stay apart.
        // A producer read by several pointwise ops (`x * clamp(x + 3)`)
        // stays inside the newest region with them: no region after it
        // can hold an input this node reads.
        let newest = regions.len().checked_sub(1);
        let joined = g.inputs(id).iter().find_map(|t| {
            let r = *region_of.get(&t.node)?;
            let readers = g.consumers(t.node);
            let all_pointwise = readers
                .iter()
                .all(|&c| g.node(c).op.class() == OpClass::Pointwise);
            (r != usize::MAX && (readers.len() == 1 || (all_pointwise && Some(r) == newest)))
                .then_some(r)
        });
        let r = joined.unwrap_or_else(|| {
            regions.push(Vec::new());
            regions.len() - 1
        });
        regions[r].push(id.index() as u32);
        region_of.insert(id, r);
    }
    if !other.is_empty() {
        // The first few by name; many are repeats of one kind.
        let shown = other.len().min(6);
        let more = if other.len() > shown {
            format!(" and {} more", other.len() - shown)
        } else {
            String::new()
        };
        bail!(
            "the template coder has no family yet for {}{more}; today `optimize` covers pointwise chains, reductions, softmax, norms, pooling, scans and losses, with matmuls and convolutions as library calls or GEMM kernels, and attention as a library call",
            other[..shown].join(", ")
        );
    }
    Ok(regions)
}

#[cfg(test)]
mod tests {
    use mtmc_coder::template::TemplateCoder;

    use super::*;

    /// AlexNet's rewritten graph computes between its convolutions in
    /// channels-last order and permutes back before each: where the
    /// convolutions are GEMM kernels, each reads its input by a raw
    /// pointer, so the permute back is copied dense (a strided view read
    /// as NCHW memory computed a wrong result, 0.29 of the output's
    /// scale, on the H100); where torch computes them it stays a view.
    #[test]
    fn a_kernel_never_reads_a_strided_view() {
        let g = mtmc_actions::import::shared_graph(3, "5_AlexNet").unwrap();
        let (r, applied) = mtmc_actions::rewrite::rewrite_all(&g).unwrap();
        assert!(applied.contains(&"channels_last"), "{applied:?}");
        let regions = regions(&r, true, false).unwrap();
        let params = Params {
            block: 256,
            vector: 1,
        };
        // Each permute's variable, and whether the export copies it dense.
        let permutes = |code: &str| -> Vec<(String, bool)> {
            code.lines()
                .filter(|l| l.contains(".permute("))
                .map(|l| {
                    let v = l.trim().split(" = ").next().unwrap().to_string();
                    (v, l.ends_with(".contiguous()"))
                })
                .collect()
        };
        for gemm in [Gemm::Kernel, Gemm::Library] {
            let (p, _) = build(&r, &regions, params, true, gemm, TemplateCoder, false).unwrap();
            assert_eq!(has_conv(&p), gemm == Gemm::Kernel);
            let code = mtmc_coder::export::to_model_new(&r, &p, "class Model: pass\n").unwrap();
            let permutes = permutes(&code);
            let read_by_kernels: Vec<_> = permutes
                .iter()
                .filter(|(v, _)| code.contains(&format!("_ptr({v})")))
                .collect();
            assert!(
                read_by_kernels.iter().all(|(_, dense)| *dense),
                "{gemm:?}: {read_by_kernels:?}\n{code}"
            );
            // Four convolutions read a permute back: kernels through
            // dense copies, torch through views.
            let views = permutes.iter().filter(|(_, dense)| !dense).count();
            match gemm {
                Gemm::Kernel => assert!(read_by_kernels.len() >= 4 && views == 0, "{permutes:?}"),
                _ => assert!(views >= 4, "{permutes:?}"),
            }
        }
    }
}

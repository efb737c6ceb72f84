//! fp32 GEMMs with their bias and the pointwise chain after them, `tl.dot`
//! at `tf32x3`.

use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::Op;

use crate::action::{Action, ActionKind};
use crate::program::{Fragment, Lang, Launch};
use crate::template::Refusal;
use crate::template::pointwise::{boundary, shape};

use super::expr::{chain_body_after, check_pointwise};
use super::{grid, program_id};

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
pub(super) fn gemm(
    g: &OpGraph,
    region: &[NodeId],
    name: &str,
    warps: u32,
) -> Result<Fragment, Refusal> {
    let mm = region[0];
    let Op::MatMul(m) = &g.node(mm).op else {
        return Err(Refusal::new("a GEMM region starts with a matrix product"));
    };
    crate::template::gemm::float32_only(g, mm, "Triton GEMM")?;
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

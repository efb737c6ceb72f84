//! Cumsum and cumprod, forward or reverse, inclusive or exclusive.

use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph};
use mtmc_actions::op::Scan;

use crate::program::Fragment;
use crate::template::Refusal;
use crate::template::scan;

use super::{TILE, grid, node_fragment, pow2, program_id};

/// Cumulative sums and products over one dim, forward or reverse,
/// inclusive or exclusive, seen as `[outer, K, inner]`: a program per row
/// scanning tiles of up to [`TILE`] with `tl.cumsum`/`tl.cumprod` and a
/// carry between tiles when `inner == 1`; else a program per `(outer,
/// BLOCK columns)` stepping along the dim. An exclusive scan is the
/// inclusive scan of the input shifted one place (the identity first).
pub(super) fn scan(g: &OpGraph, node: NodeId, name: &str, warps: u32) -> Result<Fragment, Refusal> {
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

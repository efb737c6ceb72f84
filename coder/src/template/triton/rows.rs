//! Reductions and softmax over a run of adjacent dims, a program per row
//! or per tile of columns, long lines split into runs combined atomically
//! ([`Split`]).

use std::fmt::Write as _;

use mtmc_actions::DType;
use mtmc_actions::graph::{NodeId, OpGraph};

use crate::program::{Fragment, Launch, Pass};
use crate::template::Refusal;
use crate::template::rows::{Kind, row_view};

use super::{Loader, TILE, WHOLE_ROW, grid, node_fragment, pow2, program_id};

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

/// A reduction, softmax or global pooling over `[outer, K, inner]`.
pub(super) fn rows(
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
pub(super) const SPLIT_BELOW: u64 = 132 * 2;

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

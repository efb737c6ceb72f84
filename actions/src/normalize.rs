//! Normal forms that make equivalent programs look alike to the planner.
//!
//! Each rewrite keeps the function the model computes; it only changes how a
//! step is expressed (a transpose read by a matmul becomes the matmul's
//! transpose flag, a norm written out op by op the norm op) and drops views
//! that nothing reads any more.

use crate::graph::{NodeId, OpGraph, TensorRef};
use crate::op::{Fill, Layout, Op, Scan};

mod norms;

pub use norms::fold_written_norms;

/// Applies every normalization.
pub fn normalize(g: &mut OpGraph) {
    fold_transposes(g);
    fold_flipped_scans(g);
    fold_exclusive_scans(g);
    einsums_to_matmuls(g);
    fold_written_norms(g);
    drop_dead_nodes(g);
}

/// Removes the computed nodes whose results nothing reads (what fed a
/// `zeros_like` only for its shape, say); inputs and parameters stay.
pub fn drop_dead_nodes(g: &mut OpGraph) {
    loop {
        let dead: Vec<NodeId> = g
            .order()
            .iter()
            .rev()
            .copied()
            .filter(|&n| !g.node(n).op.is_source())
            .filter(|&n| g.consumers(n).is_empty() && !g.outputs().iter().any(|t| t.node == n))
            .collect();
        if dead.is_empty() {
            return;
        }
        for n in dead {
            g.remove_unread(n);
        }
    }
}

/// `dim`, `start` and `length` of a `narrow` slice's subscript, given by
/// position or by name (`narrow(1, 0, 7)`, `narrow(dim=1, length=7,
/// start=0)`).
fn narrow_args(subscript: &str) -> Option<(i64, i64, i64)> {
    let inner = subscript.strip_prefix("narrow(")?.strip_suffix(')')?;
    let (mut dim, mut start, mut length) = (None, None, None);
    for (k, part) in inner.split(',').map(str::trim).enumerate() {
        let (slot, value) = match part.split_once('=') {
            Some((name, v)) => (name.trim(), v.trim()),
            None => (["dim", "start", "length"].get(k).copied()?, part),
        };
        let v: i64 = value.parse().ok()?;
        match slot {
            "dim" => dim = Some(v),
            "start" => start = Some(v),
            "length" => length = Some(v),
            _ => return None,
        }
    }
    Some((dim?, start?, length?))
}

/// The dim and length of a slice that keeps the leading `length`
/// elements of one dim of a tensor of shape `shape` and all of the
/// others: `narrow(d, 0, length)` (by position or by name), or a basic
/// subscript such as `[:, :-1]` or `[..., :7]`.
fn leading_slice(subscript: &str, shape: &[u64]) -> Option<(usize, u64)> {
    let rank = shape.len();
    if let Some((d, start, length)) = narrow_args(subscript) {
        let d = usize::try_from(if d < 0 { d + rank as i64 } else { d }).ok()?;
        return (d < rank && start == 0 && length >= 0).then_some((d, length as u64));
    }
    let inner = subscript.strip_prefix('[')?.strip_suffix(']')?;
    let parts: Vec<&str> = inner.split(',').map(str::trim).collect();
    let ellipsis = parts.iter().position(|p| *p == "...");
    // The dim each part indexes: those after an ellipsis count from the
    // end.
    let mut cut = None;
    for (k, part) in parts.iter().enumerate() {
        if *part == "..." || *part == ":" {
            continue;
        }
        let dim = match ellipsis {
            Some(e) if k > e => rank.checked_sub(parts.len() - k)?,
            _ => k,
        };
        let stop = part.strip_prefix(':').or_else(|| part.strip_prefix("0:"))?;
        let stop: i64 = stop.trim().parse().ok()?;
        let extent = *shape.get(dim)? as i64;
        let length = if stop < 0 {
            extent + stop
        } else {
            stop.min(extent)
        };
        if cut.is_some() || length < 0 {
            return None;
        }
        cut = Some((dim, length as u64));
    }
    // Dims past the subscript's are kept whole.
    (parts.len() - usize::from(ellipsis.is_some()) <= rank).then_some(())?;
    cut
}

/// `cat([c, scan(x[:n - 1], d)], d)` or `cat([c, scan(x, d)[:n - 1]], d)`
/// (the slice along `d`, a `narrow` or a subscript) with `c` the scan's
/// identity (zeros for a sum, ones for a product) one element deep along
/// `d`: the exclusive scan of `x` (an "exclusive cumsum" written with
/// torch's inclusive one). The same sums in the same order, in one op
/// instead of a slice, a scan and a concatenation.
pub fn fold_exclusive_scans(g: &mut OpGraph) {
    let cats: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::Layout(Layout::Concat { .. })))
        .map(|(id, _)| id)
        .collect();
    for cat in cats {
        let Op::Layout(Layout::Concat { dim }) = g.node(cat).op else {
            continue;
        };
        let &[first, second] = &g.inputs(cat)[..] else {
            continue;
        };
        let out = g.node(cat).outputs[0].shape.clone();
        // The slice, the scan, and x, in either order.
        let slice_of = |t: TensorRef| match &g.node(t.node).op {
            Op::Layout(Layout::Slice { subscript }) => {
                let x = g.inputs(t.node)[0];
                leading_slice(subscript, &g.tensor(x).shape).map(|cut| (x, cut))
            }
            _ => None,
        };
        let keep = (dim, out[dim].saturating_sub(1));
        let found = match &g.node(second.node).op {
            Op::Scan(_) => {
                let s = g.inputs(second.node)[0];
                slice_of(s)
                    .filter(|(_, cut)| *cut == keep)
                    .map(|(x, _)| (second.node, s.node, x))
            }
            _ => slice_of(second)
                .filter(|(scanned, cut)| {
                    matches!(g.node(scanned.node).op, Op::Scan(_)) && *cut == keep
                })
                .map(|(scanned, _)| (scanned.node, second.node, g.inputs(scanned.node)[0])),
        };
        let Some((scan_node, sliced, x)) = found else {
            continue;
        };
        let Op::Scan(scan) = g.node(scan_node).op.clone() else {
            continue;
        };
        let identity = if scan.prod { 1.0 } else { 0.0 };
        let single =
            |n: NodeId| g.consumers(n).len() == 1 && !g.outputs().iter().any(|t| t.node == n);
        let fits = matches!(g.node(first.node).op, Op::Constant { fill: Fill::Full(v) } if v == identity)
            && g.tensor(first).shape.get(dim) == Some(&1)
            && scan.dim == dim
            && !scan.reverse
            && !scan.exclusive
            && g.tensor(x).shape == out
            && g.tensor(x).dtype == g.node(cat).outputs[0].dtype
            && single(scan_node)
            && single(sliced)
            && single(first.node);
        if !fits {
            continue;
        }
        let name = format!("{}_exclusive", g.node(scan_node).name);
        let dtype = g.node(cat).outputs[0].dtype;
        let exclusive = g
            .add(
                name,
                Op::Scan(Scan {
                    exclusive: true,
                    ..scan
                }),
                &[x],
                vec![crate::dtype::TensorType::new(out, dtype)],
            )
            .expect("x exists");
        g.place_after(exclusive, cat);
        crate::rewrite::redirect(g, cat, TensorRef::first(exclusive));
        for n in [cat, second.node, g.inputs(second.node)[0].node, first.node] {
            g.remove_unread(n);
        }
    }
}

/// Whether an einsum equation is a matmul in torch's broadcasting sense:
/// `P·mk,kn->P·mn` (B without batch dims) or `P·mk,P·kn->P·mn`, with every
/// letter distinct but the shared ones.
pub fn einsum_is_matmul(equation: &str) -> bool {
    let eq: String = equation.chars().filter(|c| !c.is_whitespace()).collect();
    let Some((lhs, out)) = eq.split_once("->") else {
        return false;
    };
    let Some((a, b)) = lhs.split_once(',') else {
        return false;
    };
    let (a, b, out): (Vec<char>, Vec<char>, Vec<char>) = (
        a.chars().collect(),
        b.chars().collect(),
        out.chars().collect(),
    );
    if a.len() < 2 || b.len() < 2 || out.len() != a.len() || b.len() > a.len() {
        return false;
    }
    if !a.iter().chain(&b).chain(&out).all(char::is_ascii_lowercase) {
        return false;
    }
    let (m, k) = (a[a.len() - 2], a[a.len() - 1]);
    let (kb, n) = (b[b.len() - 2], b[b.len() - 1]);
    let batch = &a[..a.len() - 2];
    let b_batch = &b[..b.len() - 2];
    let mut expected = batch.to_vec();
    expected.extend([m, n]);
    let mut letters: Vec<char> = batch.iter().copied().chain([m, k, n]).collect();
    letters.sort_unstable();
    letters.dedup();
    k == kb
        && out == expected
        && (b_batch.is_empty() || b_batch == batch)
        && letters.len() == batch.len() + 3
}

/// An einsum that is a matmul (see [`einsum_is_matmul`]) becomes one.
pub fn einsums_to_matmuls(g: &mut OpGraph) {
    let found: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| matches!(&n.op, Op::Einsum { equation } if einsum_is_matmul(equation)))
        .map(|(id, _)| id)
        .collect();
    for id in found {
        *g.op_mut(id) = Op::MatMul(crate::op::MatMul {
            trans_a: false,
            trans_b: false,
            bias: false,
        });
    }
}

/// `flip(scan(flip(x, d), d), d)` → the scan of `x` run the other way
/// (`reverse` toggled): the same values, without the two copies. The
/// flips are removed when nothing else reads them.
pub fn fold_flipped_scans(g: &mut OpGraph) {
    let scans: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::Scan(_)))
        .map(|(id, _)| id)
        .collect();
    let flip_of = |g: &OpGraph, id: NodeId| match &g.node(id).op {
        Op::Layout(Layout::Flip { dims }) if dims.len() == 1 => Some(dims[0]),
        _ => None,
    };
    for scan in scans {
        let Op::Scan(s) = &g.node(scan).op else {
            continue;
        };
        let dim = s.dim;
        let before = g.inputs(scan)[0];
        let consumers = g.consumers(scan);
        let [after] = consumers[..] else {
            continue;
        };
        if flip_of(g, before.node) != Some(dim)
            || flip_of(g, after) != Some(dim)
            || g.consumers(before.node).len() != 1
            || g.outputs().iter().any(|t| t.node == scan)
        {
            continue;
        }
        let source = g.inputs(before.node)[0];
        g.replace_input(scan, 0, source);
        if let Op::Scan(s) = g.op_mut(scan) {
            s.reverse = !s.reverse;
        }
        crate::rewrite::redirect(g, after, TensorRef::first(scan));
        g.remove_unread(after);
        g.remove_unread(before.node);
    }
}

/// Whether `perm` swaps the last two dims and keeps the rest.
fn swaps_last_two(perm: &[usize]) -> bool {
    let r = perm.len();
    r >= 2
        && perm[r - 2] == r - 1
        && perm[r - 1] == r - 2
        && perm[..r - 2].iter().enumerate().all(|(i, &p)| i == p)
}

/// `matmul(A.T, B)` → matmul with `trans_a`; likewise for B. The transposed
/// view is removed when nothing else reads it.
pub fn fold_transposes(g: &mut OpGraph) {
    let matmuls: Vec<NodeId> = g
        .nodes()
        .filter(|(_, n)| matches!(n.op, Op::MatMul(_)))
        .map(|(id, _)| id)
        .collect();
    let mut views = Vec::new();
    for id in matmuls {
        for slot in 0..2 {
            let Some(&operand) = g.inputs(id).get(slot) else {
                continue;
            };
            let producer = g.node(operand.node);
            let Op::Layout(Layout::Permute { perm }) = &producer.op else {
                continue;
            };
            if !swaps_last_two(perm) {
                continue;
            }
            let Some(&source) = g.inputs(operand.node).first() else {
                continue;
            };
            g.replace_input(id, slot, source);
            if let Op::MatMul(m) = g.op_mut(id) {
                let flag = if slot == 0 {
                    &mut m.trans_a
                } else {
                    &mut m.trans_b
                };
                *flag = !*flag;
            }
            views.push(operand.node);
        }
    }
    for v in views {
        g.remove_unread(v);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn einsums_that_are_matmuls_are_told_apart() {
        assert!(einsum_is_matmul("bijl,lk->bijk"));
        assert!(einsum_is_matmul("bmk,bkn->bmn"));
        assert!(einsum_is_matmul("ij, jk -> ik"));
        assert!(!einsum_is_matmul("bij,bjk->bki"), "output transposed");
        assert!(!einsum_is_matmul("ij,kj->ik"), "B transposed");
        assert!(!einsum_is_matmul("bii,bij->bij"), "a repeated letter");
        assert!(!einsum_is_matmul("bij,cjk->bik"), "different batches");
    }

    #[test]
    fn only_a_swap_of_the_last_two_dims_is_a_transpose() {
        assert!(swaps_last_two(&[1, 0]));
        assert!(swaps_last_two(&[0, 2, 1]));
        assert!(!swaps_last_two(&[2, 1, 0]));
        assert!(!swaps_last_two(&[0]));
        assert!(!swaps_last_two(&[1, 0, 2]));
    }

    #[test]
    fn leading_slices_are_read_from_narrow_calls_and_subscripts() {
        let shape = [4, 8, 5];
        assert_eq!(leading_slice("narrow(1, 0, 7)", &shape), Some((1, 7)));
        assert_eq!(
            leading_slice("narrow(dim=-1, start=0, length=4)", &shape),
            Some((2, 4))
        );
        assert_eq!(leading_slice("[:, :-1]", &shape), Some((1, 7)));
        assert_eq!(leading_slice("[:, :, :-1]", &shape), Some((2, 4)));
        assert_eq!(leading_slice("[..., :3]", &shape), Some((2, 3)));
        assert_eq!(leading_slice("[:3]", &shape), Some((0, 3)));
        assert_eq!(
            leading_slice("[:, :, :, :1]", &shape),
            None,
            "past the rank"
        );
        assert_eq!(leading_slice("[:3, ...]", &shape), Some((0, 3)));
        assert_eq!(leading_slice("[:, 1:]", &shape), None, "not from the start");
        assert_eq!(leading_slice("[:, :-1, :2]", &shape), None, "two dims cut");
        assert_eq!(leading_slice("narrow(1, 1, 7)", &shape), None);
    }

    /// `cat([zeros, cumsum(x, 1)[:, :-1]], 1)` over `x` of 4 x 8.
    fn exclusive_by_slicing_the_scan(identity: f64) -> OpGraph {
        use crate::dtype::TensorType;
        let mut g = OpGraph::new();
        let f = |s: &[u64]| vec![TensorType::new(s.to_vec(), crate::DType::F32)];
        let x = g
            .add("x", Op::Input { name: "x".into() }, &[], f(&[4, 8]))
            .unwrap();
        let scan = Scan {
            prod: false,
            dim: 1,
            reverse: false,
            exclusive: false,
        };
        let scan = g
            .add("cumsum", Op::Scan(scan), &[TensorRef::first(x)], f(&[4, 8]))
            .unwrap();
        let slice = Op::Layout(Layout::Slice {
            subscript: "[:, :-1]".into(),
        });
        let slice = g
            .add("getitem", slice, &[TensorRef::first(scan)], f(&[4, 7]))
            .unwrap();
        let zeros = Op::Constant {
            fill: Fill::Full(identity),
        };
        let zeros = g.add("zeros", zeros, &[], f(&[4, 1])).unwrap();
        let cat = g
            .add(
                "cat",
                Op::Layout(Layout::Concat { dim: 1 }),
                &[TensorRef::first(zeros), TensorRef::first(slice)],
                f(&[4, 8]),
            )
            .unwrap();
        g.set_outputs(vec![TensorRef::first(cat)]);
        g
    }

    #[test]
    fn a_sliced_inclusive_scan_after_its_identity_is_an_exclusive_scan() {
        let mut g = exclusive_by_slicing_the_scan(0.0);
        fold_exclusive_scans(&mut g);
        let ops: Vec<String> = g.nodes().map(|(_, n)| n.op.to_string()).collect();
        assert_eq!(ops, ["input x", "cumsum dim=1 exclusive"]);
        let out = g.outputs()[0];
        assert_eq!(g.tensor(out).shape, [4, 8]);
        assert!(matches!(
            g.node(g.inputs(out.node)[0].node).op,
            Op::Input { .. }
        ));
        // Ones in front of a sum are no identity: nothing changes.
        let mut g = exclusive_by_slicing_the_scan(1.0);
        fold_exclusive_scans(&mut g);
        assert_eq!(g.nodes().count(), 5);
    }
}

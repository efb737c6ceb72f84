//! Normal forms that make equivalent programs look alike to the planner.
//!
//! Each rewrite keeps every value the model computes; it only changes how a
//! step is expressed (a transpose read by a matmul becomes the matmul's
//! transpose flag) and drops views that nothing reads any more.

use crate::graph::{NodeId, OpGraph};
use crate::op::{Layout, Op};

/// Applies every normalization.
pub fn normalize(g: &mut OpGraph) {
    fold_transposes(g);
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
    fn only_a_swap_of_the_last_two_dims_is_a_transpose() {
        assert!(swaps_last_two(&[1, 0]));
        assert!(swaps_last_two(&[0, 2, 1]));
        assert!(!swaps_last_two(&[2, 1, 0]));
        assert!(!swaps_last_two(&[0]));
        assert!(!swaps_last_two(&[1, 0, 2]));
    }
}

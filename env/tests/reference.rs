//! The f64 reference against straightforward loops written here, on graphs
//! from the intent language.

use std::collections::HashMap;

use mtmc_actions::intent::{Bindings, compile, parse_shapes};
use mtmc_actions::{DType, OpGraph};
use mtmc_env::reference::{Reference, ReferenceError, Rng, elements_to_check};

fn graph(src: &str, shapes: &str) -> OpGraph {
    let b = Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    };
    compile(src, &b).unwrap()
}

fn random(n: usize, seed: u64) -> Vec<f64> {
    let mut rng = Rng::new(seed);
    (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect()
}

/// Every element of the graph's first output.
fn all(g: &OpGraph, inputs: &HashMap<String, Vec<f64>>) -> Vec<f64> {
    let mut r = Reference::new(g, inputs).unwrap();
    let out = g.outputs()[0];
    (0..g.tensor(out).numel() as usize)
        .map(|i| r.element(out, i).unwrap())
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12 * (1.0 + b.abs())
}

#[test]
fn gelu_of_an_affine_map_matches_the_loops() {
    let (m, k, n) = (5, 7, 3);
    let g = graph("y = gelu(x @ w + b)", &format!("x={m}x{k},w={k}x{n},b={n}"));
    let (x, w, b) = (random(m * k, 1), random(k * n, 2), random(n, 3));
    let inputs = HashMap::from([
        ("x".into(), x.clone()),
        ("w".into(), w.clone()),
        ("b".into(), b.clone()),
    ]);
    let got = all(&g, &inputs);
    for i in 0..m {
        for j in 0..n {
            let z: f64 = (0..k).map(|p| x[i * k + p] * w[p * n + j]).sum::<f64>() + b[j];
            let want = 0.5 * z * (1.0 + libm::erf(z / 2f64.sqrt()));
            assert!(
                close(got[i * n + j], want),
                "({i},{j}): {} vs {want}",
                got[i * n + j]
            );
        }
    }
}

#[test]
fn a_transposed_operand_and_log_softmax_match_the_loops() {
    let g = graph(
        "a: [m=4, k=6]; b: [n=5, k]; c = a @ b.T; d = log_softmax(c, dim=n)",
        "",
    );
    let (a, b) = (random(24, 4), random(30, 5));
    let inputs = HashMap::from([("a".into(), a.clone()), ("b".into(), b.clone())]);
    let got = all(&g, &inputs);
    for i in 0..4 {
        let c: Vec<f64> = (0..5)
            .map(|j| (0..6).map(|p| a[i * 6 + p] * b[j * 6 + p]).sum())
            .collect();
        let lse = c.iter().map(|v| v.exp()).sum::<f64>().ln();
        for j in 0..5 {
            assert!(close(got[i * 5 + j], c[j] - lse));
        }
    }
}

#[test]
fn layer_norm_gives_rows_of_zero_mean_and_unit_variance() {
    let g = graph("y = layer_norm(x, dim=-1, eps=0.0)", "x=3x8");
    let x = random(24, 6);
    let got = all(&g, &HashMap::from([("x".into(), x)]));
    for row in got.chunks(8) {
        let mean = row.iter().sum::<f64>() / 8.0;
        let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / 8.0;
        assert!(
            mean.abs() < 1e-12 && (var - 1.0).abs() < 1e-9,
            "{mean} {var}"
        );
    }
}

/// `normalize` (F.normalize) divides each line along its dim by the
/// line's p-norm, or by ε when that is smaller: over the last dim and over
/// the first, with p = 2 and p = 1, and a line of zeros stays zeros.
#[test]
fn normalize_divides_each_line_by_its_p_norm() {
    let x: Vec<f64> = random(24, 7)
        .into_iter()
        .enumerate()
        .map(|(i, v)| if i < 8 { 0.0 } else { v })
        .collect();
    let inputs = HashMap::from([("x".to_string(), x.clone())]);
    for (src, p) in [
        ("y = normalize(x, dim=-1)", 2.0),
        ("y = normalize(x, dim=1, p=1.0)", 1.0),
    ] {
        let got = all(&graph(src, "x=3x8"), &inputs);
        for (row, (g, x)) in got.chunks(8).zip(x.chunks(8)).enumerate() {
            let length = x.iter().map(|v| v.abs().powf(p)).sum::<f64>().powf(1.0 / p);
            for (g, x) in g.iter().zip(x) {
                assert!(
                    close(*g, x / length.max(1e-12)),
                    "{src} row {row}: {g} {x} {length}"
                );
            }
        }
    }
    let got = all(&graph("y = normalize(x, dim=0)", "x=3x8"), &inputs);
    for c in 0..8 {
        let column = [x[c], x[8 + c], x[16 + c]];
        let length = column.iter().map(|v| v * v).sum::<f64>().sqrt();
        for r in 0..3 {
            assert!(close(got[r * 8 + c], column[r] / length), "column {c}");
        }
    }
    assert!(got.iter().all(|v| v.is_finite()));
}

/// Norms a model writes out op by op (folded into the norm op when the
/// graph is built) compute what the ops one by one do: an RMS norm along
/// a dim with others after it, over the trailing dim, and a division by
/// the Euclidean length.
#[test]
fn norms_written_out_compute_what_their_ops_do() {
    let (n, c, s) = (2, 5, 3);
    let x = random(n * c * s, 11);
    let inputs = HashMap::from([("x".to_string(), x.clone())]);
    let at = |i: usize, j: usize, k: usize| x[(i * c + j) * s + k];
    for src in [
        "y = x / sqrt(mean(x ** 2, dim=1, keepdim=true) + 0.25)",
        "y = x * rsqrt(mean(x * x, dim=1, keepdim=true) + 0.25)",
        "y = x / norm(x, dim=1, keepdim=true)",
    ] {
        let g = graph(src, &format!("x={n}x{c}x{s}"));
        assert!(
            g.nodes()
                .any(|(_, n)| matches!(n.op, mtmc_actions::op::Op::Norm(_))),
            "{src} is one norm"
        );
        let got = all(&g, &inputs);
        for i in 0..n {
            for k in 0..s {
                let squares: f64 = (0..c).map(|j| at(i, j, k) * at(i, j, k)).sum();
                let by = if src.contains("norm(") {
                    squares.sqrt()
                } else {
                    (squares / c as f64 + 0.25).sqrt()
                };
                for j in 0..c {
                    let want = at(i, j, k) / by;
                    let g = got[(i * c + j) * s + k];
                    assert!(
                        (g - want).abs() <= 1e-12 * (1.0 + want.abs()),
                        "{src}: {g} vs {want}"
                    );
                }
            }
        }
    }
    let got = all(
        &graph(
            "y = x / sqrt(mean(x ** 2, dim=-1, keepdim=true) + 0.25)",
            "x=10x3",
        ),
        &inputs,
    );
    for (row, (g, x)) in got.chunks(3).zip(x.chunks(3)).enumerate() {
        let by = (x.iter().map(|v| v * v).sum::<f64>() / 3.0 + 0.25).sqrt();
        for (g, x) in g.iter().zip(x) {
            assert!(close(*g, x / by), "row {row}: {g} vs {}", x / by);
        }
    }
}

#[test]
fn reductions_and_scans_match_the_loops() {
    let x: Vec<f64> = vec![3.0, -1.0, 4.0, 1.0, -5.0, 9.0];
    let inputs = HashMap::from([("x".to_string(), x)]);
    let cases = [
        ("y = sum(x, dim=1)", vec![6.0, 5.0]),
        ("y = mean(x, dim=0, keepdim=true)", vec![2.0, -3.0, 6.5]),
        ("y = max(x, dim=1)", vec![4.0, 9.0]),
        ("y = argmax(x, dim=1)", vec![2.0, 2.0]),
        ("y = argmin(x, dim=0)", vec![1.0, 1.0, 0.0]),
        ("y = prod(x, dim=1)", vec![-12.0, -45.0]),
        ("y = cumsum(x, dim=1)", vec![3.0, 2.0, 6.0, 1.0, -4.0, 5.0]),
        (
            "y = cumsum(x, dim=1, reverse=true)",
            vec![6.0, 3.0, 4.0, 5.0, 4.0, 9.0],
        ),
        (
            "y = cumsum(x, dim=1, exclusive=true)",
            vec![0.0, 3.0, 2.0, 0.0, 1.0, -4.0],
        ),
        (
            "y = cumprod(x, dim=0)",
            vec![3.0, -1.0, 4.0, 3.0, 5.0, 36.0],
        ),
    ];
    for (src, want) in cases {
        let g = graph(src, "x=2x3");
        assert_eq!(all(&g, &inputs), want, "{src}");
    }
}

/// Ops of one input keep statistics of their own: a layer norm and an
/// RMS norm of the same rows, a sum and a product scan of the same
/// lines, and a normalize beside them, each what it is alone.
#[test]
fn ops_reading_one_input_keep_their_statistics_apart() {
    let inputs = HashMap::from([("x".to_string(), random(24, 9))]);
    for (both, one, other) in [
        (
            "y = layer_norm(x, dim=-1) + rms_norm(x, dim=-1)",
            "y = layer_norm(x, dim=-1)",
            "y = rms_norm(x, dim=-1)",
        ),
        (
            "y = cumsum(x, dim=1) + cumprod(x, dim=1)",
            "y = cumsum(x, dim=1)",
            "y = cumprod(x, dim=1)",
        ),
        (
            "y = softmax(x, dim=1) + normalize(x, dim=1)",
            "y = softmax(x, dim=1)",
            "y = normalize(x, dim=1)",
        ),
    ] {
        let got = all(&graph(both, "x=3x8"), &inputs);
        let a = all(&graph(one, "x=3x8"), &inputs);
        let b = all(&graph(other, "x=3x8"), &inputs);
        for (k, g) in got.iter().enumerate() {
            assert!(
                close(*g, a[k] + b[k]),
                "{both} [{k}]: {g} vs {}",
                a[k] + b[k]
            );
        }
    }
}

#[test]
fn norms_and_logsumexp() {
    let x: Vec<f64> = vec![3.0, 4.0, 0.0, 0.0];
    let inputs = HashMap::from([("x".to_string(), x)]);
    assert_eq!(
        all(&graph("y = norm(x, dim=1)", "x=2x2"), &inputs),
        [5.0, 0.0]
    );
    let lse = all(&graph("y = logsumexp(x, dim=1)", "x=2x2"), &inputs);
    assert!(close(lse[0], (3f64.exp() + 4f64.exp()).ln()));
    assert!(close(lse[1], 2f64.ln()));
}

#[test]
fn broadcasting_reads_the_right_elements() {
    let g = graph("y = x * s - c", "x=2x3,s=3,c=2x1");
    let inputs = HashMap::from([
        ("x".to_string(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        ("s".to_string(), vec![10.0, 100.0, 1000.0]),
        ("c".to_string(), vec![1.0, 2.0]),
    ]);
    assert_eq!(all(&g, &inputs), [9.0, 199.0, 2999.0, 38.0, 498.0, 5998.0]);
}

#[test]
fn missing_inputs_and_unknown_ops_are_named() {
    let g = graph("y = relu(x)", "x=4");
    assert_eq!(
        Reference::new(&g, &HashMap::new()).err(),
        Some(ReferenceError::MissingInput("x".into()))
    );
    assert_eq!(
        Reference::new(&g, &HashMap::from([("x".into(), vec![1.0])])).err(),
        Some(ReferenceError::InputSize {
            name: "x".into(),
            got: 1,
            want: 4
        })
    );
    let mut g = graph("y = relu(x)", "x=4");
    let out = g.outputs()[0];
    let opaque = g
        .add(
            "conv",
            mtmc_actions::op::Op::Opaque {
                target: "conv_tbc".into(),
                reason: "unknown".into(),
                call: None,
            },
            &[out],
            vec![g.tensor(out).clone()],
        )
        .unwrap();
    g.set_outputs(vec![mtmc_actions::graph::TensorRef::first(opaque)]);
    let ones = HashMap::from([("x".into(), vec![1.0; 4])]);
    let mut r = Reference::new(&g, &ones).unwrap();
    let e = r.element(g.outputs()[0], 0).unwrap_err();
    assert!(
        e.to_string().contains("node `conv`") && e.to_string().contains("worker"),
        "{e}"
    );
}

#[test]
fn small_outputs_are_checked_whole_and_large_ones_sampled_with_their_edges() {
    let mut rng = Rng::new(7);
    assert_eq!(
        elements_to_check(&[10, 10], 4096, 4096, &mut rng).len(),
        100
    );
    let picked = elements_to_check(&[2048, 2048], 4096, 4096, &mut rng);
    assert!(picked.len() >= 4096, "{}", picked.len());
    let n = 2048 * 2048;
    for edge in [0, 2047, 2048 * 2047, n - 1, 2048 * 1024, 2048 * 1024 + 2047] {
        assert!(picked.binary_search(&edge).is_ok(), "edge {edge} missing");
    }
    assert!(picked.windows(2).all(|w| w[0] < w[1]));
}

#[test]
fn rewritten_graphs_compute_what_the_originals_do() {
    for (src, shapes) in [
        ("y = sum((x @ w + b) * 0.5 - 2, dim=1)", "x=6x9,w=9x11,b=11"),
        (
            "y = mean(x @ w - v, dim=1, keepdim=true) / 3",
            "x=6x9,w=9x11,v=11",
        ),
        ("y = logsumexp(sum(x, dim=1, keepdim=true), dim=1)", "x=5x8"),
    ] {
        let g = graph(src, shapes);
        let (r, applied) = mtmc_actions::rewrite::rewrite_all(&g).unwrap();
        let mut inputs = HashMap::new();
        for (k, (_, n)) in g.nodes().filter(|(_, n)| n.op.is_source()).enumerate() {
            let numel = n.outputs[0].numel() as usize;
            inputs.insert(n.name.clone(), random(numel, 10 + k as u64));
        }
        let (before, after) = (all(&g, &inputs), all(&r, &inputs));
        assert_eq!(before.len(), after.len(), "{src}");
        for (a, b) in after.iter().zip(&before) {
            assert!(
                (a - b).abs() <= 1e-9 * (1.0 + b.abs()),
                "{src} ({applied:?}): {a} vs {b}"
            );
        }
    }
}

#[test]
fn ops_moved_to_channels_last_compute_what_the_originals_do() {
    for (src, shapes) in [
        (
            "y = softmax(sum(x * 2, dim=2, keepdim=true) + b, dim=1)",
            "x=2x3x4x5,b=3x1x1",
        ),
        ("y = max(relu(x) - b, dim=1)", "x=2x3x4x5,b=3x1x1"),
        ("y = mean(gelu(x), dim=3)", "x=2x3x4x5"),
        ("y = log_softmax(x, dim=2) * x", "x=2x3x4x5"),
        ("y = relu(x) + z", "x=2x3x4x5,z=2x3x4x5"),
        (
            "y = sum(tanh(x) + b, dim=1, keepdim=true)",
            "x=2x3x2x3x4,b=3x1x1x1",
        ),
    ] {
        let g = graph(src, shapes);
        let x = g.nodes().find(|(_, n)| n.name == "x").unwrap().0;
        let r = mtmc_actions::rewrite::sink_layout(&g, &[x]);
        let mut inputs = HashMap::new();
        for (k, (_, n)) in g.nodes().filter(|(_, n)| n.op.is_source()).enumerate() {
            let numel = n.outputs[0].numel() as usize;
            inputs.insert(n.name.clone(), random(numel, 20 + k as u64));
        }
        let (before, after) = (all(&g, &inputs), all(&r, &inputs));
        assert_eq!(g.tensor(g.outputs()[0]), r.tensor(r.outputs()[0]), "{src}");
        for (a, b) in after.iter().zip(&before) {
            assert!(close(*a, *b), "{src}: {a} vs {b}");
        }
    }
}

//! CPU hot paths of the problem side: importing traces into op graphs,
//! costing them, compiling intent programs, and the f64 reference's check
//! of one native-evaluator trial. Prints figures; run with
//! `cargo bench --bench graphs`.

use std::hint::black_box;
use std::time::{Duration, Instant};

use mtmc_actions::device::{MathMode, builtin_devices, roofline};
use mtmc_actions::import::{import_trace, parse_trace};
use mtmc_actions::intent::{Bindings, compile, parse_shapes};

const TRACES: &str = mtmc_actions::import::SHARED_TRACES;

/// Runs `f` repeatedly for about a second and returns the median of 15
/// batches, per call.
fn measure(mut f: impl FnMut()) -> Duration {
    let start = Instant::now();
    let mut calls = 0u32;
    while start.elapsed() < Duration::from_millis(100) {
        f();
        calls += 1;
    }
    let per_batch = calls.max(1);
    let mut samples: Vec<Duration> = (0..15)
        .map(|_| {
            let t = Instant::now();
            for _ in 0..per_batch {
                f();
            }
            t.elapsed() / per_batch
        })
        .collect();
    samples.sort();
    samples[samples.len() / 2]
}

fn main() {
    let lines: Vec<&str> = TRACES.lines().collect();
    let parse = measure(|| {
        for l in &lines {
            black_box(parse_trace(l).unwrap());
        }
    });
    let traces: Vec<_> = lines.iter().map(|l| parse_trace(l).unwrap()).collect();
    let import = measure(|| {
        for t in &traces {
            black_box(import_trace(t).unwrap());
        }
    });
    let graphs: Vec<_> = traces
        .iter()
        .map(|t| import_trace(t).unwrap().graph)
        .collect();
    let spec = &builtin_devices()[0];
    let cost = measure(|| {
        for g in &graphs {
            black_box(roofline(g, spec, MathMode::default()));
        }
    });
    let bindings = Bindings {
        shapes: parse_shapes("x=4096x4096,w=4096x4096,b=4096").unwrap(),
        dtype: None,
    };
    let intent = measure(|| {
        black_box(compile("y = gelu(x @ w + b)\nz = softmax(y, dim=-1)", &bindings).unwrap());
    });
    let reference = reference_check();
    let reduction = reduction_check();
    let n = lines.len() as u32;
    println!("{:<40} {:>12} {:>12}", "benchmark", "total", "per problem");
    for (name, d) in [
        ("parse 200 traces (JSON)", parse),
        ("import 200 traces into op graphs", import),
        ("roofline of 200 graphs (H100)", cost),
    ] {
        println!("{name:<40} {:>12.3?} {:>12.3?}", d, d / n);
    }
    println!("{:<40} {:>12.3?}", "compile a 2-statement intent", intent);
    println!(
        "{:<40} {:>12.3?}",
        "f64 check of gelu(x@w+b), 1024^3", reference
    );
    println!(
        "{:<40} {:>12.3?}",
        "f64 check of sum(relu(x)*2), 2048^2", reduction
    );
}

/// One trial's check of a row reduction over a computed input: every one
/// of the 2048 sums of y = sum(relu(x) * 2, dim=1) on a 2048x2048 input.
fn reduction_check() -> Duration {
    use mtmc_env::reference::{Reference, Rng};
    use std::collections::HashMap;
    let bindings = Bindings {
        shapes: parse_shapes("x=2048x2048").unwrap(),
        dtype: None,
    };
    let g = compile("y = sum(relu(x) * 2, dim=1)", &bindings).unwrap();
    let mut rng = Rng::new(2);
    let inputs: HashMap<String, Vec<f64>> = [(
        "x".to_string(),
        (0..1 << 22).map(|_| rng.uniform(-1.0, 1.0)).collect(),
    )]
    .into_iter()
    .collect();
    let out = g.outputs()[0];
    measure(|| {
        let mut r = Reference::new(&g, &inputs).unwrap();
        for i in 0..2048 {
            black_box(r.element(out, i).unwrap());
        }
    })
}

/// One trial's check by the native evaluator: the edge and 4096 sampled
/// elements of y = gelu(x @ w + b) with 1024x1024 operands, in f64.
fn reference_check() -> Duration {
    use mtmc_env::reference::{Reference, Rng, elements_to_check};
    use std::collections::HashMap;
    let bindings = Bindings {
        shapes: parse_shapes("x=1024x1024,w=1024x1024,b=1024").unwrap(),
        dtype: None,
    };
    let g = compile("y = gelu(x @ w + b)", &bindings).unwrap();
    let mut rng = Rng::new(1);
    let inputs: HashMap<String, Vec<f64>> = [("x", 1 << 20), ("w", 1 << 20), ("b", 1 << 10)]
        .into_iter()
        .map(|(n, len)| {
            (
                n.to_string(),
                (0..len).map(|_| rng.uniform(-1.0, 1.0)).collect(),
            )
        })
        .collect();
    let out = g.outputs()[0];
    let picked = elements_to_check(&[1024, 1024], 1 << 16, 4096, &mut rng);
    measure(|| {
        let mut r = Reference::new(&g, &inputs).unwrap();
        for &i in &picked {
            black_box(r.element(out, i).unwrap());
        }
    })
}

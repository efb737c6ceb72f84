//! The intent language: valid programs lower to the expected graphs, and
//! every kind of mistake is reported at its line and column.

use mtmc_actions::intent::{Bindings, ErrorKind, compile, parse_shapes};
use mtmc_actions::op::{BinaryOp, NormKind, Op, ReduceOp, UnaryOp};
use mtmc_actions::{DType, OpGraph, graph_cost};

fn bind(shapes: &str) -> Bindings {
    Bindings {
        shapes: parse_shapes(shapes).unwrap(),
        dtype: Some(DType::F32),
    }
}

fn ops(g: &OpGraph) -> Vec<String> {
    g.nodes().map(|(_, n)| n.op.to_string()).collect()
}

fn outputs(g: &OpGraph) -> Vec<String> {
    g.outputs()
        .iter()
        .map(|t| format!("{} {}", g.node(t.node).name, g.tensor(*t)))
        .collect()
}

#[track_caller]
fn error(src: &str, shapes: &str) -> (usize, usize, ErrorKind, String) {
    let e = compile(src, &bind(shapes)).unwrap_err();
    (e.pos.line, e.pos.column, e.kind, e.message)
}

#[test]
fn gelu_of_an_affine_map() {
    let g = compile(
        "y = gelu(x @ w + b)",
        &bind("x=4096x4096,w=4096x4096,b=4096"),
    )
    .unwrap();
    assert_eq!(
        ops(&g),
        ["input x", "input w", "matmul", "input b", "+", "gelu"]
    );
    assert_eq!(outputs(&g), ["y f32[4096x4096]"]);
    let cost = graph_cost(&g);
    let n = 4096u64 * 4096;
    // 2·M·N·K for the product, then one add and five FLOPs of gelu per element.
    assert_eq!(cost.unfused.flops, 2 * n * 4096 + n + 5 * n);
    // Fused: x, w, b read once, y written once.
    assert_eq!(cost.fused_bytes, 4 * (3 * n + 4096));
}

#[test]
fn named_dims_select_reductions_and_softmax() {
    let src = "x: f32[batch=64, feat=1024]\n\
               p = softmax(x, dim=feat)\n\
               s = sum(p, dim=batch, keepdim=true)\n\
               m = max(x, dim=[batch, feat])";
    let g = compile(src, &Bindings::default()).unwrap();
    let find = |name: &str| g.nodes().find(|(_, n)| n.name == name).unwrap().1;
    assert_eq!(find("p").op, Op::Softmax { dim: 1, log: false });
    match &find("s").op {
        Op::Reduce(r) => {
            assert_eq!(r.op, ReduceOp::Sum);
            assert_eq!(r.dims, [0]);
            assert!(r.keepdim);
        }
        other => panic!("not a reduction: {other}"),
    }
    assert_eq!(outputs(&g), ["s f32[1x1024]", "m f32[]"]);
}

#[test]
fn names_flow_through_matmul_and_transpose() {
    let src = "a: [m=8, k=16]; b: [n=32, k]; c = a @ b.T; d = log_softmax(c, dim=n)";
    let g = compile(src, &Bindings::default()).unwrap();
    assert_eq!(outputs(&g), ["d f32[8x32]"]);
    // `.T` read by `@` becomes the matmul's transpose flag.
    assert_eq!(
        ops(&g),
        ["input a", "input b", "matmul Bᵀ", "log_softmax dim=1"]
    );
}

#[test]
fn several_statements_and_scalars_on_either_side() {
    let src = "h = relu(x) * 0.5\nz = 1 - h\nq = clamp(z, min=-1, max=1) ** 2";
    let g = compile(src, &bind("x=128x256")).unwrap();
    let scalars: Vec<&Op> = g
        .nodes()
        .map(|(_, n)| &n.op)
        .filter(|op| matches!(op, Op::Scalar { .. }))
        .collect();
    assert_eq!(
        scalars,
        [
            &Op::Scalar {
                op: BinaryOp::Mul,
                value: 0.5,
                scalar_first: false
            },
            &Op::Scalar {
                op: BinaryOp::Sub,
                value: 1.0,
                scalar_first: true
            },
            &Op::Scalar {
                op: BinaryOp::Pow,
                value: 2.0,
                scalar_first: false
            },
        ]
    );
    assert_eq!(outputs(&g), ["q f32[128x256]"]);
}

#[test]
fn broadcasting_norms_linear_and_dtypes() {
    let src = "y = layer_norm(linear(x, w, b), g, beta, dim=-1, eps=0.001)\n\
               r = rms_norm(x, dim=-1)\n\
               t = gelu(y, tanh=true) + leaky_relu(y, slope=0.2)";
    let g = compile(src, &{
        let mut b = bind("x=32x64,w=128x64,b=128,g=128,beta=128");
        b.dtype = Some(DType::BF16);
        b
    })
    .unwrap();
    let norm = g.nodes().find(|(_, n)| n.name == "y").unwrap().1;
    match &norm.op {
        Op::Norm(n) => {
            assert_eq!(n.kind, NormKind::Layer { dims: 1 });
            assert_eq!(n.eps, 0.001);
            assert!(n.affine && n.bias);
        }
        other => panic!("not a norm: {other}"),
    }
    assert!(
        g.nodes()
            .any(|(_, n)| n.op == Op::Unary(UnaryOp::Gelu { tanh: true }))
    );
    assert_eq!(outputs(&g), ["r bf16[32x64]", "t bf16[32x128]"]);
}

#[test]
fn lexical_errors_point_at_the_character() {
    assert_eq!(
        error("y = x $ 2", "x=4"),
        (1, 7, ErrorKind::Lex, "unexpected character `$`".to_string())
    );
}

#[test]
fn syntax_errors_say_what_was_expected() {
    assert_eq!(
        error("y = gelu(x @ w + b", "x=4x4,w=4x4,b=4"),
        (
            1,
            19,
            ErrorKind::Syntax,
            "expected `,` or `)` in the arguments of `gelu`, found end of line".to_string()
        )
    );
    assert_eq!(
        error("\ny gelu(x)", "x=4"),
        (
            2,
            3,
            ErrorKind::Syntax,
            "expected `=` or `:` after `y`, found `gelu`".to_string()
        )
    );
    assert_eq!(
        error("y = (x + 1", "x=4").2,
        ErrorKind::Syntax,
        "unclosed parenthesis"
    );
    assert_eq!(
        error("y = relu(x) relu(x)", "x=4").3,
        "expected end of statement (a new line or `;`), found `relu`"
    );
    assert_eq!(
        error("", "").3,
        "the program computes nothing: write at least one `name = expression`"
    );
}

#[test]
fn unknown_functions_list_the_known_ones() {
    let (line, column, kind, message) = error("y = x\nz = swoosh(y)", "x=4");
    assert_eq!((line, column, kind), (2, 5, ErrorKind::UnknownFunction));
    assert!(
        message.starts_with("unknown function `swoosh`; known: relu, "),
        "{message}"
    );
}

#[test]
fn bad_arguments_name_the_argument() {
    assert_eq!(
        error("y = softmax(x, axis=0)", "x=4x4"),
        (
            1,
            16,
            ErrorKind::BadArgument,
            "`softmax` takes no argument `axis` (it takes: dim)".to_string()
        )
    );
    assert_eq!(
        error("y = maximum(x)", "x=4").3,
        "`maximum` takes 2 tensor argument(s), got 1"
    );
    assert_eq!(
        error("y = clamp(x)", "x=4").3,
        "`clamp` needs `min=` or `max=`"
    );
    assert_eq!(error("y = softmax(x)", "x=4").3, "`softmax` needs `dim=`");
    assert_eq!(error("x: q32[4]\ny = x", "").2, ErrorKind::BadArgument);
}

#[test]
fn inputs_without_shapes_say_how_to_give_one() {
    assert_eq!(
        error("y = relu(x) + b", "x=4"),
        (
            1,
            15,
            ErrorKind::MissingShape,
            "`b` has no shape: declare it (`b: [4096, 1024]`) or pass --shape b=4096x1024"
                .to_string()
        )
    );
}

#[test]
fn inconsistent_shapes_are_reported_with_both_types() {
    assert_eq!(
        error("y = x @ w", "x=64x128,w=64x128"),
        (
            1,
            7,
            ErrorKind::ShapeMismatch,
            "`@` needs matching inner dims, but f32[64x128] has 128 columns and f32[64x128] has 64 rows"
                .to_string()
        )
    );
    assert_eq!(
        error("y = x + b", "x=64x128,b=64").3,
        "`+` cannot broadcast f32[64x128] with f32[64]: dim -1 is 128 on the left and 64 on the right"
    );
    assert_eq!(
        error("x: [m=4, m=8]\ny = x", "").3,
        "dim `m` is 4 elsewhere but 8 here"
    );
    assert_eq!(
        error("x: [4, 8]\ny = x", "x=4x9").3,
        "`x` is declared [4x8] here but --shape gives [4x9]"
    );
}

#[test]
fn unknown_dims_list_the_known_names() {
    assert_eq!(
        error("x: [m=4, n=8]\ny = sum(x, dim=k)", ""),
        (
            2,
            16,
            ErrorKind::UnknownDim,
            "`k` is not a dim of this operand (its dims: m, n)".to_string()
        )
    );
    assert_eq!(
        error("y = sum(x, dim=2)", "x=4x8").3,
        "dim 2 is out of range for f32[4x8]"
    );
    assert_eq!(
        error("x: [m]\ny = x", "").3,
        "dim `m` has no size yet: write `m=SIZE` where it first appears"
    );
}

#[test]
fn names_are_assigned_once_and_shapes_must_be_used() {
    assert_eq!(
        error("y = relu(x)\ny = exp(y)", "x=4"),
        (
            2,
            1,
            ErrorKind::Redefined,
            "`y` is already defined; give the new value another name".to_string()
        )
    );
    assert_eq!(error("y = relu(x)", "x=4,z=8").2, ErrorKind::UnknownName);
}

#[test]
fn shape_flags_are_checked() {
    assert_eq!(
        parse_shapes("x=4096x1024, b=1024").unwrap()["x"],
        vec![4096, 1024]
    );
    assert_eq!(
        parse_shapes("x=4096y").unwrap_err().to_string(),
        "--shape `x=4096y`: each dim must be a positive integer (expected NAME=DIMxDIM..., e.g. x=4096x1024,b=1024)"
    );
    assert!(parse_shapes("x").is_err());
    assert!(parse_shapes("x=0").is_err());
    assert!(parse_shapes("x=1,x=2").is_err());
}

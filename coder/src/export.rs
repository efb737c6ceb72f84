//! A program as a KernelBench `ModelNew` file: the same constructor and
//! forward signature as the problem's `Model`, its fragments compiled with
//! NVRTC through cupy and launched on torch's current stream, and the ops
//! no fragment covers kept as torch calls (the call-library action,
//! reported as such by the evaluator).
//!
//! Parameters come from an instance of the problem's own `Model`, built
//! with the same arguments in the constructor, so they are initialized
//! exactly as the reference's are; its forward is never called.

use std::collections::HashMap;
use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{Conv, MatMul, Op};

use crate::program::Program;

/// Whether the exporter can write `op` as a torch call.
pub fn library_op(op: &Op) -> bool {
    matches!(op, Op::MatMul(_) | Op::Conv(_) | Op::Attention(_))
}

/// A Python tuple literal (`()` for a scalar's shape).
fn tuple(v: &[u64]) -> String {
    if v.is_empty() {
        return "()".into();
    }
    let items: Vec<String> = v.iter().map(u64::to_string).collect();
    format!("({},)", items.join(", "))
}

/// The torch expression computing `op` from `ins` (Python names).
fn torch_call(op: &Op, ins: &[String]) -> Option<String> {
    Some(match op {
        Op::MatMul(MatMul {
            trans_a,
            trans_b,
            bias,
        }) => {
            if !trans_a && *trans_b && *bias {
                format!("F.linear({}, {}, {})", ins[0], ins[1], ins[2])
            } else {
                let a = if *trans_a {
                    format!("{}.mT", ins[0])
                } else {
                    ins[0].clone()
                };
                let b = if *trans_b {
                    format!("{}.mT", ins[1])
                } else {
                    ins[1].clone()
                };
                if *bias {
                    format!("(torch.matmul({a}, {b}) + {})", ins[2])
                } else {
                    format!("torch.matmul({a}, {b})")
                }
            }
        }
        Op::Conv(Conv {
            spatial,
            transposed,
            stride,
            padding,
            dilation,
            output_padding,
            groups,
            bias,
            ..
        }) => {
            let b = if *bias { ins[2].clone() } else { "None".into() };
            if *transposed {
                format!(
                    "F.conv_transpose{spatial}d({}, {}, {b}, {}, {}, {}, {groups}, {})",
                    ins[0],
                    ins[1],
                    tuple(stride),
                    tuple(padding),
                    tuple(output_padding),
                    tuple(dilation)
                )
            } else {
                format!(
                    "F.conv{spatial}d({}, {}, {b}, {}, {}, {}, {groups})",
                    ins[0],
                    ins[1],
                    tuple(stride),
                    tuple(padding),
                    tuple(dilation)
                )
            }
        }
        Op::Attention(a) => {
            let mut call = format!(
                "F.scaled_dot_product_attention({}, {}, {}",
                ins[0], ins[1], ins[2]
            );
            if a.mask {
                call += &format!(", attn_mask={}", ins[3]);
            }
            if a.causal {
                call += ", is_causal=True";
            }
            if let Some(scale) = a.scale {
                call += &format!(", scale={scale:e}");
            }
            call + ")"
        }
        _ => return None,
    })
}

/// torch's name for an element type a fragment writes.
fn torch_dtype(d: mtmc_actions::DType) -> Result<&'static str, String> {
    use mtmc_actions::DType;
    Ok(match d {
        DType::F32 => "float32",
        DType::F16 => "float16",
        DType::BF16 => "bfloat16",
        DType::F64 => "float64",
        DType::I64 => "int64",
        DType::I32 => "int32",
        DType::Bool => "bool",
        other => return Err(format!("no torch dtype for {other:?}")),
    })
}

/// A Python identifier from a node name.
fn ident(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        format!("_{s}")
    } else {
        s
    }
}

/// The `ModelNew` source, or why the program cannot be exported yet.
pub fn to_model_new(g: &OpGraph, p: &Program, problem_code: &str) -> Result<String, String> {
    let covered = p.covered();
    let mut var: HashMap<TensorRef, String> = HashMap::new();
    let mut forward_args = Vec::new();
    let mut params = Vec::new();
    let mut body = String::new();
    // The fragment each node belongs to, launched at its region's last node.
    let mut last_node: HashMap<NodeId, usize> = HashMap::new();
    for (k, f) in p.fragments.iter().enumerate() {
        let last = f
            .region
            .iter()
            .max_by_key(|n| g.order().iter().position(|o| o == *n))
            .copied()
            .ok_or("a fragment with an empty region")?;
        last_node.insert(last, k);
    }
    for (id, node) in g.nodes() {
        let t = TensorRef::first(id);
        match &node.op {
            Op::Input { name } => {
                let v = format!("in_{}", ident(name));
                forward_args.push(v.clone());
                var.insert(t, v);
                continue;
            }
            Op::Param { name, trainable } => {
                let v = format!("p_{}", ident(name));
                params.push((v.clone(), name.clone(), *trainable));
                var.insert(t, v);
                continue;
            }
            op if op.is_view() => {
                // Dense memory under a new shape: a torch view, no kernel.
                let input = g.inputs(id)[0];
                let v = var.get(&input).ok_or_else(|| {
                    format!(
                        "`{}` is read before it is computed",
                        g.node(input.node).name
                    )
                })?;
                let view = format!("t{}", id.index());
                let _ = writeln!(
                    body,
                    "        {view} = {v}.view({})",
                    tuple(&node.outputs[0].shape)
                );
                var.insert(t, view);
                continue;
            }
            _ => {}
        }
        if covered.contains(&id) {
            if let Some(&k) = last_node.get(&id) {
                let f = &p.fragments[k];
                let mut args = Vec::new();
                for input in &f.inputs {
                    let v = var.get(input).ok_or_else(|| {
                        format!(
                            "{} reads `{}` before it is computed",
                            f.name,
                            g.node(input.node).name
                        )
                    })?;
                    args.push(format!("_ptr({v})"));
                }
                for out in &f.outputs {
                    let v = format!("t{}", out.node.index());
                    let tensor = g.tensor(*out);
                    let _ = writeln!(
                        body,
                        "        {v} = torch.empty({}, dtype=torch.{}, device=_device)",
                        tuple(&tensor.shape),
                        torch_dtype(tensor.dtype)?
                    );
                    args.push(format!("_ptr({v})"));
                    var.insert(*out, v);
                }
                for (kernel, launch) in f.launches() {
                    let mut args = args.clone();
                    args.extend(launch.sizes.iter().map(|n| format!("cp.int64({n})")));
                    let _ = writeln!(
                        body,
                        "        _KERNELS[{kernel:?}](({},), ({},), ({},))",
                        launch.grid,
                        launch.block,
                        args.join(", ")
                    );
                }
            }
            continue;
        }
        let ins: Vec<String> = g
            .inputs(id)
            .iter()
            .map(|i| {
                var.get(i).cloned().ok_or_else(|| {
                    format!("`{}` is read before it is computed", g.node(i.node).name)
                })
            })
            .collect::<Result<_, _>>()?;
        let call = torch_call(&node.op, &ins).ok_or_else(|| {
            format!(
                "no fragment computes `{}` ({}) and it has no torch rendering yet",
                node.name, node.op
            )
        })?;
        let v = format!("t{}", id.index());
        let _ = writeln!(body, "        {v} = {call}.contiguous()");
        var.insert(t, v);
    }
    let outs: Vec<String> = g
        .outputs()
        .iter()
        .map(|t| {
            var.get(t)
                .cloned()
                .ok_or("an output is never computed".to_string())
        })
        .collect::<Result<_, _>>()?;
    let device_of = forward_args
        .first()
        .cloned()
        .unwrap_or_else(|| "torch.empty(0, device='cuda')".into());

    let mut py = String::new();
    py.push_str("# Generated by mtmc: custom kernels compiled with NVRTC through cupy and\n");
    py.push_str("# launched on torch's current stream; ops without a kernel are torch calls.\n");
    py.push_str("import cupy as cp\nimport torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n\n");
    let source: String = p
        .fragments
        .iter()
        .map(|f| f.source.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let _ = writeln!(
        py,
        "_SOURCE = {}",
        serde_json::to_string(&source).expect("a string serializes")
    );
    let names: Vec<String> = p
        .fragments
        .iter()
        .flat_map(|f| f.launches().map(|(k, _)| format!("{k:?}")))
        .collect();
    if p.fragments.is_empty() {
        py.push_str("# Every op is a library call: no kernel to compile.\n_KERNELS = {}\n");
    } else {
        py.push_str("_MODULE = cp.RawModule(code=_SOURCE, options=(\"--std=c++17\",))\n");
        let _ = writeln!(
            py,
            "_KERNELS = {{name: _MODULE.get_function(name) for name in [{}]}}",
            names.join(", ")
        );
    }
    py.push_str("\n# The problem's Model, for its parameters only (built exactly as the\n# reference builds its own); its forward is never called.\n");
    let _ = writeln!(
        py,
        "_PROBLEM = {}",
        serde_json::to_string(problem_code).expect("a string serializes")
    );
    py.push_str("_PROBLEM_NS = {\"__name__\": \"mtmc_problem\"}\nexec(compile(_PROBLEM, \"problem.py\", \"exec\"), _PROBLEM_NS)\n\n\n");
    py.push_str("def _ptr(t):\n    return cp.uint64(t.data_ptr())\n\n\n");
    py.push_str("class ModelNew(nn.Module):\n    def __init__(self, *args, **kwargs):\n        super().__init__()\n");
    py.push_str("        self.reference_parameters = _PROBLEM_NS[\"Model\"](*args, **kwargs)\n");
    let _ = writeln!(py, "\n    def forward(self, {}):", forward_args.join(", "));
    for a in &forward_args {
        let _ = writeln!(py, "        {a} = {a}.contiguous()");
    }
    for (v, name, trainable) in &params {
        let getter = if *trainable {
            "get_parameter"
        } else {
            "get_buffer"
        };
        let _ = writeln!(
            py,
            "        {v} = self.reference_parameters.{getter}({name:?}).contiguous()"
        );
    }
    let _ = writeln!(py, "        _device = {device_of}.device");
    py.push_str("        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n");
    for line in body.lines() {
        let _ = writeln!(py, "    {line}");
    }
    if outs.len() == 1 {
        let _ = writeln!(py, "        return {}", outs[0]);
    } else {
        let _ = writeln!(py, "        return ({},)", outs.join(", "));
    }
    Ok(py)
}

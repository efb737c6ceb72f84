//! A program as a KernelBench `ModelNew` file: the same constructor and
//! forward signature as the problem's `Model`, its fragments compiled with
//! NVRTC through cupy and launched on torch's current stream, and the ops
//! no fragment covers kept as torch calls (the call-library action,
//! reported as such by the evaluator).
//!
//! Parameters come from an instance of the problem's own `Model`, built
//! with the same arguments in the constructor, so they are initialized
//! exactly as the reference's are; its forward is called only where the
//! whole forward stays the problem's code ([`whole_forward`]: no graph),
//! and a submodule's only where the program makes an opaque call to it.
//!
//! Its `torch` module writes the ops no fragment covers as torch calls.
//! The pieces of a `ModelNew` that are mostly text (the channels-last
//! transpose kernel and its Python side, the CUDA-graph launcher) are
//! files under `coder/model_new/`.

use std::collections::HashMap;
use std::fmt::Write as _;

use mtmc_actions::graph::{NodeId, OpGraph, TensorRef};
use mtmc_actions::op::{Layout, Op};

use crate::program::{Lang, Program};

mod torch;

use torch::{dims_tuple, rnn_call, torch_call, tuple};

/// Whether the exporter can write `op` as a torch call.
pub fn library_op(op: &Op) -> bool {
    matches!(op, Op::MatMul(_) | Op::Conv(_) | Op::Attention(_))
}

/// The nodes computed from parameters and constants of one value alone (no
/// forward input reaches them), by torch calls or views, each with one
/// result that is not a graph output: the weights a rewrite derives, say.
/// The export keeps them between calls until a parameter they read
/// changes; `covered` (the nodes kernels compute) are left out, and so are
/// opaque calls (their code may keep state or draw random numbers).
pub fn derived_from_parameters(
    g: &OpGraph,
    covered: &std::collections::BTreeSet<NodeId>,
) -> std::collections::HashSet<NodeId> {
    let mut derived = std::collections::HashSet::new();
    for &id in g.order() {
        let node = g.node(id);
        let ins = g.inputs(id);
        // A constant filled with one value is the same on every call;
        // random ones are not.
        let full = matches!(
            node.op,
            Op::Constant {
                fill: mtmc_actions::op::Fill::Full(_)
            }
        );
        let from_parameters = full
            || !ins.is_empty()
                && ins.iter().all(|i| {
                    matches!(g.node(i.node).op, Op::Param { .. }) || derived.contains(&i.node)
                });
        if from_parameters
            && !covered.contains(&id)
            && node.outputs.len() == 1
            && !g.outputs().iter().any(|t| t.node == id)
            && !matches!(
                node.op,
                Op::Input { .. } | Op::Param { .. } | Op::Opaque { .. }
            )
        {
            derived.insert(id);
        }
    }
    derived
}

/// The transpose of a dense `[N, C, S]` float32 tensor into its dense
/// channels-last copy `[N, S, C]`, for the input of a convolution that
/// runs channels-last: 32x32 tiles through shared memory (padded against
/// bank conflicts), read along `S` and written along `C`, both coalesced;
/// a block of 32x8 threads per tile and image. torch's own copy of a
/// strided tensor reaches about 60 % of the copy bandwidth.
pub const CHANNELS_LAST: &str = include_str!("../../model_new/channels_last.cu");

/// The Python side of [`CHANNELS_LAST`]: `_channels_last(x)`, which
/// returns `x`'s dense channels-last copy, the module compiled at its
/// first call on the GPU (torch's own copy off the GPU, or where the grid
/// cannot hold the batch).
const CHANNELS_LAST_PY: &str = include_str!("../../model_new/channels_last.py");

/// The CUDA-graph launcher of a `ModelNew` whose program has
/// `cuda_graph` set: `forward` replays a graph of `_forward` captured for
/// the arguments' storage, shapes, strides and devices, the parameters'
/// and buffers' storage and versions, and torch's precision switches;
/// when any of them changes, the graph is captured again. The graph reads
/// the inputs where they lie, so new values in the same tensors are
/// computed on; the outputs are copied out of the graph's memory, which
/// the next replay overwrites. Before a capture, one eager run on a side
/// stream does the lazy work a capture cannot hold (module loads,
/// library workspaces); buffers it wrote (running statistics) are put
/// back, so a call changes them once.
const CUDA_GRAPH_PY: &str = include_str!("../../model_new/cuda_graph.py");

/// The views that read a dense channels-last tensor of rank `rank` in
/// NC… order and back (`.permute(…)` each), or nothing.
fn channels_last_views(channels_last: bool, rank: usize) -> (String, String) {
    if !channels_last {
        return (String::new(), String::new());
    }
    let last = mtmc_actions::rewrite::channels_last_perm(rank);
    (
        format!(
            ".permute{}",
            dims_tuple(&mtmc_actions::rewrite::inverse(&last))
        ),
        format!(".permute{}", dims_tuple(&last)),
    )
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

/// The `ModelNew` of a problem mtmc has no graph of (its trace failed or
/// does not import): the whole forward as the problem's own PyTorch code,
/// its `Model` built as the reference builds its own and called as it is,
/// so that state it keeps across calls is kept alike.
pub fn whole_forward(problem_code: &str) -> String {
    format!(
        "import torch\nimport torch.nn as nn\n\n# The whole forward is the problem's own PyTorch code: mtmc has no graph of it.\n_PROBLEM = {}\n_PROBLEM_NS = {{\"__name__\": \"mtmc_problem\"}}\nexec(compile(_PROBLEM, \"problem.py\", \"exec\"), _PROBLEM_NS)\n\n\nclass ModelNew(nn.Module):\n    def __init__(self, *args, **kwargs):\n        super().__init__()\n        self.reference_parameters = _PROBLEM_NS[\"Model\"](*args, **kwargs)\n\n    def forward(self, *args, **kwargs):\n        return self.reference_parameters(*args, **kwargs)\n",
        serde_json::to_string(problem_code).expect("a string serializes")
    )
}

/// The `ModelNew` source, or why the program cannot be exported yet.
pub fn to_model_new(g: &OpGraph, p: &Program, problem_code: &str) -> Result<String, String> {
    let covered = p.covered();
    // Whether a convolution's input goes channels-last through the
    // transpose kernel ([`CHANNELS_LAST`]).
    let mut layout_kernel = false;
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
    let derived = derived_from_parameters(g, &covered);
    // Inputs and parameters first, then what derives from parameters alone
    // (its lines are the first of `body`), then the rest in graph order.
    let source = |id: NodeId| matches!(g.node(id).op, Op::Input { .. } | Op::Param { .. });
    let ids: Vec<NodeId> = g.nodes().map(|(id, _)| id).collect();
    let order: Vec<NodeId> = ids
        .iter()
        .filter(|&&id| source(id))
        .chain(ids.iter().filter(|id| derived.contains(id)))
        .chain(
            ids.iter()
                .filter(|&&id| !source(id) && !derived.contains(&id)),
        )
        .copied()
        .collect();
    let mut derived_end = None;
    for id in order {
        let node = g.node(id);
        if !derived.contains(&id) && !source(id) && derived_end.is_none() {
            derived_end = Some(body.len());
        }
        let t = TensorRef::first(id);
        match &node.op {
            Op::Input { name } => {
                let v = format!("in_{}", ident(name));
                forward_args.push((v.clone(), name.clone()));
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
                // CUDA kernels take raw pointers; Triton kernels tensors.
                let triton = f.lang == Lang::Triton;
                let pointer = |v: &str| {
                    if triton {
                        v.to_string()
                    } else {
                        format!("_ptr({v})")
                    }
                };
                let mut args = Vec::new();
                for input in &f.inputs {
                    let v = var.get(input).ok_or_else(|| {
                        format!(
                            "{} reads `{}` before it is computed",
                            f.name,
                            g.node(input.node).name
                        )
                    })?;
                    args.push(pointer(v));
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
                    args.push(pointer(&v));
                    var.insert(*out, v);
                }
                for (kernel, launch) in f.launches() {
                    if triton {
                        let mut args = args.clone();
                        args.extend(launch.sizes.iter().map(|n| n.to_string()));
                        let _ = writeln!(
                            body,
                            "        {kernel}[({},)]({}, num_warps={})",
                            launch.grid,
                            args.join(", "),
                            launch.warps()
                        );
                        continue;
                    }
                    let mut args = args.clone();
                    args.extend(launch.sizes.iter().map(|n| format!("cp.int64({n})")));
                    let shared = if launch.shared > 0 {
                        format!(", shared_mem={}", launch.shared)
                    } else {
                        String::new()
                    };
                    let _ = writeln!(
                        body,
                        "        _KERNELS[{kernel:?}](({},), ({},), ({},){shared})",
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
        // A convolution read only through its channels-last view runs on
        // channels-last operands and keeps torch's channels-last result,
        // which that view reads densely; a permute that only graph outputs
        // and torch's convolutions read stays a view (a kernel takes a raw
        // pointer, and reads dense memory in the tensor's own order).
        let rank = node.outputs[0].shape.len();
        let read_channels_last = matches!(node.op, Op::Conv(_))
            && (rank == 4 || rank == 5)
            && !g.outputs().iter().any(|t| t.node == id)
            && g.consumers(id).iter().all(|&c| {
                matches!(&g.node(c).op, Op::Layout(Layout::Permute { perm })
                    if *perm == mtmc_actions::rewrite::channels_last_perm(rank))
            });
        let output_view = matches!(node.op, Op::Layout(Layout::Permute { .. }))
            && mtmc_actions::rewrite::reads_as_view(g, id)
            && !g.consumers(id).iter().any(|c| covered.contains(c));
        let mut ins = ins;
        if read_channels_last {
            let format = if rank == 4 {
                "channels_last"
            } else {
                "channels_last_3d"
            };
            // The input by the transpose kernel where its tiles fill (32
            // channels or more, float32), torch's copy otherwise; the
            // weights (small) by torch.
            let x = g.tensor(g.inputs(id)[0]);
            let tiled = x.dtype == mtmc_actions::DType::F32
                && x.shape.get(1).is_some_and(|&c| c >= 32)
                && !p.fragments.iter().any(|f| f.lang == Lang::Triton);
            for (slot, x) in ins[..2].iter_mut().enumerate() {
                *x = if slot == 0 && tiled {
                    layout_kernel = true;
                    format!("_channels_last({x})")
                } else {
                    format!("{x}.contiguous(memory_format=torch.{format})")
                };
            }
        }
        // `split` and recurrent stacks make several tensors: the tuple,
        // then each part.
        let several = match &node.op {
            Op::Layout(Layout::Slice { subscript }) if subscript.starts_with("split(") => {
                Some(format!("{}.{subscript}", ins[0]))
            }
            Op::Opaque { call: Some(c), .. } if node.outputs.len() > 1 => {
                Some(torch::opaque_call(c, &ins).ok_or_else(|| {
                    format!(
                        "`{}` ({}) takes arguments that have no Python spelling here",
                        node.name, node.op
                    )
                })?)
            }
            Op::Rnn(r) => Some(
                node.outputs
                    .get(1)
                    .and_then(|hidden| rnn_call(r, &ins, hidden))
                    .ok_or_else(|| {
                        format!(
                            "`{}` ({}) takes inputs that have no torch rendering yet",
                            node.name, node.op
                        )
                    })?,
            ),
            _ => None,
        };
        if let Some(call) = several {
            let v = format!("t{}", id.index());
            let _ = writeln!(body, "        {v} = {call}");
            for output in 0..node.outputs.len() {
                let part = format!("{v}_{output}");
                let _ = writeln!(body, "        {part} = {v}[{output}].contiguous()");
                var.insert(TensorRef { node: id, output }, part);
            }
            continue;
        }
        let call = torch_call(&node.op, &ins, &node.outputs[0]).ok_or_else(|| {
            format!(
                "no fragment computes `{}` ({}) and it has no torch rendering yet",
                node.name, node.op
            )
        })?;
        let v = format!("t{}", id.index());
        // A result only returned keeps torch's strides: no kernel reads it,
        // and the reference returns the same call's result (attention's
        // comes head-major from the memory-efficient kernel: making it
        // dense was a copy of the whole output). Views and copies stay
        // dense, so nothing returned aliases what the caller passed in.
        let returned_only = !matches!(node.op, Op::Layout(_))
            && !node.op.is_view()
            && g.consumers(id).is_empty()
            && g.outputs().iter().any(|t| t.node == id);
        if read_channels_last || output_view || returned_only {
            let _ = writeln!(body, "        {v} = {call}");
        } else {
            let _ = writeln!(body, "        {v} = {call}.contiguous()");
        }
        var.insert(t, v);
    }
    let (derived_body, body) = body.split_at(derived_end.unwrap_or(body.len()));
    // An output that is a view of kept tensors is copied: the caller may
    // write into what it gets.
    let aliases_kept = |t: &TensorRef| {
        let mut at = t.node;
        while g.node(at).op.is_view() && !derived.contains(&at) {
            match g.inputs(at).first() {
                Some(i) => at = i.node,
                None => return false,
            }
        }
        derived.contains(&at)
    };
    let outs: Vec<String> = g
        .outputs()
        .iter()
        .map(|t| {
            let v = var
                .get(t)
                .cloned()
                .ok_or("an output is never computed".to_string())?;
            Ok(if aliases_kept(t) {
                format!("{v}.clone()")
            } else {
                v
            })
        })
        .collect::<Result<_, String>>()?;
    let device_of = forward_args
        .first()
        .map(|(v, _)| v.clone())
        .unwrap_or_else(|| "torch.empty(0, device='cuda')".into());

    let mut py = String::new();
    let (triton, cuda): (Vec<_>, Vec<_>) = p.fragments.iter().partition(|f| f.lang == Lang::Triton);
    if !triton.is_empty() {
        py.push_str("# Generated by mtmc: custom kernels written in Triton, launched on torch's\n# current stream");
        if !cuda.is_empty() {
            py.push_str(", and in CUDA, compiled with NVRTC through cupy");
        }
        py.push_str("; ops without a kernel are torch calls.\n");
    } else {
        py.push_str("# Generated by mtmc: custom kernels compiled with NVRTC through cupy and\n");
        py.push_str(
            "# launched on torch's current stream; ops without a kernel are torch calls.\n",
        );
    }
    let kernels = !cuda.is_empty();
    if kernels {
        py.push_str("import cupy as cp\n");
    }
    py.push_str("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n");
    if !triton.is_empty() {
        py.push_str("import triton\nimport triton.language as tl\n");
    }
    py.push('\n');
    for f in &triton {
        py.push('\n');
        py.push_str(&f.source);
        py.push('\n');
    }
    let source: String = cuda
        .iter()
        .map(|f| f.source.as_str())
        .collect::<Vec<_>>()
        .join("\n");
    let _ = writeln!(
        py,
        "_SOURCE = {}",
        serde_json::to_string(&source).expect("a string serializes")
    );
    let names: Vec<String> = cuda
        .iter()
        .flat_map(|f| f.launches().map(|(k, _)| format!("{k:?}")))
        .collect();
    if p.fragments.is_empty() {
        py.push_str("# Every op is a library call: no kernel to compile.\n_KERNELS = {}\n");
    } else if cuda.is_empty() {
        py.push_str("# No CUDA kernel: every kernel is a Triton function above.\n_KERNELS = {}\n");
    } else {
        // Hopper's arch-specific target where the GPU is one (kernels guard
        // what only it has); cupy names the plain target after it.
        py.push_str(
            "_OPTIONS = (\"--std=c++17\",) + ((\"-arch=sm_90a\",) if cp.cuda.Device().compute_capability == \"90\" else ())\n",
        );
        py.push_str("_MODULE = cp.RawModule(code=_SOURCE, options=_OPTIONS)\n");
        let _ = writeln!(
            py,
            "_KERNELS = {{name: _MODULE.get_function(name) for name in [{}]}}",
            names.join(", ")
        );
        // Past 48 KiB of dynamic shared memory a kernel opts in.
        for (kernel, launch) in cuda.iter().flat_map(|f| f.launches()) {
            if launch.shared > 48 * 1024 {
                let _ = writeln!(
                    py,
                    "_KERNELS[{kernel:?}].max_dynamic_shared_size_bytes = {}",
                    launch.shared
                );
            }
        }
    }
    py.push_str("\n# The problem's Model, built exactly as the reference builds its own: its\n# parameters, and the submodules the program calls as the problem does.\n");
    let _ = writeln!(
        py,
        "_PROBLEM = {}",
        serde_json::to_string(problem_code).expect("a string serializes")
    );
    py.push_str("_PROBLEM_NS = {\"__name__\": \"mtmc_problem\"}\nexec(compile(_PROBLEM, \"problem.py\", \"exec\"), _PROBLEM_NS)\n\n\n");
    if kernels {
        py.push_str("def _ptr(t):\n    return cp.uint64(t.data_ptr())\n\n\n");
    }
    if layout_kernel {
        let _ = writeln!(
            py,
            "_LAYOUT_SOURCE = {}",
            serde_json::to_string(CHANNELS_LAST).expect("a string serializes")
        );
        py.push_str(CHANNELS_LAST_PY);
        py.push_str("\n\n");
    }
    // Constants torch.fx lifted out of the forward (`torch.tensor(c)`) are
    // no attributes of the Model: they are read from a trace of it, once.
    let lifted: Vec<&String> = params
        .iter()
        .map(|(_, name, _)| name)
        .filter(|n| n.starts_with("_tensor_constant"))
        .collect();
    if !lifted.is_empty() {
        py.push_str("def _lifted_constants(model, names):\n    holder = nn.Module()\n    traced = torch.fx.symbolic_trace(model)\n    for k, name in enumerate(names):\n        holder.register_buffer(f\"c{k}\", getattr(traced, name).detach().clone())\n    return holder\n\n\n");
    }
    if p.cuda_graph {
        py.push_str(CUDA_GRAPH_PY);
        py.push_str("\n\n");
    }
    // The forward takes the Model's arguments by position and reads the
    // tensors the graph uses by name (a Python scalar argument is a
    // constant of the traced graph).
    py.push_str("import inspect\n_FORWARD = list(inspect.signature(_PROBLEM_NS[\"Model\"].forward).parameters)[1:]\n\n\n");
    py.push_str("class ModelNew(nn.Module):\n    def __init__(self, *args, **kwargs):\n        super().__init__()\n");
    py.push_str("        self.reference_parameters = _PROBLEM_NS[\"Model\"](*args, **kwargs)\n");
    if !lifted.is_empty() {
        let names: Vec<String> = lifted.iter().map(|n| format!("{n:?}")).collect();
        let _ = writeln!(
            py,
            "        self.lifted_constants = _lifted_constants(self.reference_parameters, [{}])",
            names.join(", ")
        );
    }
    if p.cuda_graph {
        py.push_str(
            "        self._graph = self._graph_out = self._graph_key = self._graph_tensors = None\n",
        );
        py.push_str("\n    def forward(self, *args, **kwargs):\n        return _replay(self, args, kwargs)\n");
        py.push_str("\n    def _forward(self, *args, **kwargs):\n");
    } else {
        py.push_str("\n    def forward(self, *args, **kwargs):\n");
    }
    py.push_str("        bound = dict(zip(_FORWARD, args))\n        bound.update(kwargs)\n");
    for (v, name) in &forward_args {
        let _ = writeln!(py, "        {v} = bound[{name:?}].contiguous()");
    }
    // Each parameter as the Model holds it (the cache key reads these).
    let mut held = HashMap::new();
    for (v, name, trainable) in &params {
        let tensor = if let Some(k) = lifted.iter().position(|n| *n == name) {
            format!("self.lifted_constants.c{k}")
        } else {
            let getter = if *trainable {
                "get_parameter"
            } else {
                "get_buffer"
            };
            format!("self.reference_parameters.{getter}({name:?})")
        };
        let _ = writeln!(py, "        {v} = {tensor}.contiguous()");
        held.insert(v.clone(), tensor);
    }
    let _ = writeln!(py, "        _device = {device_of}.device");
    if !derived_body.is_empty() {
        // What derives from parameters alone is kept until one of them
        // changes: its storage, or its version counter (which every
        // in-place write through the tensor moves).
        let mut read: Vec<&String> = Vec::new();
        for &id in &derived {
            for i in g.inputs(id) {
                if let Some(v) = var.get(&i)
                    && let Some(tensor) = held.get(v)
                    && !read.contains(&tensor)
                {
                    read.push(tensor);
                }
            }
        }
        read.sort();
        let key: Vec<String> = read
            .iter()
            .map(|t| format!("({t}.data_ptr(), {t}._version)"))
            .collect();
        let kept: Vec<String> = g
            .order()
            .iter()
            .filter(|id| derived.contains(id))
            .filter_map(|&id| var.get(&TensorRef::first(id)).cloned())
            .collect();
        // The device too: constants are made on the inputs' device.
        let _ = writeln!(py, "        _key = (_device, {})", key.join(", "));
        py.push_str("        if getattr(self, \"_derived_key\", None) != _key:\n");
        for line in derived_body.lines() {
            let _ = writeln!(py, "    {line}");
        }
        let _ = writeln!(py, "            self._derived = ({},)", kept.join(", "));
        py.push_str("            self._derived_key = _key\n");
        let _ = writeln!(py, "        {}, = self._derived", kept.join(", "));
    }
    if kernels {
        py.push_str(
            "        with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):\n",
        );
        for line in body.lines() {
            let _ = writeln!(py, "    {line}");
        }
    } else {
        py.push_str(body);
    }
    if outs.len() == 1 {
        let _ = writeln!(py, "        return {}", outs[0]);
    } else {
        let _ = writeln!(py, "        return ({},)", outs.join(", "));
    }
    Ok(py)
}

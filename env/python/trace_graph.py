#!/usr/bin/env python3
"""Trace KernelBench problems into the JSON graphs that mtmc reads.

Reads problems as JSON lines on stdin ({"level", "name", "code", ...}, the
format of KernelBench's problems.jsonl) and writes one trace per line on
stdout. Each trace lists the model's operations at the level the user wrote
them (leaf nn modules, torch functions, tensor methods) with every output's
shape and dtype. Rust decides what each operation means; this script only
records faithfully.

Tracing uses torch.fx (symbolic trace + shape propagation on meta tensors, so
no memory is spent on the problem's real sizes). Models that fx cannot trace
symbolically (data-dependent Python control flow, asserts on shapes) are run
once under a TorchFunctionMode that records the same vocabulary.

Regenerate the committed fixtures with:
    python3 env/python/trace_graph.py < ../shared/kernelbench/problems.jsonl \
        > traces/kernelbench.jsonl
"""

import argparse
import hashlib
import json
import math
import operator
import sys
import traceback
import types

import torch
import torch.fx as fx
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

SCHEMA = 1


def dtype_name(dt):
    return str(dt).replace("torch.", "")


def encode(value, ref):
    """Encodes an argument or a non-tensor result as JSON; `ref` maps tensors
    (or fx nodes) to node names and returns None for unknown ones."""
    name = ref(value)
    if name is not None:
        return {"node": name}
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        if math.isfinite(value):
            return value
        return {"float": str(value)}
    if isinstance(value, (list, tuple, torch.Size)):
        return [encode(v, ref) for v in value]
    if isinstance(value, dict):
        return {"dict": {str(k): encode(v, ref) for k, v in value.items()}}
    if isinstance(value, slice):
        return {"slice": [encode(value.start, ref), encode(value.stop, ref), encode(value.step, ref)]}
    if isinstance(value, torch.dtype):
        return {"dtype": dtype_name(value)}
    if isinstance(value, torch.device):
        return {"device": str(value)}
    if value is Ellipsis:
        return {"ellipsis": True}
    if isinstance(value, torch.Tensor):
        # A tensor that no recorded operation produced: keep its type.
        return {"tensor": tensor_meta(value)}
    return {"repr": repr(value)[:200]}


def tensor_meta(t):
    return {"shape": list(t.shape), "dtype": dtype_name(t.dtype)}


def meta_of(value):
    """The type of one operation's result."""
    if isinstance(value, torch.Tensor):
        return {"tensor": tensor_meta(value)}
    if isinstance(value, (tuple, list)) and any(isinstance(v, torch.Tensor) for v in value):
        return {"tuple": [meta_of(v) for v in value]}
    return {"value": encode(value, lambda _: None)}


def module_attrs(mod):
    """Hyperparameters of a leaf module: its constants and plain attributes."""
    attrs = {}
    names = set(getattr(mod, "__constants__", []))
    names.update(k for k, v in vars(mod).items() if not k.startswith("_"))
    for k in sorted(names):
        v = getattr(mod, k, None)
        if isinstance(v, (nn.Module, torch.Tensor)) or callable(v):
            continue
        attrs[k] = encode(v, lambda _: None)
    return attrs


def module_params(mod):
    """A leaf module's parameters and buffers, its children's included
    (nn.MultiheadAttention keeps out_proj in a child)."""
    out = {}
    for k, p in mod.named_parameters():
        out[k] = dict(tensor_meta(p), trainable=True)
    for k, b in mod.named_buffers():
        if b is not None:
            out[k] = dict(tensor_meta(b), trainable=False)
    return out


def qualified_function_name(fn):
    """A stable name for a called function: torch.X, torch.nn.functional.X,
    operator.X, builtins.X, or module.qualname."""
    name = getattr(fn, "__name__", None)
    if name is not None:
        for prefix, space in (
            ("torch.nn.functional", F),
            ("torch", torch),
            ("torch.special", torch.special),
            ("torch.linalg", torch.linalg),
            ("operator", operator),
        ):
            if getattr(space, name, None) is fn:
                return f"{prefix}.{name}"
    if isinstance(fn, types.BuiltinFunctionType) and getattr(fn, "__module__", None) == "builtins":
        return f"builtins.{name}"
    module = getattr(fn, "__module__", None) or "?"
    return f"{module}.{getattr(fn, '__qualname__', name)}"


class Recorder:
    """Collects nodes in the trace schema."""

    def __init__(self):
        self.nodes = []
        self.used = set()

    def fresh(self, base):
        base = "".join(c if c.isalnum() or c == "_" else "_" for c in base) or "v"
        name, i = base, 1
        while name in self.used:
            i += 1
            name = f"{base}_{i}"
        self.used.add(name)
        return name

    def add(self, **node):
        self.nodes.append(node)
        return node["name"]


def instantiate(ns, device):
    torch.manual_seed(42)
    with torch.device(device):
        init = ns["get_init_inputs"]()
        model = ns["Model"](*init)
        torch.manual_seed(42)
        inputs = ns["get_inputs"]()
    if device != "meta":
        model = model.to(device)
        inputs = [x.to(device) if isinstance(x, torch.Tensor) else x for x in inputs]
    return init, model, inputs


def forward_arg_names(model, count):
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        params = []
    names = [p for p in params if p not in ("self",)]
    return [names[i] if i < len(names) else f"input{i}" for i in range(count)]


class ShapeInterpreter(fx.Interpreter):
    """Runs an fx graph and keeps every node's result type."""

    def __init__(self, gm):
        super().__init__(gm)
        self.metas = {}

    def run_node(self, n):
        result = super().run_node(n)
        self.metas[n.name] = meta_of(result)
        return result


def trace_fx(model, inputs, arg_names):
    tracer = fx.Tracer()
    graph = tracer.trace(model)
    gm = fx.GraphModule(model, graph)
    interp = ShapeInterpreter(gm)
    interp.run(*inputs)
    modules = dict(gm.named_modules())
    rec = Recorder()

    def ref(v):
        return v.name if isinstance(v, fx.Node) else None

    placeholder_index = 0
    outputs = []
    for n in graph.nodes:
        rec.used.add(n.name)
        meta = interp.metas.get(n.name)
        args = encode(list(n.args), ref)
        kwargs = {k: encode(v, ref) for k, v in n.kwargs.items()}
        if n.op == "placeholder":
            name = arg_names[placeholder_index] if placeholder_index < len(arg_names) else n.target
            placeholder_index += 1
            rec.add(name=n.name, op="input", target=name, out=meta)
        elif n.op == "get_attr":
            owner, _, leaf = n.target.rpartition(".")
            sub = gm.get_submodule(owner) if owner else gm
            trainable = leaf in dict(sub.named_parameters(recurse=False))
            rec.add(name=n.name, op="param", target=n.target, trainable=trainable, out=meta)
        elif n.op == "call_module":
            mod = modules[n.target]
            rec.add(
                name=n.name,
                op="module",
                target=n.target,
                module=type(mod).__name__,
                training=mod.training,
                attrs=module_attrs(mod),
                children={k: {"module": type(m).__name__, "attrs": module_attrs(m)} for k, m in mod.named_modules() if k},
                params=module_params(mod),
                args=args,
                kwargs=kwargs,
                out=meta,
            )
        elif n.op == "call_function":
            rec.add(
                name=n.name,
                op="function",
                target=qualified_function_name(n.target),
                args=args,
                kwargs=kwargs,
                out=meta,
            )
        elif n.op == "call_method":
            rec.add(name=n.name, op="method", target=n.target, args=args, kwargs=kwargs, out=meta)
        elif n.op == "output":
            outputs = encode(n.args[0], ref)
            outputs = outputs if isinstance(outputs, list) else [outputs]
    return rec.nodes, outputs


class FunctionRecorder(TorchFunctionMode):
    """Records every torch function and tensor method that the model calls."""

    def __init__(self, rec, names):
        super().__init__()
        self.rec = rec
        self.names = names  # id(tensor) -> node name
        self.keep = []  # keeps recorded tensors alive so ids stay unique

    def ref(self, v):
        if isinstance(v, torch.Tensor):
            return self.names.get(id(v))
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "__get__" or not any(isinstance(r, torch.Tensor) for r in _flat(result)):
            # Property reads (x.shape) and non-tensor results are concrete here:
            # later calls see their values as constants.
            return result
        # Tensors that no recorded call produced (buffers created in forward,
        # attributes assigned outside parameters) become constant nodes.
        for a in _flat(list(args) + list(kwargs.values())):
            if isinstance(a, torch.Tensor) and id(a) not in self.names:
                cname = self.rec.fresh("const")
                self.rec.add(name=cname, op="param", target=cname, trainable=False, out=meta_of(a))
                self.names[id(a)] = cname
                self.keep.append(a)
        is_method = bool(name) and getattr(torch.Tensor, name, None) is func
        node = dict(
            name=self.rec.fresh(name or "call"),
            args=encode(list(args), self.ref),
            kwargs={k: encode(v, self.ref) for k, v in kwargs.items()},
            out=meta_of(result),
        )
        if is_method:
            node.update(op="method", target=name)
        else:
            node.update(op="function", target=qualified_function_name(func))
        self.rec.add(**node)
        if isinstance(result, torch.Tensor):
            self.names[id(result)] = node["name"]
            self.keep.append(result)
        elif isinstance(result, (tuple, list)):
            for i, r in enumerate(result):
                if isinstance(r, torch.Tensor):
                    item = self.rec.fresh(f"{node['name']}_{i}")
                    self.rec.add(
                        name=item,
                        op="function",
                        target="operator.getitem",
                        args=[{"node": node["name"]}, i],
                        kwargs={},
                        out=meta_of(r),
                    )
                    self.names[id(r)] = item
                    self.keep.append(r)
        return result


def _flat(value):
    if isinstance(value, (list, tuple)):
        for v in value:
            yield from _flat(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _flat(v)
    else:
        yield value


def trace_function_mode(model, inputs, arg_names):
    rec = Recorder()
    names = {}
    for i, x in enumerate(inputs):
        name = rec.fresh(arg_names[i])
        rec.add(name=name, op="input", target=arg_names[i], out=meta_of(x))
        if isinstance(x, torch.Tensor):
            names[id(x)] = name
    for pname, p in list(model.named_parameters()) + list(model.named_buffers()):
        name = rec.fresh(pname.replace(".", "_"))
        rec.add(name=name, op="param", target=pname, trainable=isinstance(p, nn.Parameter), out=meta_of(p))
        names[id(p)] = name
    recorder = FunctionRecorder(rec, names)
    with recorder:
        result = model(*inputs)
    outputs = encode(result, recorder.ref)
    outputs = outputs if isinstance(outputs, list) else [outputs]
    return rec.nodes, outputs


def trace_problem(problem, devices):
    code = problem["code"]
    trace = {
        "schema": SCHEMA,
        "level": problem.get("level"),
        "name": problem.get("name"),
        "code_sha256": hashlib.sha256(code.encode()).hexdigest(),
        "torch": torch.__version__,
    }
    ns = {"__name__": f"kernelbench_{problem.get('level')}_{problem.get('name')}"}
    try:
        exec(compile(code, problem.get("name") or "<problem>", "exec"), ns)
    except Exception as e:  # the problem file itself does not run
        trace.update(status="error", error=f"problem code failed: {type(e).__name__}: {e}")
        return trace
    errors = []
    for method in ("fx", "function_mode"):
        for device in devices:
            try:
                init, model, inputs = instantiate(ns, device)
                arg_names = forward_arg_names(model, len(inputs))
                run = trace_fx if method == "fx" else trace_function_mode
                with torch.no_grad():
                    nodes, outputs = run(model, inputs, arg_names)
                trace.update(
                    status="ok",
                    method=method,
                    device=device,
                    training=model.training,
                    init_inputs=encode(list(init), lambda _: None),
                    nodes=nodes,
                    outputs=outputs,
                )
                if errors:
                    trace["fallback_reasons"] = errors
                return trace
            except Exception as e:
                last = traceback.format_exception_only(type(e), e)[-1].strip()
                errors.append(f"{method} on {device}: {last[:300]}")
    trace.update(status="error", error="; ".join(errors))
    return trace


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        action="append",
        help="devices to try in order (default: meta, then cuda if available, then cpu)",
    )
    opts = parser.parse_args()
    devices = opts.device or (["meta"] + (["cuda"] if torch.cuda.is_available() else []) + ["cpu"])
    for line_no, line in enumerate(sys.stdin, 1):
        if not line.strip():
            continue
        try:
            problem = json.loads(line)
        except json.JSONDecodeError as e:
            print(json.dumps({"schema": SCHEMA, "status": "error", "error": f"stdin line {line_no}: {e}"}), flush=True)
            continue
        print(f"tracing L{problem.get('level')}/{problem.get('name')}", file=sys.stderr, flush=True)
        print(json.dumps(trace_problem(problem, devices)), flush=True)


if __name__ == "__main__":
    main()

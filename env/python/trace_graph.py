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
symbolically (Python control flow on shapes, asserts) are run once under a
TorchFunctionMode that records the same vocabulary, provided that run stands
for every run: its Python read no value computed from the inputs, and the
model's state is the same after it. Otherwise fx traces again with each
submodule it cannot follow (its forward branches on a value, keeps state
across calls, or fails to trace) kept as a call of that submodule
(`fx_partial`; the trace lists them under `untraced`, each node says why). A
model whose own forward keeps state has no trace: mtmc runs its whole
forward.

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


# Tensor reads that turn a value into Python (a branch, an index, a
# number): a trace taken while one of them reads a value derived from the
# inputs holds only the path those inputs took.
VALUE_READS = {
    "__bool__", "__int__", "__float__", "__index__", "__complex__", "item", "tolist",
    "numpy", "__array__", "equal", "allclose", "is_nonzero",
}


class Untraced(Exception):
    """A submodule (path `module`, "" for the model itself) that tracing
    must keep as a call of its own forward, and why."""

    def __init__(self, module, reason):
        super().__init__(f"{module or 'Model'}: {reason}")
        self.module = module
        self.reason = reason


class ValueRead(Exception):
    """A run that stands only for itself: its Python read a value computed
    from the inputs, or it changed the model's state."""


def state_of(mod, own_only=False):
    """The identity of every attribute of `mod` and its submodules, and the
    version of every parameter and buffer: a forward that assigns one (a
    hidden state, a counter) or updates one in place keeps state across
    calls. fx runs an in-place update of a tensor attribute while it traces
    and records nothing, so only its version shows it. With `own_only`,
    versions are read only off the problem's own modules: torch.nn's update
    theirs (batch norm's running statistics), which the IR models."""
    state = {}
    for q, m in mod.named_modules():
        versions = not (own_only and type(m).__module__.startswith("torch.nn."))
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules"):
                for kk, vv in v.items():
                    state[(q, kk)] = (id(vv), vv._version if versions and isinstance(vv, torch.Tensor) else 0)
            elif not k.startswith("_"):
                state[(q, k)] = (id(v), v._version if versions and isinstance(v, torch.Tensor) else 0)
    return state


def assigned(before, after, prefix=""):
    """The attributes (paths under `prefix`) whose object changed."""
    names = sorted({k for k in before.keys() | after.keys() if before.get(k) != after.get(k)})
    out = []
    for q, k in names:
        path = ".".join(p for p in (prefix, q, k) if p)
        out.append(path)
    return out


def stateful_reason(paths, owner):
    rel = [p[len(owner) + 1:] if owner and p.startswith(owner + ".") else p for p in paths]
    return "keeps state across calls: it assigns or updates " + ", ".join(f"self.{p}" for p in rel[:3])


class PartialTracer(fx.Tracer):
    """fx's tracer that keeps the submodules in `opaque` as calls (leaves), and
    names the submodule to keep when tracing fails inside one: the innermost
    one whose forward raised, or whose forward assigned an attribute."""

    def __init__(self, opaque):
        super().__init__()
        self.opaque = opaque
        self.blame = None

    def is_leaf_module(self, m, qualname):
        return qualname in self.opaque or super().is_leaf_module(m, qualname)

    def call_module(self, m, forward, args, kwargs):
        q = self.path_of_module(m)
        if self.is_leaf_module(m, q):
            return super().call_module(m, forward, args, kwargs)
        before = state_of(m)
        try:
            out = super().call_module(m, forward, args, kwargs)
        except Untraced:
            raise
        except Exception as e:
            if self.blame is None:
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                self.blame = Untraced(q, f"its forward does what fx cannot trace: {first[:200]}")
            raise
        changed = assigned(before, state_of(m), q)
        if changed:
            raise Untraced(q, stateful_reason(changed, q))
        return out


def inplace_on_state(graph):
    """An in-place method called on a parameter or buffer (`self.count.add_(1)`):
    the attribute's owner keeps state across calls."""
    for n in graph.nodes:
        if n.op != "call_method" or not n.args or not isinstance(n.args[0], fx.Node):
            continue
        t = n.target
        inplace = (t.endswith("_") and not t.startswith("_")) or is_inplace_dunder(t)
        if inplace and n.args[0].op == "get_attr":
            owner = n.args[0].target.rpartition(".")[0]
            raise Untraced(owner, f"keeps state across calls: it updates self.{n.args[0].target.rpartition('.')[2]} in place ({t})")


def is_inplace_dunder(t):
    return t in ("__iadd__", "__isub__", "__imul__", "__itruediv__", "__ifloordiv__", "__ipow__", "__imatmul__")


def trace_fx(model, inputs, arg_names, opaque=None):
    opaque = opaque or {}
    tracer = PartialTracer(opaque)
    before = state_of(model)
    try:
        graph = tracer.trace(model)
    except Untraced:
        raise
    except Exception as e:
        if tracer.blame is not None:
            raise tracer.blame from e
        raise
    changed = assigned(before, state_of(model))
    if changed:
        raise Untraced("", stateful_reason(changed, ""))
    inplace_on_state(graph)
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
            if n.target in opaque:
                # Kept as a call of its own forward: its class and why.
                what = dict(module=type(mod).__qualname__, opaque=opaque[n.target])
            else:
                children = {k: {"module": type(m).__name__, "attrs": module_attrs(m)} for k, m in mod.named_modules() if k}
                what = dict(module=type(mod).__name__, attrs=module_attrs(mod), children=children)
            rec.add(
                name=n.name,
                op="module",
                target=n.target,
                training=mod.training,
                params=module_params(mod),
                args=args,
                kwargs=kwargs,
                out=meta,
                **what,
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
        self.derived = set()  # ids of tensors computed from the inputs
        self.value_reads = []  # reads of input-derived values into Python

    def ref(self, v):
        if isinstance(v, torch.Tensor):
            return self.names.get(id(v))
        return None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        flat_in = [a for a in _flat(list(args) + list(kwargs.values())) if isinstance(a, torch.Tensor)]
        derived = any(id(a) in self.derived for a in flat_in)
        if name in VALUE_READS and derived:
            self.value_reads.append(name)
        result = func(*args, **kwargs)
        if derived:
            for r in _flat(result):
                if isinstance(r, torch.Tensor):
                    self.derived.add(id(r))
                    self.keep.append(r)
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
    recorder.derived = {id(x) for x in inputs if isinstance(x, torch.Tensor)}
    before = state_of(model, own_only=True)
    with recorder:
        result = model(*inputs)
    changed = assigned(before, state_of(model, own_only=True))
    if changed:
        raise ValueRead(stateful_reason(changed, ""))
    if recorder.value_reads:
        reads = ", ".join(sorted(set(recorder.value_reads)))
        raise ValueRead(f"its Python reads values computed from the inputs ({reads}), so one run holds only the path those inputs took")
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
    for method in ("fx", "function_mode", "fx_partial"):
        for device in devices:
            try:
                init, model, inputs = instantiate(ns, device)
                arg_names = forward_arg_names(model, len(inputs))
                opaque = {}
                with torch.no_grad():
                    if method == "fx":
                        nodes, outputs = trace_fx(model, inputs, arg_names)
                    elif method == "function_mode":
                        nodes, outputs = trace_function_mode(model, inputs, arg_names)
                    else:
                        nodes, outputs = trace_partial(ns, device, opaque)
                trace.update(
                    status="ok",
                    method=method,
                    device=device,
                    training=model.training,
                    init_inputs=encode(list(init), lambda _: None),
                    nodes=nodes,
                    outputs=outputs,
                )
                if opaque:
                    trace["untraced"] = [{"module": q, "reason": r} for q, r in opaque.items()]
                if errors:
                    trace["fallback_reasons"] = errors
                return trace
            except Untraced as e:
                if method == "fx" and not e.module:
                    # The model's own forward keeps state: no trace of one
                    # call stands for the next.
                    trace.update(status="error", error=f"Model.forward {e.reason}")
                    return trace
                errors.append(f"{method} on {device}: {e}")
            except Exception as e:
                last = traceback.format_exception_only(type(e), e)[-1].strip()
                errors.append(f"{method} on {device}: {last[:300]}")
    trace.update(status="error", error="; ".join(errors))
    return trace


def trace_partial(ns, device, opaque):
    """fx with the submodules it cannot trace faithfully kept as calls of
    their own forward: each failure names one more (filling `opaque`, path to
    reason) until the rest traces or the model's own forward is to blame."""
    while True:
        _, model, inputs = instantiate(ns, device)
        arg_names = forward_arg_names(model, len(inputs))
        try:
            return trace_fx(model, inputs, arg_names, opaque)
        except Untraced as e:
            if not e.module or e.module in opaque:
                raise
            opaque[e.module] = e.reason


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

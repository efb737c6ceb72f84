#!/usr/bin/env python3
"""mtmc's evaluation worker: one persistent process per GPU.

Reads requests as JSON lines on stdin and answers each with one JSON line on
stdout (stdout carries nothing else: candidate prints go to stderr). torch is
imported once, on the first request that needs it, and stays loaded.

Requests:
  {"id": N, "op": "hello"}
      -> python and torch versions, the device.
  {"id": N, "op": "prepare", "problem": {...}, ...}
      -> the reference side of a problem (see `eval`), computed now so that
         the caller can give it a longer limit than a candidate gets.
  {"id": N, "op": "eval", "problem": {"name", "code"}, "candidate": {"name", "code"},
   "seed": 42, "correctness_trials": 5, "warmup": 3, "trials": 100,
   "atol": 1e-4, "rtol": 1e-4, "max_error_to_scale": 1e-2,
   "baselines": ["eager", "compile"], "baseline_cache": DIR or null,
   "inputs": "device" | "host", "device": "cuda" | "cpu", "strict": false}
      -> the KernelBench protocol on the candidate's ModelNew against the
         problem's Model: correctness over fresh random inputs per trial, then
         timing (CUDA events, L2 flushed before every trial), with the
         baselines timed the same way on the same GPU: eager trial by trial
         beside the candidate ("paired_eager", on by default; its time alone,
         taken before any candidate code ran, bounds it), torch.compile
         alone.

Inputs: "host" draws them on the CPU and copies them over, exactly as
KernelBench does; "device" (the fast path) runs `get_inputs()` with the GPU
as the default device, so the same seeded draws happen on the GPU's
generator (other values, the same distributions) without moving gigabytes
over PCIe.

Faults that kill the process (a hanging kernel, an illegal address, a
segfault) are the caller's to handle: it restarts the worker.
"""

import collections
import hashlib
import json
import linecache
import math
import os
import re
import sys
import tempfile
import time
import traceback
import types

_torch = None
_l2_flush = None

# The worker's own clock, taken before any candidate code can replace it.
_clock = time.perf_counter

# Error texts after which the process's CUDA context cannot be used again.
CUDA_FATAL = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "CUDA_ERROR_",
    "cudaErrorIllegal",
    "misaligned address",
    "out of memory",
)

# aten ops that allocate, reshape or move memory without computing anything
# a problem asks for. Every other op a candidate runs is a torch (library)
# computation, reported as such.
MEMORY_OPS = {
    "aten.empty", "aten.empty_like", "aten.empty_strided", "aten.new_empty", "aten.new_empty_strided",
    "aten.view", "aten._unsafe_view", "aten.reshape", "aten.contiguous", "aten.clone", "aten.t",
    "aten.transpose", "aten.permute", "aten.expand", "aten.as_strided", "aten.detach", "aten.alias",
    "aten.slice", "aten.select", "aten.unsqueeze", "aten.squeeze", "aten.flatten", "aten.unflatten",
    "aten.lift_fresh", "aten._to_copy", "aten.copy_", "aten.split", "aten.chunk", "aten.unbind",
    "aten.narrow", "aten.resize_", "aten.set_", "aten.zeros", "aten.zeros_like", "aten.new_zeros",
    "aten.ones", "aten.ones_like", "aten.full", "aten.full_like", "aten.fill_", "aten.zero_",
    "aten.sym_size", "aten.sym_stride", "aten.sym_numel", "aten.is_same_size", "aten.record_stream",
}


_strftime, _gmtime = time.strftime, time.gmtime


def _utc_now():
    return _strftime("%Y-%m-%dT%H:%M:%SZ", _gmtime())


def torch():
    global _torch
    if _torch is None:
        import torch as t

        # Imported now, not by the first candidate: importing them adds
        # attributes to torch and wraps torch.manual_seed, which would look
        # like a candidate's patch.
        import torch._dynamo  # noqa: F401
        import torch.utils._python_dispatch  # noqa: F401

        _torch = t
        # Before any candidate code can touch them.
        _TIMERS.update(Event=t.cuda.Event, synchronize=t.cuda.synchronize, perf_counter=_clock)
    return _torch


def finite(value):
    """JSON has no infinities or NaN: those floats are sent as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


def reply(obj):
    sys.__stdout__.write(json.dumps(finite(obj), allow_nan=False) + "\n")
    sys.__stdout__.flush()


ERROR_CHARS = 2000
ERROR_LINE = re.compile(r"\berror\b", re.IGNORECASE)


def error_text(e):
    """The exception's message, at most ERROR_CHARS long. A long one (a
    compiler's log, where warnings can fill it) keeps its first line (the
    exception's name) and its error lines with the two after each (the
    source line and the caret) first, then as much of its end as fits, so
    the line and kind of a compile error survive the cut."""
    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    if len(text) <= ERROR_CHARS:
        return text
    lines = text.split("\n")
    keep = [0]
    for i, line in enumerate(lines):
        if ERROR_LINE.search(line) and "warning" not in line.lower():
            keep.extend(j for j in range(i, min(i + 3, len(lines))) if j not in keep)
    if len(keep) == 1:
        return text[-ERROR_CHARS:]
    head = "\n".join(lines[j][:200] for j in keep)[: ERROR_CHARS // 2] + "\n[...]\n"
    return head + text[-(ERROR_CHARS - len(head)):]


def hello(_req):
    out = {"python": sys.version.split()[0], "pid": os.getpid()}
    try:
        t = torch()
        out["torch"] = t.__version__
        out["cuda"] = t.cuda.is_available()
        if out["cuda"]:
            out["device"] = t.cuda.get_device_name(0)
    except ImportError as e:
        out["torch"] = None
        out["torch_error"] = error_text(e)
    out["network"] = network_state()
    return out


def network_state():
    """`none` when this process sits in a network namespace of its own
    (only a loopback interface), else `present`."""
    try:
        import socket

        names = [name for _, name in socket.if_nameindex() if name != "lo"]
    except OSError:
        return "unknown"
    return "none" if not names else "present"


def load_module(name, code, filename=None):
    """Executes a source as a fresh module; returns its namespace."""
    filename = filename or name
    ns = {"__name__": f"mtmc_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"}
    # Kept where `inspect` finds it: Triton reads a kernel's source.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    exec(compile(code, filename, "exec"), ns)
    return ns


def set_seed(seed):
    t = torch()
    t.manual_seed(seed)
    if t.cuda.is_available():
        t.cuda.manual_seed(seed)


def make_inputs(ns, seed, device, mode):
    """The problem's `get_inputs()` under `seed`, on `device`."""
    t = torch()
    set_seed(seed)
    if mode == "device" and device.type == "cuda":
        with t.device(device):
            xs = ns["get_inputs"]()
    else:
        xs = ns["get_inputs"]()
    return [x.to(device) if isinstance(x, t.Tensor) else x for x in xs]


def flush_l2(device):
    """Writes 256 MB so that no trial starts with the candidate's data in L2."""
    global _l2_flush
    t = torch()
    if _l2_flush is None:
        _l2_flush = t.empty(64 * 1024 * 1024, dtype=t.float32, device=device)
    _l2_flush.fill_(1.0)


# The timing primitives, taken when torch is first imported and before any
# candidate code runs, so that a candidate cannot swap them for fakes.
_TIMERS = {}


def timers():
    torch()
    return _TIMERS


def one_trial(fn, inputs, device):
    """Milliseconds of one call. On a GPU: a CUDA-event pair, L2 flushed
    first; the end event is recorded only after the whole device is
    synchronized, so work that a candidate puts on other streams is inside
    the measured span. On the CPU (tests): the host clock."""
    tm = timers()
    if device.type == "cuda":
        flush_l2(device)
        start = tm["Event"](enable_timing=True)
        end = tm["Event"](enable_timing=True)
        start.record()
        fn(*inputs)
        tm["synchronize"](device)
        end.record()
        end.synchronize()
        return start.elapsed_time(end)
    clock = tm["perf_counter"]
    begin = clock()
    fn(*inputs)
    return (clock() - begin) * 1e3


def clock_name(device):
    return "cuda_events" if device.type == "cuda" else "host"


def time_calls(fn, inputs, warmup, trials, device):
    """Milliseconds per call over `trials` calls after `warmup` ones
    (`one_trial` each)."""
    t = torch()
    with t.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        if device.type == "cuda":
            timers()["synchronize"](device)
        times = [one_trial(fn, inputs, device) for _ in range(trials)]
    return stats(times, clock_name(device))


def time_paired(fn, base, inputs, warmup, trials, device, base_context):
    """`fn` and the baseline `base` timed trial by trial, in turn (the first
    of each pair alternates), so that both meet the same state of the
    machine: the host's launch gaps, the GPU's clocks. `base` runs inside
    `base_context()` (the reference's switches). Returns both timings."""
    t = torch()
    ours, theirs = [], []
    with t.no_grad():
        for _ in range(warmup):
            fn(*inputs)
            with base_context():
                base(*inputs)
        if device.type == "cuda":
            timers()["synchronize"](device)
        for k in range(trials):
            for which in ((0, 1) if k % 2 == 0 else (1, 0)):
                if which == 0:
                    ours.append(one_trial(fn, inputs, device))
                else:
                    with base_context():
                        theirs.append(one_trial(base, inputs, device))
    return stats(ours, clock_name(device)), stats(theirs, clock_name(device))


def stats(times, clock):
    n = len(times)
    mean = sum(times) / n
    ordered = sorted(times)
    median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    std = math.sqrt(sum((x - mean) ** 2 for x in times) / max(n - 1, 1))
    return {"mean_ms": mean, "median_ms": median, "std_ms": std, "min_ms": ordered[0], "max_ms": ordered[-1], "trials": n, "clock": clock}


def outputs_of(value):
    """A model's result as a list of outputs (one tensor, or a tuple)."""
    if isinstance(value, (tuple, list)):
        return list(value)
    return [value]


def compare(refs, outs, atol, rtol, min_scale_ratio):
    """KernelBench's allclose, output by output, plus a check against the
    output's scale, so that outputs small enough to fit inside atol (zeros)
    do not pass."""
    t = torch()
    if len(outs) != len(refs):
        return {"ok": False, "why": f"the candidate returned {len(outs)} output(s), the reference {len(refs)}"}
    total = {"max_abs_err": 0.0, "scale": 0.0}
    for k, (ref, out) in enumerate(zip(refs, outs)):
        one = compare_one(t, ref, out, atol, rtol, min_scale_ratio)
        if len(refs) > 1 and "why" in one:
            one["why"] = f"output {k}: {one['why']}"
        if not one["ok"]:
            return one
        total["max_abs_err"] = max(total["max_abs_err"], one["max_abs_err"])
        total["scale"] = max(total["scale"], one["scale"])
    scale = total["scale"]
    total["rel_to_scale"] = total["max_abs_err"] / scale if scale > 0 else None
    total["ok"] = True
    return total


def compare_one(t, ref, out, atol, rtol, min_scale_ratio):
    # KernelBench's tolerance for half-precision outputs.
    if ref.dtype in (t.float16, t.bfloat16):
        atol, rtol = max(atol, 1e-2), max(rtol, 1e-2)
    # Exactly a tensor: a subclass could compute lazily, when read, outside
    # the timed span.
    if type(out) is not t.Tensor:
        return {"ok": False, "why": f"the candidate returned {type(out).__name__}, not a plain torch.Tensor"}
    if tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "why": f"shape {list(out.shape)} differs from the reference's {list(ref.shape)}"}
    if out.dtype != ref.dtype:
        return {"ok": False, "why": f"dtype {out.dtype} differs from the reference's {ref.dtype}"}
    if out.device.type != ref.device.type and ref.device.type != "cpu":
        return {"ok": False, "why": f"the result is on {out.device}, the reference on {ref.device}"}
    # |out - ref| <= atol + rtol * |ref| in the outputs' own dtype, as
    # torch.allclose does, in chunks so that multi-GB outputs need little
    # extra memory; one device sync per output, not per chunk. The first
    # pass only finds the largest |out - ref| and |ref|: when no difference
    # exceeds atol every element passes, and the elementwise test (several
    # more passes over memory) runs only when one does.
    r_flat, o_flat = ref.detach().reshape(-1), out.detach().reshape(-1)
    if not r_flat.is_floating_point():
        r_flat, o_flat = r_flat.double(), o_flat.double()
    chunk = 1 << 26
    spans = [(b, min(b + chunk, r_flat.numel())) for b in range(0, r_flat.numel(), chunk)]
    if not spans:
        return {"ok": True, "max_abs_err": 0.0, "scale": 0.0, "rel_to_scale": None}

    def pieces(begin, end):
        o = o_flat[begin:end]
        return o, r_flat[begin:end].to(o.device, non_blocking=True)

    maxes, scales = [], []
    for begin, end in spans:
        o, r = pieces(begin, end)
        maxes.append(t.linalg.vector_norm(t.sub(o, r), ord=math.inf))
        scales.append(t.linalg.vector_norm(r, ord=math.inf))
    max_abs = float(t.stack(maxes).max())
    scale = float(t.stack(scales).max())
    if not math.isfinite(scale):
        scale = max(float(t.nan_to_num(pieces(b, e)[1].abs(), nan=0.0, posinf=0.0).max()) for b, e in spans)
    if not max_abs <= atol:
        for begin, end in spans:
            o, r = pieces(begin, end)
            bad = ~t.isclose(o, r, atol=atol, rtol=rtol)
            if bool(bad.any()):
                k = int(bad.nonzero()[0])
                index = list(reversed([int(i) for i in _unravel(begin + k, list(ref.shape))]))
                max_abs = max_abs if math.isfinite(max_abs) else math.inf
                return {"ok": False, "why": "values differ beyond tolerance", "first_bad_index": index, "expected": float(r[k]), "got": float(o[k]), "max_abs_err": max_abs, "scale": scale, "rel_to_scale": max_abs / scale if scale > 0 else None}
        if not math.isfinite(max_abs):
            # All close, with equal infinities: the error is in the rest.
            max_abs = max(float(t.nan_to_num((pieces(b, e)[0] - pieces(b, e)[1]).abs(), nan=0.0, posinf=0.0).max()) for b, e in spans)
    result = {"max_abs_err": max_abs, "scale": scale, "rel_to_scale": max_abs / scale if scale > 0 else None}
    if scale > 0 and max_abs > min_scale_ratio * scale:
        result.update(ok=False, why=f"error is {max_abs / scale:.2%} of the output's scale: within atol only because the outputs are small")
        return result
    result["ok"] = True
    return result


def _unravel(flat, shape):
    for d in reversed(shape):
        yield flat % d
        flat //= d


def snapshot(inputs):
    t = torch()
    return [x.detach().clone() if isinstance(x, t.Tensor) else x for x in inputs]


def mutated(before, after):
    t = torch()
    for i, (b, a) in enumerate(zip(before, after)):
        if isinstance(b, t.Tensor) and not t.equal(b, a):
            return i
    return None


def namespaces():
    """What a candidate could patch to change the reference or the timer."""
    t = torch()
    return {"torch": t, "torch.nn.functional": t.nn.functional, "torch.Tensor": t.Tensor, "torch.cuda": t.cuda, "time": time}


def snapshot_namespaces():
    return {name: dict(vars(ns)) for name, ns in namespaces().items()}


def patched_names(before):
    changed = []
    for name, ns in namespaces().items():
        now = vars(ns)
        old = before[name]
        for key in set(old) | set(now):
            new = now.get(key, _MISSING)
            # A submodule imported since is an addition, not a replacement.
            if key not in old and isinstance(new, types.ModuleType):
                continue
            if old.get(key, _MISSING) is not new:
                changed.append(f"{name}.{key}")
    return sorted(changed)


_MISSING = object()


class SwallowedExceptions:
    """Records exceptions that pass through the candidate's own frames while
    its forward runs. A forward that returns normally after one was raised
    caught it: a try/except that falls back to other code when a kernel
    fails, which must not pass as the kernel's result."""

    def __init__(self, filename):
        self.filename = filename
        self.seen = []

    def _global(self, frame, event, arg):
        if frame.f_code.co_filename == self.filename:
            return self._local
        return None

    def _local(self, frame, event, arg):
        if event == "exception" and len(self.seen) < 5:
            kind, value = arg[0], arg[1]
            self.seen.append(f"{kind.__name__}: {str(value)[:160]} (in {frame.f_code.co_name}, line {frame.f_lineno})")
        return self._local

    def __enter__(self):
        self._previous = sys.gettrace()
        sys.settrace(self._global)
        return self

    def __exit__(self, *exc):
        sys.settrace(self._previous)
        return False


def op_recorder():
    """A dispatch mode that counts the aten ops run under it."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = collections.Counter()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops[str(func.overloadpacket)] += 1
            return func(*args, **(kwargs or {}))

    return Recorder()


def kernel_reports(ns, model):
    """Resources of the kernels a candidate compiled, where its kernel
    objects say: cupy RawKernel attributes, Triton compiled kernels."""
    found, seen = [], set()
    values = list(ns.values()) + list(vars(model).values())
    for obj in values:
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        kind = type(obj).__name__
        module = type(obj).__module__ or ""
        try:
            if module.startswith("cupy") and kind == "RawKernel":
                a = obj.attributes
                found.append({"name": obj.name, "source": "cupy", "registers": a.get("num_regs"), "local_bytes": a.get("local_size_bytes"), "shared_bytes": a.get("shared_size_bytes"), "max_threads_per_block": a.get("max_threads_per_block")})
            elif module.startswith("triton") and hasattr(obj, "device_caches"):
                for caches in obj.device_caches.values():
                    for compiled in caches[0].values():
                        found.append({"name": compiled.name, "source": "triton", "registers": getattr(compiled, "n_regs", None), "spills": getattr(compiled, "n_spills", None), "shared_bytes": getattr(compiled.metadata, "shared", None), "num_warps": getattr(compiled.metadata, "num_warps", None), "block_threads": 32 * getattr(compiled.metadata, "num_warps", 0) or None})
        except Exception:
            # A kernel object that cannot describe itself is left out; the
            # outcome is not at stake.
            continue
    return found


# The reference side of the last problem: the model, its outputs on every
# check's inputs and the baselines, computed before any candidate code ran.
# A candidate that patches torch gets this worker replaced, so what is cached
# here was computed in a clean state.
_REFERENCE = {}


def settings(req):
    return {
        "seed": req.get("seed", 42),
        "correctness_trials": req.get("correctness_trials", 5),
        "warmup": req.get("warmup", 3),
        "trials": req.get("trials", 100),
        "inputs": req.get("inputs", "device"),
        "device": req.get("device", "cuda"),
        "references": req.get("references", "auto"),
        "paired_eager": req.get("paired_eager", True),
    }


def pick_device(req):
    t = torch()
    want = req.get("device", "cuda")
    if want == "cpu":
        return t.device("cpu")
    if not t.cuda.is_available():
        return None
    return t.device("cuda:0")


def reference_side(problem, req, device):
    """The model, the seeds of every check, the reference outputs (kept on
    the GPU when they fit in about half of its memory, else recomputed for
    each check) and the baselines. Cached per problem and settings."""
    s = settings(req)
    key = json.dumps([problem["code"], s])
    if _REFERENCE.get("key") == key:
        ref = _REFERENCE
    else:
        _REFERENCE.clear()
        ref = build_reference(problem, s, device)
        ref["key"] = key
        _REFERENCE.update(ref)
    wanted = req.get("baselines", ["eager"])
    missing = [b for b in wanted if b not in ref["baselines"]]
    if missing:
        ref["baselines"].update(measure_baselines(problem, ref, s, device, missing, req.get("baseline_cache")))
    return ref


def build_reference(problem, s, device):
    t = torch()
    ns = load_module(problem.get("name", "problem"), problem["code"])
    init = ns["get_init_inputs"]()
    with t.no_grad():
        set_seed(s["seed"])
        model = ns["Model"](*init).to(device)
    set_seed(s["seed"])
    trial_seeds = [int(t.randint(0, 2**32 - 1, (1,)).item()) for _ in range(s["correctness_trials"])]
    # The last seed gives the fresh values checked after timing.
    check_seeds = trial_seeds + [s["seed"] + 1]
    ref = {"ns": ns, "init": init, "model": model, "trial_seeds": trial_seeds, "check_seeds": check_seeds, "math": math_flags(), "speed": speed_flags(), "baselines": {}}
    ref["reference_tf32"] = reference_tf32(model, ns, trial_seeds[0], device, s)
    refs, kept = [], "device" if device.type == "cuda" else "host"
    if s["references"] == "recompute":
        kept = "recomputed"
    for trial_seed in check_seeds:
        inputs = make_inputs(ns, trial_seed, device, s["inputs"])
        with t.no_grad():
            outs = forward_outputs(model, inputs)
        if kept == "device" and not refs:
            # Every check compares against outputs kept on the GPU when all
            # of them take at most about half of its memory (blocks the
            # allocator caches count as free). Larger ones are recomputed
            # on the GPU for each check, a forward of milliseconds, where
            # copying them from host memory took about a second per 6 GB.
            # One more set for the check with scaled parameters.
            sets = len(check_seeds) + (1 if float_parameters(model) else 0)
            size = sum(o.numel() * o.element_size() for o in outs) * sets
            free, _total = t.cuda.mem_get_info(device)
            free += t.cuda.memory_reserved(device) - t.cuda.memory_allocated(device)
            if size > 0.55 * (free + size / sets):
                kept = "recomputed"
        refs.append(outs if kept != "recomputed" else None)
        del inputs, outs
    ref.update(refs=refs, refs_kept=kept)
    # The outputs after the parameters change (kept like the others).
    ref["scaled_ref"] = None
    if kept != "recomputed" and float_parameters(model):
        inputs = make_inputs(ns, check_seeds[-1], device, s["inputs"])
        ref["scaled_ref"] = with_scaled_parameters(model, lambda: forward_outputs(model, inputs))
        del inputs
    return ref


# The factor the parameters are scaled by in place for the last check: a
# candidate that keeps weights derived from its parameters must see the
# change (as an optimizer step would make it) and recompute them.
PARAMETER_SCALE = 0.5


def float_parameters(model):
    return [p for p in model.parameters() if p.is_floating_point()]


def with_scaled_parameters(model, run):
    """`run()` with the model's floating-point parameters scaled in place by
    PARAMETER_SCALE (their version counters move), then restored exactly."""
    t = torch()
    params = float_parameters(model)
    with t.no_grad():
        saved = [p.detach().clone() for p in params]
        try:
            for p in params:
                p.mul_(PARAMETER_SCALE)
            return run()
        finally:
            for p, v in zip(params, saved):
                p.copy_(v)


def scaled_reference_outputs(ref, inputs):
    """The reference's outputs on `inputs` (the last check's values) with
    its parameters scaled: kept, or recomputed like the other checks."""
    if ref["scaled_ref"] is not None:
        return ref["scaled_ref"]
    return reference_forward(ref, inputs, scaled=True)


def reference_tf32(model, ns, seed, device, s):
    """Whether the reference's own outputs are TF32-rounded: torch's
    default switches let cuDNN run float32 convolutions on TF32 tensor
    cores, and then the outputs of the first check's inputs differ from
    the same forward with TF32 off by more than KernelBench's 1e-4. An
    exact float32 candidate cannot meet the tolerance against such a
    reference; the search uses this to skip the kernels it cannot pass."""
    t = torch()
    flags = math_flags()
    if device.type != "cuda" or not (flags["matmul_tf32"] or flags["cudnn_tf32"]):
        return False
    inputs = make_inputs(ns, seed, device, s["inputs"])
    try:
        with t.no_grad():
            rounded = forward_outputs(model, inputs)
            set_math_flags({"matmul_tf32": False, "cudnn_tf32": False, "precision": "highest"})
            exact = forward_outputs(model, inputs)
    finally:
        set_math_flags(flags)
    return any(
        a.dtype == t.float32 and a.shape == b.shape and not t.allclose(a, b, atol=1e-4, rtol=1e-4)
        for a, b in zip(rounded, exact)
    )


def math_flags():
    """The precision switches the reference computed under."""
    t = torch()
    return {
        "matmul_tf32": t.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": t.backends.cudnn.allow_tf32,
        "precision": t.get_float32_matmul_precision(),
    }


def speed_flags():
    """The switches that change how fast torch runs the reference."""
    t = torch()
    return {
        "cudnn_benchmark": t.backends.cudnn.benchmark,
        "cudnn_deterministic": t.backends.cudnn.deterministic,
        "deterministic": t.are_deterministic_algorithms_enabled(),
    }


def set_speed_flags(flags):
    t = torch()
    t.backends.cudnn.benchmark = flags["cudnn_benchmark"]
    t.backends.cudnn.deterministic = flags["cudnn_deterministic"]
    t.use_deterministic_algorithms(flags["deterministic"])


class ReferenceSwitches:
    """Within it, torch's math and speed switches are those the reference
    was first run under (a candidate may have changed them); the
    candidate's come back on leaving."""

    def __init__(self, ref):
        self.ref = ref

    def __enter__(self):
        self.math, self.speed = math_flags(), speed_flags()
        set_math_flags(self.ref["math"])
        set_speed_flags(self.ref["speed"])

    def __exit__(self, *exc):
        set_math_flags(self.math)
        set_speed_flags(self.speed)


# Eager timed beside the candidate runs after the candidate's code did: a
# candidate that slowed the reference down (work left on the GPU, a patched
# module object) would gain by it. Beside the candidate eager may take at
# most this much longer than alone, or its time alone is the baseline.
PAIRED_SLOWER_AT_MOST = 1.05


def paired_baseline(paired, alone):
    """The eager baseline of an evaluation: `paired` (timed beside the
    candidate) unless it is more than PAIRED_SLOWER_AT_MOST times `alone`
    (timed before any candidate code ran)."""
    ratio = paired["mean_ms"] / alone["mean_ms"] if alone["mean_ms"] > 0 else float("inf")
    if ratio <= PAIRED_SLOWER_AT_MOST:
        return dict(paired, paired=True, alone_mean_ms=alone["mean_ms"], measured_at=_utc_now())
    why = (
        f"eager took {paired['mean_ms']:.4g} ms a call beside the candidate, {ratio:.2f}x its "
        f"{alone['mean_ms']:.4g} ms alone (at most {PAIRED_SLOWER_AT_MOST}x is allowed): its time alone is the baseline"
    )
    return dict(alone, paired=False, why=why)


def reference_outputs(ref, n, inputs):
    """The reference's outputs for check `n` (computed from `inputs`, which
    must hold that check's values): the kept ones, or a forward of the
    reference model under the math switches it was first computed with, so
    that a candidate that turned on TF32 does not change the reference too."""
    kept = ref["refs"][n]
    if kept is not None:
        return kept
    return reference_forward(ref, inputs)


def forward_outputs(model, inputs):
    """The model's outputs on `inputs`, detached."""
    return [o.detach() for o in outputs_of(model(*inputs))]


def reference_forward(ref, inputs, scaled=False):
    """A forward of the reference model (with its parameters scaled when
    `scaled`) under the math switches it was first computed with."""
    t = torch()
    model = ref["model"]
    now = math_flags()
    try:
        set_math_flags(ref["math"])
        with t.no_grad():
            if scaled:
                return with_scaled_parameters(model, lambda: forward_outputs(model, inputs))
            return forward_outputs(model, inputs)
    finally:
        set_math_flags(now)


def set_math_flags(flags):
    t = torch()
    t.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    t.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    t.set_float32_matmul_precision(flags["precision"])


def baseline_cache_file(problem, s, device, directory):
    t = torch()
    gpu = t.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    digest = hashlib.sha256(problem["code"].encode()).hexdigest()[:16]
    # Pairing changes what an evaluation reports, not a timing alone.
    keyed = {k: v for k, v in s.items() if k != "paired_eager"}
    params = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")
    return os.path.join(directory, f"{digest}-{slug}-torch{t.__version__}-{params}.json")


def measure_baselines(problem, ref, s, device, names, cache_dir):
    """Eager and torch.compile timings of the problem's own model, from the
    cache of this (problem, GPU, torch version, settings) when there is one."""
    t = torch()
    path = baseline_cache_file(problem, s, device, cache_dir) if cache_dir else None
    cached = {}
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                cached = json.load(f)
        except (OSError, ValueError):
            cached = {}
    out = {}
    for name in names:
        if name in cached:
            out[name] = dict(cached[name], cached=True)
            continue
        inputs = make_inputs(ref["ns"], ref["trial_seeds"][0], device, s["inputs"])
        began = _clock()
        try:
            fn = ref["model"] if name == "eager" else t.compile(ref["model"])
            timing = time_calls(fn, inputs, s["warmup"], s["trials"], device)
            timing["seconds"] = _clock() - began
            out[name] = timing
        except Exception as e:
            out[name] = {"error": error_text(e)}
        del inputs
        out[name]["measured_at"] = _utc_now()
    if path:
        fresh = {k: v for k, v in out.items() if not v.get("cached") and "error" not in v}
        if fresh:
            os.makedirs(cache_dir, exist_ok=True)
            merged = dict(cached, **fresh)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, path)
    return out


def prepare(req):
    device = pick_device(req)
    if device is None:
        return {"status": "not_run", "why": "torch sees no GPU on this machine"}
    began = _clock()
    ref = reference_side(req["problem"], req, device)
    return {"seconds": _clock() - began, "baselines": ref["baselines"], "refs_kept": ref["refs_kept"]}


def runtime_error(outcome, e):
    text = error_text(e)
    outcome.pop("runtime", None)
    outcome.update(status="runtime_error", error=text)
    # After a fault such as an illegal address the CUDA context is unusable:
    # the caller must replace this worker.
    outcome["replace_worker"] = any(m in text for m in CUDA_FATAL)
    return outcome


def evaluate(req):
    """The KernelBench protocol, with the reference outputs and the
    baselines computed before any candidate code runs; eager is timed once
    more beside the candidate (`paired_baseline`)."""
    problem, candidate = req["problem"], req["candidate"]
    atol, rtol = req.get("atol", 1e-4), req.get("rtol", 1e-4)
    min_scale_ratio = req.get("max_error_to_scale", 1e-2)
    s = settings(req)
    try:
        t = torch()
    except ImportError:
        t = None
    device = pick_device(req) if t is not None else None
    began = _clock()
    if device is not None:
        ref = reference_side(problem, req, device)
        before = snapshot_namespaces()
    reference_seconds = _clock() - began

    gpu = (t.cuda.get_device_name(device) if device.type == "cuda" else "cpu") if device is not None else None
    outcome = {"status": "compile_error", "device": gpu, "reference_seconds": reference_seconds}
    if device is not None:
        outcome["reference_tf32"] = ref["reference_tf32"]
    filename = f"<mtmc candidate {candidate.get('name', 'candidate')}>"
    start = _clock()
    try:
        cand_ns = load_module(candidate.get("name", "candidate"), candidate["code"], filename)
        if "ModelNew" not in cand_ns:
            raise NameError("the candidate defines no ModelNew class")
    except Exception as e:
        outcome["error"] = error_text(e)
        outcome["load_seconds"] = _clock() - start
        return outcome
    if t is None:
        raise ImportError("No module named 'torch'")
    if device is None:
        return {"status": "not_run", "why": "torch sees no GPU on this machine"}
    ns, init = ref["ns"], ref["init"]
    try:
        with t.no_grad():
            set_seed(s["seed"])
            model_new = cand_ns["ModelNew"](*init).to(device)
        if device.type == "cuda":
            t.cuda.synchronize(device)
    except Exception as e:
        outcome["error"] = error_text(e)
        outcome["load_seconds"] = _clock() - start
        return runtime_error(outcome, e) if device.type == "cuda" and any(m in outcome["error"] for m in CUDA_FATAL) else outcome
    outcome["load_seconds"] = _clock() - start

    def cheated():
        patched = patched_names(before)
        if patched:
            # The process state is no longer clean: replace the worker.
            outcome.update(status="incorrect", why=f"the candidate replaced {', '.join(patched[:5])}", replace_worker=True)
            outcome.pop("runtime", None)
            return True
        return False

    def sync():
        if device.type == "cuda":
            t.cuda.synchronize(device)

    if cheated():
        return outcome
    checks = []
    check_began = _clock()
    for n, trial_seed in enumerate(ref["trial_seeds"]):
        inputs = make_inputs(ns, trial_seed, device, s["inputs"])
        # Before the candidate runs: it could write into its inputs.
        refs = reference_outputs(ref, n, inputs)
        with t.no_grad():
            kept = snapshot(inputs)
            try:
                if n == 0:
                    # The first trial runs watched: exceptions the forward
                    # swallows, and the torch ops it calls.
                    recorder = op_recorder()
                    with SwallowedExceptions(filename) as swallowed, recorder:
                        out = model_new(*inputs)
                    sync()
                    torch_ops = {k: v for k, v in recorder.ops.items() if k not in MEMORY_OPS}
                    outcome["torch_ops"] = dict(sorted(torch_ops.items()))
                else:
                    out = model_new(*inputs)
                    sync()
            except Exception as e:
                outcome["trials_run"] = len(checks)
                return runtime_error(outcome, e)
            if n == 0 and swallowed.seen:
                outcome.update(status="incorrect", trials_run=1, why=f"the forward caught an exception and went on ({swallowed.seen[0]}): a fallback hides what failed")
                return outcome
            if n == 0 and req.get("strict") and outcome["torch_ops"]:
                outcome.update(status="incorrect", trials_run=1, why=f"strict mode: the forward computes with torch ({', '.join(outcome['torch_ops'])})")
                return outcome
            changed = mutated(kept, inputs)
            if changed is not None:
                outcome.update(status="incorrect", why=f"the candidate modified input {changed}", trials_run=len(checks) + 1)
                return outcome
            del kept
            check = compare(refs, outputs_of(out), atol, rtol, min_scale_ratio)
        del inputs, out, refs
        checks.append(check)
        if not check["ok"]:
            outcome.update(status="incorrect", trials_run=len(checks), **{k: v for k, v in check.items() if k not in ("ok", "scale")})
            return outcome
    outcome.update(
        status="correct",
        trials_run=len(checks),
        max_abs_err=max(c["max_abs_err"] for c in checks),
        rel_to_scale=max((c["rel_to_scale"] or 0.0) for c in checks),
        check_seconds=_clock() - check_began,
    )

    # Timing on the first trial's inputs.
    try:
        timing_began = _clock()
        inputs = make_inputs(ns, ref["trial_seeds"][0], device, s["inputs"])
        alone = ref["baselines"].get("eager")
        if s["paired_eager"] and "eager" in req.get("baselines", ["eager"]) and alone and "error" not in alone:
            # Eager timed trial by trial beside the candidate: both meet the
            # same state of the machine, and their ratio is steadier than
            # against a timing taken earlier (or by another process).
            outcome["runtime"], paired = time_paired(
                model_new, ref["model"], inputs, s["warmup"], s["trials"], device, lambda: ReferenceSwitches(ref)
            )
            eager = paired_baseline(paired, alone)
        else:
            outcome["runtime"] = time_calls(model_new, inputs, s["warmup"], s["trials"], device)
            eager = None
        outcome["timing_seconds"] = _clock() - timing_began
        if cheated():
            return outcome
    except Exception as e:
        return runtime_error(outcome, e)
    tolerance = (atol, rtol, min_scale_ratio)

    # New values in the same buffers: a candidate that returns a result
    # cached during timing (keyed on the buffers) fails here.
    def new_values():
        fresh = make_inputs(ns, ref["check_seeds"][-1], device, s["inputs"])
        refs = reference_outputs(ref, len(ref["check_seeds"]) - 1, fresh)
        for buf, new in zip(inputs, fresh):
            if isinstance(buf, t.Tensor):
                buf.copy_(new)
        return inputs, refs

    failed = check_after_timing(outcome, model_new, sync, new_values, tolerance, "after timing, on new values in the same input buffers")
    del inputs
    if failed:
        return failed

    # The parameters change in place (the candidate's and the reference's
    # alike): weights derived from them and kept must be recomputed.
    def scaled_parameters():
        inputs = make_inputs(ns, ref["check_seeds"][-1], device, s["inputs"])
        refs = scaled_reference_outputs(ref, inputs)
        for p in float_parameters(model_new):
            p.mul_(PARAMETER_SCALE)
        return inputs, refs

    if float_parameters(ref["model"]):
        failed = check_after_timing(outcome, model_new, sync, scaled_parameters, tolerance, f"after its parameters were scaled in place by {PARAMETER_SCALE} (as a training step changes them)")
        if failed:
            return failed
    outcome["kernels"] = kernel_reports(cand_ns, model_new)
    outcome["baselines"] = {k: v for k, v in ref["baselines"].items() if k in req.get("baselines", ["eager"])}
    if eager is not None:
        outcome["baselines"]["eager"] = eager
    return outcome


def check_after_timing(outcome, model_new, sync, prepare, tolerance, when):
    """Runs the candidate once more (then `sync()`) on the inputs `prepare`
    returns with their reference outputs, after timing; the outcome,
    incorrect with no timing (or a runtime error), where it differs; else
    None."""
    t = torch()
    try:
        with t.no_grad():
            inputs, refs = prepare()
            out = model_new(*inputs)
            sync()
            check = compare(refs, outputs_of(out), *tolerance)
        del inputs, out, refs
    except Exception as e:
        return runtime_error(outcome, e)
    if not check["ok"]:
        return failed_after_timing(outcome, check, when)
    return None


def failed_after_timing(outcome, check, when):
    """A check after timing failed: incorrect, with no timing reported."""
    outcome.update(status="incorrect", why=f"{when}: {check['why']}", **{k: v for k, v in check.items() if k not in ("ok", "why", "scale")})
    outcome.pop("runtime")
    return outcome


HANDLERS = {"hello": hello, "prepare": prepare, "eval": evaluate}


def main():
    # Candidate code may print; keep stdout for the protocol.
    sys.stdout = sys.stderr
    for line in sys.__stdin__:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            reply({"id": None, "ok": False, "error": f"request is not JSON: {e}"})
            continue
        handler = HANDLERS.get(req.get("op"))
        if handler is None:
            reply({"id": req.get("id"), "ok": False, "error": f"unknown op {req.get('op')!r}"})
            continue
        try:
            reply({"id": req.get("id"), "ok": True, "result": handler(req)})
        except Exception as e:
            reply({"id": req.get("id"), "ok": False, "error": error_text(e)})


if __name__ == "__main__":
    main()

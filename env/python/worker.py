#!/usr/bin/env python3
"""mtmc's evaluation worker: one persistent process per GPU.

Reads requests as JSON lines on stdin and answers each with one JSON line on
stdout (stdout carries nothing else: candidate prints go to stderr). torch is
imported once, on the first request that needs it, and stays loaded.

Requests:
  {"id": N, "op": "hello"}
      -> python and torch versions, the device.
  {"id": N, "op": "eval", "problem": {"name", "code"}, "candidate": {"name", "code"},
   "seed": 42, "correctness_trials": 5, "warmup": 3, "trials": 100,
   "atol": 1e-4, "rtol": 1e-4, "baseline": true}
      -> the KernelBench protocol on the candidate's ModelNew against the
         problem's Model: correctness over fresh random inputs per trial, then
         CUDA-event timing with the L2 cache flushed before every trial, and the
         eager baseline timed the same way in the same process.

Faults that kill the process (a hanging kernel, an illegal address, a
segfault) are the caller's to handle: it restarts the worker.
"""

import json
import math
import os
import sys
import time
import traceback

_torch = None
_l2_flush = None

# Error texts after which the process's CUDA context cannot be used again.
CUDA_FATAL = ("illegal memory access", "illegal address", "unspecified launch failure", "CUDA_ERROR_", "cudaErrorIllegal", "misaligned address")


def torch():
    global _torch
    if _torch is None:
        import torch as t

        _torch = t
        # Before any candidate code can touch them.
        _TIMERS.update(Event=t.cuda.Event, synchronize=t.cuda.synchronize)
    return _torch


def reply(obj):
    sys.__stdout__.write(json.dumps(obj) + "\n")
    sys.__stdout__.flush()


def error_text(e):
    return "".join(traceback.format_exception_only(type(e), e)).strip()[-2000:]


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
    return out


def load_module(name, code):
    """Executes a source as a fresh module; returns its namespace."""
    ns = {"__name__": f"mtmc_{name}"}
    exec(compile(code, name, "exec"), ns)
    return ns


def set_seed(seed):
    t = torch()
    t.manual_seed(seed)
    if t.cuda.is_available():
        t.cuda.manual_seed(seed)


def to_device(x, device):
    t = torch()
    if isinstance(x, t.Tensor):
        return x.to(device)
    return x


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


def time_cuda(fn, inputs, warmup, trials, device):
    """Milliseconds per call, one CUDA-event pair per trial, L2 flushed first.

    The end event is recorded only after the whole device is synchronized, so
    work that a candidate puts on other streams is inside the measured span."""
    tm = timers()
    sync, event = tm["synchronize"], tm["Event"]
    t = torch()
    with t.no_grad():
        for _ in range(warmup):
            fn(*inputs)
        sync(device)
        times = []
        for _ in range(trials):
            flush_l2(device)
            start = event(enable_timing=True)
            end = event(enable_timing=True)
            start.record()
            fn(*inputs)
            sync(device)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
    return stats(times)


def stats(times):
    n = len(times)
    mean = sum(times) / n
    ordered = sorted(times)
    median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    std = math.sqrt(sum((x - mean) ** 2 for x in times) / max(n - 1, 1))
    return {"mean_ms": mean, "median_ms": median, "std_ms": std, "min_ms": ordered[0], "max_ms": ordered[-1], "trials": n}


def compare(ref, out, atol, rtol, min_scale_ratio):
    """KernelBench's allclose plus a check against the output's scale, so that
    outputs small enough to fit inside atol (zeros) do not pass."""
    t = torch()
    # Exactly a tensor: a subclass could compute lazily, when read, outside
    # the timed span.
    if type(out) is not t.Tensor:
        return {"ok": False, "why": f"the candidate returned {type(out).__name__}, not a plain torch.Tensor"}
    if tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "why": f"shape {list(out.shape)} differs from the reference's {list(ref.shape)}"}
    if out.dtype != ref.dtype:
        return {"ok": False, "why": f"dtype {out.dtype} differs from the reference's {ref.dtype}"}
    # In chunks of 16M elements, so comparing multi-GB outputs in f64 needs
    # little extra memory.
    r_flat, o_flat = ref.detach().reshape(-1), out.detach().reshape(-1)
    chunk = 1 << 24
    max_abs, scale, first_bad = 0.0, 0.0, None
    for begin in range(0, r_flat.numel(), chunk):
        o = o_flat[begin : begin + chunk].double()
        r = r_flat[begin : begin + chunk].to(o.device).double()
        diff = t.nan_to_num((o - r).abs(), nan=math.inf)
        max_abs = max(max_abs, float(diff.max()))
        scale = max(scale, float(t.nan_to_num(r.abs(), nan=0.0).max()))
        bad = ~t.isclose(o, r, atol=atol, rtol=rtol)
        if first_bad is None and bool(bad.any()):
            k = int(bad.nonzero()[0])
            first_bad = (begin + k, float(r[k]), float(o[k]))
    result = {"max_abs_err": max_abs, "scale": scale, "rel_to_scale": (max_abs / scale) if scale > 0 else None}
    if first_bad is not None:
        flat, expected, got = first_bad
        index = list(reversed([int(i) for i in _unravel(flat, list(ref.shape))]))
        result.update(ok=False, why="values differ beyond tolerance", first_bad_index=index, expected=expected, got=got)
        return result
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
    return {"torch": t, "torch.nn.functional": t.nn.functional, "torch.Tensor": t.Tensor, "torch.cuda": t.cuda}


def snapshot_namespaces():
    return {name: dict(vars(ns)) for name, ns in namespaces().items()}


def patched_names(before):
    changed = []
    for name, ns in namespaces().items():
        now = vars(ns)
        old = before[name]
        for key in set(old) | set(now):
            if old.get(key, _MISSING) is not now.get(key, _MISSING):
                changed.append(f"{name}.{key}")
    return sorted(changed)


_MISSING = object()


# The reference side of the last problem evaluated: its outputs on every
# check's inputs and its eager timing, computed before any candidate code ran.
# A candidate that patches torch gets this worker replaced, so what is cached
# here was computed in a clean state.
_REFERENCE = {}


def reference_side(ref_ns, req, seed, warmup, trials, device):
    t = torch()
    init = ref_ns["get_init_inputs"]()
    with t.no_grad():
        set_seed(seed)
        model = ref_ns["Model"](*init).to(device)
    set_seed(seed)
    trial_seeds = [int(t.randint(0, 2**32 - 1, (1,)).item()) for _ in range(req.get("correctness_trials", 5))]
    # The last seed gives the fresh values checked after timing.
    check_seeds = trial_seeds + [seed + 1]
    refs = []
    for trial_seed in check_seeds:
        set_seed(trial_seed)
        inputs = [to_device(x, device) for x in ref_ns["get_inputs"]()]
        with t.no_grad():
            refs.append(model(*inputs).detach().to("cpu"))
        del inputs
    baseline = None
    if req.get("baseline", True):
        set_seed(trial_seeds[0])
        inputs = [to_device(x, device) for x in ref_ns["get_inputs"]()]
        baseline = time_cuda(model, inputs, warmup, trials, device)
        del inputs
    return {"ns": ref_ns, "init": init, "model": model, "trial_seeds": trial_seeds, "check_seeds": check_seeds, "refs": refs, "baseline": baseline}


def runtime_error(outcome, e):
    text = error_text(e)
    outcome.pop("runtime", None)
    outcome.update(status="runtime_error", error=text)
    # After a fault such as an illegal address the CUDA context is unusable:
    # the caller must replace this worker.
    outcome["replace_worker"] = any(m in text for m in CUDA_FATAL)
    return outcome


def evaluate(req):
    """The KernelBench protocol, with the reference outputs and the eager
    baseline computed before any candidate code runs."""
    problem, candidate = req["problem"], req["candidate"]
    seed = req.get("seed", 42)
    atol, rtol = req.get("atol", 1e-4), req.get("rtol", 1e-4)
    min_scale_ratio = req.get("max_error_to_scale", 1e-2)
    warmup, trials = req.get("warmup", 3), req.get("trials", 100)
    key = json.dumps([problem["code"], seed, req.get("correctness_trials", 5), warmup, trials, req.get("baseline", True)])
    cached = _REFERENCE.get("key") == key
    # The problem's code runs once per cached reference side, not per request.
    ref_ns = _REFERENCE["ns"] if cached else load_module(problem.get("name", "problem"), problem["code"])
    try:
        t = torch()
    except ImportError:
        t = None
    if t is not None and t.cuda.is_available():
        device = t.device("cuda:0")
        if not cached:
            _REFERENCE.clear()
            _REFERENCE.update(reference_side(ref_ns, req, seed, warmup, trials, device), key=key)
        ref_ns = _REFERENCE["ns"]
        init, model = _REFERENCE["init"], _REFERENCE["model"]
        trial_seeds, check_seeds = _REFERENCE["trial_seeds"], _REFERENCE["check_seeds"]
        refs, baseline = _REFERENCE["refs"], _REFERENCE["baseline"]
        before = snapshot_namespaces()

    outcome = {"status": "compile_error"}
    start = time.perf_counter()
    try:
        cand_ns = load_module(candidate.get("name", "candidate"), candidate["code"])
        if "ModelNew" not in cand_ns:
            raise NameError("the candidate defines no ModelNew class")
    except Exception as e:
        outcome["error"] = error_text(e)
        outcome["load_seconds"] = time.perf_counter() - start
        return outcome
    if t is None:
        raise ImportError("No module named 'torch'")
    if not t.cuda.is_available():
        return {"status": "not_run", "why": "torch sees no GPU on this machine"}
    try:
        with t.no_grad():
            set_seed(seed)
            model_new = cand_ns["ModelNew"](*init).to(device)
        t.cuda.synchronize(device)
    except Exception as e:
        outcome["error"] = error_text(e)
        outcome["load_seconds"] = time.perf_counter() - start
        return outcome
    outcome["load_seconds"] = time.perf_counter() - start

    def cheated():
        patched = patched_names(before)
        if patched:
            # The process state is no longer clean: replace the worker.
            outcome.update(status="incorrect", why=f"the candidate replaced {', '.join(patched[:5])}", replace_worker=True)
            outcome.pop("runtime", None)
            return True
        return False

    if cheated():
        return outcome
    checks = []
    for trial_seed, ref in zip(trial_seeds, refs):
        set_seed(trial_seed)
        inputs = [to_device(x, device) for x in ref_ns["get_inputs"]()]
        with t.no_grad():
            kept = snapshot(inputs)
            try:
                out = model_new(*inputs)
                t.cuda.synchronize(device)
            except Exception as e:
                outcome["trials_run"] = len(checks)
                return runtime_error(outcome, e)
            changed = mutated(kept, inputs)
            if changed is not None:
                outcome.update(status="incorrect", why=f"the candidate modified input {changed}", trials_run=len(checks) + 1)
                return outcome
            check = compare(ref, out, atol, rtol, min_scale_ratio)
        checks.append(check)
        if not check["ok"]:
            outcome.update(status="incorrect", trials_run=len(checks), **{k: v for k, v in check.items() if k != "ok"})
            return outcome
    outcome.update(
        status="correct",
        trials_run=len(checks),
        max_abs_err=max(c["max_abs_err"] for c in checks),
        rel_to_scale=max((c["rel_to_scale"] or 0.0) for c in checks),
    )

    # Timing on the first trial's inputs.
    try:
        set_seed(trial_seeds[0])
        inputs = [to_device(x, device) for x in ref_ns["get_inputs"]()]
        outcome["runtime"] = time_cuda(model_new, inputs, warmup, trials, device)
        if cheated():
            return outcome
        # New values in the same buffers: a candidate that returns a result
        # cached during timing (keyed on the buffers) fails here.
        with t.no_grad():
            set_seed(check_seeds[-1])
            fresh = [to_device(x, device) for x in ref_ns["get_inputs"]()]
            for buf, new in zip(inputs, fresh):
                if isinstance(buf, t.Tensor):
                    buf.copy_(new)
            del fresh
            out = model_new(*inputs)
            t.cuda.synchronize(device)
            check = compare(refs[-1], out, atol, rtol, min_scale_ratio)
    except Exception as e:
        return runtime_error(outcome, e)
    if not check["ok"]:
        outcome.update(
            status="incorrect",
            why=f"after timing, on new values in the same input buffers: {check['why']}",
            **{k: v for k, v in check.items() if k not in ("ok", "why")},
        )
        outcome.pop("runtime")
        return outcome
    if baseline is not None:
        outcome["baseline_eager"] = baseline
    return outcome


HANDLERS = {"hello": hello, "eval": evaluate}


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

#!/usr/bin/env python3
"""mtmc's judge: one persistent process per GPU, which runs no candidate code.

Reads requests as JSON lines on stdin and answers each with one JSON line on
stdout, which carries the request's id and token (stdout carries nothing
else). A candidate's code runs in a runner process of its own (runner.py,
forked from a zygote that this process starts), reached through a socket
and a shared memory cell; its inputs live in memory the judge shares with
it (CUDA IPC on a GPU, a memory file on the CPU) and its outputs are read
from its own memory by the judge. The reference outputs, the comparison, the
timing and its statistics, the baselines and their cache live here, out of
the candidate's reach.

Requests:
  {"id": N, "token": T, "op": "hello"}
      -> python and torch versions, the device.
  {"id": N, "token": T, "op": "prepare", "problem": {...}, ...}
      -> the reference side of a problem (see `eval`), computed now so that
         the caller can give it a longer limit than a candidate gets.
  {"id": N, "token": T, "op": "eval", "problem": {"name", "code"},
   "candidate": {"name", "code"}, "seed": 42, "correctness_trials": 5,
   "warmup": 3, "trials": 100, "atol": 1e-4, "rtol": 1e-4,
   "max_error_to_scale": 1e-2, "baselines": ["eager", "compile"],
   "baseline_cache": DIR or null, "inputs": "device" | "host",
   "device": "cuda" | "cpu", "strict": false, "limit_seconds": 120}
      -> the KernelBench protocol on the candidate's ModelNew against the
         problem's Model (judge_candidate says what is checked and how calls
         are timed).

Faults of a candidate (a hanging kernel, an illegal address, a segfault)
cost its runner only: the judge kills it and reports the fault. A fault of
the judge itself is the caller's to handle: it restarts the judge.
"""

import contextlib
import ctypes
import hashlib
import json
import math
import mmap
import os
import random
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import time

_torch = None
_clock = time.perf_counter
_strftime, _gmtime = time.strftime, time.gmtime

# The runner's source, given by the caller as the first argument.
RUNNER_SOURCE = sys.argv[1] if len(sys.argv) > 1 else None

# The runner's definitions (`from_runner`).
_RUNNER = {}

# Error texts after which a CUDA context cannot be used again.
CUDA_FATAL = (
    "illegal memory access",
    "illegal address",
    "unspecified launch failure",
    "CUDA_ERROR_",
    "cudaErrorIllegal",
    "misaligned address",
    "out of memory",
)

# The version of how calls are timed: part of the baseline cache's key, so
# that timings taken otherwise are never mixed with these.
TIMING_METHOD = "judge-3"

# Share of the timed calls whose outputs are compared (at least MIN_CHECKED),
# and how many calls run with the watchers on.
CHECKED_SHARE, MIN_CHECKED, WATCHED = 0.08, 6, 3
# A screen's compared calls (at least) and its steps beside the null call.
SCREEN_CHECKED, SCREEN_BESIDE = 2, 4
# A checked timed call's output with more elements than SAMPLE_ABOVE is
# compared at SAMPLED positions drawn after it returned (read from the
# candidate's memory at once, as a full copy would be), and its inputs at
# SAMPLED positions drawn when they were: the correctness trials compare
# every element.
SAMPLE_ABOVE, SAMPLED = 1 << 22, 1 << 20
# Elements compared per pass of `compare_one` (its extra memory).
COMPARE_CHUNK = 1 << 26
# Share of a candidate's steps (at least MIN_BESIDE) on which eager runs
# beside it, with a call that does nothing for the calibration.
BESIDE_SHARE, MIN_BESIDE = 0.2, 20

# A candidate's calls are timed from the moment the judge releases them to
# the moment its runner says it is done, less the same span of a call that
# does nothing (measured in the same run); work still running on the GPU
# then shows in the judge's own next step, and what it adds beyond the
# reference's is counted.
#
# Beside the candidate eager may take at most this much longer than alone,
# or its time alone is the baseline.
PAIRED_SLOWER_AT_MOST = 1.05
# The judge's L2 flushes right after a candidate's calls (their lower
# quartile) may take at most this much longer than those right after a
# call that does nothing (their median), in the same steps (and at least
# BUSY_MARGIN_MS more): flushes that take longer share the GPU with work
# the candidate left running. Where fewer than MIN_AFTER
# of either were timed (eager not beside), every flush while the
# candidate's process lived is compared with one with none.
BUSY_RATIO, BUSY_MARGIN_MS, MIN_AFTER = 1.5, 0.05, 8
# What a flush timed on the host may take beyond its median with no
# candidate before the rest is charged to the step's candidate (host noise).
FLUSH_SLACK_MS = 0.02

# The factor the parameters are scaled by in place for the last check.
PARAMETER_SCALE = 0.5


_DEBUG = os.environ.get("MTMC_JUDGE_DEBUG") == "1"
# Where every call's record is written (`dump_records`), or None.
_RECORDS = os.environ.get("MTMC_JUDGE_RECORDS") or None


def debug(*parts):
    """A line on stderr when MTMC_JUDGE_DEBUG=1: what the judge is doing."""
    if _DEBUG:
        print(f"mtmc judge {_clock():.3f}:", *parts, file=sys.stderr, flush=True)


def _utc_now():
    return _strftime("%Y-%m-%dT%H:%M:%SZ", _gmtime())


def torch():
    global _torch
    if _torch is None:
        import torch as t

        import torch._dynamo  # noqa: F401
        import torch.utils._python_dispatch  # noqa: F401

        _torch = t
    return _torch


_libc = ctypes.CDLL(None, use_errno=True)


def finite(value):
    """JSON has no infinities or NaN: those floats are sent as strings."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite(v) for v in value]
    return value


_OUT = None


def reply(obj):
    _OUT.write(json.dumps(finite(obj), allow_nan=False) + "\n")
    _OUT.flush()


ERROR_CHARS = 2000
ERROR_LINE = re.compile(r"\berror\b", re.IGNORECASE)


def error_text(e):
    """An exception's message, cut as `cut_error` cuts."""
    return cut_error(from_runner("error_text")(e))


def cut_error(text):
    """At most ERROR_CHARS of an error. A long one (a compiler's log, where
    warnings can fill it) keeps its first line and its error lines with the
    two after each (the source line and the caret) first, then as much of
    its end as fits, so that the line and kind of a compile error survive."""
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
        names = [name for _, name in socket.if_nameindex() if name != "lo"]
    except OSError:
        return "unknown"
    return "none" if not names else "present"


def set_seed(seed):
    t = torch()
    t.manual_seed(seed)
    if t.cuda.is_available():
        t.cuda.manual_seed(seed)


def make_inputs(ns, seed, device, mode, recipes=None):
    """The problem's `get_inputs()` under `seed`, on `device`. Where
    `recipes` (a list) is given, it gets one entry per input: how to draw
    that input again in place (`redraw`), or None where the input is not
    the untouched result of one of torch's random factories."""
    t = torch()
    set_seed(seed)
    recorder = FactoryRecorder() if recipes is not None else None
    with recorder if recorder is not None else contextlib.nullcontext():
        if mode == "device" and device.type == "cuda":
            with t.device(device):
                xs = ns["get_inputs"]()
        else:
            xs = ns["get_inputs"]()
    if recorder is not None:
        recipes.extend(recorder.recipe(x) for x in xs)
    return [x.to(device) if isinstance(x, t.Tensor) else x for x in xs]


# torch's random factories, and the in-place draw of the same distribution.
RANDOM_FACTORIES = {
    "rand": "uniform", "rand_like": "uniform",
    "randn": "normal", "randn_like": "normal",
    "randint": "integers", "randint_like": "integers",
}


def FactoryRecorder():
    """A torch function mode that notes what each of torch's random
    factories returned during `get_inputs()` (weakly: intermediates still
    die when the problem drops them)."""
    import weakref

    from torch.overrides import TorchFunctionMode

    class Recorder(TorchFunctionMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            kind = RANDOM_FACTORIES.get(getattr(func, "__name__", ""))
            if kind is not None and isinstance(out, torch().Tensor) and kwargs.get("out") is None:
                bounds = integer_bounds(func.__name__, args, kwargs) if kind == "integers" else None
                if kind != "integers" or bounds is not None:
                    self.made.append((weakref.ref(out), out._version, kind, bounds))
            return out

        def recipe(self, x):
            for ref, version, kind, bounds in self.made:
                if ref() is x and x._version == version:
                    return (kind, bounds)
            return None

    return Recorder()


def integer_bounds(name, args, kwargs):
    """`(low, high)` of a `randint` or `randint_like` call, or None where
    they cannot be read."""
    rest = list(args[1:] if name == "randint_like" else args)
    nums = [a for a in rest if isinstance(a, int) and not isinstance(a, bool)]
    low, high = 0, None
    if len(nums) == 1:
        high = nums[0]
    elif len(nums) >= 2:
        low, high = nums[0], nums[1]
    low, high = kwargs.get("low", low), kwargs.get("high", high)
    if not isinstance(low, int) or not isinstance(high, int) or high <= low:
        return None
    return (low, high)


def redraw(x, recipe):
    """Draws `x` again in place, by torch under the seed set, from the
    distribution its factory drew it from."""
    kind, bounds = recipe
    if kind == "uniform":
        x.uniform_(0.0, 1.0)
    elif kind == "normal":
        x.normal_(0.0, 1.0)
    else:
        x.random_(*bounds)


# The judge's own kernels on a GPU (Triton compiles them where Triton is
# installed; torch does the same work otherwise).
#
# `draw`, a timed call's floating-point inputs: a counter-based hash of each
# element's index under three 31-bit keys, one write of the memory (torch's
# Philox draws take about twice as long as a fill on inputs of gigabytes,
# and every timed call draws its inputs again). Uniform values carry as many
# random bits as the dtype's significand holds (so that none rounds up to
# 1); normal values by Box-Muller. A draw that fails, or whose first result
# per dtype and distribution is not what it should be, leaves torch drawing
# from then on.
#
# `gap`, the first pass of a comparison: the largest |out - ref| (the
# difference in the outputs' dtype, as torch computes it) and the largest
# |ref| of each block, NaN counted as infinite, in one read of both (torch
# takes a subtraction, its write and two more reads). Its first result per
# dtype is checked against torch's; one that differs leaves torch comparing.
KERNELS_SOURCE = r'''
import triton
import triton.language as tl


@triton.jit
def _mix(h):
    h ^= h >> 16
    h *= 0x85EBCA6B
    h ^= h >> 13
    h *= 0xC2B2AE35
    h ^= h >> 16
    return h


@triton.jit(do_not_specialize=["k0", "k1", "k2"])
def draw(ptr, n, k0, k1, k2, NORMAL: tl.constexpr, DIGITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    lo = offs.to(tl.uint32)
    hi = (offs >> 32).to(tl.uint32)
    h = _mix(_mix(lo ^ k0.to(tl.uint32)) + hi * 0x9E3779B9 + k1.to(tl.uint32))
    if NORMAL:
        u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
        v = (_mix(h ^ k2.to(tl.uint32)) >> 8).to(tl.float32) * (1.0 / 16777216.0)
        # The GPU's approximate log2 and cosine: accurate libm calls would
        # make the draw slower than torch's.
        lg = tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=r,r", [u], dtype=tl.float32, is_pure=True, pack=1)
        cs = tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=r,r", [6.283185307179586 * v], dtype=tl.float32, is_pure=True, pack=1)
        out = tl.sqrt(-1.3862943611198906 * lg) * cs
    else:
        out = (h >> (32 - DIGITS)).to(tl.float32) * (1.0 / (1 << DIGITS))
    tl.store(ptr + offs, out.to(ptr.dtype.element_ty), mask=offs < n)


@triton.jit
def gap(o_ptr, r_ptr, n, part_ptr, BLOCK: tl.constexpr, ROUNDS: tl.constexpr):
    base = tl.program_id(0).to(tl.int64) * (BLOCK * ROUNDS)
    worst = tl.zeros((BLOCK,), dtype=tl.float32)
    top = tl.zeros((BLOCK,), dtype=tl.float32)
    for k in tl.static_range(ROUNDS):
        offs = base + k * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        o = tl.load(o_ptr + offs, mask=m, other=0.0)
        r = tl.load(r_ptr + offs, mask=m, other=0.0)
        d = tl.abs((o - r).to(o.dtype).to(tl.float32))
        a = tl.abs(r.to(tl.float32))
        worst = tl.maximum(worst, tl.where(d == d, d, float("inf")))
        top = tl.maximum(top, tl.where(a == a, a, float("inf")))
    tl.store(part_ptr + 2 * tl.program_id(0), tl.max(worst, 0))
    tl.store(part_ptr + 2 * tl.program_id(0) + 1, tl.max(top, 0))
'''
_FAST_DRAW = {}


def fast_draw(x, kind, key):
    """Whether the judge's own kernel drew `x` (see KERNELS_SOURCE)."""
    t = torch()
    digits = {t.float32: 24, t.float16: 11, t.bfloat16: 8}.get(x.dtype)
    if kind not in ("uniform", "normal") or x.device.type != "cuda" or digits is None or not x.is_contiguous() or x.numel() == 0 or _FAST_DRAW.get("off"):
        return False
    try:
        kernel = _FAST_DRAW.get("draw")
        if kernel is None:
            kernel = _FAST_DRAW["draw"] = judge_kernels().draw
        keys = random.Random(key)
        block = 4096
        kernel[(-(-x.numel() // block),)](x, x.numel(), keys.getrandbits(31), keys.getrandbits(31), keys.getrandbits(31), NORMAL=kind == "normal", DIGITS=digits, BLOCK=block, num_warps=8)
        tried = (kind, x.dtype)
        if tried not in _FAST_DRAW:
            _FAST_DRAW[tried] = True
            why = fast_draw_wrong(x, kind)
            if why is not None:
                raise RuntimeError(why)
    except Exception as e:  # noqa: BLE001  (no Triton, or a draw that is wrong: torch draws)
        _FAST_DRAW["off"] = error_text(e)[:200]
        debug(f"inputs drawn by torch from now on: {_FAST_DRAW['off']}")
        return False
    return True


def judge_kernels():
    """KERNELS_SOURCE's module, made once: Triton reads a kernel's source
    from its file, and the judge runs from a string."""
    if "module" in _KERNELS:
        return _KERNELS["module"]
    import importlib.util
    import shutil

    folder = tempfile.mkdtemp(prefix="mtmc-judge-kernels-")
    try:
        path = os.path.join(folder, "mtmc_judge_kernels.py")
        with open(path, "w") as f:
            f.write(KERNELS_SOURCE)
        spec = importlib.util.spec_from_file_location("mtmc_judge_kernels", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _KERNELS["module"] = module
    return module


_KERNELS = {}


def fast_draw_wrong(x, kind):
    """Why a first draw of the judge's kernel is not from `kind`'s
    distribution, or None: its range, mean and spread, and values that
    differ from one element to the next."""
    t = torch()
    v = x.detach().reshape(-1)[: 1 << 24].float()
    if v.numel() < 1024:
        return None
    mean, std, low, high = (float(a) for a in (v.mean(), v.std(), v.min(), v.max()))
    distinct = float((v[1:] != v[:-1]).float().mean())
    if kind == "uniform":
        ok = low >= 0.0 and high < 1.0 and abs(mean - 0.5) < 0.02 and abs(std - 12 ** -0.5) < 0.02
    else:
        ok = bool(t.isfinite(v).all()) and abs(mean) < 0.05 and abs(std - 1.0) < 0.05
    if not ok or distinct < 0.9:
        return f"the judge's draw of {kind} {x.dtype} values is wrong (mean {mean:.4f}, std {std:.4f}, range {low:.4f} to {high:.4f}, {distinct:.1%} differ from the next)"
    return None


def normal_inputs(xs, seed):
    """The same shapes and dtypes from another distribution: every
    floating-point input redrawn in place from a standard normal (signed,
    unlike `torch.rand`); integer inputs (indices, labels) kept."""
    t = torch()
    for k, x in enumerate(xs):
        if isinstance(x, t.Tensor) and x.is_floating_point():
            g = t.Generator(device=x.device)
            g.manual_seed(seed + k)
            x.copy_(t.randn(x.shape, dtype=x.dtype, device=x.device, generator=g))
    return xs


def stats(times, clock):
    n = len(times)
    mean = sum(times) / n
    ordered = sorted(times)
    median = ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])
    std = math.sqrt(sum((x - mean) ** 2 for x in times) / max(n - 1, 1))
    return {"mean_ms": mean, "median_ms": median, "std_ms": std, "min_ms": ordered[0], "max_ms": ordered[-1], "trials": n, "clock": clock}


def median(xs):
    ordered = sorted(xs)
    n = len(ordered)
    if n == 0:
        return 0.0
    return ordered[n // 2] if n % 2 else 0.5 * (ordered[n // 2 - 1] + ordered[n // 2])


def lower_quartile(xs):
    """The 25th percentile of `xs` (linear between the nearest two)."""
    ordered = sorted(xs)
    if not ordered:
        return 0.0
    k = 0.25 * (len(ordered) - 1)
    i = int(k)
    j = min(i + 1, len(ordered) - 1)
    return ordered[i] + (ordered[j] - ordered[i]) * (k - i)


def compare(refs, outs, atol, rtol, min_scale_ratio, scale_slack=False):
    """KernelBench's allclose, output by output, plus a check against the
    output's scale, so that outputs small enough to fit inside atol (zeros)
    do not pass. `outs` are the judge's copies of the candidate's outputs,
    or the reason an output could not be read. With `scale_slack` (the
    trial on normal inputs) each element may also differ by rtol times the
    output's scale: signed inputs make sums cancel to near zero, where a
    correct program that adds in another order differs from the reference
    by the rounding of terms at the output's scale (an honest split-K
    product over K = 524288 differed beyond KernelBench's tolerance there)."""
    t = torch()
    if len(outs) != len(refs):
        return {"ok": False, "why": f"the candidate returned {len(outs)} output(s), the reference {len(refs)}"}
    total = {"max_abs_err": 0.0, "scale": 0.0}
    for k, (ref, out) in enumerate(zip(refs, outs)):
        one = {"ok": False, "why": out} if isinstance(out, str) else compare_one(t, ref, out, atol, rtol, min_scale_ratio, scale_slack)
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


def compare_one(t, ref, out, atol, rtol, min_scale_ratio, scale_slack=False):
    """One output against the reference's; `out` may be `Sampled`, and is
    then compared with the reference's elements at its positions."""
    # KernelBench's tolerance for half-precision outputs.
    if ref.dtype in (t.float16, t.bfloat16):
        atol, rtol = max(atol, 1e-2), max(rtol, 1e-2)
    if tuple(out.shape) != tuple(ref.shape):
        return {"ok": False, "why": f"shape {list(out.shape)} differs from the reference's {list(ref.shape)}"}
    if out.dtype != ref.dtype:
        return {"ok": False, "why": f"dtype {out.dtype} differs from the reference's {ref.dtype}"}
    shape, picks = list(ref.shape), None
    if isinstance(out, Sampled):
        picks = out.picks
        ref, out = take_flat(ref.detach(), picks.to(ref.device)), out.values
    # |out - ref| <= atol + rtol * |ref| in the outputs' own dtype, as
    # torch.allclose does, in chunks so that multi-GB outputs need little
    # extra memory; one device sync per output, not per chunk. The first
    # pass only finds the largest |out - ref| and |ref|: when no difference
    # exceeds atol every element passes, and the elementwise test (several
    # more passes over memory) runs only when one does.
    r_flat, o_flat = ref.detach().reshape(-1), out.detach().reshape(-1)
    if not r_flat.is_floating_point():
        r_flat, o_flat = r_flat.double(), o_flat.double()
    chunk = COMPARE_CHUNK
    spans = [(b, min(b + chunk, r_flat.numel())) for b in range(0, r_flat.numel(), chunk)]
    if not spans:
        return {"ok": True, "max_abs_err": 0.0, "scale": 0.0, "rel_to_scale": None}

    def pieces(begin, end):
        o = o_flat[begin:end]
        return o, r_flat[begin:end].to(o.device, non_blocking=True)

    fast = fast_gap(o_flat, r_flat)
    max_abs, scale = fast if fast is not None else torch_gap(t, o_flat, r_flat, spans)
    if not math.isfinite(scale):
        scale = max(float(t.nan_to_num(pieces(b, e)[1].abs(), nan=0.0, posinf=0.0).max()) for b, e in spans)
    if scale_slack:
        atol += rtol * scale
    if not max_abs <= atol:
        for begin, end in spans:
            o, r = pieces(begin, end)
            bad = ~t.isclose(o, r, atol=atol, rtol=rtol)
            if bool(bad.any()):
                k = int(bad.nonzero()[0])
                flat = begin + k if picks is None else int(picks[begin + k])
                index = list(reversed([int(i) for i in _unravel(flat, shape)]))
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


def torch_gap(t, o_flat, r_flat, spans):
    """The largest |out - ref| (in the outputs' dtype) and the largest
    |ref| by torch, chunk by chunk (NaN where one is NaN), one sync."""
    maxes, scales = [], []
    for begin, end in spans:
        o = o_flat[begin:end]
        r = r_flat[begin:end].to(o.device, non_blocking=True)
        maxes.append(t.linalg.vector_norm(t.sub(o, r), ord=math.inf))
        scales.append(t.linalg.vector_norm(r, ord=math.inf))
    return float(t.stack(maxes).max()), float(t.stack(scales).max())


def fast_gap(o, r):
    """`torch_gap` of two flat tensors on one GPU by the judge's `gap`
    kernel (see KERNELS_SOURCE), NaN as infinity; None where it does not
    apply. Its first result per dtype is checked against torch's."""
    t = torch()
    if o.device.type != "cuda" or r.device != o.device or o.dtype != r.dtype or o.dtype not in (t.float32, t.float16, t.bfloat16):
        return None
    if not (o.is_contiguous() and r.is_contiguous()) or o.numel() == 0 or _GAP.get("off"):
        return None
    try:
        worst, top = gap_kernel(o, r)
        if o.dtype not in _GAP:
            _GAP[o.dtype] = True
            n = o.numel()
            spans = [(b, min(b + COMPARE_CHUNK, n)) for b in range(0, n, COMPARE_CHUNK)]
            expect = [math.inf if math.isnan(v) else v for v in torch_gap(t, o, r, spans)]
            if [worst, top] != expect:
                raise RuntimeError(f"the judge's comparison of {o.dtype} outputs found {worst!r} and {top!r} where torch finds {expect[0]!r} and {expect[1]!r}")
    except Exception as e:  # noqa: BLE001  (no Triton, or a kernel that is wrong: torch compares)
        _GAP["off"] = error_text(e)[:200]
        debug(f"outputs compared by torch from now on: {_GAP['off']}")
        return None
    return worst, top


def gap_kernel(o, r):
    """The `gap` kernel's largest |o - r| and |r| of two flat contiguous
    tensors of one dtype (one sync)."""
    t = torch()
    n, block, rounds = o.numel(), 4096, 8
    programs = -(-n // (block * rounds))
    parts = t.empty(2 * programs, dtype=t.float32, device=o.device)
    judge_kernels().gap[(programs,)](o, r, n, parts, BLOCK=block, ROUNDS=rounds, num_warps=8)
    worst, top = parts.view(-1, 2).amax(0).tolist()
    return worst, top


_GAP = {}


def _unravel(flat, shape):
    for d in reversed(shape):
        yield flat % d
        flat //= d


def snapshot(inputs):
    t = torch()
    return [x.detach().clone() if isinstance(x, t.Tensor) else x for x in inputs]


def flat_positions(numel, device, secret):
    """SAMPLED positions of `numel` drawn under a seed no runner can know,
    the first and last among them."""
    t = torch()
    g = t.Generator(device=device)
    g.manual_seed(secret.getrandbits(62))
    picks = t.randint(0, numel, (SAMPLED,), generator=g, device=device)
    picks[0], picks[-1] = 0, numel - 1
    return picks


def take_flat(x, picks, shape=None, stride=None, offset=0):
    """The elements of `x` (or of the strided view of raw memory `x` with
    `shape`, `stride`, `offset`) at logical flat positions `picks`, without
    reading the rest."""
    t = torch()
    if shape is None:
        shape, stride, offset = list(x.shape), list(x.stride()), x.storage_offset()
        x = storage_of(x)
    return x[memory_index(picks, shape, stride, offset)]


def storage_of(x):
    """All of `x`'s storage as a flat tensor of its dtype."""
    return torch().as_strided(x, (x.untyped_storage().nbytes() // x.element_size(),), (1,), 0)


def memory_index(picks, shape, stride, offset):
    """Where in memory (in elements) the logical flat positions `picks` of
    a strided view lie."""
    t = torch()
    where = t.full_like(picks, offset)
    rest = picks.clone()
    for d, st in zip(reversed(shape), reversed(stride)):
        where += (rest % d) * st
        rest //= d
    return where


class Sampled:
    """Elements of a tensor at known flat positions, with its shape and
    dtype: what a checked timed call's large output is compared by."""

    def __init__(self, shape, dtype, picks, values, index=None):
        self.shape, self.dtype, self.picks, self.values = list(shape), dtype, picks, values
        # Where the positions lie in the tensor's storage (set for inputs,
        # which `probe_changed` reads again there).
        self.index = index


def probe_inputs(xs, secret, kept=None):
    """What a check after the call compares the inputs against: a copy of
    each small input tensor, the values at sampled positions of each large
    one. With `kept` (a dict, one per run of steps) the positions of an
    input at the same address and layout as before are those drawn for it
    then: one gather per input and step."""
    t = torch()
    out = []
    for k, x in enumerate(xs):
        if not isinstance(x, t.Tensor) or x.numel() <= SAMPLE_ABOVE:
            out.append(x.detach().clone() if isinstance(x, t.Tensor) else x)
            continue
        key = (k, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype)
        found = kept.get(key) if kept is not None else None
        if found is None:
            picks = flat_positions(x.numel(), x.device, secret)
            found = (picks, memory_index(picks, list(x.shape), list(x.stride()), x.storage_offset()))
            if kept is not None:
                kept[key] = found
        picks, index = found
        out.append(Sampled(x.shape, x.dtype, picks, storage_of(x.detach())[index], index))
    return out


def probe_changed(probe, xs):
    """The first input that differs from its probe, or None."""
    t = torch()
    for i, (p, x) in enumerate(zip(probe, xs)):
        if isinstance(p, Sampled):
            if not t.equal(p.values, storage_of(x.detach())[p.index]):
                return i
        elif isinstance(p, t.Tensor) and not t.equal(p, x):
            return i
    return None


def mutated(before, after):
    t = torch()
    for i, (b, a) in enumerate(zip(before, after)):
        if isinstance(b, t.Tensor) and not t.equal(b, a):
            return i
    return None


def overlaps_itself(x):
    """Whether two elements of `x` may share memory (an expanded input)."""
    t = torch()
    check = getattr(t, "_debug_has_internal_overlap", None)
    if check is not None:
        return check(x) != 0
    extent = 1 + sum((d - 1) * abs(st) for d, st in zip(x.shape, x.stride()))
    return any(st == 0 and d > 1 for d, st in zip(x.shape, x.stride())) or extent < x.numel()


def shares_memory(xs):
    """Whether two tensors of `xs` share memory, or one overlaps itself."""
    t = torch()
    tensors = [x for x in xs if isinstance(x, t.Tensor) and x.numel() > 0]
    storages = {x.untyped_storage().data_ptr() for x in tensors}
    return len(storages) < len(tensors) or any(overlaps_itself(x) for x in tensors)


def flush_l2(device):
    """Writes 256 MB so that no call starts with data in L2."""
    t = torch()
    buf = _L2.get("buf")
    if buf is None:
        buf = _L2["buf"] = t.empty(64 * 1024 * 1024, dtype=t.float32, device=device)
    buf.fill_(1.0)


_L2 = {}


# ---------------------------------------------------------------- CUDA IPC


_CUDA = []


def cuda_api():
    """The runner's `Cuda` (IPC handles and mappings), one for the judge."""
    if not _CUDA:
        _CUDA.append(from_runner("Cuda")())
    return _CUDA[0]


def device_bytes(ptr, n):
    return from_runner("device_bytes")(torch(), ptr, n)


# ---------------------------------------------------------------- inputs


class Stage:
    """The memory the runners read inputs from, and what the judge writes
    there: on a GPU a private memory pool whose segments (and nothing else
    of the judge's) are shared through CUDA IPC; on the CPU a memory file."""

    def __init__(self, device, nbytes):
        t = torch()
        self.device = device
        self.exported = {}
        # How each input is drawn again in place (None until the first
        # draw; a None in it where some input cannot be), and the last draw.
        self.recipes = None
        self.last = self.last_desc = None
        if device.type == "cuda":
            self.pool = t.cuda.MemPool()
            self.segments = {}
            self.slots = {}
        else:
            self.nbytes = max(1 << 20, nbytes)
            self.fd = os.memfd_create("mtmc-inputs")
            os.ftruncate(self.fd, self.nbytes)
            self.map = mmap.mmap(self.fd, self.nbytes)
            self.raw = t.frombuffer(self.map, dtype=t.uint8)

    def generate(self, ns, seed, mode, normal_seed=None, fresh=False):
        """Inputs of `get_inputs()` under `seed` in the shared memory, and
        their descriptor for the runners. With `fresh` (a timed call's
        inputs: new values from the same distribution, not KernelBench's
        values for a seed) and every input the untouched result of one of
        torch's random factories, the kept inputs are drawn again in place:
        one write of the inputs instead of a draw and a copy."""
        t = torch()
        cuda = self.device.type == "cuda"
        if fresh and self.recipes and None not in self.recipes and self.last is not None:
            # On a GPU a contiguous floating-point input is drawn by the
            # judge's own kernel where it works (`fast_draw`), the rest by
            # torch under the seed.
            seeded = False
            for k, (x, recipe) in enumerate(zip(self.last, self.recipes)):
                if recipe[0] == "kept" or fast_draw(x, recipe[0], seed * 131 + k):
                    continue
                if not seeded:
                    set_seed(seed)
                    seeded = True
                redraw(x, recipe)
            if cuda:
                t.cuda.current_stream(self.device).synchronize()
            return list(self.last), self.last_desc
        recipes = [] if self.recipes is None else None
        if cuda:
            with t.cuda.use_mem_pool(self.pool):
                xs = make_inputs(ns, seed, self.device, mode, recipes)
                if normal_seed is not None:
                    normal_inputs(xs, normal_seed)
                xs, placed = self.into_slots(xs)
            # Another process reads them as soon as it is told to: the
            # judge's stream must have written them by then (the memory is
            # the last inputs', back in the pool).
            t.cuda.current_stream(self.device).synchronize()
        else:
            xs = make_inputs(ns, seed, self.device, mode, recipes)
            if normal_seed is not None:
                normal_inputs(xs, normal_seed)
            # Copies part inputs that share memory: not drawn again in
            # place one by one then.
            xs, placed = self.into_arena(xs), not shares_memory(xs)
        if recipes is not None:
            # Drawn again in place only where every input is in memory of
            # its own that stays.
            kept = [("kept", None) if not isinstance(x, t.Tensor) or x.numel() == 0 else r for x, r in zip(xs, recipes)]
            self.recipes = kept if placed else [None]
        self.last, self.last_desc = xs, self.describe(xs)
        return xs, self.last_desc

    def into_arena(self, xs):
        """`xs` copied into the memory file, from its start."""
        t = torch()
        shared, cursor = [], 0
        for x in xs:
            if not isinstance(x, t.Tensor):
                shared.append(x)
                continue
            if x.numel() == 0:
                shared.append(x)
                continue
            # The same strides as `get_inputs()` gave, over as many elements
            # as they reach.
            extent = 1 + sum((d - 1) * st for d, st in zip(x.shape, x.stride()))
            n = extent * x.element_size()
            start = (cursor + 63) & ~63
            if start + n > self.nbytes:
                raise RuntimeError(f"the inputs take more than the {self.nbytes} bytes shared with the runners")
            view = self.raw[start:start + n].view(x.dtype).as_strided(x.shape, x.stride())
            view.copy_(x)
            shared.append(view)
            cursor = start + n
        return shared

    def into_slots(self, xs):
        """`xs` copied into memory kept from one draw to the next: input k
        is at the same address in every step while its shape, strides and
        dtype stay, as KernelBench's timed calls see one input set at one
        address (a program replaying a CUDA graph captured on its inputs'
        addresses replays it on the new values). Inputs that share memory,
        or a tensor whose elements overlap, keep the draw's own memory (a
        copy would part them)."""
        t = torch()
        if shares_memory(xs):
            return [self.in_pool(x) for x in xs], False
        out = []
        for k, x in enumerate(xs):
            if not isinstance(x, t.Tensor) or x.numel() == 0:
                out.append(x)
                continue
            key = (tuple(x.shape), x.stride(), x.dtype)
            kept = self.slots.get(k)
            if kept is None or kept[0] != key:
                kept = (key, t.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=self.device))
                self.slots[k] = kept
            kept[1].copy_(x)
            out.append(kept[1])
        return out, True

    def in_pool(self, x):
        """`x` where its memory is a segment of the private pool (a copy,
        where `get_inputs()` returned memory from elsewhere)."""
        t = torch()
        if not isinstance(x, t.Tensor) or x.numel() == 0:
            return x
        base, size = cuda_api().range(x.data_ptr())
        if base not in self.segments:
            for seg in t.cuda.memory_snapshot(self.pool.id, include_traces=False) if hasattr(t.cuda, "memory_snapshot") else []:
                self.segments[seg["address"]] = seg["total_size"]
        if base not in self.segments:
            return x.clone()
        return x

    def describe(self, xs):
        t = torch()
        desc = []
        for k, x in enumerate(xs):
            if not isinstance(x, t.Tensor):
                try:
                    json.dumps(x)
                except TypeError:
                    raise RuntimeError(f"input {k} is a {type(x).__name__}, which the judge cannot send to the candidate's process") from None
                desc.append({"v": x})
                continue
            item = {"dtype": str(x.dtype).replace("torch.", ""), "shape": list(x.shape), "stride": list(x.stride())}
            if x.numel() == 0:
                item["empty"] = True
            elif self.device.type == "cuda":
                base, _ = cuda_api().range(x.data_ptr())
                if base not in self.exported:
                    self.exported[base] = cuda_api().handle(base)[0]
                item["segment"] = self.exported[base].hex()
                item["offset"] = x.data_ptr() - base
            else:
                item["offset"] = x.data_ptr() - self.raw.data_ptr()
            desc.append(item)
        return json.dumps(desc, separators=(",", ":")).encode()

    def owner(self, handle):
        """The judge's own pointer for one of its exported handles."""
        for base, h in self.exported.items():
            if h == handle:
                return base
        return None


# ---------------------------------------------------------------- runners


class Lost(Exception):
    """The runner process is gone (it exited, or was killed)."""


class Overran(Exception):
    """The runner did not answer within the time left; `detail` says what
    it was doing then."""

    def __init__(self, text, detail=None):
        super().__init__(text)
        self.detail = detail


class Channel:
    """JSON lines from a process the judge does not trust: each an object,
    at most 64 MiB waiting, read within a deadline; `gone()` says, while
    nothing arrives, why the process will never answer."""

    what = "process"

    def line(self, deadline):
        while b"\n" not in self.buf:
            left = deadline - _clock()
            if left <= 0:
                raise Overran(f"the {self.what} did not answer in time")
            if not select.select([self.sock], [], [], min(left, 0.5))[0]:
                why = self.gone()
                if why:
                    raise Lost(why)
                continue
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                raise Lost(self.gone() or f"the {self.what} closed its channel")
            self.buf += chunk
            if len(self.buf) > 64 << 20:
                raise Lost(f"the {self.what} sent more than the protocol allows")
        line, self.buf = self.buf.split(b"\n", 1)
        try:
            msg = json.loads(line)
        except ValueError:
            raise Lost(f"the {self.what} sent a line that is not JSON") from None
        if not isinstance(msg, dict):
            raise Lost(f"the {self.what} sent a line that is not an object")
        return msg


class Zygote(Channel):
    """The process runners are forked from (runner.py): it imported torch
    once and never touched the GPU."""

    what = "runners' zygote"

    def __init__(self):
        if RUNNER_SOURCE is None:
            raise RuntimeError("the judge was started without the runner's source (its first argument)")
        a, b = socket.socketpair()
        boot = "import sys\nexec(compile(sys.argv[1], '<mtmc runner>', 'exec'), {'__name__': '__main__'})"
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", boot, RUNNER_SOURCE, "zygote", str(b.fileno())],
            pass_fds=[b.fileno()], stdin=subprocess.DEVNULL, stdout=2, stderr=2,
        )
        b.close()
        self.sock = a
        self.buf = b""
        self.ready = None

    def gone(self):
        code = self.proc.poll()
        return None if code is None else f"the runners' zygote exited ({code})"

    def spawn(self, role, device, uid, scratch, deadline):
        if self.ready is None:
            self.ready = self.line(deadline)
            debug("zygote ready", self.ready)
        mine, theirs = socket.socketpair()
        cell_fd = os.memfd_create("mtmc-cell")
        os.ftruncate(cell_fd, from_runner("CELL_BYTES"))
        req = {"role": role, "device": device, "uid": uid, "scratch": scratch}
        socket.send_fds(self.sock, [(json.dumps(req) + "\n").encode()], [theirs.fileno(), cell_fd])
        theirs.close()
        keeper = self.line(deadline)["keeper"]
        debug(f"spawned a {role} runner, keeper {keeper}, uid {uid}")
        cell = mmap.mmap(cell_fd, from_runner("CELL_BYTES"))
        os.close(cell_fd)
        return Child(role, mine, cell, keeper, device)


_ZYGOTE = []


def zygote():
    if _ZYGOTE and _ZYGOTE[0].proc.poll() is not None:
        _ZYGOTE.clear()
    if not _ZYGOTE:
        _ZYGOTE.append(Zygote())
    return _ZYGOTE[0]


def from_runner(name):
    """One of the runner's definitions (the cell's layout, call kinds, record
    kinds, dtypes, `Cuda`, `device_bytes`, `load_module`, `error_text`,
    `proc_stat`), read
    from its source so that the two never disagree."""
    if not _RUNNER:
        ns = {"__name__": "mtmc_runner_definitions"}
        exec(compile(RUNNER_SOURCE, "<mtmc runner definitions>", "exec"), ns)
        _RUNNER.update(ns)
    return _RUNNER[name]


class Child(Channel):
    """One runner, from the judge's side."""

    def __init__(self, role, sock, cell, keeper, device):
        self.role, self.sock, self.cell, self.keeper, self.device = role, sock, cell, keeper, device
        self.what = f"{role}'s process"
        self.buf = b""
        self.words = from_runner("Words")(cell)
        self.seq = self.words.q[from_runner("DONE_W")]
        self.desc = None
        self.pid = None
        self.pidfd = None
        self.info = None
        self.out_arena = None
        # The handles of its memory the judge mapped.
        self.opened = set()
        self.dead = False

    def gone(self):
        return None if self.alive() else self.exit_text()

    def wait_ready(self, deadline):
        if self.info is None:
            self.info = self.line(deadline)
            debug(f"{self.role} runner ready", self.info)
            self.pid = int(self.info.get("pid", 0))
            try:
                self.pidfd = os.pidfd_open(self.pid)
            except (OSError, AttributeError):
                self.pidfd = None
        return self.info

    def request(self, msg, deadline, fds=()):
        self.wait_ready(deadline)
        data = (json.dumps(msg) + "\n").encode()
        try:
            if fds:
                socket.send_fds(self.sock, [data], list(fds))
            else:
                self.sock.sendall(data)
        except OSError:
            raise Lost(self.exit_text()) from None
        return self.line(deadline)

    def alive(self):
        if self.dead:
            return False
        if self.pid is None:
            # Not ready yet: its keeper stands for it.
            try:
                os.kill(self.keeper, 0)
                return True
            except ProcessLookupError:
                self.dead = True
                return False
        if self.pidfd is not None:
            if select.select([self.pidfd], [], [], 0)[0]:
                self.dead = True
                return False
            return True
        try:
            os.kill(self.pid, 0)
            return True
        except (ProcessLookupError, TypeError):
            self.dead = True
            return False
        except PermissionError:
            return True

    def state_text(self):
        """What the kernel says the runner is doing, for a call that did not
        return."""
        fields = from_runner("proc_stat")(self.pid) if self.pid is not None else []
        if not fields:
            return "its process could not be inspected"
        state = fields[0]
        names = {"R": "running", "S": "sleeping", "D": "waiting on a device", "T": "stopped", "t": "stopped by a tracer", "Z": "a zombie"}
        try:
            with open(f"/proc/{self.pid}/wchan") as f:
                wchan = f.read().strip()
        except OSError:
            wchan = ""
        where = f" in {wchan}" if wchan and wchan != "0" else ""
        return f"its process is {names.get(state, state)}{where}"

    def exit_text(self):
        # The keeper writes how the runner ended just after it ended.
        waited = _clock() + 1.0
        code = 0
        while code == 0 and _clock() < waited:
            code = self.words.i[from_runner("EXIT_W")]
            if code == 0:
                time.sleep(0.01)
        if code >= 1000:
            return f"the {self.role}'s process exited with status {code - 1000}"
        if code < 0:
            name = signal.Signals(-code).name if -code in signal.Signals._value2member_map_ else str(-code)
            return f"the {self.role}'s process was killed by {name}"
        return f"the {self.role}'s process ended"

    # -- calls on the cell

    def begin_calls(self, deadline):
        debug(f"{self.role}: begin calls")
        msg = self.request({"op": "calls"}, deadline)
        if not msg.get("serving"):
            raise Lost(f"the {self.role}'s process did not start serving calls")

    def end_calls(self, deadline):
        # Not timed: the runner's reply on the socket says it stopped (the
        # judge does not spin on the cell for it).
        self.release(from_runner("STOP"), 0)
        msg = self.line(deadline)
        if not msg.get("served"):
            raise Lost(f"the {self.role}'s process did not stop serving calls")
        done = self.words.q[from_runner("DONE_W")]
        if done != self.seq:
            debug(f"{self.role}: stopped serving with the cell's done at {done}, go at {self.seq}")
            self.seq = done

    def release(self, kind, watch):
        """Hands the runner its next call: the kind first, then the new
        sequence number it waits for. Returns that number and the host's
        time just before the release."""
        q, i = self.words.q, self.words.i
        i[from_runner("KIND_W")] = kind
        i[from_runner("WATCH_W")] = watch
        self.seq += 1
        go = from_runner("GO_W")
        t0 = _clock()
        q[go] = self.seq
        return self.seq, t0

    def call(self, kind, desc, watch, deadline):
        """One call: the host times at release and at `done`. New inputs'
        descriptor is read by the runner before, in a step of its own, so
        that no call's time holds the reading of it."""
        cell = self.cell
        if desc is not None and desc != self.desc:
            if len(desc) > from_runner("IN_MAX"):
                raise RuntimeError("the inputs' descriptor is larger than the cell")
            cell[from_runner("IN_BASE"):from_runner("IN_BASE") + len(desc)] = desc
            struct.pack_into("<I", cell, from_runner("IN_LEN"), len(desc))
            self.desc = desc
            self.wait_done(*self.release(from_runner("PLAN"), 0), deadline)
        return self.wait_done(*self.release(kind, watch), deadline)

    def wait_done(self, seq, t0, deadline):
        """Waits for the runner's `done` of call `seq` released at `t0`;
        returns `t0` and the host's time at `done`."""
        q, done = self.words.q, from_runner("DONE_W")
        spin = self.device == "cuda"
        n = 0
        # On a GPU both sides spin (a wake-up would count in the call's
        # time); on the CPU they share the cores with the call, and sleep.
        every = 0xFFF if spin else 0x3F
        while q[done] != seq:
            n += 1
            if n & every == 0:
                if _clock() > deadline:
                    raise Overran(f"the {self.role}'s call did not return in time", f"the call had waited {_clock() - t0:.1f} s; {self.state_text()}")
                if not self.alive():
                    raise Lost(self.exit_text())
                if not spin:
                    time.sleep(0.0001)
        return t0, _clock()

    def outcome_of_call(self):
        """`None` after a normal return, else the error text it raised."""
        status, _count, err = struct.unpack_from("<III", self.cell, from_runner("OUT_STATUS"))
        if status == from_runner("OUT_EXCEPTION"):
            base = from_runner("ERR_BASE")
            return self.cell[base:base + min(err, from_runner("ERR_MAX"))].decode(errors="replace")
        return None

    def watch_report(self):
        n = struct.unpack_from("<I", self.cell, from_runner("WATCH_LEN"))[0]
        base = from_runner("WATCH_BASE")
        try:
            report = json.loads(self.cell[base:base + min(n, from_runner("WATCH_MAX"))])
        except ValueError:
            return {"torch_ops": {}, "swallowed": ["the watch report is unreadable"]}
        if not isinstance(report, dict):
            return {"torch_ops": {}, "swallowed": ["the watch report is unreadable"]}
        return report

    def outputs(self, stage, secret=None, copy=True):
        """The judge's own copies of the call's outputs (a reason instead of
        a tensor where one cannot be read); with `secret`, outputs of more
        than SAMPLE_ABOVE elements as their values at positions drawn now
        (`Sampled`). Without `copy`, a GPU's outputs are views of the
        runner's memory, to be read before the runner is called again."""
        t = torch()
        _status, count = struct.unpack_from("<II", self.cell, from_runner("OUT_STATUS"))
        if count > from_runner("OUT_MAX"):
            return [f"the candidate returned more than {from_runner('OUT_MAX')} outputs"]
        outs = []
        dtypes = from_runner("DTYPES")
        for k in range(count):
            base = from_runner("OUT_BASE") + k * from_runner("OUT_RECORD")
            kind, _pad, handle, offset, dtype, dims = struct.unpack_from("<II64sQII", self.cell, base)
            shape = list(struct.unpack_from("<8q", self.cell, base + 88))[: min(dims, 8)]
            stride = list(struct.unpack_from("<8q", self.cell, base + 152))[: min(dims, 8)]
            if kind == from_runner("REC_NOT_TENSOR"):
                name = handle.split(b"\0")[0].decode(errors="replace")
                outs.append(f"the candidate returned {name}, not a plain torch.Tensor")
                continue
            if kind == from_runner("REC_TOO_LARGE"):
                outs.append("the candidate's output is larger than the reference's space for it")
                continue
            if kind == from_runner("REC_OTHER_DEVICE"):
                outs.append(f"the result is not on the {self.device} device the reference is on")
                continue
            if kind != from_runner("REC_TENSOR") or dtype >= len(dtypes) or any(s < 0 for s in shape):
                outs.append("the candidate's output could not be read")
                continue
            tdtype = getattr(t, dtypes[dtype])
            numel = math.prod(shape)
            try:
                picks = flat_positions(numel, stage.device, secret) if secret is not None and numel > SAMPLE_ABOVE else None
                if numel == 0:
                    outs.append(t.empty(shape, dtype=tdtype, device=stage.device))
                elif self.device == "cuda":
                    outs.append(self.read_device(stage, handle, offset, tdtype, shape, stride, picks, copy))
                else:
                    esize = t.empty(0, dtype=tdtype).element_size()
                    raw = self.out_arena
                    if offset % esize or offset + numel * esize > raw.numel():
                        raise ValueError("out of the arena")
                    view = raw[offset:offset + numel * esize].view(tdtype).view(shape)
                    outs.append(view.clone() if picks is None else Sampled(shape, tdtype, picks, take_flat(view, picks)))
            except (RuntimeError, ValueError) as e:
                outs.append(f"the candidate's output could not be read ({str(e)[:120]})")
        if self.device == "cuda":
            # The copies are done before the runner may touch its memory
            # again.
            t.cuda.synchronize()
        return outs

    def read_device(self, stage, handle, offset, dtype, shape, stride, picks=None, copy=True):
        t = torch()
        own = stage.owner(handle)
        if own is not None:
            ptr, size = own, cuda_api().range(own)[1]
        else:
            ptr, size = cuda_api().open(handle)
            self.opened.add(handle)
        esize = t.empty(0, dtype=dtype).element_size()
        if offset % esize:
            raise ValueError("a misaligned output")
        raw = device_bytes(ptr, size - size % esize).view(dtype)
        # The whole strided view must lie in the allocation (as_strided
        # checks it).
        view = t.as_strided(raw, shape, stride, offset // esize)
        if picks is None:
            return view.clone() if copy else view
        return Sampled(shape, dtype, picks, take_flat(raw, picks, shape, stride, offset // esize))

    def kill(self):
        """Ends the runner and every process it started; closes what the
        judge mapped of its memory."""
        try:
            os.kill(self.keeper, signal.SIGTERM)
        except ProcessLookupError:
            pass
        if self.opened:
            torch().cuda.synchronize()
            for handle in self.opened:
                cuda_api().close(handle)
            self.opened.clear()
        self.words.release()
        for f in (self.sock, self.cell):
            try:
                f.close()
            except (OSError, BufferError):
                pass
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None


def scratch_root():
    """Where the runners' scratch folders go: a folder of this judge's."""
    root = _SCRATCH.get("root")
    if root is None:
        root = _SCRATCH["root"] = tempfile.mkdtemp(prefix="mtmc-runners-")
        os.chmod(root, 0o711)
    return root


_SCRATCH = {}
_UIDS = {}


def candidate_uid():
    """A user id of its own for the next candidate's runner, where this
    judge runs as root and the interpreter and its packages are readable to
    other users; else None (the runner keeps the judge's)."""
    if os.geteuid() != 0 or not real_root():
        return None
    if "readable" not in _UIDS:
        _UIDS["readable"] = all(world_readable(p) for p in python_paths())
    if not _UIDS["readable"]:
        return None
    return 0x40000000 + random.SystemRandom().randrange(1 << 28)


def real_root():
    """Whether this is root of the machine, not of a user namespace (where
    no other user id is mapped to become)."""
    try:
        with open("/proc/self/uid_map") as f:
            return any(line.split()[:3] == ["0", "0", "4294967295"] for line in f)
    except OSError:
        return False


def python_paths():
    import sysconfig

    t = torch()
    paths = {sysconfig.get_paths().get(k) for k in ("stdlib", "purelib", "platlib")}
    paths.add(os.path.dirname(os.path.dirname(t.__file__)))
    paths.add(os.path.realpath(sys.executable))
    return [p for p in paths if p]


def world_readable(path):
    """Whether another user may read `path` and every folder above it."""
    path = os.path.realpath(path)
    while True:
        try:
            st = os.stat(path)
        except OSError:
            return False
        need = 0o005 if os.path.isdir(path) else 0o004
        if st.st_mode & need != need:
            return False
        if path == "/":
            return True
        path = os.path.dirname(path)


def new_child(role, device, deadline):
    uid = candidate_uid() if role == "candidate" else None
    scratch = os.path.join(scratch_root(), f"{role}-{time.monotonic_ns()}")
    return zygote().spawn(role, device.type, uid, scratch, deadline)


_SPARE = []


def candidate_child(device, deadline):
    """A candidate runner: the spare started after the last candidate, or a
    new one. A runner serves one candidate only."""
    while _SPARE:
        child = _SPARE.pop()
        if child.device == device.type and child.alive():
            return child
        child.kill()
    return new_child("candidate", device, deadline)


def start_spare(device):
    if not _SPARE:
        try:
            _SPARE.append(new_child("candidate", device, _clock() + 60))
        except (Lost, Overran, OSError) as e:
            print(f"mtmc judge: could not start a spare runner: {e}", file=sys.stderr)


def spare_ready(deadline):
    """Waits for the spare runner to be up (its CUDA start must not share
    the GPU with timed calls); one that fails is dropped."""
    for child in list(_SPARE):
        try:
            child.wait_ready(deadline)
        except (Lost, Overran, OSError, ValueError) as e:
            print(f"mtmc judge: the spare runner did not start: {e}", file=sys.stderr)
            _SPARE.remove(child)
            child.kill()


# ---------------------------------------------------------------- reference


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
    if req.get("device", "cuda") == "cpu":
        return t.device("cpu")
    if not t.cuda.is_available():
        return None
    return t.device("cuda:0")


def reference_side(problem, req, device, deadline):
    """The problem's reference side, built once per problem and settings:
    the judge's model, the seeds of every check, the reference outputs, the
    shared input memory, the reference runner and the baselines."""
    s = settings(req)
    key = json.dumps([problem["code"], s])
    if _REFERENCE.get("key") != key or not _REFERENCE["runner"].alive():
        # The zygote imports torch while the judge builds the reference.
        zygote()
        old = _REFERENCE.get("runner")
        if old is not None:
            old.kill()
        _REFERENCE.clear()
        if device.type == "cuda":
            # What the old side held (its kept outputs, its inputs' pool)
            # goes back to the GPU, not only to this process's cache: a
            # candidate's runner is another process (a candidate that ran
            # out of memory beside kept outputs is judged again with them
            # recomputed, in the memory they leave).
            import gc

            gc.collect()
            torch().cuda.empty_cache()
        ref = build_reference(problem, s, device, deadline)
        ref["key"] = key
        _REFERENCE.update(ref)
    ref = _REFERENCE
    wanted = req.get("baselines", ["eager"])
    missing = [b for b in wanted if b not in ref["baselines"]]
    if missing or "calibration" not in ref:
        measure_baselines(problem, ref, s, device, missing, req.get("baseline_cache"), deadline)
    return ref


def build_reference(problem, s, device, deadline):
    t = torch()
    name = problem.get("name", "problem")
    ns = from_runner("load_module")(name, problem["code"], name)
    ref = {"ns": ns, "init": ns["get_init_inputs"](), "math": math_flags(), "baselines": {}, "problem": problem}
    model = ref["model"] = fresh_model(ref, device, s)
    set_seed(s["seed"])
    trial_seeds = [int(t.randint(0, 2**32 - 1, (1,)).item()) for _ in range(s["correctness_trials"])]
    check_seeds = trial_seeds + [s["seed"] + 1]
    ref.update(trial_seeds=trial_seeds, check_seeds=check_seeds)
    # A model that keeps state across calls is judged in lockstep: each
    # candidate's calls are mirrored, in order, on a fresh model of the
    # judge's own (`fresh_model`), which gives each call's reference.
    ref["stateful"] = keeps_state(model, ns, trial_seeds[0], device, s)
    if ref["stateful"]:
        model = ref["model"] = fresh_model(ref, device, s)
    ref["reference_tf32"] = reference_tf32((lambda: fresh_model(ref, device, s)) if ref["stateful"] else (lambda: model), ns, trial_seeds[0], device, s)
    refs, kept = [], "device" if device.type == "cuda" else "host"
    if s["references"] == "recompute":
        kept = "recomputed"
    if ref["stateful"]:
        kept = "lockstep"
    in_bytes = out_bytes = 0
    ref["mutates_inputs"] = False
    for trial_seed in check_seeds:
        inputs = make_inputs(ns, trial_seed, device, s["inputs"])
        probe = probe_inputs(inputs, random.SystemRandom())
        with t.no_grad():
            outs = forward_outputs(model, inputs)
        # A model that writes to its inputs runs on a copy of a timed
        # call's inputs, which eager beside the candidate reads after it.
        ref["mutates_inputs"] |= probe_changed(probe, inputs) is not None
        del probe
        in_bytes = max(in_bytes, sum(x.numel() * x.element_size() + 64 for x in inputs if isinstance(x, t.Tensor)))
        out_bytes = max(out_bytes, sum(o.numel() * o.element_size() + 64 for o in outs))
        if ref["stateful"]:
            model = ref["model"] = fresh_model(ref, device, s)
        if kept == "device" and not refs:
            # Every check compares against outputs kept on the GPU when all
            # of them take at most about half of its memory; larger ones are
            # recomputed for each check. One more set for the check with
            # scaled parameters.
            sets = len(check_seeds) + 1 + (1 if float_parameters(model) else 0)
            size = sum(o.numel() * o.element_size() for o in outs) * sets
            free, _total = t.cuda.mem_get_info(device)
            free += t.cuda.memory_reserved(device) - t.cuda.memory_allocated(device)
            if size > 0.45 * (free + size / sets):
                kept = "recomputed"
        refs.append(outs if kept not in ("recomputed", "lockstep") else None)
        del inputs, outs
    ref.update(refs=refs, refs_kept=kept)
    if device.type == "cuda" and kept == "recomputed":
        # Memory is short (the outputs are recomputed for each check): what
        # the checks above left in this process's cache (inputs and
        # several output sets) goes back to the GPU for the candidate's
        # process.
        import gc

        gc.collect()
        t.cuda.empty_cache()
    ref["scaled_ref"] = ref["normal_ref"] = None
    if kept not in ("recomputed", "lockstep"):
        ref["normal_ref"] = normal_reference(ref, s, device)
    if kept not in ("recomputed", "lockstep") and float_parameters(model):
        inputs = make_inputs(ns, check_seeds[-1], device, s["inputs"])
        ref["scaled_ref"] = with_scaled_parameters(model, lambda: forward_outputs(model, inputs))
        del inputs
    ref["stage"] = Stage(device, 2 * in_bytes)
    debug("reference outputs kept:", kept)
    if device.type == "cpu":
        ref["out_bytes"] = max(1 << 20, 4 * out_bytes)
    # The problem's own model in a runner of its own: its calls are timed
    # exactly as a candidate's are.
    runner = new_child("reference", device, deadline)
    ref["runner"] = runner
    load_into(runner, problem, {"name": problem.get("name", "problem"), "code": problem["code"]}, "Model", s, device, ref, deadline)
    return ref


def normal_trial(s, ref):
    """The seed of the correctness trial's inputs drawn from a normal
    distribution and the seed of their draw."""
    return ref["trial_seeds"][0], s["seed"] + 7


def normal_reference(ref, s, device, inputs=None):
    """The reference's outputs on the trial's inputs drawn from a normal
    distribution, or the reason there is no such trial (a str)."""
    t = torch()
    if inputs is None:
        seed, normal_seed = normal_trial(s, ref)
        inputs = normal_inputs(make_inputs(ref["ns"], seed, device, s["inputs"]), normal_seed)
    try:
        refs = reference_forward(ref, inputs)
    except Exception as e:  # noqa: BLE001  (the reference cannot run there: no such trial)
        return f"skipped: the reference fails on normal inputs ({error_text(e)[:120]})"
    if not all(bool(t.isfinite(r).all()) for r in refs if r.is_floating_point()):
        return "skipped: the reference's outputs are not finite on normal inputs"
    return refs


def load_into(child, problem, candidate, cls, s, device, ref, deadline):
    """Sends the problem's and the candidate's code to a runner, which
    builds the model under the seed; returns the runner's reply."""
    msg = {
        "op": "load", "problem_name": problem.get("name", "problem"), "problem_code": problem["code"],
        "name": candidate.get("name", "candidate"), "code": candidate["code"],
        "filename": f"<mtmc candidate {candidate.get('name', 'candidate')}>", "class": cls, "seed": s["seed"],
        "references": ref.get("refs_kept", ""),
    }
    fds = ()
    if device.type == "cpu":
        out_fd = os.memfd_create("mtmc-outputs")
        os.ftruncate(out_fd, ref["out_bytes"])
        child.out_map = mmap.mmap(out_fd, ref["out_bytes"])
        child.out_arena = torch().frombuffer(child.out_map, dtype=torch().uint8)
        msg.update(in_bytes=ref["stage"].nbytes, out_bytes=ref["out_bytes"])
        fds = (ref["stage"].fd, out_fd)
    try:
        reply_ = child.request(msg, deadline, fds)
    finally:
        if device.type == "cpu":
            os.close(out_fd)
    if cls == "Model" and not reply_.get("ok"):
        raise RuntimeError(f"the problem's model did not load in its runner: {reply_.get('error')}")
    return reply_


def reference_outputs(ref, n, inputs):
    kept = ref["refs"][n]
    if kept is not None:
        return kept
    return reference_forward(ref, inputs)


def forward_outputs(model, inputs):
    t = torch()
    value = model(*inputs)
    outs = list(value) if isinstance(value, (tuple, list)) else [value]
    return [o.detach() if isinstance(o, t.Tensor) else t.as_tensor(o) for o in outs]


def fresh_model(ref, device, s):
    """The problem's model built as a runner builds a candidate's: under
    the seed, from the init inputs."""
    t = torch()
    with t.no_grad():
        set_seed(s["seed"])
        return ref["ns"]["Model"](*ref["init"]).to(device)


def reference_forward(ref, inputs, scaled=False):
    """A forward of the judge's model under the math switches it was first
    computed with: in lockstep (a stateful model), the candidate's own fresh
    model, which sees every call the candidate sees."""
    t = torch()
    model = ref["lock"] if ref.get("lock") is not None else ref["model"]
    now = math_flags()
    try:
        set_math_flags(ref["math"])
        with t.no_grad():
            if scaled:
                return with_scaled_parameters(model, lambda: forward_outputs(model, inputs))
            return forward_outputs(model, inputs)
    finally:
        set_math_flags(now)


def float_parameters(model):
    return [p for p in model.parameters() if p.is_floating_point()]


def with_scaled_parameters(model, run):
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
    if ref["scaled_ref"] is not None:
        return ref["scaled_ref"]
    return reference_forward(ref, inputs, scaled=True)


def attribute_identities(model):
    """The identity of every public attribute, parameter and buffer of the
    model and its submodules: a forward that assigns one keeps state."""
    out = {}
    for q, m in model.named_modules():
        for k, v in vars(m).items():
            if k in ("_parameters", "_buffers", "_modules"):
                for kk, vv in v.items():
                    out[(q, kk)] = id(vv)
            elif not k.startswith("_"):
                out[(q, k)] = id(v)
    return out


def keeps_state(model, ns, seed, device, s):
    """Whether the problem's model keeps state across calls: a call assigns
    one of its attributes (a hidden state, a counter), or outputs differ
    beyond what an atomic's order changes where inputs are the same -- the
    same inputs twice, and again after other inputs (a running mean of its
    inputs gives the same output for the same input twice in a row).
    Inputs are drawn afresh for each call, as a model may write to its
    inputs, and each call runs under the same seed, so that random ops draw
    alike."""
    t = torch()
    outs = []
    before = attribute_identities(model)
    with t.no_grad():
        for inputs_seed in (seed, seed, seed + 7919, seed):
            inputs = make_inputs(ns, inputs_seed, device, s["inputs"])
            set_seed(s["seed"])
            outs.append(forward_outputs(model, inputs))
            del inputs
    if attribute_identities(model) != before:
        return True

    def same(a, b):
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.is_floating_point() or a.is_complex():
            return bool(t.allclose(a, b, rtol=1e-3, atol=1e-3, equal_nan=True))
        return bool(t.equal(a, b))

    def differ(x, y):
        return len(x) != len(y) or not all(same(a, b) for a, b in zip(x, y))

    return differ(outs[0], outs[1]) or differ(outs[0], outs[3])


def reference_tf32(models, ns, seed, device, s):
    """Whether the reference's own outputs are TF32-rounded (cuDNN's float32
    convolutions under torch's default switches): an exact float32
    candidate cannot meet 1e-4 against such a reference. `models()` gives
    the model of each of the two forwards (a fresh one for a model that
    keeps state)."""
    t = torch()
    flags = math_flags()
    if device.type != "cuda" or not (flags["matmul_tf32"] or flags["cudnn_tf32"]):
        return False
    inputs = make_inputs(ns, seed, device, s["inputs"])
    try:
        with t.no_grad():
            rounded = forward_outputs(models(), inputs)
            set_math_flags({"matmul_tf32": False, "cudnn_tf32": False, "precision": "highest"})
            exact = forward_outputs(models(), inputs)
    finally:
        set_math_flags(flags)
    return any(
        a.dtype == t.float32 and a.shape == b.shape and not t.allclose(a, b, atol=1e-4, rtol=1e-4)
        for a, b in zip(rounded, exact)
    )


def math_flags():
    t = torch()
    return {
        "matmul_tf32": t.backends.cuda.matmul.allow_tf32,
        "cudnn_tf32": t.backends.cudnn.allow_tf32,
        "precision": t.get_float32_matmul_precision(),
    }


def set_math_flags(flags):
    t = torch()
    t.backends.cuda.matmul.allow_tf32 = flags["matmul_tf32"]
    t.backends.cudnn.allow_tf32 = flags["cudnn_tf32"]
    t.set_float32_matmul_precision(flags["precision"])


def baseline_cache_file(problem, s, device, directory):
    t = torch()
    gpu = t.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    digest = hashlib.sha256(problem["code"].encode()).hexdigest()[:16]
    keyed = {k: v for k, v in s.items() if k != "paired_eager"}
    keyed["method"] = TIMING_METHOD
    params = hashlib.sha256(json.dumps(keyed, sort_keys=True).encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", gpu).strip("-")
    return os.path.join(directory, f"{digest}-{slug}-torch{t.__version__}-{params}.json")


def measure_baselines(problem, ref, s, device, names, cache_dir, deadline):
    """Eager and torch.compile timings of the problem's own model in its
    runner, timed as candidates are (from the cache of this problem, GPU,
    torch version and settings when there is one), and the calibration of
    this run: the span of a call that does nothing, how long the judge's
    own step after a call takes, and its L2 flush with no candidate."""
    path = baseline_cache_file(problem, s, device, cache_dir) if cache_dir else None
    cached = {}
    if path and os.path.exists(path):
        try:
            with open(path) as f:
                cached = json.load(f)
        except (OSError, ValueError):
            cached = {}
    runner = ref["runner"]
    if "calibration" not in ref or "eager" in names:
        steps = s["trials"] if "eager" in names and "eager" not in cached else 30
        records = timed_steps(ref, s, device, [("reference", runner)], ["warmup"] * s["warmup"] + ["timed"] * steps, deadline)
        failed = [r["error"] for r in records if r.get("error")]
        if failed:
            raise RuntimeError(f"the problem's model failed in its runner: {failed[0]}")
        ref["calibration"] = calibration(records, device)
        if "eager" in names:
            if "eager" in cached:
                ref["baselines"]["eager"] = dict(cached["eager"], cached=True)
            else:
                began = _clock()
                timing = stats(call_times(records, "reference", ref["calibration"], device), clock_name(device))
                timing["seconds"] = _clock() - began
                timing["measured_at"] = _utc_now()
                ref["baselines"]["eager"] = timing
    for name in [n for n in names if n != "eager"]:
        if name in cached:
            ref["baselines"][name] = dict(cached[name], cached=True)
            continue
        began = _clock()
        try:
            # torch.compile of the problem's own model, timed in this
            # process with CUDA events (trusted code, before any candidate):
            # its time alone, as comparable to the runners' spans less the
            # null call as eager's is to its in-process time.
            timing = time_in_process(torch().compile(ref["model"]), ref, s, device)
            timing["seconds"] = _clock() - began
            ref["baselines"][name] = timing
        except Exception as e:  # noqa: BLE001  (a baseline that cannot be timed says why)
            ref["baselines"][name] = {"error": cut_error(str(e))}
        ref["baselines"][name]["measured_at"] = _utc_now()
    if path:
        fresh = {k: v for k, v in ref["baselines"].items() if not v.get("cached") and "error" not in v and k in names}
        if fresh:
            os.makedirs(cache_dir, exist_ok=True)
            merged = dict(cached, **fresh)
            fd, tmp = tempfile.mkstemp(dir=cache_dir, suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump(merged, f)
            os.replace(tmp, path)


def time_in_process(fn, ref, s, device):
    """Milliseconds per call of `fn` in the judge itself: warm-ups, then
    `trials` calls on fresh inputs, each after an L2 flush, between CUDA
    events with the device synchronized before the second."""
    t = torch()
    secret = random.SystemRandom()
    times = []
    with t.no_grad():
        for k in range(s["warmup"] + s["trials"]):
            xs = make_inputs(ref["ns"], secret.getrandbits(62), device, s["inputs"])
            if device.type == "cuda":
                flush_l2(device)
                start, end = t.cuda.Event(enable_timing=True), t.cuda.Event(enable_timing=True)
                start.record()
                fn(*xs)
                t.cuda.synchronize(device)
                end.record()
                end.synchronize()
                ms = start.elapsed_time(end)
            else:
                began = _clock()
                fn(*xs)
                ms = (_clock() - began) * 1e3
            if k >= s["warmup"]:
                times.append(ms)
            del xs
    return stats(times, "cuda_events" if device.type == "cuda" else "host")


def clock_name(device):
    return "judge" if device.type == "cuda" else "host"


def calibration(records, device):
    """What the judge adds to every call, from calls of the trusted
    reference runner: the span of a call that does nothing (`null_ms`), the
    judge's step after a call (`seal_ms`) and its L2 flush (`flush_ms`)."""
    nulls = [r["span_ms"] for r in records if r["who"] == "null"]
    seals = [r["seal_ms"] for r in records if r["who"] == "reference"]
    flushes = [r["flush_ms"] for r in records if r.get("flush_ms") is not None]
    return {"null_ms": median(nulls), "seal_ms": median(seals), "flush_ms": median(flushes) if flushes else None}


def call_times(records, who, cal, device, kinds=("timed",)):
    """Milliseconds of each of `who`'s calls of the given kinds: the span
    from release to `done` less the span of a call that does nothing, plus
    what the judge's step after it took beyond the reference's and what its
    step's flushes waited for the GPU."""
    null = cal["null_ms"]
    between = between_calls(records, cal) if device.type == "cuda" else {}
    out = []
    for r in records:
        if r["who"] != who or r["kind"] not in kinds:
            continue
        t = max(0.0, r["span_ms"] - null)
        if device.type == "cuda":
            t += max(0.0, r["seal_ms"] - cal["seal_ms"])
            if who == between.get(r["step"], (None, 0.0))[0]:
                t += between[r["step"]][1]
        out.append(t)
    return out


def dump_records(records):
    """With MTMC_JUDGE_RECORDS=DIR, every call's record of one run of steps
    in a JSON file there (for studying the judge's timing)."""
    if _RECORDS:
        os.makedirs(_RECORDS, exist_ok=True)
        with open(os.path.join(_RECORDS, f"steps-{os.getpid()}-{_clock():.6f}.json"), "w") as f:
            json.dump(records, f)


def flushes_after(records):
    """The L2 flushes that came right after a call in the same step, by
    who made that call; warm-up steps left out (the next candidate's
    runner may still be starting then)."""
    warmups = {r["step"] for r in records if r["kind"] == "warmup"}
    after = {}
    for prev, r in zip(records, records[1:]):
        if r.get("flush_ms") is not None and prev["step"] == r["step"] and r["step"] not in warmups:
            after.setdefault(prev["who"], []).append(r["flush_ms"])
    return after


def flush_reading(records, cal):
    """What the judge's L2 flushes say of the work a candidate left
    running between its calls: the figure read after its calls, the one
    it is held against, and the sentence that says which they are."""
    after = flushes_after(records)
    if len(after.get("candidate", [])) >= MIN_AFTER and len(after.get("null", [])) >= MIN_AFTER:
        # Like for like: a flush right after another process's call waits
        # for the GPU to switch to the judge. Beside a neighbour's work
        # (another process's kernels on the same GPU) some flushes wait
        # for its turn too, after any call: the lower quartile after the
        # candidate's calls is read, which work it leaves running after
        # every call still raises.
        busy, clean = lower_quartile(after["candidate"]), median(after["null"])
        return busy, clean, f"right after its calls took {busy:.3f} ms (lower quartile of {len(after['candidate'])}), right after a call that does nothing {clean:.3f} ms (median)"
    busy = median([r["flush_ms"] for r in records if r.get("flush_ms") is not None])
    clean = cal["flush_ms"]
    return busy, clean, f"took {busy:.3f} ms (median) while its process lived, {clean:.3f} ms with none"


def left_running(busy, clean):
    """Whether flushes of `busy` ms against `clean` ms say the GPU was busy
    with the candidate's work between its calls."""
    return busy > max(BUSY_RATIO * clean, clean + BUSY_MARGIN_MS)


def between_calls(records, cal):
    """Per step, who is charged with how long the judge's L2 flushes of the
    step waited for the GPU beyond a flush with no candidate (less
    FLUSH_SLACK_MS each): work a process left running between its calls
    delays them. The candidate where one called in the step, else the
    reference (so that eager alone is timed as candidates are)."""
    clean = cal.get("flush_ms")
    if clean is None:
        return {}
    steps = {}
    for r in records:
        if r.get("flush_ms") is None:
            continue
        who, extra = steps.get(r["step"], ("reference", 0.0))
        if r["who"] == "candidate":
            who = "candidate"
        steps[r["step"]] = (who, extra + max(0.0, r["flush_ms"] - clean - FLUSH_SLACK_MS))
    return steps


def timed_steps(ref, s, device, callers, kinds, deadline, on_call=None, checked=(), beside=None, before_counted=None):
    """Runs one step per entry of `kinds`: fresh inputs from `get_inputs()`
    under a seed no runner can know, a call that does nothing on the
    reference runner, then one call of each of `callers` (in an order that
    alternates), each after an L2 flush and followed by an event on the
    judge's stream. Where `beside` (a set of steps) is given, the call that
    does nothing and every caller but the first run on those steps only.
    After a candidate's call on a step in `checked` the judge copies its
    outputs (`on_call` checks them). `before_counted` is called once,
    before the first step that is not a warm-up. Returns a record per
    call."""
    null_runner = ref["runner"]
    serving = [null_runner] + [c for _, c in callers if c is not null_runner]
    for c in serving:
        c.begin_calls(deadline)
    try:
        return steps_of(ref, s, device, callers, kinds, deadline, on_call, checked, beside, before_counted)
    finally:
        for c in serving:
            if c.alive():
                c.end_calls(deadline)


def steps_of(ref, s, device, callers, kinds, deadline, on_call, checked, beside, before_counted):
    """`timed_steps` while the runners serve calls."""
    t = torch()
    secret = random.SystemRandom()
    stage, cuda, null_runner = ref["stage"], device.type == "cuda", ref["runner"]
    records, positions = [], {}
    began, spent = _clock(), {"inputs": 0.0, "calls": 0.0, "checks": 0.0}
    for step, kind in enumerate(kinds):
        if before_counted is not None and kind != "warmup":
            before_counted()
            before_counted = None
        seed = secret.getrandbits(62)
        g0 = _clock()
        xs, desc = stage.generate(ref["ns"], seed, s["inputs"], fresh=True)
        probe = probe_inputs(xs, secret, positions) if checked else None
        if cuda and probe is not None:
            # Done before the step's flush is timed (`generate` synced the
            # draw itself).
            t.cuda.current_stream(device).synchronize()
        spent["inputs"] += _clock() - g0
        if step < 2:
            debug(f"step {step} ({kind}): inputs {desc[:200]!r}")
        order = [("null", null_runner)] + (callers if step % 2 == 0 else list(reversed(callers)))
        if beside is not None and step not in beside:
            order = [c for c in order if c[0] == callers[0][0]]
        for who, child in order:
            rec = {"who": who, "kind": kind if who != "null" else "null", "step": step, "seed": seed}
            flush_ms = None
            if cuda:
                # Timed on the host, not with events: the judge's events
                # are stamped while its own context runs, so the wait for a
                # GPU busy with another process's work would not show.
                f0 = _clock()
                # The flush's own span by the judge's events, for the
                # records only (MTMC_JUDGE_RECORDS).
                a = t.cuda.Event(enable_timing=True) if _RECORDS else None
                if a is not None:
                    a.record()
                flush_l2(device)
                b = t.cuda.Event(enable_timing=a is not None)
                b.record()
                b.synchronize()
                flush_ms = (_clock() - f0) * 1e3
                if a is not None:
                    rec["flush_gpu_ms"] = a.elapsed_time(b)
            c0 = _clock()
            t0, t_done = child.call(from_runner("NULL") if who == "null" else from_runner("CALL"), desc, int(kind == "watched"), deadline)
            error = child.outcome_of_call()
            if error is not None and who == "null":
                raise RuntimeError(f"the reference runner failed a call that does nothing: {error}")
            if cuda:
                e = t.cuda.Event()
                e.record()
                e.synchronize()
            t1 = _clock()
            spent["calls"] += t1 - c0
            outs = None
            if step in checked and who == "candidate" and error is None:
                outs = child.outputs(stage, secret)
                rec["checked"] = True
            rec.update(span_ms=(t_done - t0) * 1e3, seal_ms=(t1 - t_done) * 1e3, flush_ms=flush_ms)
            if step < 2:
                debug(f"step {step}: {who} call", rec)
            if error is not None:
                rec["error"] = error
            records.append(rec)
            k0 = _clock()
            stop = on_call is not None and who == "candidate" and on_call(rec, child, xs, outs, probe)
            spent["checks"] += _clock() - k0
            if stop or (error is not None and who == "candidate"):
                return records
        del xs, probe
    debug(f"{len(kinds)} steps in {_clock() - began:.3f} s: " + ", ".join(f"{k} {v:.3f} s" for k, v in spent.items()))
    dump_records(records)
    return records


# ---------------------------------------------------------------- judging


def prepare(req):
    device = pick_device(req)
    if device is None:
        return {"status": "not_run", "why": "torch sees no GPU on this machine"}
    began = _clock()
    deadline = began + float(req.get("limit_seconds", 600))
    ref = reference_side(req["problem"], req, device, deadline)
    # The first candidate's runner is up before the first candidate comes.
    start_spare(device)
    spare_ready(deadline)
    return {"seconds": _clock() - began, "baselines": dict(ref["baselines"]), "refs_kept": ref["refs_kept"], "calibration": ref["calibration"]}


def runtime_error(outcome, text):
    outcome.pop("runtime", None)
    outcome.update(status="runtime_error", error=cut_error(text))
    return outcome


def evaluate(req):
    """The KernelBench protocol on one candidate, in a runner of its own."""
    problem, candidate = req["problem"], req["candidate"]
    s = settings(req)
    try:
        t = torch()
    except ImportError:
        t = None
    if t is None:
        raise ImportError("No module named 'torch'")
    device = pick_device(req)
    if device is None:
        return {"status": "not_run", "why": "torch sees no GPU on this machine"}
    began = _clock()
    limit = float(req.get("limit_seconds", 120))
    ref = reference_side(problem, req, device, began + max(limit, 600))
    reference_seconds = _clock() - began
    deadline = _clock() + 0.9 * limit
    gpu = t.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    outcome = {"status": "compile_error", "device": gpu, "reference_seconds": reference_seconds, "reference_tf32": ref["reference_tf32"]}
    child = None
    try:
        child = candidate_child(device, deadline)
        info = child.wait_ready(deadline)
        # The next candidate's runner starts now, while this one loads and
        # its correctness trials run (untimed).
        start_spare(device)
        outcome["integrity"] = {"confinement": info.get("confinement", [])}
        return judge_candidate(req, s, ref, child, outcome, device, deadline)
    except Overran as e:
        outcome.pop("runtime", None)
        detail = f" ({e.detail})" if e.detail else ""
        outcome.update(status="timeout", error=f"{e} (limit {limit:.0f} s); its process was stopped{detail}")
        return outcome
    except Lost as e:
        outcome.pop("runtime", None)
        outcome.update(status="crashed", error=str(e))
        return outcome
    except Exception as e:
        # The judge's own allocation failed while the candidate's process
        # held the GPU's memory (its caching allocator keeps what it freed):
        # the candidate ran out of memory beside the judge, a verdict (and,
        # beside kept reference outputs, a reason to judge it again with
        # them recomputed), not a failure of the evaluation.
        if child is not None and device.type == "cuda" and "out of memory" in str(e):
            return runtime_error(outcome, f"out of memory beside the judge (the judge's own allocation failed while the candidate's process held the GPU's memory): {error_text(e)}")
        raise
    finally:
        ref.pop("lock", None)
        if child is not None:
            child.kill()
        start_spare(device)


def judge_candidate(req, s, ref, child, outcome, device, deadline):
    """Loads the candidate in its runner, then: KernelBench's correctness
    trials (its seeds), one trial on inputs from a normal distribution,
    the timed calls, a check with the parameters scaled in place.

    Timed calls: a random number of warm-ups, then `trials` calls whose
    times count, mixed at random with calls run with the watchers on
    (`watched`); the judge copies and compares the outputs of some timed
    calls and one warm-up, chosen at random (`checked`). Every call gets
    fresh inputs drawn under a seed no runner can know; the candidate cannot
    tell the kinds apart before it returns. Beside a random share of the
    calls eager runs on the same inputs in the reference runner.

    A screen (`screen`: its number of timed calls) is the short form that
    ranks candidates: the first of KernelBench's correctness trials, then
    its timed calls (a few compared, one watched), no eager beside, no
    check of work left between calls or of scaled parameters. Its outcome
    says it is one; the full protocol decides every reported figure."""
    t = torch()
    screen = req.get("screen")
    if screen:
        outcome["screen"] = screen
    if ref["stateful"]:
        # Lockstep: this candidate's own reference model, fresh as its own.
        ref["lock"] = fresh_model(ref, device, s)
        outcome["integrity"]["lockstep"] = True
    atol, rtol = req.get("atol", 1e-4), req.get("rtol", 1e-4)
    tolerance = (atol, rtol, req.get("max_error_to_scale", 1e-2))
    stage = ref["stage"]
    started = _clock()
    loaded = load_into(child, ref["problem"], req["candidate"], "ModelNew", s, device, ref, deadline)
    outcome["load_seconds"] = _clock() - started
    if not loaded.get("ok"):
        error = loaded.get("error", "the candidate did not load")
        outcome["error"] = cut_error(error)
        if device.type == "cuda" and any(m in error for m in CUDA_FATAL):
            return runtime_error(outcome, error)
        return outcome
    torch_ops, swallowed = {}, []

    def watched_report():
        report = child.watch_report()
        for k, v in (report.get("torch_ops") or {}).items():
            if isinstance(v, int):
                torch_ops[str(k)] = torch_ops.get(str(k), 0) + v
        swallowed.extend(str(x) for x in (report.get("swallowed") or [])[:5])

    def watch_verdict(trials_run, check):
        if swallowed:
            outcome.update(status="incorrect", trials_run=trials_run, failed_check="fallback", why=f"the forward caught an exception and went on ({swallowed[0]}): a fallback hides what failed")
            return outcome
        compute = {k: v for k, v in torch_ops.items() if k not in MEMORY_OPS}
        if req.get("strict") and compute:
            outcome.update(status="incorrect", trials_run=trials_run, failed_check="strict", why=f"strict mode: the forward computes with torch ({', '.join(sorted(compute))}) on {check}")
            return outcome
        return None

    # KernelBench's correctness trials, then one on normal inputs.
    checks = []
    check_began = _clock()
    trials = [(n, seed, None) for n, seed in enumerate(ref["trial_seeds"])] + [(len(ref["trial_seeds"]), *normal_trial(s, ref))]
    state = {"second": "passed"}
    if screen:
        trials, state["second"] = trials[:1], "not run: a screen"
    # In lockstep (a model that keeps state) the trial on normal inputs
    # comes after the timed calls: one skipped (the reference's outputs not
    # finite there) would leave the judge's model a call ahead of the
    # candidate's, and only the check with scaled parameters comes after.
    later = []
    if ref["stateful"] and not screen:
        trials, later = trials[:-1], trials[-1:]

    def run_trials(trials):
        """The trials in order: the verdict of the first that fails, or
        none."""
        for n, seed, normal_seed in trials:
            trial_began = _clock()
            if normal_seed is not None and isinstance(ref["normal_ref"], str):
                state["second"] = ref["normal_ref"]
                return None
            xs, desc = stage.generate(ref["ns"], seed, s["inputs"], normal_seed)
            if normal_seed is None:
                refs = reference_outputs(ref, n, xs)
            else:
                refs = ref["normal_ref"] if ref["normal_ref"] is not None else normal_reference(ref, s, device, xs)
                if isinstance(refs, str):
                    state["second"] = refs
                    # The judge's model in lockstep took the call (or part
                    # of it) and the candidate's did not.
                    state["out_of_step"] = ref["stateful"]
                    return None
            marks = [_clock()]
            kept = snapshot(xs)
            marks.append(_clock())
            child.call(from_runner("CALL"), desc, 1, deadline)
            error = child.outcome_of_call()
            if error is not None:
                outcome["trials_run"] = len(checks)
                return runtime_error(outcome, error)
            marks.append(_clock())
            # Compared where the runner left them (it waits for the judge's
            # next call): a copy of gigabytes would cost as much as the call.
            outs = child.outputs(stage, copy=False)
            check = compare(refs, outs, *tolerance, scale_slack=normal_seed is not None)
            del outs
            marks.append(_clock())
            watched_report()
            which = "KernelBench's correctness trials" if normal_seed is None else "inputs drawn from a normal distribution"
            verdict = watch_verdict(len(checks) + 1, which)
            if verdict is not None:
                return verdict
            changed = mutated(kept, xs)
            if changed is not None:
                outcome.update(status="incorrect", failed_check="mutation", why=f"the candidate modified input {changed}", trials_run=len(checks) + 1)
                return outcome
            del xs, refs, kept
            checks.append(check)
            marks.append(_clock())
            if _DEBUG:
                steps = [marks[0] - trial_began] + [b - a for a, b in zip(marks, marks[1:])]
                debug(f"correctness trial {n}: {_clock() - trial_began:.3f} s (" + ", ".join(f"{k} {v * 1e3:.1f} ms" for k, v in zip(["inputs and reference", "snapshot", "call", "outputs compared", "other checks"], steps)) + ")")
            if not check["ok"]:
                if normal_seed is not None:
                    check["why"] = f"on inputs drawn from a normal distribution (same shapes and dtypes): {check['why']}"
                outcome.update(status="incorrect", trials_run=len(checks), failed_check="second_distribution" if normal_seed is not None else "correctness_trial", **{k: v for k, v in check.items() if k not in ("ok", "scale")})
                return outcome
        return None

    child.begin_calls(deadline)
    verdict = run_trials(trials)
    if verdict is not None:
        return verdict
    child.end_calls(deadline)
    outcome.update(
        status="correct",
        trials_run=len(checks),
        max_abs_err=max(c["max_abs_err"] for c in checks),
        rel_to_scale=max((c["rel_to_scale"] or 0.0) for c in checks),
        check_seconds=_clock() - check_began,
    )
    outcome["integrity"]["second_distribution"] = state["second"]

    # The timed calls.
    secret = random.SystemRandom()
    warmup = (1 if screen else s["warmup"]) + secret.randint(0, 1 if screen else 3)
    watched = 1 if screen else WATCHED
    kinds = ["timed"] * (screen or s["trials"]) + ["watched"] * watched
    secret.shuffle(kinds)
    kinds = ["warmup"] * warmup + kinds
    timed = [k for k, kind in enumerate(kinds) if kind == "timed"]
    least = SCREEN_CHECKED if screen else max(MIN_CHECKED, round(CHECKED_SHARE * s["trials"]))
    n_checked = min(len(timed), least + secret.randint(0, 1 if screen else 3))
    checked = set(secret.sample(timed, n_checked)) | {secret.randrange(warmup)}
    # A screen's steps beside the null call only (its span is the run's
    # calibration), eager nowhere.
    n_beside = min(len(kinds), SCREEN_BESIDE if screen else max(MIN_BESIDE, round(BESIDE_SHARE * len(kinds))))
    # As many even steps as odd ones (eager runs after the candidate on one
    # kind, before it on the other): the flushes right after its calls are
    # as many as those right after a call that does nothing, halved.
    evens, odds = range(0, len(kinds), 2), range(1, len(kinds), 2)
    half = min(n_beside // 2, len(odds))
    beside = set(secret.sample(evens, min(len(evens), n_beside - half))) | set(secret.sample(odds, half))
    failure = {}

    def on_call(rec, c, xs, outs, probe):
        """Whether the timing must stop: a watched call that hid a failure
        or computed with torch in strict mode, or a checked call whose
        outputs differ or that changed its inputs."""
        if rec.get("error"):
            return False
        expected = None
        if ref["stateful"]:
            # Every call mirrored on the judge's model, compared or not.
            expected = reference_forward(ref, snapshot(xs) if ref["mutates_inputs"] else xs)
            if device.type == "cuda":
                t.cuda.synchronize(device)
        if rec["kind"] == "watched":
            watched_report()
            verdict = watch_verdict(len(checks), "a timed call")
            if verdict is not None:
                failure["verdict"] = verdict
                return True
        if not rec.get("checked"):
            return False
        changed = probe_changed(probe, xs)
        if changed is not None:
            failure["verdict"] = dict(outcome, status="incorrect", failed_check="mutation", why=f"the candidate modified input {changed} on a timed call")
            return True
        if expected is None:
            expected = reference_forward(ref, snapshot(xs) if ref["mutates_inputs"] else xs)
        check = compare(expected, outs, *tolerance)
        if not check["ok"]:
            where = f"call {rec['step'] + 1} of {len(kinds)}, one of {len(checked)} the judge chose at random and compared after it returned"
            failure["verdict"] = dict(outcome, status="incorrect", failed_check="timed_call", why=f"on {where}: {check['why']}", **{k: v for k, v in check.items() if k not in ("ok", "scale", "why")})
            return True
        return False

    timing_began = _clock()
    watch_flushes = not screen and device.type == "cuda" and bool(ref["calibration"].get("flush_ms"))
    paired = not screen and s["paired_eager"] and "eager" in req.get("baselines", ["eager"]) and "error" not in ref["baselines"].get("eager", {"error": 1})
    callers = [("candidate", child)] + ([("reference", ref["runner"])] if paired else [])
    # The next candidate's runner, started before this one's load, may
    # start CUDA during the warm-ups, not beside a call whose time counts.
    records = timed_steps(ref, s, device, callers, kinds, deadline, on_call, checked, beside, before_counted=lambda: spare_ready(deadline))
    errors = [r for r in records if r.get("who") == "candidate" and r.get("error")]
    if errors:
        return runtime_error(outcome, errors[0]["error"])
    if "verdict" in failure:
        verdict = failure["verdict"]
        verdict.pop("runtime", None)
        verdict["integrity"] = outcome["integrity"]
        return verdict
    cal = dict(ref["calibration"])
    run_cal = calibration(records, device)
    cal["null_ms"] = run_cal["null_ms"]
    if paired:
        cal["seal_ms"] = run_cal["seal_ms"]
    outcome["runtime"] = stats(call_times(records, "candidate", cal, device), clock_name(device))
    outcome["timing_seconds"] = _clock() - timing_began
    outcome["integrity"].update(
        calls=len(kinds), warmup=warmup, checked=len(checked), watched=watched, eager_beside=len(beside) if paired else 0,
        null_ms=cal["null_ms"], seal_ms=cal["seal_ms"],
    )
    eager = None
    if paired:
        paired_timing = stats(call_times(records, "reference", cal, device), clock_name(device))
        eager = paired_baseline(paired_timing, ref["baselines"]["eager"])
    if watch_flushes:
        charged = [extra for who, extra in between_calls(records, cal).values() if who == "candidate"]
        outcome["integrity"]["between_ms"] = sum(charged) / len(charged) if charged else 0.0
        busy, clean, where = flush_reading(records, cal)
        outcome["integrity"]["flush_ms"] = busy
        if left_running(busy, clean):
            outcome.pop("runtime", None)
            outcome.update(status="incorrect", failed_check="work_between_calls", why=f"the GPU was busy with the candidate's work between its calls: the judge's L2 flush {where}")
            return outcome

    # In lockstep the trial on normal inputs, before the parameters are
    # scaled (the candidate's stay scaled, the judge's model's do not).
    if later:
        child.begin_calls(deadline)
        verdict = run_trials(later)
        if verdict is not None:
            verdict.pop("runtime", None)
            return verdict
        child.end_calls(deadline)
        outcome["integrity"]["second_distribution"] = state["second"]

    # The parameters change in place (the candidate's and the reference's
    # alike): weights derived from them and kept must be recomputed.
    if not screen and not state.get("out_of_step") and float_parameters(ref["model"]):
        scaled = child.request({"op": "scale", "factor": PARAMETER_SCALE}, deadline)
        if not scaled.get("ok"):
            return runtime_error(outcome, scaled.get("error", "scaling the parameters failed"))
        child.begin_calls(deadline)
        xs, desc = stage.generate(ref["ns"], ref["check_seeds"][-1], s["inputs"])
        refs = scaled_reference_outputs(ref, xs)
        child.call(from_runner("CALL"), desc, 0, deadline)
        error = child.outcome_of_call()
        if error is not None:
            return runtime_error(outcome, error)
        check = compare(refs, child.outputs(stage), *tolerance)
        child.end_calls(deadline)
        del xs, refs
        if not check["ok"]:
            outcome.pop("runtime", None)
            outcome.update(status="incorrect", failed_check="scaled_parameters", why=f"after its parameters were scaled in place by {PARAMETER_SCALE} (as a training step changes them): {check['why']}", **{k: v for k, v in check.items() if k not in ("ok", "why", "scale")})
            return outcome
    report = child.request({"op": "report"}, deadline)
    outcome["kernels"] = [k for k in report.get("kernels", []) if isinstance(k, dict)][:64]
    outcome["torch_ops"] = dict(sorted((k, v) for k, v in torch_ops.items() if k not in MEMORY_OPS))
    outcome["baselines"] = {k: v for k, v in ref["baselines"].items() if k in req.get("baselines", ["eager"])}
    if eager is not None:
        outcome["baselines"]["eager"] = eager
    return outcome


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


HANDLERS = {"hello": hello, "prepare": prepare, "eval": evaluate}


def main():
    global _OUT
    import faulthandler

    # `kill -USR1` prints where every thread of the judge is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Neither a runner nor anything else may trace this process or read its
    # memory.
    _libc.prctl(4, ctypes.c_ulong(0), 0, 0, 0)
    _OUT = os.fdopen(os.dup(1), "w")
    # Nothing else may write the protocol's channel: stdout becomes stderr.
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
        except json.JSONDecodeError as e:
            reply({"id": None, "ok": False, "error": f"request is not JSON: {e}"})
            continue
        token = req.get("token")
        handler = HANDLERS.get(req.get("op"))
        if handler is None:
            reply({"id": req.get("id"), "token": token, "ok": False, "error": f"unknown op {req.get('op')!r}"})
            continue
        try:
            reply({"id": req.get("id"), "token": token, "ok": True, "result": handler(req)})
        except Exception as e:  # noqa: BLE001  (the caller gets every failure as a reply)
            reply({"id": req.get("id"), "token": token, "ok": False, "error": error_text(e)})


if __name__ == "__main__":
    main()

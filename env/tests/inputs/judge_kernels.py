# The judge's own Triton kernels (judge.py's KERNELS_SOURCE) run in
# Triton's CPU interpreter on CPU tensors: `gap` (the first pass of a
# comparison) finds what torch finds, NaN as infinity, at every position
# and past the last full block; `draw` (a timed call's uniform inputs) fills
# every element from [0, 1), differently under another key. Prints one line
# per check, "ok" or what went wrong; exits 1 on any failure, 2 where
# Triton is not installed. Run by env/tests/inputs.rs with the judge's
# folder first on sys.path.
import math
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"
import torch  # noqa: E402

try:
    import triton  # noqa: E402,F401
except ImportError:
    print("no triton")
    sys.exit(2)
from harness import check, done, import_judge  # noqa: E402

judge = import_judge()


def torch_figures(o, r):
    n = o.numel()
    spans = [(b, min(b + judge.COMPARE_CHUNK, n)) for b in range(0, n, judge.COMPARE_CHUNK)]
    return [math.inf if math.isnan(v) else v for v in judge.torch_gap(torch, o, r, spans)]


# Two programs and a part of a third: the mask past the end is crossed.
n = 2 * 4096 * 8 + 1000
g = torch.Generator().manual_seed(7)
# bfloat16 is left to the GPU checks (gpu-check's draw section): the
# interpreter holds tensors as numpy arrays, and numpy has no bfloat16.
for dtype in (torch.float32, torch.float16):
    ref = torch.randn(n, generator=g).to(dtype)
    out = (ref.float() + 1e-3 * torch.randn(n, generator=g)).to(dtype)
    got = list(judge.gap_kernel(out, ref))
    check(f"{dtype}: the largest gap and scale are torch's ({got})", got == torch_figures(out, ref))
    for where in (0, 4096 * 8 - 1, n - 1):
        bad = out.clone()
        bad[where] = ref[where] + 1000.0
        got = list(judge.gap_kernel(bad, ref))
        check(f"{dtype}: one element off at {where} of {n} is the largest gap ({got[0]})", got == torch_figures(bad, ref) and got[0] >= 999.0)
    nan = out.clone()
    nan[n - 2] = float("nan")
    got = list(judge.gap_kernel(nan, ref))
    check(f"{dtype}: a NaN output is an infinite gap ({got[0]})", got[0] == math.inf and got == torch_figures(nan, ref))
    inf = ref.clone()
    inf[3] = float("-inf")
    got = list(judge.gap_kernel(inf, inf.clone()))
    check(f"{dtype}: equal infinities: an infinite gap and scale, as torch's NaN ({got})", got == [math.inf, math.inf] and got == torch_figures(inf, inf.clone()))

draw = judge.judge_kernels().draw
x = torch.full((n,), -1.0)
draw[(-(-n // 4096),)](x, n, 11, 22, 33, NORMAL=False, DIGITS=24, BLOCK=4096)
check(f"draw: every element in [0, 1) ({float(x.min()):.4f} to {float(x.max()):.4f})", float(x.min()) >= 0.0 and float(x.max()) < 1.0)
check("draw: a uniform draw passes the judge's first-draw check", judge.fast_draw_wrong(x, "uniform") is None)
y = x.clone()
draw[(-(-n // 4096),)](x, n, 11, 23, 33, NORMAL=False, DIGITS=24, BLOCK=4096)
check("draw: another key, other values", float((x != y).float().mean()) > 0.99)

done()

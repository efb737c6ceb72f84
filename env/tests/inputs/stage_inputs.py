# Drives the judge's input staging (judge.py's Stage) on the CPU with real
# torch; prints one line per check, "ok" or what went wrong, and exits 1 on
# any failure. Run by env/tests/inputs.rs with the judge's folder first on
# sys.path; with the argument `cuda` (scripts/gpu-check's `draw` section)
# it checks the staging on the GPU instead, the judge's own draw among it,
# and the comparison of outputs by the judge's own kernel.
import sys
import types

import torch
from harness import check, done, import_judge

on_gpu = sys.argv[1:] == ["cuda"]
judge = import_judge()


def gpu_checks():
    """The staging on the GPU: timed inputs drawn again in place by the
    judge's own kernel (uniform and normal, float32, float16 and bfloat16),
    integers by torch, KernelBench's seeded values unchanged."""
    dev = torch.device("cuda")
    n = 1 << 22
    factories = {"get_inputs": lambda: [
        torch.rand(n), torch.randn(2048, 2048), torch.rand(n, dtype=torch.float16),
        torch.randn(n, dtype=torch.bfloat16), torch.randint(0, 5, (4096,)), 3.0]}
    stage = judge.Stage(dev, 0)
    xs, desc = stage.generate(factories, 11, "device")
    check("gpu: recipes", stage.recipes == [("uniform", None), ("normal", None), ("uniform", None), ("normal", None), ("integers", (0, 5)), ("kept", None)])
    expected = judge.make_inputs(factories, 11, dev, "device")
    check("gpu: a seeded draw is get_inputs() under that seed", all(torch.equal(a, b) for a, b in zip(xs[:5], expected[:5])))
    before = [x.clone() for x in xs[:5]]
    ptrs = [x.data_ptr() for x in xs[:5]]
    ys, desc2 = stage.generate(factories, 12, "device", fresh=True)
    check("gpu: a fresh draw keeps the descriptor and addresses", desc2 == desc and [y.data_ptr() for y in ys[:5]] == ptrs)
    drawn = {k for k in judge._FAST_DRAW if isinstance(k, tuple)}
    check(f"gpu: the judge's kernel drew every float input ({judge._FAST_DRAW.get('off', 'on')})", "off" not in judge._FAST_DRAW and drawn == {("uniform", torch.float32), ("normal", torch.float32), ("uniform", torch.float16), ("normal", torch.bfloat16)})
    check("gpu: a fresh draw changes every tensor", all(not torch.equal(a, b) for a, b in zip(before, ys)))
    for x, kind in zip(ys[:4], ["uniform", "normal", "uniform", "normal"]):
        v = x.float().reshape(-1)
        mean, std, low, high = float(v.mean()), float(v.std()), float(v.min()), float(v.max())
        if kind == "uniform":
            ok = low >= 0.0 and high < 1.0 and abs(mean - 0.5) < 2e-3 and abs(std - 12 ** -0.5) < 2e-3
        else:
            ok = abs(mean) < 5e-3 and abs(std - 1.0) < 5e-3 and low < -4.0 and high > 4.0
        check(f"gpu: {kind} {x.dtype} (mean {mean:.4f}, std {std:.4f}, range {low:.3f} to {high:.3f})", ok)
    check("gpu: integers stay in [0, 5) and reach both ends", int(ys[4].min()) == 0 and int(ys[4].max()) == 4)
    a = ys[0].clone()
    ys, _ = stage.generate(factories, 13, "device", fresh=True)
    b = ys[0]
    corr = float(torch.corrcoef(torch.stack([a, b]))[0, 1])
    near = float(torch.corrcoef(torch.stack([b[:-1], b[1:]]))[0, 1])
    check(f"gpu: draws under two keys, and neighbours, are uncorrelated ({corr:.1e}, {near:.1e})", abs(corr) < 5e-3 and abs(near) < 5e-3)
    t = torch.rand(512, 256, device=dev).t()
    check("gpu: a strided tensor is left to torch", not judge.fast_draw(t, "uniform", 1) and "off" not in judge._FAST_DRAW)
    check("gpu: a wrong draw is seen", judge.fast_draw_wrong(torch.zeros(1 << 16, device=dev), "uniform") is not None and judge.fast_draw_wrong(torch.rand(1 << 16, device=dev), "uniform") is None)
    compare_checks(dev)


def compare_checks(dev):
    """The judge's comparison on the GPU (its `gap` kernel): one wrong
    element anywhere is found, NaN fails, equal infinities pass, and its
    figures are torch's."""
    n = (1 << 22) + 333
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        ref = torch.randn(n, device=dev).to(dtype)
        same = judge.compare([ref], [ref.clone()], 1e-4, 1e-4, 1e-2)
        check(f"gpu: {dtype} outputs equal to the reference pass", same["ok"] and same["max_abs_err"] == 0.0)
        for where in (0, n // 2 + 7, n - 1):
            out = ref.clone()
            out[where] += 1.0
            got = judge.compare([ref], [out], 1e-4, 1e-4, 1e-2)
            check(f"gpu: {dtype}, one element off at {where} of {n} fails there", not got["ok"] and got.get("first_bad_index") == [where])
        out = ref.clone()
        out[n // 3] = float("nan")
        check(f"gpu: {dtype}, a NaN fails", not judge.compare([ref], [out], 1e-4, 1e-4, 1e-2)["ok"])
        both = ref.clone()
        both[5] = float("inf")
        check(f"gpu: {dtype}, equal infinities pass", judge.compare([both], [both.clone()], 1e-4, 1e-4, 1e-2)["ok"])
        out = ref + 1e-3
        fast = judge.fast_gap(out, ref)
        spans = [(b, min(b + judge.COMPARE_CHUNK, n)) for b in range(0, n, judge.COMPARE_CHUNK)]
        check(f"gpu: {dtype}, the kernel's largest gap and scale are torch's ({fast})", fast is not None and list(fast) == list(judge.torch_gap(torch, out, ref, spans)))
    check(f"gpu: the judge's kernel compared every output ({judge._GAP.get('off', 'on')})", "off" not in judge._GAP and {k for k in judge._GAP if k != "off"} == {torch.float32, torch.float16, torch.bfloat16})


if on_gpu:
    gpu_checks()
    done()

cpu = torch.device("cpu")

# Every input a random factory's untouched result: drawn again in place.
factories = {"get_inputs": lambda: [torch.rand(64, 32), torch.randint(3, 9, (500,)), 7, torch.randn(16, 8)]}
stage = judge.Stage(cpu, 1 << 20)
xs, desc = stage.generate(factories, 1, "device")
check("recipes of rand, randint, a number, randn", stage.recipes == [("uniform", None), ("integers", (3, 9)), ("kept", None), ("normal", None)])
before = [x.clone() if isinstance(x, torch.Tensor) else x for x in xs]
ptrs = [x.data_ptr() for x in xs if isinstance(x, torch.Tensor)]
ys, desc2 = stage.generate(factories, 2, "device", fresh=True)
check("a fresh draw keeps the descriptor", desc2 == desc)
check("a fresh draw keeps the addresses", [y.data_ptr() for y in ys if isinstance(y, torch.Tensor)] == ptrs)
check("a fresh draw changes every tensor", all(not torch.equal(a, b) for a, b in zip(before, ys) if isinstance(a, torch.Tensor)))
check("uniform stays in [0, 1)", 0.0 <= float(ys[0].min()) and float(ys[0].max()) < 1.0)
check("randint stays in [3, 9) and reaches both ends", int(ys[1].min()) == 3 and int(ys[1].max()) == 8)
check("the number is kept", ys[2] == 7)
check("normal is signed", float(ys[3].min()) < 0.0 < float(ys[3].max()))
again, _ = stage.generate(factories, 1, "device")
check("a seeded draw is get_inputs() under that seed", torch.equal(again[0], before[0]) and torch.equal(again[1], before[1]))

# An input derived from a factory's result (or changed after it): drawn by
# get_inputs() again, still at the same address.
derived = {"get_inputs": lambda: [torch.rand(64, 32) * 2 - 1, torch.rand(10).mul_(3)]}
stage = judge.Stage(cpu, 1 << 20)
xs, desc = stage.generate(derived, 1, "device")
check("no recipe for a derived or changed input", stage.recipes == [None, None])
first = xs[0].clone()
ys, desc2 = stage.generate(derived, 5, "device", fresh=True)
check("a derived input is drawn again by get_inputs()", desc2 == desc and not torch.equal(first, ys[0]) and float(ys[0].min()) < 0.0)

# The same tensor twice: copies part them, so it is not drawn again in
# place (two draws would differ where get_inputs() gives one).
shared = torch.rand(8)
aliased = {"get_inputs": lambda: [shared, shared]}
stage = judge.Stage(cpu, 1 << 20)
stage.generate(aliased, 1, "device")
check("inputs that share memory are not drawn again in place", stage.recipes == [None])

# Slots (the GPU's stable addresses), with CPU tensors: one address per
# input from one draw to the next; inputs that share memory, or overlap
# themselves, keep the draw's own.
slots = types.SimpleNamespace(slots={}, device=cpu, in_pool=lambda x: x)
a, b = torch.rand(4, 5), torch.rand(5, 4).t()
out, placed = judge.Stage.into_slots(slots, [a, b, 3])
check("slots copy the values, strides kept", placed and torch.equal(out[0], a) and torch.equal(out[1], b) and out[1].stride() == b.stride() and out[2] == 3)
ptrs = [o.data_ptr() for o in out[:2]]
out2, _ = judge.Stage.into_slots(slots, [torch.rand(4, 5), torch.rand(5, 4).t(), 3])
check("slots keep their addresses", [o.data_ptr() for o in out2[:2]] == ptrs)
base = torch.rand(10)
view_pair = [base[:5], base[5:]]
out3, placed3 = judge.Stage.into_slots(slots, view_pair)
check("inputs sharing memory keep it", not placed3 and out3[0] is view_pair[0])
expanded = torch.rand(3, 1).expand(3, 4)
out4, placed4 = judge.Stage.into_slots(slots, [expanded])
check("an expanded input keeps its memory", not placed4 and out4[0] is expanded)

done()

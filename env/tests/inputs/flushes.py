# The judge's reading of its own L2 flushes between calls (`flush_reading`,
# `left_running` in judge.py), on steps laid out as `steps_of` records
# them: each record's flush is the one timed just before its call, so the
# flush on the candidate's record follows the call that does nothing, and
# the one on eager's record follows the candidate's call. The figures of
# the shared GPU are those of one Triton program on an H200 that 20
# optimizing processes shared (the GPU tests), in milliseconds.
from harness import check, done, import_judge

judge = import_judge()

CLEAN = 0.22


def steps(after_null, after_candidate):
    """Records of beside steps, the candidate before eager: one step per
    pair of flushes (after the call that does nothing, after the
    candidate's call), after a warm-up step whose flushes are left out."""
    records = [
        {"who": "null", "kind": "null", "step": 0, "flush_ms": 9.0},
        {"who": "candidate", "kind": "warmup", "step": 0, "flush_ms": 9.0},
        {"who": "reference", "kind": "warmup", "step": 0, "flush_ms": 9.0},
    ]
    for k, (a, b) in enumerate(zip(after_null, after_candidate), start=1):
        records += [
            {"who": "null", "kind": "null", "step": k, "flush_ms": CLEAN},
            {"who": "candidate", "kind": "timed", "step": k, "flush_ms": a},
            {"who": "reference", "kind": "timed", "step": k, "flush_ms": b},
        ]
    return records


def verdict(after_null, after_candidate):
    busy, clean, where = judge.flush_reading(steps(after_null, after_candidate), {"flush_ms": CLEAN})
    return judge.left_running(busy, clean), where


shared_null = [0.222, 0.223, 0.223, 0.224, 0.226, 0.228, 0.231, 0.236, 0.247, 1.694]
shared_candidate = [0.171, 0.242, 0.243, 0.244, 1.812, 1.818, 1.84, 1.963, 2.251, 2.273]
failed, where = verdict(shared_null, shared_candidate)
check(f"an honest candidate on a GPU another process shares is not failed ({where})", not failed)
check("the reading says which figures it compared", "lower quartile of 10" in where and "(median)" in where)
# The median of those flushes is in the slow group: read so, the shared GPU
# would fail the honest candidate.
check("the shared GPU's flushes after the candidate's calls have a median above the limit",
      judge.left_running(judge.median(shared_candidate), judge.median(shared_null)))

quiet = [0.22, 0.221, 0.223, 0.219, 0.224, 0.222, 0.22, 0.225, 0.221, 0.223]
failed, _ = verdict(quiet, [x + 0.01 for x in quiet])
check("an honest candidate on a quiet GPU is not failed", not failed)

# Work left queued after every call (0.3 ms of it) delays every flush
# after the candidate's calls, the fastest too.
failed, where = verdict(quiet, [x + 0.3 for x in quiet])
check(f"work left running after every call fails the candidate ({where})", failed)
# Beside a neighbour too.
failed, _ = verdict(shared_null, [x + 0.3 for x in sorted(shared_candidate)[:3]] * 3 + [2.3])
check("work left running after every call fails it on a shared GPU too", failed)

# Without enough flushes of both kinds (eager not beside), every flush
# while the candidate's process lived is held against a flush with none.
busy, clean, where = judge.flush_reading(steps(quiet[:3], quiet[:3]), {"flush_ms": CLEAN})
check(f"with few flushes after calls every flush is read ({where})", "while its process lived" in where and clean == CLEAN)
done()

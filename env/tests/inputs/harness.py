# What the judge's test scripts share: judge.py imported with its runner's
# source (judge.py reads it from its first argument), and one printed line
# per check, "ok" or what went wrong.
import os
import sys

failed = []


def check(name, ok):
    print(("ok " if ok else "FAILED ") + name)
    if not ok:
        failed.append(name)


def import_judge():
    with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "../../python/runner.py")) as f:
        sys.argv[1:] = [f.read()]
    import judge

    return judge


def done():
    sys.exit(1 if failed else 0)

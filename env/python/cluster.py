"""The driver's side of judging on a Dask cluster (`mtmc ... --cluster ADDRESS`).

mtmc starts this script (shipped inside its binary) with the Python that has
`distributed`, and speaks JSON lines with it over stdin and stdout:

  {"op": "connect", "address": A, "judge": SRC, "runner": SRC, "gpu": NAME or null,
   "wait_seconds": S}
      -> {"ok": true, "gpu": NAME, "workers": [{"address", "gpu", "host"}],
          "refused": [{"address", "gpu"}]}
  {"op": "batch", "prepare": REQUEST, "requests": [REQUEST, ...],
   "prepare_limit": S, "limit": S}
      -> one line per request as it finishes, in any order:
         {"index": I, "worker": ADDRESS, "reply": REPLY}
         REPLY is {"ok": true, "result": OUTCOME, "wall_seconds", "recomputed"},
         {"ok": false, "error": TEXT} (the judge answered that it failed), or
         {"lost": "timeout" | "died" | "killed", "error": TEXT}
      -> then {"done": true, "workers": [...]} (the run's workers now)

Each candidate is a Dask task that needs the resource `judge` (one per GPU:
`dask worker ADDRESS --nthreads 1 --resources judge=1`, one worker per GPU,
each seeing its GPU alone). On the worker, the task hands the candidate to a
judge process (`judge.py`, the same judge a local run starts, in a network
namespace of its own where `unshare` allows), kept across tasks with its
reference side: a worker prepares a problem once. A worker that is lost
(its process or host gone) costs only its tasks in flight, which the
scheduler gives to another worker; a candidate that kills its judge costs
that candidate (its reply says the judge died), and the next task starts a
new judge. A worker whose GPU is not the run's takes no candidate.
"""

import collections
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid

try:
    from distributed.diagnostics.plugin import WorkerPlugin
except ImportError as e:
    sys.stderr.write("No module named 'distributed' (%s)\n" % e)
    sys.exit(3)

# A signal to mtmc (Ctrl-C) stops the run between rounds; the candidates in
# flight here finish and their outcomes are kept.
signal.signal(signal.SIGINT, signal.SIG_IGN)

PLUGIN = "mtmc-judge"
STDERR_TAIL = 20


def _isolation():
    """The `unshare` flags that give the judge a network of its own here, or
    None where none works (the judge's own confinement of each candidate
    still holds)."""
    if os.environ.get("MTMC_WORKER_NETWORK") == "allow":
        return None
    for flags in (["--net"], ["--net", "--map-root-user"]):
        try:
            if subprocess.run(["unshare", *flags, "true"], capture_output=True).returncode == 0:
                return flags
        except OSError:
            return None
    return None


def _die_with_parent():
    # The judge goes with the worker that started it (a lost worker leaves
    # no judge holding its GPU).
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except Exception:
        pass


class JudgeHost(WorkerPlugin):
    """A Dask worker plugin: the worker's judge process and the problem it
    has prepared."""

    name = PLUGIN

    def __init__(self, judge, runner):
        self.judge_src = judge
        self.runner_src = runner

    def setup(self, worker=None):
        self.lock = threading.Lock()
        self.proc = None
        self.key = None
        self.refs_kept = None
        self.gpu_name = None
        self.isolation = _isolation()

    def teardown(self, worker=None):
        self.stop()

    def gpu(self):
        """The name of the GPU this worker's judge sees (torch's, as the
        judge reports it), or `cpu`."""
        if self.gpu_name is None:
            code = "import torch; print(torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'cpu')"
            try:
                r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
                self.gpu_name = r.stdout.strip().splitlines()[-1] if r.returncode == 0 and r.stdout.strip() else "cpu"
            except (OSError, subprocess.TimeoutExpired):
                self.gpu_name = "cpu"
        return self.gpu_name

    def stop(self):
        if self.proc is not None:
            try:
                self.proc.kill()
                self.proc.wait(timeout=10)
            except Exception:
                pass
        self.proc = None
        self.key = None

    def start(self):
        cmd = [sys.executable, "-u", "-c", self.judge_src, self.runner_src]
        if self.isolation:
            cmd = ["unshare", *self.isolation, "--", *cmd]
        self.proc = subprocess.Popen(
            cmd,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            bufsize=1,
            preexec_fn=_die_with_parent,
        )
        self.token = uuid.uuid4().hex + uuid.uuid4().hex
        self.next_id = 1
        self.lines = queue.Queue()
        self.tail = collections.deque(maxlen=STDERR_TAIL)
        proc, lines, tail = self.proc, self.lines, self.tail

        def read_out():
            for line in proc.stdout:
                lines.put(line)
            lines.put(None)

        def read_err():
            for line in proc.stderr:
                tail.append(line.rstrip("\n"))

        threading.Thread(target=read_out, daemon=True).start()
        threading.Thread(target=read_err, daemon=True).start()

    def request(self, req, limit):
        """One request to the judge: its reply (`ok`/`result` or `error`), or
        `lost` when it overran `limit` or died (it is then stopped)."""
        if self.proc is None or self.proc.poll() is not None:
            self.stop()
            self.start()
        req = dict(req, id=self.next_id, token=self.token)
        self.next_id += 1
        deadline = time.monotonic() + limit
        try:
            self.proc.stdin.write(json.dumps(req) + "\n")
            self.proc.stdin.flush()
        except OSError:
            return self.died()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                self.stop()
                return {"lost": "timeout", "error": "no reply within %.0fs; the worker was stopped" % limit}
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                return self.died()
            try:
                reply = json.loads(line)
            except ValueError:
                self.stop()
                return {"lost": "died", "error": "protocol error: reply is not JSON"}
            if reply.get("token") != self.token:
                self.stop()
                return {"lost": "died", "error": "protocol error: a reply without this worker's token (a line written into its channel by something else); the worker was stopped"}
            if reply.get("id") != req["id"]:
                continue
            if reply.get("ok"):
                return {"ok": True, "result": reply.get("result")}
            return {"ok": False, "error": reply.get("error") or "the worker reported a failure"}

    def died(self):
        try:
            code = self.proc.wait(timeout=5)
            status = "exit status: %s" % code
        except Exception:
            status = "no exit status"
        time.sleep(0.05)
        tail = list(self.tail)
        self.stop()
        last = (": " + tail[-1]) if tail else ""
        return {"lost": "died", "error": "the worker died (%s)%s" % (status, last), "stderr": tail}

    def judge(self, prepare, request, prepare_limit, limit, gpu):
        with self.lock:
            if gpu is not None and self.gpu() != gpu:
                return {"refused": self.gpu()}
            return self._judge(prepare, request, prepare_limit, limit)

    def _prepared(self, prepare, prepare_limit):
        key = json.dumps(prepare, sort_keys=True)
        if self.key == key and self.proc is not None and self.proc.poll() is None:
            return None
        self.key = None
        r = self.request(prepare, prepare_limit)
        if not r.get("ok"):
            return r
        self.key = key
        result = r.get("result") or {}
        self.refs_kept = result.get("refs_kept")
        return None

    def _judge(self, prepare, request, prepare_limit, limit):
        failed = self._prepared(prepare, prepare_limit)
        if failed is not None:
            return failed
        began = time.monotonic()
        r = self.request(request, limit)
        r["wall_seconds"] = time.monotonic() - began
        result = r.get("result") or {}
        # As a local worker does: a candidate out of memory beside the kept
        # reference outputs is judged once more, by a fresh judge, with
        # them recomputed for each check.
        if (
            r.get("ok")
            and result.get("status") == "runtime_error"
            and "out of memory" in (result.get("error") or "")
            and self.refs_kept not in ("recomputed", "lockstep")
        ):
            first = r["wall_seconds"]
            self.stop()
            again = dict(prepare, references="recompute")
            failed = self._prepared(again, prepare_limit)
            if failed is not None:
                return failed
            began = time.monotonic()
            r = self.request(dict(request, references="recompute"), limit)
            r["wall_seconds"] = first + time.monotonic() - began
            r["recomputed"] = True
            # The next candidate is judged with the outputs kept again.
            self.stop()
        return r


def judge_task(prepare, request, prepare_limit, limit, gpu):
    from distributed import get_worker

    worker = get_worker()
    host = worker.plugins[PLUGIN]
    reply = host.judge(prepare, request, prepare_limit, limit, gpu)
    return worker.address, reply


def gpu_task():
    from distributed import get_worker

    worker = get_worker()
    return worker.address, worker.plugins[PLUGIN].gpu()


def write(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


class Bridge:
    def __init__(self):
        self.client = None
        self.gpu = None
        self.names = {}
        self.refused = {}
        self.n_workers = None

    def judge_workers(self):
        if self.n_workers is None:
            self.n_workers = _takes_n_workers()
        info = self.client.scheduler_info(n_workers=-1) if self.n_workers else self.client.scheduler_info()
        return {a: w for a, w in info.get("workers", {}).items() if w.get("resources", {}).get("judge", 0) >= 1}

    def connect(self, msg):
        from distributed import Client

        self.client = Client(msg["address"], timeout=msg.get("connect_seconds", 30))
        deadline = time.monotonic() + msg.get("wait_seconds", 60)
        while not self.judge_workers():
            if time.monotonic() > deadline:
                raise RuntimeError(
                    "the cluster at %s has no worker with the resource `judge`: start one per GPU with "
                    "`CUDA_VISIBLE_DEVICES=N dask worker %s --nthreads 1 --resources judge=1`" % (msg["address"], msg["address"])
                )
            time.sleep(0.5)
        plugin = JudgeHost(msg["judge"], msg["runner"])
        if hasattr(self.client, "register_plugin"):
            self.client.register_plugin(plugin, name=PLUGIN)
        else:
            self.client.register_worker_plugin(plugin, name=PLUGIN)
        workers = self.judge_workers()
        futures = [
            self.client.submit(gpu_task, workers=[a], allow_other_workers=False, resources={"judge": 1}, pure=False, key="mtmc-gpu-" + uuid.uuid4().hex)
            for a in workers
        ]
        names = dict(f.result() for f in futures)
        wanted = msg.get("gpu")
        if wanted is None:
            counts = collections.Counter(names.values())
            wanted = max(sorted(counts), key=lambda g: counts[g])
        else:
            # A name as the table gives it (`H200`) matches the driver's
            # (`NVIDIA H200`).
            full = [n for n in names.values() if n == wanted or wanted.lower() in n.lower().split() or n.lower().endswith(wanted.lower())]
            if not full:
                raise RuntimeError(
                    "no worker of the cluster at %s has the %s: they have %s"
                    % (msg["address"], wanted, ", ".join(sorted(set(names.values()))))
                )
            wanted = full[0]
        self.gpu = wanted
        self.names = names
        self.refused = {a: g for a, g in names.items() if g != wanted}
        return {
            "ok": True,
            "gpu": wanted,
            "workers": [{"address": a, "gpu": g, "host": workers[a].get("host", "")} for a, g in sorted(names.items()) if g == wanted],
            "refused": [{"address": a, "gpu": g} for a, g in sorted(self.refused.items())],
        }

    def submit(self, args):
        restrict = {}
        if self.refused:
            allowed = [a for a in self.judge_workers() if a not in self.refused]
            if allowed:
                restrict = {"workers": allowed, "allow_other_workers": False}
        return self.client.submit(judge_task, *args, resources={"judge": 1}, pure=False, key="mtmc-judge-" + uuid.uuid4().hex, **restrict)

    def batch(self, msg):
        from distributed import as_completed

        args = [(msg["prepare"], r, msg["prepare_limit"], msg["limit"], self.gpu) for r in msg["requests"]]
        index = {}
        for i, a in enumerate(args):
            index[self.submit(a)] = i
        pending = as_completed(list(index))
        grace = msg.get("wait_seconds", 60)
        alone_since = None
        while index:
            ready = pending.next_batch(block=False)
            if not ready:
                # No worker of the run's GPU left (lost, and not back
                # within the grace): the candidates left are lost too.
                if [a for a in self.judge_workers() if a not in self.refused]:
                    alone_since = None
                elif alone_since is None:
                    alone_since = time.monotonic()
                elif time.monotonic() - alone_since > grace:
                    for f, i in list(index.items()):
                        f.cancel()
                        write({"index": i, "worker": "", "reply": {"lost": "killed", "error": "no worker with the %s was left in the cluster for %.0f s" % (self.gpu, grace)}})
                    index.clear()
                    break
                time.sleep(0.01)
                continue
            for done in ready:
                i = index.pop(done)
                try:
                    address, reply = done.result()
                except Exception as e:  # KilledWorker: the task took its workers with it
                    write({"index": i, "worker": "", "reply": {"lost": "killed", "error": "the candidate's task was lost with the workers it ran on (%s: %s)" % (type(e).__name__, e)}})
                    continue
                if "refused" in reply:
                    self.refused[address] = reply["refused"]
                    sys.stderr.write("mtmc cluster: worker %s has the %s, not the run's %s: it takes no more candidates\n" % (address, reply["refused"], self.gpu))
                    if not [a for a in self.judge_workers() if a not in self.refused]:
                        write({"index": i, "worker": "", "reply": {"lost": "killed", "error": "no worker with the %s is left in the cluster" % self.gpu}})
                        continue
                    f = self.submit(args[i])
                    index[f] = i
                    pending.add(f)
                    continue
                # A worker that joined after the connection passed the
                # task's check of its GPU.
                self.names.setdefault(address, self.gpu)
                write({"index": i, "worker": address, "reply": reply})
        live = self.judge_workers()
        write({"done": True, "workers": [{"address": a, "gpu": self.names.get(a, ""), "host": live[a].get("host", "")} for a in sorted(live) if a not in self.refused]})


def _takes_n_workers():
    import inspect
    from distributed import Client

    try:
        return "n_workers" in inspect.signature(Client.scheduler_info).parameters
    except (TypeError, ValueError):
        return False


def main():
    bridge = Bridge()
    for line in sys.stdin:
        msg = json.loads(line)
        try:
            if msg["op"] == "connect":
                write(bridge.connect(msg))
            elif msg["op"] == "batch":
                bridge.batch(msg)
            else:
                write({"ok": False, "error": "unknown op %r" % msg["op"]})
        except Exception as e:
            write({"ok": False, "error": "%s: %s" % (type(e).__name__, e)})


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""mtmc's candidate runner: the only process where a candidate's code runs.

The judge (judge.py) never runs candidate code. It starts this file once as
a *zygote*: a process that imports torch (and Triton, cupy where they are
installed), never touches the GPU, and forks on request. Each fork is a
*keeper* (a subreaper in a session of its own) that forks the *runner*
proper and, when the judge is done with it, kills every process the runner
left behind. A runner serves one candidate and is then killed; the
reference runner (the problem's own `Model`, for the eager baseline and
the calls that do nothing) serves one problem.

Before it reads a line of candidate code a candidate's runner is confined:
as root it becomes a user id of its own (no file of the judge's is writable
to it, no process of the judge's can be signalled or traced); where the
kernel has Landlock (applied once CUDA is up, before the candidate's code)
it may write only its scratch folder, /dev and /proc, cannot signal or
trace any process outside its domain and cannot open TCP connections. The
runner reports which of these held.

Channels, both set up by the judge:
- a Unix socket, JSON lines: `load`, `report`, `scale`, `calls`
  (the judge's requests) and the runner's replies;
- a shared memory *cell* for the calls themselves, so that a timed call
  costs no system call: the judge writes the call's inputs (a descriptor of
  tensors in memory it shares) and bumps `go`; the runner calls the model,
  waits for the device, describes its outputs in the cell and bumps `done`.

Nothing the runner says is trusted: the judge reads the outputs' memory
itself, times the calls itself and checks whatever it likes.
"""

import ctypes
import json
import mmap
import os
import signal
import socket
import struct
import sys
import time

# The cell: fixed fields, then the input descriptor, the output records,
# an error text and what the watched calls saw.
GO, DONE, KIND, WATCH, IN_LEN = 0, 8, 16, 20, 24
OUT_STATUS, OUT_COUNT, ERR_LEN, WATCH_LEN, EXIT_INFO = 32, 36, 40, 44, 48
IN_BASE, IN_MAX = 256, 1 << 16
OUT_BASE, OUT_RECORD, OUT_MAX = IN_BASE + IN_MAX, 224, 64
ERR_BASE, ERR_MAX = OUT_BASE + OUT_RECORD * OUT_MAX, 1 << 16
WATCH_BASE, WATCH_MAX = ERR_BASE + ERR_MAX, 1 << 16
CELL_BYTES = WATCH_BASE + WATCH_MAX


class Words:
    """The cell's counters and flags, each read and written as one aligned
    machine word: `q[GO_W]`, `q[DONE_W]`, `i[KIND_W]`, `i[WATCH_W]`,
    `i[EXIT_W]`. `struct.pack_into` writes a word a byte at a time: a
    process spinning on `go` while it changes from 255 to 256 can read 0, a
    call it was never given (and then a STOP it was not sent). A
    memoryview's item is one load or store. Released before the cell is
    closed."""

    def __init__(self, cell):
        self.view = memoryview(cell)[:IN_BASE]
        self.q = self.view.cast("Q")
        self.i = self.view.cast("i")

    def release(self):
        for v in (self.q, self.i, self.view):
            v.release()


GO_W, DONE_W = GO // 8, DONE // 8
KIND_W, WATCH_W, EXIT_W = KIND // 4, WATCH // 4, EXIT_INFO // 4

# Call kinds. PLAN reads a new inputs' descriptor, before (and outside)
# the call that uses it.
CALL, NULL, STOP, PLAN = 1, 2, 3, 4
# Output statuses.
OUT_OK, OUT_EXCEPTION = 0, 1
# Output record kinds.
REC_TENSOR, REC_NOT_TENSOR, REC_TOO_LARGE, REC_OTHER_DEVICE, REC_UNREADABLE = 0, 1, 2, 3, 4

DTYPES = [
    "float32", "float16", "bfloat16", "float64", "int64", "int32", "int16", "int8",
    "uint8", "bool", "complex64", "complex128",
]

PR_SET_PDEATHSIG, PR_SET_DUMPABLE, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 4, 36, 38

_libc = ctypes.CDLL(None, use_errno=True)


def prctl(option, value):
    return _libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0) == 0


def log(*parts):
    print("mtmc runner:", *parts, file=sys.stderr, flush=True)


_DEBUG = os.environ.get("MTMC_JUDGE_DEBUG") == "1"


def debug(*parts):
    """A line on stderr when MTMC_JUDGE_DEBUG=1, as the judge's."""
    if _DEBUG:
        log(f"{os.getpid()} {time.monotonic():.3f}", *parts)


def send_line(sock, obj):
    sock.sendall((json.dumps(obj) + "\n").encode())


class Lines:
    """JSON lines from a socket, at most `limit` bytes each."""

    def __init__(self, sock, limit=64 << 20):
        self.sock, self.limit, self.buf = sock, limit, b""

    def next(self):
        while b"\n" not in self.buf:
            chunk = self.sock.recv(1 << 20)
            if not chunk:
                return None
            self.buf += chunk
            if len(self.buf) > self.limit:
                raise ValueError("a line longer than the limit")
        line, self.buf = self.buf.split(b"\n", 1)
        return json.loads(line)


# ---------------------------------------------------------------- zygote


def zygote(ctl_fd):
    """Imports what candidates use, then forks a keeper per request."""
    import faulthandler

    # `kill -USR1` prints where a zygote, keeper or runner is.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_DUMPABLE, 0)
    ctl = socket.socket(fileno=ctl_fd)
    # Every runner is forked from here: no thread may be running at a fork
    # (one holding a lock would leave it held in the child), and numpy's
    # BLAS starts a pool of them at import unless told otherwise.
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = "1"
    preloaded = []
    for name in ("numpy", "torch", "torch.nn.functional", "torch.utils._python_dispatch", "triton", "triton.language", "cupy"):
        try:
            __import__(name)
            preloaded.append(name)
        except Exception:
            continue
    if "torch" in preloaded:
        import torch._dynamo  # noqa: F401  (its import wraps torch functions)
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        log(f"the zygote runs {threads} threads after its imports: a runner forked from it may find a lock held")
    send_line(ctl, {"ready": True, "pid": os.getpid(), "preloaded": preloaded, "threads": threads})
    buf = b""
    while True:
        msg, fds, _flags, _addr = socket.recv_fds(ctl, 1 << 16, 4)
        if not msg:
            os._exit(0)
        buf += msg
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            req = json.loads(line)
            pid = os.fork()
            if pid == 0:
                ctl.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                try:
                    keeper(req, fds[0], fds[1])
                finally:
                    os._exit(1)
            for fd in fds:
                os.close(fd)
            fds = []
            send_line(ctl, {"keeper": pid})


# ---------------------------------------------------------------- keeper


def keeper(req, sock_fd, cell_fd):
    """Forks the runner, then waits; when the judge sends SIGTERM or the
    runner exits, kills every process it left behind and removes its
    scratch folder."""
    os.setsid()
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_CHILD_SUBREAPER, 1)
    prctl(PR_SET_DUMPABLE, 0)
    waited = {signal.SIGTERM, signal.SIGCHLD}
    signal.pthread_sigmask(signal.SIG_BLOCK, waited)
    uid = req.get("uid")
    scratch = req["scratch"]
    os.makedirs(scratch, mode=0o700, exist_ok=True)
    if uid is not None:
        os.chown(scratch, uid, uid)
    pid = os.fork()
    if pid == 0:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, waited)
        try:
            runner(req, sock_fd, cell_fd)
        except (BrokenPipeError, ConnectionResetError):
            pass
        except BaseException as e:  # noqa: BLE001  (the runner's last word)
            log(f"{type(e).__name__}: {e}")
        finally:
            os._exit(0)
    os.close(sock_fd)
    cell = mmap.mmap(cell_fd, CELL_BYTES)
    status = None
    while status is None:
        if signal.sigwaitinfo(waited).si_signo == signal.SIGTERM:
            break
        try:
            while True:
                done, st = os.waitpid(-1, os.WNOHANG)
                if done == 0:
                    break
                if done == pid:
                    status = st
        except ChildProcessError:
            break
    if status is not None:
        code = os.waitstatus_to_exitcode(status)
        words = Words(cell)
        words.i[EXIT_W] = 1000 + code if code >= 0 else code
        words.release()
    sweep(uid)
    import shutil

    shutil.rmtree(scratch, ignore_errors=True)
    os._exit(0)


def proc_stat(pid):
    """The fields of `/proc/PID/stat` after the command name (state first,
    then the parent's pid), or none when the process is gone. The name
    stands in parentheses and may hold any character, `)` and spaces too."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return []
    return stat[stat.rfind(")") + 2:].split()


def sweep(uid):
    """Kills the runner and everything it started: every process of its own
    user id (where it has one), then, until none is left, every child of
    this subreaper (orphans are re-parented here)."""
    if uid is not None:
        for _ in range(3):
            killer = os.fork()
            if killer == 0:
                try:
                    os.setgid(uid)
                    os.setuid(uid)
                    os.kill(-1, signal.SIGKILL)
                finally:
                    os._exit(0)
            os.waitpid(killer, 0)
    me = os.getpid()
    for _ in range(1000):
        children = []
        for entry in os.listdir("/proc"):
            if not entry.isdigit():
                continue
            fields = proc_stat(entry)
            if len(fields) > 1 and int(fields[1]) == me:
                children.append(int(entry))
        for child in children:
            try:
                os.kill(child, signal.SIGKILL)
            except ProcessLookupError:
                pass
        try:
            while os.waitpid(-1, os.WNOHANG)[0] > 0:
                pass
        except ChildProcessError:
            if not children:
                return
        if not children:
            time.sleep(0.001)


# ---------------------------------------------------------------- confinement


def drop_user(uid):
    """Becomes `uid` (root only): no file, process or trace of the judge's
    is reachable to it."""
    os.setgroups([])
    os.setgid(uid)
    os.setuid(uid)


LL_FS = {
    "execute": 1 << 0, "write_file": 1 << 1, "read_file": 1 << 2, "read_dir": 1 << 3,
    "remove_dir": 1 << 4, "remove_file": 1 << 5, "make_char": 1 << 6, "make_dir": 1 << 7,
    "make_reg": 1 << 8, "make_sock": 1 << 9, "make_fifo": 1 << 10, "make_block": 1 << 11,
    "make_sym": 1 << 12, "refer": 1 << 13, "truncate": 1 << 14, "ioctl_dev": 1 << 15,
}


def landlock(writable):
    """Restricts this process and its children with Landlock: the whole file
    system read-only except the folders in `writable`; no signal to and no
    trace of a process outside the domain; no TCP. Returns what it could
    do, or raises OSError where the kernel has no Landlock."""
    sc = lambda n, *a: _libc.syscall(ctypes.c_long(n), *a)  # noqa: E731
    abi = sc(444, None, ctypes.c_size_t(0), ctypes.c_uint32(1))
    if abi < 0:
        raise OSError(ctypes.get_errno(), "Landlock is not available")
    fs = 0
    for name, bit in LL_FS.items():
        if (name == "refer" and abi < 2) or (name == "truncate" and abi < 3) or (name == "ioctl_dev" and abi < 5):
            continue
        fs |= bit
    net = 0b11 if abi >= 4 else 0
    # Signals only: abstract Unix sockets stay open (the judge listens on
    # none, and the driver's own channels must not be cut).
    scoped = 0b10 if abi >= 6 else 0
    attr = struct.pack("<QQQ", fs, net, scoped)
    size = 8 if abi < 4 else (16 if abi < 6 else 24)
    buf = ctypes.create_string_buffer(attr, len(attr))
    ruleset = sc(444, buf, ctypes.c_size_t(size), ctypes.c_uint32(0))
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    read = LL_FS["execute"] | LL_FS["read_file"] | LL_FS["read_dir"]
    rules = [("/", read)] + [(w, fs) for w in writable]
    for path, access in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue
        rule = ctypes.create_string_buffer(struct.pack("<Qi", access & fs, fd), 12)
        r = sc(445, ctypes.c_int(ruleset), ctypes.c_int(1), rule, ctypes.c_uint32(0))
        os.close(fd)
        if r < 0:
            raise OSError(ctypes.get_errno(), f"landlock_add_rule {path} failed")
    if sc(446, ctypes.c_int(ruleset), ctypes.c_uint32(0)) < 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(ruleset)
    held = ["landlock: file system read-only but its scratch folder, /dev and /proc"]
    if scoped:
        held.append("landlock: no signal to a process outside it")
    if net:
        held.append("landlock: no TCP")
    return held


def confine(role, uid):
    """What keeps a candidate's runner from the judge before anything else
    runs, as a list of what held; Landlock follows once the device is up
    (`restrict`)."""
    held = ["a process of its own"]
    if role != "candidate":
        prctl(PR_SET_DUMPABLE, 0)
        return held
    if uid is not None:
        drop_user(uid)
        held.append(f"user id {uid}")
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    return held


def restrict(role, scratch):
    """Landlock for a candidate's runner, applied after CUDA is initialized
    and before any candidate code: CUDA's start writes under /proc, which
    stays writable (a process's own files there; another's are guarded by
    the same ptrace rule Landlock enforces)."""
    if role != "candidate":
        return []
    if os.environ.get("MTMC_RUNNER_LANDLOCK") == "off":
        return ["no landlock (MTMC_RUNNER_LANDLOCK=off)"]
    try:
        return landlock([scratch, "/dev", "/proc"])
    except OSError as e:
        return [f"no landlock ({e.strerror})"]


# ---------------------------------------------------------------- runner


class _IpcHandle(ctypes.Structure):
    """cudaIpcMemHandle_t: 64 opaque bytes."""

    _fields_ = [("reserved", ctypes.c_ubyte * 64)]


class Cuda:
    """The CUDA calls beyond torch that sharing device memory between
    processes takes (the judge uses this class too): IPC handles of
    allocations, and mappings of another process's."""

    def __init__(self):
        self.rt = None
        for line in open("/proc/self/maps"):
            if "libcudart.so" in line:
                self.rt = ctypes.CDLL(line.split()[-1])
                break
        if self.rt is None:
            self.rt = ctypes.CDLL("libcudart.so.13")
        self.drv = ctypes.CDLL("libcuda.so.1")
        self.opened = {}

    def range(self, ptr):
        """The allocation holding `ptr`: its base and size."""
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        r = self.drv.cuMemGetAddressRange_v2(ctypes.byref(base), ctypes.byref(size), ctypes.c_uint64(ptr))
        if r != 0:
            raise RuntimeError(f"cuMemGetAddressRange failed ({r})")
        return base.value, size.value

    def handle(self, ptr):
        """The allocation holding `ptr`: its IPC handle, `ptr`'s offset in
        it and its size."""
        base, size = self.range(ptr)
        h = (ctypes.c_ubyte * 64)()
        r = self.rt.cudaIpcGetMemHandle(ctypes.byref(h), ctypes.c_void_p(base))
        if r != 0:
            # Cleared, so that torch does not find it after its next launch.
            self.rt.cudaGetLastError()
            raise RuntimeError(f"cudaIpcGetMemHandle failed ({r})")
        return bytes(h), ptr - base, size

    def open(self, handle):
        """A pointer to another process's allocation, and its size (opened
        once per handle)."""
        if handle in self.opened:
            return self.opened[handle]
        # cudaIpcMemHandle_t is a struct passed by value (a bare array
        # would go as a pointer).
        h = _IpcHandle.from_buffer_copy(handle)
        p = ctypes.c_void_p()
        r = self.rt.cudaIpcOpenMemHandle(ctypes.byref(p), h, ctypes.c_uint(1))
        if r != 0:
            self.rt.cudaGetLastError()
            raise RuntimeError(f"cudaIpcOpenMemHandle failed ({r})")
        self.opened[handle] = (p.value, self.range(p.value)[1])
        return self.opened[handle]

    def close(self, handle):
        """Unmaps what `open` mapped of `handle`."""
        ptr, _size = self.opened.pop(handle, (None, 0))
        if ptr is not None:
            self.rt.cudaIpcCloseMemHandle(ctypes.c_void_p(ptr))


class _Cai:
    """Device memory as a `__cuda_array_interface__` of bytes."""

    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False), "version": 3}


def device_bytes(torch, ptr, n):
    """A uint8 tensor over `n` bytes of device memory at `ptr`."""
    return torch.as_tensor(_Cai(ptr, n), device="cuda")


def load_module(name, code, filename):
    import linecache
    import re

    ns = {"__name__": f"mtmc_{re.sub(r'[^A-Za-z0-9_]', '_', name)}"}
    # Kept where `inspect` finds it: Triton reads a kernel's source.
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
    exec(compile(code, filename, "exec"), ns)
    return ns


def error_text(e, limit=1 << 16):
    """The exception's message (the judge cuts it to what it reports)."""
    import traceback

    text = "".join(traceback.format_exception_only(type(e), e)).strip()
    return text if len(text) <= limit else text[: limit // 2] + "\n[...]\n" + text[-limit // 2:]


class Runner:
    def __init__(self, req, sock, cell):
        self.req, self.sock, self.cell = req, sock, cell
        self.words = Words(cell)
        self.lines = Lines(sock)
        self.device = req["device"]
        import torch

        self.torch = torch
        # Made once CUDA is up, so that it finds the runtime torch loaded.
        self.cuda = None
        self.model = None
        self.ns = None
        self.in_arena = None
        self.out_arena = None
        self.segments = {}
        # The judge's input memory as this process maps it: (pointer,
        # size, handle), so that an output that is a view of an input is
        # described by the judge's own handle.
        self.input_ranges = []
        self.plan_bytes = None
        self.plan = None
        self.tiny = None
        # The device-wide synchronization, taken before any candidate code
        # runs: a candidate that replaces torch.cuda.synchronize or
        # torch._C._cuda_synchronize in its process does not change what
        # the runner waits for before it says a call is done.
        self._synchronize = None

    def sync(self):
        if self._synchronize is not None:
            self._synchronize()

    # ---- requests on the socket

    def serve(self, held):
        t = self.torch
        if self.device == "cuda":
            t.cuda.init()
            self.tiny = t.zeros(1, device="cuda")
            t.cuda.synchronize()
            self._synchronize = t._C._cuda_synchronize
            self.cuda = Cuda()
        else:
            # The judge, the reference runner and this one share the CPU.
            t.set_num_threads(1)
        held = held + restrict(self.req["role"], self.req["scratch"])
        debug(self.req["role"], "ready:", "; ".join(held))
        send_line(self.sock, {"ready": True, "pid": os.getpid(), "uid": os.getuid(), "confinement": held})
        while True:
            msg, fds = self.receive()
            if msg is None:
                return
            op = msg.get("op")
            debug(self.req["role"], "op", op)
            try:
                reply = getattr(self, "op_" + op)(msg, fds)
            except Exception as e:  # noqa: BLE001  (the judge decides what it means)
                reply = {"ok": False, "error": error_text(e)}
            debug(self.req["role"], "op", op, "done:", str(reply)[:300])
            send_line(self.sock, reply)
            if op == "exit":
                return

    def receive(self):
        """The next request and the file descriptors sent with it."""
        if b"\n" in self.lines.buf:
            return self.lines.next(), []
        msg, fds, _flags, _addr = socket.recv_fds(self.sock, 1 << 20, 4)
        if not msg:
            return None, []
        self.lines.buf += msg
        while b"\n" not in self.lines.buf:
            more = self.sock.recv(1 << 20)
            if not more:
                return None, []
            self.lines.buf += more
        return self.lines.next(), fds

    def op_load(self, msg, fds):
        """Runs the problem's module (for `get_init_inputs`) and the
        candidate's, and builds its model under the seed."""
        t = self.torch
        if fds:
            self.in_arena = mmap.mmap(fds[0], msg["in_bytes"])
            self.out_arena = mmap.mmap(fds[1], msg["out_bytes"])
            for fd in fds:
                os.close(fd)
        began = time.perf_counter()
        # How the judge keeps its reference outputs (`device`, `host`, or
        # `recomputed` for each check): what memory is left to a candidate.
        os.environ["MTMC_REFERENCES"] = str(msg.get("references", ""))
        problem = load_module(msg["problem_name"], msg["problem_code"], f"<mtmc problem {msg['problem_name']}>")
        init = problem["get_init_inputs"]()
        if msg.get("class") == "Model":
            ns = problem
        else:
            ns = load_module(msg["name"], msg["code"], msg["filename"])
        cls = msg.get("class", "ModelNew")
        if cls not in ns:
            return {"ok": False, "stage": "load", "error": f"NameError: the candidate defines no {cls} class"}
        self.ns = ns
        try:
            with t.no_grad():
                t.manual_seed(msg["seed"])
                if self.device == "cuda":
                    t.cuda.manual_seed(msg["seed"])
                model = ns[cls](*init)
                if isinstance(model, t.nn.Module):
                    model = model.to(self.device)
            self.sync()
        except Exception as e:  # noqa: BLE001
            return {"ok": False, "stage": "init", "error": error_text(e)}
        self.model = model
        self.forward = model
        return {"ok": True, "seconds": time.perf_counter() - began}

    def op_scale(self, msg, _fds):
        """Scales the model's floating-point parameters in place, as a
        training step changes them."""
        with self.torch.no_grad():
            for p in self.model.parameters():
                if p.is_floating_point():
                    p.mul_(msg["factor"])
        self.sync()
        return {"ok": True}

    def op_report(self, _msg, _fds):
        return {"ok": True, "kernels": kernel_reports(self.ns or {}, self.model)}

    def op_exit(self, _msg, _fds):
        return {"ok": True}

    def op_calls(self, _msg, _fds):
        """Serves calls on the cell until the judge writes STOP."""
        send_line(self.sock, {"ok": True, "serving": True})
        self.serve_calls()
        return {"ok": True, "served": True}

    # ---- calls on the cell

    def serve_calls(self):
        q, i = self.words.q, self.words.i
        last = q[DONE_W]
        spin = self.device == "cuda"
        while True:
            n = 0
            while True:
                go = q[GO_W]
                if go != last:
                    break
                n += 1
                if not spin and n > 50:
                    time.sleep(0.0001)
                elif n & 0xFFFFF == 0:
                    time.sleep(0)
            last = go
            kind = i[KIND_W]
            if kind == STOP:
                q[DONE_W] = go
                return
            if kind == PLAN:
                # A descriptor that does not parse fails the call after it.
                try:
                    self.inputs()
                except Exception:  # noqa: BLE001
                    pass
                q[DONE_W] = go
                continue
            if kind == NULL:
                try:
                    if self.tiny is not None:
                        self.tiny.add_(1.0)
                    self.sync()
                    struct.pack_into("<II", self.cell, OUT_STATUS, OUT_OK, 0)
                except Exception as e:  # noqa: BLE001  (the judge reads it as this call's error)
                    self.fail(e)
                q[DONE_W] = go
                continue
            watch = i[WATCH_W]
            try:
                inputs = self.inputs()
                if watch:
                    out = self.watched(inputs)
                else:
                    with self.torch.no_grad():
                        out = self.forward(*inputs)
                    self.sync()
                self.describe(out)
            except Exception as e:  # noqa: BLE001
                self.fail(e)
            q[DONE_W] = go

    def fail(self, e):
        """The call's error, for the judge."""
        text = error_text(e).encode()[:ERR_MAX]
        struct.pack_into("<III", self.cell, OUT_STATUS, OUT_EXCEPTION, 0, len(text))
        self.cell[ERR_BASE:ERR_BASE + len(text)] = text

    def inputs(self):
        """Fresh tensor objects over the judge's input memory, as the
        descriptor in the cell says."""
        t = self.torch
        n = struct.unpack_from("<I", self.cell, IN_LEN)[0]
        raw = self.cell[IN_BASE:IN_BASE + n]
        if raw != self.plan_bytes:
            self.plan = self.parse(json.loads(raw))
            self.plan_bytes = raw
        out = []
        for item in self.plan:
            if item[0] == "v":
                out.append(item[1])
            elif item[0] == "e":
                out.append(t.empty(item[2], dtype=item[1], device=self.device))
            else:
                _, typed, shape, stride, offset = item
                out.append(t.as_strided(typed, shape, stride, offset))
        return out

    def parse(self, desc):
        t = self.torch
        plan = []
        for item in desc:
            if "v" in item:
                plan.append(("v", item["v"]))
                continue
            dtype = getattr(t, item["dtype"])
            if item.get("empty"):
                plan.append(("e", dtype, item["shape"]))
                continue
            if self.device == "cuda":
                key = (item["segment"], item["dtype"])
                if key not in self.segments:
                    handle = bytes.fromhex(item["segment"])
                    ptr, size = self.cuda.open(handle)
                    self.input_ranges.append((ptr, size, handle))
                    self.segments[key] = device_bytes(t, ptr, size).view(dtype)
                typed = self.segments[key]
            else:
                key = ("arena", item["dtype"])
                if key not in self.segments:
                    raw = t.frombuffer(self.in_arena, dtype=t.uint8)
                    self.segments[key] = raw[: raw.numel() - raw.numel() % t.empty(0, dtype=dtype).element_size()].view(dtype)
                typed = self.segments[key]
            esize = t.empty(0, dtype=dtype).element_size()
            plan.append(("t", typed, item["shape"], item["stride"], item["offset"] // esize))
        return plan

    def watched(self, inputs):
        """One call with the watchers on: the aten ops it ran, and any
        exception that passed through a frame of code outside Python's and
        the installed packages' (a fallback that hides a failure)."""
        t = self.torch
        recorder = op_recorder(t)
        swallowed = SwallowedExceptions()
        with t.no_grad():
            with swallowed, recorder:
                out = self.forward(*inputs)
            self.sync()
        report = json.dumps({"torch_ops": dict(recorder.ops), "swallowed": swallowed.seen}).encode()[:WATCH_MAX]
        struct.pack_into("<I", self.cell, WATCH_LEN, len(report))
        self.cell[WATCH_BASE:WATCH_BASE + len(report)] = report
        return out

    def describe(self, value):
        """Writes one record per output into the cell: on a GPU, where the
        tensor's memory is (an IPC handle and an offset); on the CPU, its
        bytes copied into the judge's output arena."""
        t = self.torch
        outs = list(value) if isinstance(value, (tuple, list)) else [value]
        cell = self.cell
        cursor = 0
        count = min(len(outs), OUT_MAX)
        for k, o in enumerate(outs[:count]):
            base = OUT_BASE + k * OUT_RECORD
            kind, handle, offset, dtype, shape, stride = REC_TENSOR, b"\0" * 64, 0, 0, [], []
            if type(o) is not t.Tensor:
                kind = REC_NOT_TENSOR
                text = type(o).__name__.encode()[:64]
                handle = text + b"\0" * (64 - len(text))
            elif str(o.dtype).replace("torch.", "") not in DTYPES:
                kind = REC_UNREADABLE
            elif o.device.type != self.device:
                kind = REC_OTHER_DEVICE
            else:
                dtype = DTYPES.index(str(o.dtype).replace("torch.", ""))
                shape = list(o.shape)[:8]
                if o.dim() > 8:
                    kind = REC_UNREADABLE
                elif self.device == "cuda":
                    stride = list(o.stride())
                    if o.numel() > 0:
                        handle, offset = self.locate(o.data_ptr())
                else:
                    nbytes = o.numel() * o.element_size()
                    start = (cursor + 63) & ~63
                    if start + nbytes > len(self.out_arena):
                        kind = REC_TOO_LARGE
                    else:
                        if nbytes:
                            dst = t.frombuffer(self.out_arena, dtype=t.uint8, count=nbytes, offset=start)
                            dst.copy_(o.detach().contiguous().reshape(-1).view(t.uint8))
                        offset, cursor = start, start + nbytes
                        stride = list(t.empty(shape, device="meta").stride()) if shape else []
            dims = len(shape)
            struct.pack_into("<II64sQII", cell, base, kind, 0, handle, offset, dtype, dims)
            struct.pack_into("<8q", cell, base + 88, *(shape + [0] * (8 - dims)))
            struct.pack_into("<8q", cell, base + 152, *(stride + [0] * (8 - len(stride))))
        struct.pack_into("<II", cell, OUT_STATUS, OUT_OK, len(outs) if len(outs) <= OUT_MAX else OUT_MAX + 1)


    def locate(self, ptr):
        """The IPC handle of the allocation holding `ptr` and its offset
        there: the judge's own handle where it is the judge's input memory."""
        for base, size, handle in self.input_ranges:
            if base <= ptr < base + size:
                return handle, ptr - base
        handle, offset, _size = self.cuda.handle(ptr)
        return handle, offset


class SwallowedExceptions:
    """Records exceptions raised in frames of code that is neither Python's
    own nor an installed package's nor the runner's, while a call runs. A
    call that returns normally after one caught it: a try/except that falls
    back to other code when a kernel fails."""

    def __init__(self):
        import sysconfig

        roots = {sysconfig.get_paths().get(k) for k in ("stdlib", "platstdlib", "purelib", "platlib")}
        roots |= {sys.prefix, sys.base_prefix, sys.exec_prefix}
        self.roots = tuple(os.path.realpath(r) + os.sep for r in roots if r)
        self.seen = []
        self.verdicts = {}

    def watched(self, filename):
        v = self.verdicts.get(filename)
        if v is None:
            if filename.startswith("<frozen ") or filename == "<mtmc runner>":
                v = False
            elif filename.startswith("<"):
                v = True
            else:
                v = not os.path.realpath(filename).startswith(self.roots)
            self.verdicts[filename] = v
        return v

    def _global(self, frame, event, arg):
        if self.watched(frame.f_code.co_filename):
            return self._local
        return None

    # Exceptions that are how Python ends loops and generators, not failures.
    CONTROL = (StopIteration, StopAsyncIteration, GeneratorExit)

    def _local(self, frame, event, arg):
        if event == "exception" and len(self.seen) < 5 and not issubclass(arg[0], self.CONTROL):
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


def op_recorder(torch):
    """A dispatch mode that counts the aten ops run under it."""
    import collections

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
    values = list(ns.values()) + (list(vars(model).values()) if model is not None and hasattr(model, "__dict__") else [])
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
        except Exception:  # noqa: BLE001  (a kernel object that cannot describe itself is left out)
            continue
    return found


def point_caches_at(cupy_dir):
    """Points the kernel caches that the zygote's imports fixed at their
    import (with the judge's HOME) at the runner's scratch folder: the rest
    of the file system is read-only to the candidate. cupy 14 makes its disk
    cache when `cupy.cuda.compiler` is imported; earlier cupy read
    `CUPY_CACHE_DIR` at each compile, with a default fixed at import."""
    compiler = sys.modules.get("cupy.cuda.compiler")
    if compiler is None:
        return
    if hasattr(compiler, "_set_kernel_cache_backend"):
        from cupy.cuda._compiler_cache import DiskKernelCacheBackend

        compiler._set_kernel_cache_backend(DiskKernelCacheBackend(cupy_dir))
    if hasattr(compiler, "_default_cache_dir"):
        compiler._default_cache_dir = cupy_dir


def runner(req, sock_fd, cell_fd):
    prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    sock = socket.socket(fileno=sock_fd)
    cell = mmap.mmap(cell_fd, CELL_BYTES)
    os.close(cell_fd)
    scratch = req["scratch"]
    for var, sub in (("HOME", ""), ("TMPDIR", "tmp"), ("TRITON_CACHE_DIR", "triton"), ("CUPY_CACHE_DIR", "cupy"),
                     ("TORCH_EXTENSIONS_DIR", "torch_extensions"), ("XDG_CACHE_HOME", "cache"), ("TORCHINDUCTOR_CACHE_DIR", "inductor")):
        path = os.path.join(scratch, sub)
        os.makedirs(path, exist_ok=True)
        if req.get("uid") is not None:
            os.chown(path, req["uid"], req["uid"])
        os.environ[var] = path
    import tempfile

    tempfile.tempdir = None
    point_caches_at(os.environ["CUPY_CACHE_DIR"])
    os.chdir(scratch)
    held = confine(req["role"], req.get("uid"))
    Runner(req, sock, cell).serve(held)


def main():
    # Started as `python -c BOOT SOURCE zygote FD` (judge.py).
    role = sys.argv[2] if len(sys.argv) > 3 else ""
    if role == "zygote":
        zygote(int(sys.argv[3]))
    else:
        print("usage: runner.py zygote FD (started by the judge)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

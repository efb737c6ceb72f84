# Compiles one Triton kernel for a GPU architecture without needing a GPU:
# Triton lowers the kernel to PTX and ptxas (bundled with Triton) to a
# cubin. Reads one JSON request on stdin:
#   {"source": "...", "kernel": "name", "signature": ["*fp32", "i64", ...],
#    "num_warps": 4, "num_stages": 3, "arch": 90}
# and writes one JSON reply on stdout:
#   {"ok": bool, "log": "...", "ptx": "..." | null, "resources": "ptxas -v output",
#    "seconds": float}
# A kernel that does not compile is a reply with ok false and the error in
# the log; only a missing Triton is an exit status of 3.
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback


def main():
    req = json.loads(sys.stdin.read())
    try:
        import triton
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource
    except Exception as e:  # noqa: BLE001 - any import failure means no Triton
        print(f"triton cannot be imported by {sys.executable}: {e}", file=sys.stderr)
        sys.exit(3)
    start = time.time()
    reply = {"ok": False, "log": "", "ptx": None, "resources": "", "seconds": 0.0}
    with tempfile.TemporaryDirectory(prefix="mtmc-triton-") as tmp:
        # Triton reads a kernel's source with `inspect`: it must be a file.
        path = os.path.join(tmp, f"{req['kernel']}.py")
        with open(path, "w") as f:
            f.write(req["source"])
        try:
            # Fragments take `triton` and `tl` from the file they are
            # assembled into; the line numbers of errors are the fragment's.
            import triton.language as tl

            scope = {"__name__": f"mtmc_fragment_{req['kernel']}", "triton": triton, "tl": tl}
            exec(compile(req["source"], path, "exec"), scope)
            fn = scope[req["kernel"]]
            names = fn.arg_names
            if len(names) != len(req["signature"]):
                raise TypeError(
                    f"{req['kernel']} takes {len(names)} arguments, the launch passes {len(req['signature'])}"
                )
            signature = dict(zip(names, req["signature"]))
            src = ASTSource(fn=fn, signature=signature, constexprs={})
            target = GPUTarget("cuda", int(req["arch"]), 32)
            options = {"num_warps": int(req["num_warps"]), "num_stages": int(req.get("num_stages", 3))}
            compiled = triton.compile(src, target=target, options=options)
            ptx = compiled.asm["ptx"]
            reply["ptx"] = ptx
            reply["ok"] = True
        except Exception:  # noqa: BLE001 - a failed compile is a reply, not a crash
            reply["log"] = traceback.format_exc(limit=0).strip()
        if reply["ok"]:
            # Resources as ptxas reports them (registers, spills, shared).
            ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
            ptx_path = os.path.join(tmp, "kernel.ptx")
            with open(ptx_path, "w") as f:
                f.write(reply["ptx"])
            arch = f"sm_{req['arch']}a" if int(req["arch"]) == 90 else f"sm_{req['arch']}"
            if os.path.exists(ptxas):
                run = subprocess.run(
                    [ptxas, "-v", f"--gpu-name={arch}", ptx_path, "-o", os.path.join(tmp, "kernel.cubin")],
                    capture_output=True,
                    text=True,
                )
                reply["resources"] = run.stderr + run.stdout
    reply["seconds"] = time.time() - start
    print(json.dumps(reply))


main()

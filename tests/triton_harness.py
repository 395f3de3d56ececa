"""Shared by the Triton kernel tests: run a test file's cases once under Triton's CPU interpreter (in a
subprocess, because TRITON_INTERPRET must be set before triton is imported), and compile a kernel for
sm_90 with the real compiler (no GPU needed)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None


def write_case_results(cases, check, out_path: str) -> None:
    """In the worker: check(case) -> list of errors for each case; 'ok', 'skip: why' or the errors, as JSON."""
    res = {}
    for case in cases:
        try:
            errs = check(case)
            res[case] = "ok" if not errs else "; ".join(errs)
        except pytest.skip.Exception as e:
            res[case] = f"skip: {e}"
        except Exception as e:  # reported per case by the parent
            res[case] = f"error: {type(e).__name__}: {e}"
    Path(out_path).write_text(json.dumps(res))


def interpreted_results(script: str, tmp_path_factory, timeout: int = 600, env: dict | None = None) -> dict:
    """Run `python script --worker OUT` with TRITON_INTERPRET=1 (and `env`) and return its per-case results."""
    if not HAS_TRITON:
        pytest.skip("triton is not installed")
    out = tmp_path_factory.mktemp("triton") / "results.json"
    env = {**os.environ, **(env or {}), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, script, "--worker", str(out)], env=env, capture_output=True, text=True,
                          timeout=timeout)
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"interpreter worker failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(out.read_text())


def assert_case(results: dict, case: str) -> None:
    r = results[case]
    if r.startswith("skip: "):
        pytest.skip(r[6:])
    assert r == "ok", f"{case}: {r}"


def compile_sm90(fn, signature: dict, constexprs: dict, options: dict | None = None, arch: int = 90,
                 aligned: tuple[str, ...] = ()):
    """triton.compile for an H100/H200 (Triton -> PTX -> ptxas), or another sm_`arch`; skips where the build
    has no ptxas. aligned: arguments that are multiples of 16 (bytes for pointers), as a launch specializes them
    when they are (torch's allocations, strides of whole 16-byte rows): what lets the compiler emit wide loads."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("TRITON_INTERPRET=1: kernels are interpreted, not compiled")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    try:
        attrs = {(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
        return triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                              target=GPUTarget("cuda", arch, 32), options=options or {})
    except (RuntimeError, FileNotFoundError) as e:  # no ptxas in this triton build
        if "ptxas" in str(e).lower():
            pytest.skip(f"no ptxas: {e}")
        raise


def frame_bytes(kernel) -> int:
    """The per-thread stack frame (spilled registers, local arrays) of a compiled kernel, as cuobjdump reads
    it from the cubin: the figure the driver multiplies by every thread the GPU can hold when a launch needs
    more than the context's stack limit (1 KiB by default)."""
    import re

    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not tool.is_file():
        pytest.skip("no cuobjdump in this triton build")
    cubin = Path(os.environ.get("TMPDIR", "/tmp")) / f"frame_{os.getpid()}.cubin"
    cubin.write_bytes(kernel.asm["cubin"])
    try:
        out = subprocess.run([str(tool), "-res-usage", str(cubin)], capture_output=True, text=True).stdout
    finally:
        cubin.unlink(missing_ok=True)
    m = re.search(r"STACK:(\d+)", out)
    assert m, out
    return int(m.group(1))

"""Ahead-of-time compilation of one KernelSpec with Triton, no GPU needed.

Line info is disabled so no machine path reaches the PTX or cubin; each call compiles in a private cache
directory so a stale cache can never stand in for a compile (and determinism checks are real).
PTX is pinned to PTX_VERSION, which the oldest supported driver (CUDA 12.7, e.g. the H200's 580 driver
reads up to 9.0; Triton 3.9 would write 9.4) can JIT.
"""
from __future__ import annotations

import os
import pickle
import re
import subprocess
import sys
import tempfile

from engc.compiler.codegen.kernel_spec import KernelSpec

PTX_VERSION = 87
ARCH_CAPABILITY = {"sm80": 80, "sm90": 90}
_PTX_TARGET = re.compile(r"^\.target\s+(\S+)", re.MULTILINE)


def compile_spec(spec: KernelSpec, cache_dir: str | None = None):
    """Compile one spec; returns (cubin bytes, ptx text, metadata dict)."""
    import triton
    from triton import knobs
    from triton.backends.compiler import GPUTarget

    if spec.arch not in ARCH_CAPABILITY:
        raise ValueError(f"unsupported arch {spec.arch}; supported: {sorted(ARCH_CAPABILITY)}")
    fn = spec.fn()
    sig = spec.signature()
    attrs = {(i,): [["tt.divisibility", 16]] for i, ty in enumerate(sig.values()) if ty.startswith("*")}
    src = triton.compiler.ASTSource(fn, signature=sig, constexprs=dict(spec.constexprs), attrs=attrs)
    target = GPUTarget("cuda", ARCH_CAPABILITY[spec.arch], 32)
    options = {"num_warps": spec.num_warps, "num_stages": spec.num_stages, "ptx_version": PTX_VERSION,
               "enable_fp_fusion": True}
    if spec.tune.get("maxnreg"):   # a register cap: more programs resident a multiprocessor, maybe spills
        options["maxnreg"] = spec.tune["maxnreg"]
    with tempfile.TemporaryDirectory(prefix="engc-triton-") as tmp, \
            knobs.compilation.scope(), knobs.cache.scope():
        knobs.compilation.disable_line_info = True
        knobs.cache.dir = cache_dir or tmp
        kernel = triton.compile(src, target=target, options=options)
        cubin, ptx = kernel.asm["cubin"], kernel.asm["ptx"]
        md = kernel.metadata
    if md.global_scratch_size or md.profile_scratch_size:
        raise RuntimeError(f"{spec.fn_name} needs global scratch memory, which the launcher passes as null")
    meta = {"name": md.name, "num_warps": md.num_warps, "num_ctas": md.num_ctas, "shared": md.shared,
            "ptx_target": _PTX_TARGET.search(ptx).group(1), "triton_version": md.triton_version}
    return cubin, ptx, meta


def compile_in_children(specs: list[KernelSpec], jobs: int) -> list:
    """compile_spec over specs in up to `jobs` child interpreters (Triton's compiler holds the GIL for much
    of its work, so threads would not help; plain children, unlike multiprocessing's spawn, never
    re-import the caller's main script). Results come back in the order of specs."""
    jobs = max(1, min(jobs, len(specs)))
    chunks = [list(range(i, len(specs), jobs)) for i in range(jobs)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = []
    for chunk in chunks:
        proc = subprocess.Popen([sys.executable, "-m", "engc.compiler.codegen.aot"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        procs.append((chunk, proc))
    results = [None] * len(specs)
    for chunk, proc in procs:
        out, err = proc.communicate(pickle.dumps([specs[i] for i in chunk]))
        if proc.returncode != 0:
            raise RuntimeError(f"kernel compile failed:\n{err.decode(errors='replace')[-4000:]}")
        for i, res in zip(chunk, pickle.loads(out)):
            results[i] = res
    return results


def _child_main():
    specs = pickle.loads(sys.stdin.buffer.read())
    results = [compile_spec(spec) for spec in specs]
    sys.stdout.buffer.write(pickle.dumps(results))


if __name__ == "__main__":
    _child_main()

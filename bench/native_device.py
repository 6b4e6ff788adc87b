"""engc._native on a GPU: a Triton kernel compiled ahead of time to a cubin, loaded and launched through
the driver API on torch's stream, checked, captured in a CUDA graph and replayed; then the host cost of
one launch through each path (engc's launch / Launch / launch_many / LaunchPlan, Triton's own launchers,
a torch op, graph replay).

    python3 bench/native_device.py [--out results.json]

Host cost is wall time around a burst of launches of a near-empty kernel, started after a synchronize,
so the GPU never pushes back; the median over rounds, divided by the burst size.
"""

from __future__ import annotations

import argparse
import json
import platform
import re
import statistics
import time
import traceback

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from engc import _native
from engc.cuda import cubin

BLOCK = 1024
BURST = 200
ROUNDS = 30


@triton.jit
def axpy_kernel(x_ptr, y_ptr, out_ptr, n, alpha, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + offs, mask=mask)
    y = tl.load(y_ptr + offs, mask=mask)
    tl.store(out_ptr + offs, x * alpha + y, mask=mask)


SIGNATURE = {"x_ptr": "*fp32", "y_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "alpha": "fp32", "BLOCK": "constexpr"}


def compile_cubin():
    major, minor = torch.cuda.get_device_capability()
    src = ASTSource(fn=axpy_kernel, signature=SIGNATURE, constexprs={"BLOCK": BLOCK})
    return triton.compile(src, target=GPUTarget("cuda", major * 10 + minor, 32))


def entry_params(ptx: str) -> list[str]:
    match = re.search(r"\.entry\s+\w+\s*\((.*?)\)", ptx, re.S)
    return [p.strip() for p in match.group(1).split(",") if p.strip()] if match else []


def host_us(fire, burst=BURST, rounds=ROUNDS) -> float:
    """Median host microseconds per launch; `fire()` issues `burst` launches."""
    fire()
    torch.cuda.synchronize()
    samples = []
    for _ in range(rounds):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fire()
        samples.append(time.perf_counter() - t0)
    torch.cuda.synchronize()
    return round(statistics.median(samples) / burst * 1e6, 3)


def section(results, name, fn):
    try:
        results[name] = fn()
    except Exception as exc:  # keep the other measurements when one path breaks
        results[name] = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()[-1500:]}
    print(name, json.dumps(results[name], indent=1), flush=True)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="")
    opts = parser.parse_args()

    torch.zeros(1, device="cuda")
    results = {
        "env": {
            "python": platform.python_version(), "torch": torch.__version__, "triton": triton.__version__,
            "gpu": torch.cuda.get_device_name(), "driver_version": _native.driver_version(),
            "capability": _native.device_capability(0), "native_available": _native.available(),
        }
    }
    print(json.dumps(results["env"]), flush=True)
    compiled = compile_cubin()
    md = compiled.metadata
    params = entry_params(compiled.asm["ptx"])
    results["triton_kernel"] = {
        "name": md.name, "num_warps": md.num_warps, "shared": md.shared, "cubin_bytes": len(compiled.asm["cubin"]),
        "ptx_params": params, "declared_params": 5, "trailing_params": len(params) - 5,
        "global_scratch_size": getattr(md, "global_scratch_size", None),
        "profile_scratch_size": getattr(md, "profile_scratch_size", None),
    }
    print(json.dumps(results["triton_kernel"], indent=1), flush=True)
    scratch = len(params) - 5
    block_x = 32 * md.num_warps
    kernel = cubin.load_kernel(compiled.asm["cubin"], md.name, "pppif", block_x=block_x, shared_mem=md.shared,
                               scratch_params=scratch)
    stream = cubin.current_stream()

    def correctness():
        n = (1 << 20) + 77
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        out = torch.empty(n, device="cuda")
        grid = (triton.cdiv(n, BLOCK), 1, 1)
        kernel.launch(grid, [x, y, out, n, 1.5], stream)
        torch.cuda.synchronize()
        err_launch = (out - (1.5 * x + y)).abs().max().item()
        step = kernel.prepare(grid, [x.data_ptr(), y.data_ptr(), out.data_ptr(), n, -0.25])
        step(stream)
        torch.cuda.synchronize()
        err_prepared = (out - (-0.25 * x + y)).abs().max().item()
        return {"n": n, "max_err_launch": err_launch, "max_err_Launch": err_prepared,
                "ok": err_launch < 1e-5 and err_prepared < 1e-5, "attributes": kernel.attributes()}

    def graph_replay():
        n = 4096
        x, y = torch.randn(n, device="cuda"), torch.randn(n, device="cuda")
        out, out2 = torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda")
        grid = (triton.cdiv(n, BLOCK), 1, 1)
        first = kernel.prepare(grid, [x, y, out, n, 2.0])
        second = kernel.prepare(grid, [out, y, out2, n, 3.0])  # out2 = 3 * (2x + y) + y
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            capture_stream = cubin.current_stream()
            first(capture_stream)
            _native.launch_many([second], capture_stream)
        checks = []
        for _ in range(3):
            x.copy_(torch.randn(n, device="cuda"))
            out.zero_(), out2.zero_()
            graph.replay()
            torch.cuda.synchronize()
            checks.append((out2 - (3 * (2 * x + y) + y)).abs().max().item())
        return {"capture_stream_differs": capture_stream != stream, "max_err_per_replay": checks,
                "ok": max(checks) < 1e-4}

    section(results, "correctness", correctness)
    section(results, "graph_replay", graph_replay)

    def overhead():
        n = 1024
        x, y, out = (torch.randn(n, device="cuda") for _ in range(3))
        grid = (1, 1, 1)
        ints = [x.data_ptr(), y.data_ptr(), out.data_ptr(), n, 1.0] + [0] * scratch
        sig = "pppif" + "p" * scratch
        func = kernel.func
        launch = _native.launch
        step = kernel.prepare(grid, [x, y, out, n, 1.0])
        many = [kernel.prepare(grid, [x, y, out, n, 1.0]) for _ in range(BURST)]
        plan = _native.LaunchPlan(many)
        res = {}

        def native_launch():
            for _ in range(BURST):
                launch(func, grid, block_x, 0, stream, sig, ints)

        def native_launch_tensors():
            for _ in range(BURST):
                kernel.launch(grid, [x, y, out, n, 1.0], stream)

        def launch_object():
            for _ in range(BURST):
                step(stream)

        def launch_object_set_arg():
            for i in range(BURST):
                step.set_arg(3, n - (i & 1))
                step(stream)

        res["engc launch(ints)"] = host_us(native_launch)
        res["engc Kernel.launch(tensors)"] = host_us(native_launch_tensors)
        res["engc Launch()"] = host_us(launch_object)
        res["engc Launch.set_arg+()"] = host_us(launch_object_set_arg)
        res["engc launch_many"] = host_us(lambda: _native.launch_many(many, stream))
        res["engc LaunchPlan()"] = host_us(lambda: plan(stream))

        def triton_jit():
            for _ in range(BURST):
                axpy_kernel[grid](x, y, out, n, 1.0, BLOCK=BLOCK)

        section(res, "triton jit kernel[grid](...)", lambda: host_us(triton_jit))

        def triton_compiled():
            runner = compiled[grid]
            try:
                runner(x, y, out, n, 1.0, BLOCK)
                args = (x, y, out, n, 1.0, BLOCK)
            except Exception:
                args = (x, y, out, n, 1.0)
            for _ in range(BURST):
                runner(*args)

        section(res, "triton CompiledKernel[grid](...)", lambda: host_us(triton_compiled))

        def torch_op():
            for _ in range(BURST):
                torch.add(x, y, alpha=1.0, out=out)

        res["torch.add(out=) (reference)"] = host_us(torch_op)

        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            plan(cubin.current_stream())
        res["cuda graph replay of the plan, per kernel"] = host_us(graph.replay)
        return res

    section(results, "host_us_per_launch", overhead)
    if opts.out:
        with open(opts.out, "w") as f:
            json.dump(results, f, indent=1, default=str)


if __name__ == "__main__":
    main()

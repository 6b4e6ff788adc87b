"""The int4 Triton kernels under TRITON_INTERPRET=1 against the plain-torch reference (kernels/int4_linear).

Run in a child process: the interpreter must be on before triton is first imported (see test_kernels.py).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CASES = ["gemv_m1_g32", "gemv_m5_g64_bias", "gemm_m37_g32", "gemm_m20_g128_bias_actorder", "gemm_fp16", "gemv_bf16"]


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert proc.returncode == 0 and lines, f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
    return json.loads(lines[-1])


@pytest.mark.parametrize("case", CASES)
def test_int4_kernel_matches_reference(report, case):
    assert report[case]["ok"], report[case]


def _run_cases() -> dict:
    import torch
    from engc.kernels.int4_linear import int4_linear, pack_int4
    from engc.kernels.int4_linear.triton import int4_linear_triton
    out = {}
    for name, m, k, n, g, bias, act, dtype in [
        ("gemv_m1_g32", 1, 128, 96, 32, False, False, torch.float32),
        ("gemv_m5_g64_bias", 5, 192, 80, 64, True, False, torch.float32),
        ("gemm_m37_g32", 37, 96, 72, 32, False, False, torch.float32),
        ("gemm_m20_g128_bias_actorder", 20, 256, 64, 128, True, True, torch.float32),
        # the interpreter's tl.dot mishandles bfloat16 (numpy has no such type): bf16 GEMMs run on GPU only
        ("gemm_fp16", 24, 128, 64, 32, False, False, torch.float16),
        ("gemv_bf16", 3, 128, 64, 32, True, False, torch.bfloat16),
    ]:
        gen = torch.Generator().manual_seed(m * 1000 + k)
        qweight = pack_int4(torch.randint(0, 16, (k, n), generator=gen, dtype=torch.uint8))
        scales = (torch.rand(k // g, n, generator=gen) * 0.02 + 0.001).to(dtype)
        zeros = torch.randint(0, 16, (k // g, n), generator=gen, dtype=torch.uint8)
        x = torch.randn(m, k, generator=gen).to(dtype)
        extra = []
        if bias:
            extra.append(torch.randn(n, generator=gen).to(dtype))
        if act:
            extra.append(torch.randperm(k, generator=gen))
        kw = dict(group_size=g, has_bias=int(bias), act_order=int(act))
        ref = int4_linear(x.float(), qweight, scales.float(), zeros, *[e.float() if e.is_floating_point() else e
                                                                       for e in extra], **kw)
        got = int4_linear_triton(x, qweight, scales, zeros, *extra, **kw).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        err = float((got - ref).abs().max() / ref.abs().max())
        out[name] = {"ok": err < tol, "rel_err": err}
    return out


if __name__ == "__main__":
    print(json.dumps(_run_cases()))

"""The int4 Triton kernels under TRITON_INTERPRET=1 against the plain-torch reference (kernels/int4_linear).

Run in a child process (tests/interpreted.py): the interpreter must be on before triton is first imported.
"""
from __future__ import annotations

import json

import pytest

from interpreted import interpreted_report

# (name, M, K, N, group, bias, act_order, dtype, split K): every GEMV row bucket (M 1..8), the split-K
# reduce, the dequant + matmul path (M 16, 64, a prefill-sized 300), group sizes 32/64/128 and one covering
# all of K, ragged K (K % group != 0, K % (BLOCK_C chunks) != 0) and N % BLOCK_N != 0, act_order
SHAPES = [
    ("gemv_m1_g32_split", 1, 160, 96, 32, False, False, "float32", True),
    ("gemv_m1_g128_nosplit", 1, 288, 40, 128, False, False, "float32", False),
    ("gemv_m2_g64_bias", 2, 224, 80, 64, True, False, "float32", True),
    ("gemv_m3_g32", 3, 96, 72, 32, False, False, "float32", True),
    ("gemv_m4_g128_ragged_group", 4, 192, 24, 128, False, False, "float32", True),
    ("gemv_m5_g64_bias_nosplit", 5, 192, 80, 64, True, False, "float32", False),
    ("gemv_m6_per_channel", 6, 96, 16, 96, False, False, "float32", True),
    ("gemv_m7_bf16", 7, 128, 64, 32, True, False, "bfloat16", True),
    ("gemv_m8_g128_actorder", 8, 256, 64, 128, False, True, "float32", True),
    ("dequant_m16_g64_bias", 16, 160, 56, 64, True, False, "float32", False),
    ("dequant_m64_g32", 64, 96, 72, 32, False, False, "float32", False),
    ("dequant_m300_g128_actorder", 300, 288, 64, 128, True, True, "float32", False),
    ("dequant_fp16_m70", 70, 128, 64, 32, False, False, "float16", False),
]
# A GGUF Q4_1 / Q4_K projection's float offsets (frontend/gguf_quant.py) through the GPU binding
# (kernels/int4_linear/bind.py: the kernels' product plus the offsets' term): (name, M, K, N), on the GEMV and on
# the dequant + matmul path, as QLinear and as QLinearSiluMul (which takes its unfused path for them)
OFFSET_SHAPES = [("offsets_gemv_m3", 3, 128, 48), ("offsets_dequant_m40", 40, 96, 64)]
CASES = [c[0] for c in SHAPES] + [c[0] for c in OFFSET_SHAPES]


@pytest.fixture(scope="module")
def report():
    pytest.importorskip("triton")
    return interpreted_report(__file__, timeout=600)


@pytest.mark.parametrize("case", CASES)
def test_int4_kernel_matches_reference(report, case):
    assert report[case]["ok"], report[case]


def _run_cases() -> dict:
    import torch
    from engc.kernels.int4_linear import dequantize, int4_linear, jit_consts, pack_int4
    from engc.kernels.int4_linear.triton import JIT_CONSTS, int4_linear_triton
    out = {}
    for name, m, k, n, g, bias, act, dtype, split in SHAPES:
        dtype = getattr(torch, dtype)
        gen = torch.Generator().manual_seed(m * 1000 + k)
        groups = (k + g - 1) // g
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8))
        scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.001).to(dtype)
        zeros = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
        x = torch.randn(m, k, generator=gen).to(dtype)
        extra = []
        if bias:
            extra.append(torch.randn(n, generator=gen).to(dtype))
        if act:
            extra.append(torch.randperm(k, generator=gen))
        kw = dict(group_size=g, has_bias=int(bias), act_order=int(act))
        consts = jit_consts(g, JIT_CONSTS)
        for v in consts.values():  # small tiles so short K still spans several chunk tiles and N several rows
            if "gemv_max_rows" in v:
                v.update(BLOCK_N=4, BLOCK_C=2, num_warps=1, target_programs=64 if split else 1)
            elif "BLOCK_C" in v:
                v.update(BLOCK_N=8, BLOCK_C=2, num_warps=1)
        ref = int4_linear(x.float(), qweight, scales.float(), zeros, *[e.float() if e.is_floating_point() else e
                                                                       for e in extra], **kw)
        got = int4_linear_triton(x, qweight, scales, zeros, *extra, consts=consts, **kw).float()
        tol = 1e-4 if dtype == torch.float32 else 2e-2
        err = float((got - ref).abs().max() / ref.abs().max())
        out[name] = {"ok": err < tol, "rel_err": err}
        if m > 8:  # the dequant kernel writes exactly what the reference's dequantize gives
            from engc.kernels.int4_linear import dequant_launch
            from engc.kernels.int4_linear.triton import KERNELS
            w = torch.empty(n, k, dtype=dtype)
            for _, grid, args in dequant_launch(qweight, scales, zeros, w, group_size=g, consts=consts):
                c = consts[f"dequant_g{g}"]
                KERNELS["dequant"][grid](*args[:-2], GROUP=g, BLOCK_N=c["BLOCK_N"], BLOCK_C=c["BLOCK_C"],
                                         num_warps=c["num_warps"])
            exact = torch.equal(w, dequantize(qweight, scales, zeros, g).to(dtype))
            out[name] = {"ok": out[name]["ok"] and exact, "rel_err": err, "dequant_exact": exact}
    return {**out, **_offset_cases()}


def _offset_cases() -> dict:
    import torch
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels.int4_linear import int4_linear, jit_consts, pack_int4
    from engc.kernels.int4_linear.triton import JIT_CONSTS, jit_run
    from engc.kernels.silu_mul import silu_mul
    from engc.runtime.gpu_ops import StepFacts, gpu_ops

    class JitKernels:  # gpu_ops.BundleKernels' face, the bundle's int4 kernels run through Triton's JIT
        consts = {"int4_linear": jit_consts(32, JIT_CONSTS)}

        def run(self, op, launches):
            jit_run(launches, self.consts[op], 32)

    ops = gpu_ops(JitKernels(), StepFacts())   # QLinearSiluMul's unfused path: SiluMul's CPU reference
    out = {}
    for name, m, k, n in OFFSET_SHAPES:
        gen = torch.Generator().manual_seed(m * 1000 + k)
        qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen, dtype=torch.uint8))
        scales = torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001
        zeros = torch.zeros(n, k // 32, dtype=torch.uint8)
        offsets = -torch.rand(n, k // 32, generator=gen) * 0.1
        x = torch.randn(m, k, generator=gen)
        ref = int4_linear(x, qweight, scales, zeros, offsets, group_size=32, has_offsets=1)
        errs = []
        for op, expected in (("QLinear", ref), ("QLinearSiluMul", silu_mul(ref))):
            got = ops[(ENGC_DOMAIN, op)](x, qweight, scales, zeros, offsets, group_size=32, has_offsets=1)[0]
            errs.append(float((got - expected).abs().max() / expected.abs().max()))
        out[name] = {"ok": max(errs) < 1e-4, "rel_err": errs}
    return out


if __name__ == "__main__":
    print(json.dumps(_run_cases()))

"""What to compile for a model: model_specs checks the build's facts and asks every op folder (engc/kernels/<op>/
specs.py) which kernels it needs on each arch.
"""
from __future__ import annotations

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen.kernel_spec import TRITON_DTYPE, Build
from engc.errors import UserError
from engc.kernels import kv_quant, parts


def model_specs(cfg: ModelConfig, dtype: torch.dtype, arch: str, block_size: int, overrides=None,
                quant: str = "none", kv_cache: str = "auto", int4_group_sizes=(), int4_lm_head: bool = False,
                int4_experts: int = 0) -> list:
    """Every kernel the model needs on one arch. overrides: op -> tune overrides (bench sweeps).
    quant: the build's --quant ('none' for float or int4-from-checkpoint; 'fp8' adds fp8_quant, fp8_linear
    and the norms' fp8-out variants).
    kv_cache: the build's --kv-cache ('auto': the model dtype; 'int8'/'fp8': rotary and paged attention
    specialized on that quantized cache). int4_group_sizes: group sizes of the program's int4 QLinears.
    int4_lm_head: the lm_head is a QLinear too (`engc quantize --lm-head`): no dense Gemm is left, so no
    GEMV or skinny GEMM is built. int4_experts: the MoE experts' int4 group size (0: not int4)."""
    if arch not in tune.ARCHS:
        raise UserError(f"unsupported arch '{arch}': engc builds kernels for {', '.join(tune.ARCHS)}")
    if dtype not in TRITON_DTYPE:
        raise UserError(f"unsupported kernel dtype {dtype}: engc builds bfloat16, float16 or float32 kernels")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    t = TRITON_DTYPE[dtype]
    kv = kv_quant.cache_dtype(kv_cache, dtype)
    kv = kv if kv_quant.is_quantized(kv) else None
    if kv == torch.float8_e4m3fn and int(arch[2:]) < 89:
        raise UserError(f"--kv-cache fp8 needs sm89 or newer (e4m3 conversions); {arch} has none: "
                        "use --kv-cache int8")
    b = Build(cfg=cfg, t=t, arch=arch, block_size=block_size, quant=quant, kv=kv,
              int4_group_sizes=tuple(int4_group_sizes), int4_lm_head=int4_lm_head, int4_experts=int4_experts,
              overrides=overrides or {})
    return [spec for op in parts("specs") for spec in op.specs(b)]

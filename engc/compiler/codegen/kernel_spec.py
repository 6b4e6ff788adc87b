"""KernelSpec: one Triton kernel to compile, per (op, variant) and arch; make_spec, the one way an op's spec
builder (engc/kernels/<op>/specs.py) fills it from the tune table; Build, the facts of one model's build on
one arch that every builder reads.

A spec names the Triton function by module and attribute (so records and tests can find it), gives the
type of every runtime parameter in the kernel's own order, the constexpr values, and the tune entry.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune

TRITON_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


@dataclass(frozen=True)
class KernelSpec:
    op: str
    variant: str
    arch: str
    module: str                 # e.g. engc.kernels.rms_norm.triton
    fn_name: str
    arg_types: dict             # runtime params, kernel order -> triton type ("*bf16", "i32", "fp32")
    constexprs: dict
    num_warps: int
    num_stages: int
    tune_key: str
    tune: dict
    launch: dict = field(default_factory=dict)   # constants the op's launch rule reads

    def fn(self):
        return getattr(importlib.import_module(self.module), self.fn_name)

    def signature(self) -> dict:
        """Triton's ASTSource signature: every parameter in order, constexprs typed 'constexpr'."""
        fn = self.fn()
        sig = {}
        for name in fn.arg_names:
            if name in self.constexprs:
                sig[name] = "constexpr"
            else:
                sig[name] = self.arg_types[name]
        missing = set(self.arg_types) - set(sig)
        if missing:
            raise ValueError(f"{self.fn_name}: types given for unknown params {sorted(missing)}")
        return sig


def pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def make_spec(op, variant, arch, fn_name, arg_types, constexprs, bucket, launch_keys=(), overrides=None,
              defaults=None):
    """The KernelSpec of engc.kernels.<op>.triton.<fn_name>, its tune entry looked up for (arch, op, variant,
    bucket); defaults: the entry where the table has none (num_warps, num_stages, the upper-case constexprs
    it tunes, launch constants)."""
    key, entry = tune.lookup(arch, op, variant, bucket, overrides, defaults)
    consts = dict(constexprs)
    consts.update({k: v for k, v in entry.items() if k.isupper()})
    launch = {k: consts.get(k, entry.get(k)) for k in launch_keys}
    module = f"engc.kernels.{op}.triton"
    if "PDL" in getattr(importlib.import_module(module), fn_name).arg_names:
        # kernels written for programmatic dependent launch (kernels/pdl.py): on where the arch has it;
        # the record's launch constant tells the runtime to launch them that way
        consts["PDL"] = launch["PDL"] = int(entry.get("PDL", tune.PDL[arch]))
    return KernelSpec(op=op, variant=variant, arch=arch, module=module, fn_name=fn_name,
                      arg_types=arg_types, constexprs=consts, num_warps=entry["num_warps"],
                      num_stages=entry["num_stages"], tune_key=key, tune=entry, launch=launch)


@dataclass(frozen=True)
class Build:
    """What one build decides on one arch, as each op's `specs(b)` reads it to say which kernels it needs
    (none, where the model does not use the op)."""
    cfg: ModelConfig
    t: str                              # the model's Triton dtype: bf16, fp16 or fp32
    arch: str
    block_size: int                     # the KV cache's page (tokens a block)
    quant: str = "none"                 # --quant: 'fp8' makes the layers' projections FP8Linear
    kv: torch.dtype | None = None       # a quantized KV cache's code dtype (--kv-cache int8|fp8), else None
    int4_group_sizes: tuple = ()        # group sizes of the program's int4 QLinears
    int4_lm_head: bool = False          # the lm_head is a QLinear too: no dense Gemm is left
    int4_experts: int = 0               # the MoE experts' int4 group size (0: float or fp8 experts)
    overrides: dict = field(default_factory=dict)   # op -> tune overrides (bench sweeps)

    def ov(self, op: str):
        return self.overrides.get(op)

    @property
    def dense_layers(self) -> bool:
        """The layers' projections are dense Gemms (not FP8Linear, not QLinear)."""
        return self.quant != "fp8" and not self.int4_group_sizes

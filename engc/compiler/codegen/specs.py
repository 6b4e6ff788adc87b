"""What to compile for a model: one KernelSpec per (op, variant) and arch, specialized on its shapes.

A spec names the Triton function by module and attribute (so records and tests can find it), gives the
type of every runtime parameter in the kernel's own order, the constexpr values, and the tune entry.
"""
from __future__ import annotations

import importlib
from dataclasses import dataclass, field

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.codegen import tune
from engc.errors import UserError

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


def _pow2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _spec(op, variant, arch, fn_name, arg_types, constexprs, bucket, launch_keys=(), overrides=None):
    key, entry = tune.lookup(arch, op, variant, bucket, overrides)
    consts = dict(constexprs)
    consts.update({k: v for k, v in entry.items() if k.isupper()})
    launch = {k: consts.get(k, entry.get(k)) for k in launch_keys}
    return KernelSpec(op=op, variant=variant, arch=arch, module=f"engc.kernels.{op}.triton", fn_name=fn_name,
                      arg_types=arg_types, constexprs=consts, num_warps=entry["num_warps"],
                      num_stages=entry["num_stages"], tune_key=key, tune=entry, launch=launch)


def rms_norm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    block = _pow2(cfg.hidden_size)
    types = {"x_ptr": f"*{t}", "residual_ptr": f"*{t}", "weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "residual_out_ptr": f"*{t}", "eps": "fp32"}
    return [_spec("rms_norm", variant, arch, "rms_norm_kernel", types,
                  {"HIDDEN": cfg.hidden_size, "BLOCK": block, "HAS_RESIDUAL": has_res},
                  tune.block_bucket(block), overrides=overrides)
            for variant, has_res in (("rms_norm", False), ("add_rms_norm", True))]


def silu_mul_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    types = {"gate_up_ptr": f"*{t}", "out_ptr": f"*{t}"}
    return [_spec("silu_mul", "default", arch, "silu_mul_kernel", types, {"INTER": cfg.intermediate_size},
                  "any", launch_keys=("BLOCK",), overrides=overrides)]


def qk_norm_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    types = {"qkv_ptr": f"*{t}", "q_weight_ptr": f"*{t}", "k_weight_ptr": f"*{t}", "out_ptr": f"*{t}",
             "eps": "fp32", "copy_v": "i32"}
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": _pow2(cfg.num_heads), "KV_PAD": _pow2(cfg.num_kv_heads), "D_PAD": _pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    return [_spec("qk_norm", "default", arch, "qk_norm_kernel", types, consts, tune.block_bucket(block),
                  overrides=overrides)]


def rotary_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    consts = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "H_PAD": _pow2(cfg.num_heads), "KV_PAD": _pow2(cfg.num_kv_heads),
              "HALF_PAD": _pow2(cfg.head_dim // 2), "D_PAD": _pow2(cfg.head_dim)}
    block = consts["H_PAD"] * consts["D_PAD"]
    specs = []
    for idx in ("i64", "i32"):
        types = {"qkv_ptr": f"*{t}", "positions_ptr": f"*{idx}", "inv_freq_ptr": "*fp32",
                 "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}", "slot_mapping_ptr": f"*{idx}",
                 "q_out_ptr": f"*{t}"}
        specs.append(_spec("rotary", f"pos_{idx}", arch, "rotary_kv_kernel", types, consts,
                           tune.block_bucket(block), overrides=overrides))
    return specs


def paged_attention_specs(cfg: ModelConfig, t: str, arch: str, block_size: int, overrides=None):
    group = cfg.num_heads // cfg.num_kv_heads
    precision = "ieee" if t == "fp32" else "tf32"
    common = {"NUM_HEADS": cfg.num_heads, "NUM_KV_HEADS": cfg.num_kv_heads, "HEAD_DIM": cfg.head_dim,
              "D_PAD": _pow2(cfg.head_dim), "GROUP": group, "PAGE": block_size, "DOT_PRECISION": precision}
    bucket = tune.head_dim_bucket(cfg.head_dim)
    cache = {"q_ptr": f"*{t}", "k_cache_ptr": f"*{t}", "v_cache_ptr": f"*{t}", "block_tables_ptr": "*i32",
             "context_lens_ptr": "*i32", "query_start_loc_ptr": "*i32", "out_ptr": f"*{t}"}
    decode_types = dict(cache, part_acc_ptr="*fp32", part_ml_ptr="*fp32", scale="fp32", sliding_window="i32",
                        block_table_stride="i32", num_splits="i32")
    decode = _spec("paged_attention", "decode", arch, "paged_decode_kernel", decode_types,
                   dict(common, G_PAD=max(16, _pow2(group))), bucket,
                   launch_keys=("BLOCK_N", "target_programs", "max_splits", "min_split_tokens",
                                "min_split_tokens_busy"),
                   overrides=(overrides or {}).get("decode"))
    reduce_types = {"query_start_loc_ptr": "*i32", "part_acc_ptr": "*fp32", "part_ml_ptr": "*fp32",
                    "out_ptr": f"*{t}", "num_splits": "i32"}
    max_splits = decode.tune["max_splits"]
    reduce = _spec("paged_attention", "decode_reduce", arch, "paged_decode_reduce_kernel", reduce_types,
                   {"NUM_HEADS": cfg.num_heads, "HEAD_DIM": cfg.head_dim, "D_PAD": _pow2(cfg.head_dim),
                    "MAX_SPLITS": _pow2(max_splits)}, "any", launch_keys=("MAX_SPLITS",))
    prefill_types = dict(cache, scale="fp32", sliding_window="i32", block_table_stride="i32", skip_decode="i32")
    prefill = _spec("paged_attention", "prefill", arch, "paged_prefill_kernel", prefill_types, common, bucket,
                    launch_keys=("BLOCK_M", "GROUP"), overrides=(overrides or {}).get("prefill"))
    if prefill.constexprs["BLOCK_M"] < group:
        raise ValueError(f"prefill BLOCK_M {prefill.constexprs['BLOCK_M']} is smaller than the GQA group {group}")
    return [decode, reduce, prefill]


def sampling_specs(cfg: ModelConfig, t: str, arch: str, overrides=None):
    specs = []
    for lt in sorted({t, "fp32"}):
        types = {"logits_ptr": f"*{lt}", "temperature_ptr": "*fp32", "top_k_ptr": "*i32", "top_p_ptr": "*fp32",
                 "uniform_ptr": "*fp32", "out_ptr": "*i64"}
        specs.append(_spec("sampling", f"logits_{lt}", arch, "sample_kernel", types, {"VOCAB": cfg.vocab_size},
                           "any", overrides=overrides))
    return specs


def model_specs(cfg: ModelConfig, dtype: torch.dtype, arch: str, block_size: int, overrides=None) -> list:
    """Every kernel the model needs on one arch. overrides: op -> tune overrides (bench sweeps)."""
    if arch not in tune.ARCHS:
        raise UserError(f"unsupported arch '{arch}': engc builds kernels for {', '.join(tune.ARCHS)}")
    if dtype not in TRITON_DTYPE:
        raise UserError(f"unsupported kernel dtype {dtype}: engc builds bfloat16, float16 or float32 kernels")
    if cfg.num_heads % cfg.num_kv_heads:
        raise UserError(f"num_heads {cfg.num_heads} is not a multiple of num_kv_heads {cfg.num_kv_heads}")
    t = TRITON_DTYPE[dtype]
    ov = overrides or {}
    specs = rms_norm_specs(cfg, t, arch, ov.get("rms_norm")) + silu_mul_specs(cfg, t, arch, ov.get("silu_mul"))
    if cfg.qk_norm:
        specs += qk_norm_specs(cfg, t, arch, ov.get("qk_norm"))
    specs += rotary_specs(cfg, t, arch, ov.get("rotary"))
    specs += paged_attention_specs(cfg, t, arch, block_size, ov.get("paged_attention"))
    specs += sampling_specs(cfg, t, arch, ov.get("sampling"))
    return specs

"""Checkpoints whose projections are float8 with block scales (quantization_config quant_method "fp8" and a
weight_block_size, as DeepSeek-V3/R1, Kimi K2 and Qwen3's -FP8 releases ship): each `P.weight` is float8 e4m3
[N, K] and `P.weight_scale_inv` float32 [ceil(N / bn), ceil(K / bk)], the weight being codes times the scale of
their block.

The reader offers every such weight dequantized (float32, cast to the bundle's dtype downstream), so the
checkpoint reads as a float one; build() then keeps the projections float8 (--quant fp8's W8A8, one scale an
output channel) where its targets have FP8 tensor cores, as the checkpoint was. Static activation scales
(activation_scheme "static") are not needed: the fp8 program quantizes activations a row at a time.
"""
from __future__ import annotations

from pathlib import Path

import torch

from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.hf import read_hf_folder
from engc.errors import UserError

SCALE = ".weight_scale_inv"
DROPPED = (".input_scale", ".activation_scale")   # static activation scales: unused (see above)


def is_block_fp8(hf_config: dict) -> bool:
    return (hf_config.get("quantization_config") or {}).get("quant_method") == "fp8"


def read_fp8_folder(path: Path) -> Checkpoint:
    ckpt = read_hf_folder(path)
    qc = ckpt.hf_config["quantization_config"]
    block = qc.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(isinstance(b, int) and b > 0 for b in block)):
        raise UserError(f"{ckpt.name}: fp8 quantization_config without a weight_block_size [rows, columns] is not "
                        "supported (engc reads block-scaled float8 checkpoints)")
    if qc.get("fmt", "e4m3") != "e4m3":
        raise UserError(f"{ckpt.name}: fp8 format '{qc.get('fmt')}' is not supported; engc reads e4m3")
    scaled = [n[:-len(SCALE)] for n in ckpt.names() if n.endswith(SCALE)]
    if not scaled:
        raise UserError(f"{ckpt.name}: config.json says fp8 but no tensor is named *{SCALE}")
    loaders = {n: f for n, f in ckpt.loaders.items() if not n.endswith((SCALE, *DROPPED))}
    for p in scaled:
        if p + ".weight" not in loaders:
            raise UserError(f"{ckpt.name}: {p}{SCALE} has no {p}.weight")
        loaders[p + ".weight"] = _dequantized(ckpt.loaders[p + ".weight"], ckpt.loaders[p + SCALE], block, p)
    ckpt.loaders = loaders
    return ckpt


def _dequantized(load_codes, load_scales, block: list[int], name: str):
    def load() -> torch.Tensor:
        return dequantize(load_codes(), load_scales(), block, name)
    return load


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: list[int], name: str = "weight") -> torch.Tensor:
    """codes float8 [N, K] x scales [ceil(N / bn), ceil(K / bk)] a block -> float32 [N, K]."""
    (n, k), (bn, bk) = codes.shape, block
    if codes.dim() != 2 or scales.shape != (-(-n // bn), -(-k // bk)):
        raise UserError(f"{name}: float8 weight {tuple(codes.shape)} with block scales {tuple(scales.shape)} does "
                        f"not match weight_block_size {block}")
    full = scales.float().repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
    return codes.float() * full

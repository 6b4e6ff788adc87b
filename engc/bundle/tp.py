"""Tensor-parallel facts both sides share: which models shard over N ranks, and what one rank holds.

A TP bundle has one program for all ranks and one weight file a rank (weights/rank<r>.safetensors), laid
out Megatron-style by compiler/passes/shard_tp.py: attention by heads (KV heads replicated where there
are fewer than ranks; a latent-attention cache whole on every rank), the MLP's and the experts'
intermediate by columns then rows, the embedding replicated and the lm_head by vocabulary rows. The rank's ModelConfig is what its kernels are compiled
for and what its KV cache holds.
"""
from __future__ import annotations

import dataclasses

from engc.bundle.model_config import ModelConfig


def weight_file(rank: int) -> str:
    return f"weights/rank{rank}.safetensors"


def shard_problem(cfg: ModelConfig, tp: int) -> str | None:
    """Why cfg does not shard over tp ranks (one line), or None."""
    if tp < 1:
        return f"--tp must be at least 1, got {tp}"
    if tp == 1:
        return None
    if cfg.num_heads % tp:
        return f"{cfg.num_heads} attention heads do not divide over {tp} ranks"
    kv = cfg.num_kv_heads
    if kv % tp and tp % kv:
        return f"{kv} KV heads neither divide over {tp} ranks nor divide {tp} (to be replicated)"
    for name in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size"):
        if getattr(cfg, name) % tp:
            return f"{name} {getattr(cfg, name)} does not divide over {tp} ranks"
    return None


def kv_head_of(cfg: ModelConfig, tp: int, rank: int) -> tuple[int, int]:
    """The first KV head rank holds and how many: a slice of them, or the one it shares with other ranks."""
    if cfg.num_kv_heads >= tp:
        n = cfg.num_kv_heads // tp
        return rank * n, n
    return rank * cfg.num_kv_heads // tp, 1


def vocab_rows(cfg: ModelConfig, tp: int) -> int:
    """lm_head rows a rank holds: the vocabulary split in equal parts, the last padded with zero rows (the
    AllGather of the logits trims them)."""
    return -(-cfg.vocab_size // tp)


def rank_config(cfg: ModelConfig, tp: int) -> ModelConfig:
    """What one rank computes: its heads and intermediate widths. The vocabulary stays whole: the logits are
    gathered before anything samples them."""
    if tp == 1:
        return cfg
    return dataclasses.replace(
        cfg, num_heads=cfg.num_heads // tp, num_kv_heads=kv_head_of(cfg, tp, 0)[1],
        intermediate_size=cfg.intermediate_size // tp, moe_intermediate_size=cfg.moe_intermediate_size // tp,
        shared_expert_intermediate_size=cfg.shared_expert_intermediate_size // tp)

"""Collectives of a tensor-parallel program (compiler/passes/shard_tp.py places them), over torch.distributed.

ONNX: ai.engc::AllReduce(x) -> x summed over the ranks (after a row-parallel projection: o, down, MoE)
      ai.engc::AllGather(x) -> the ranks' x joined along the last axis, cut to `size` (the lm_head's
                               vocabulary shards, the last one padded)
The group is the one runtime/tp.py made for the program (NCCL on a GPU, gloo on the CPU); with no group
(one process) both are the identity, which is what they compute over one rank. Each rank runs the same
program, so every rank reaches every collective in the same order; a rank that dies or stalls surfaces as
the group's timeout or a closed connection (runtime/tp.py turns it into the server's 503).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

_group = None


def use(group) -> None:
    """The process group the program's collectives run over (None: one process)."""
    global _group
    _group = group


def world() -> int:
    return 1 if _group is None else dist.get_world_size(_group)


def all_reduce(x: torch.Tensor, reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x summed over the ranks; reduce_dtype: the dtype the sum is carried in (gloo has no bfloat16 sum)."""
    if _group is None:
        return x
    y = x if reduce_dtype is None or x.dtype == reduce_dtype else x.to(reduce_dtype)
    y = y.contiguous()
    dist.all_reduce(y, group=_group)
    return y.to(x.dtype)


def all_gather(x: torch.Tensor, size: int) -> torch.Tensor:
    """The ranks' x joined along the last axis, rank order, cut to `size` columns."""
    if _group is None:
        return x[..., :size]
    parts = [torch.empty_like(x) for _ in range(dist.get_world_size(_group))]
    dist.all_gather(parts, x.contiguous(), group=_group)
    return torch.cat(parts, dim=-1)[..., :size]

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
# torch's newer name for the one-buffer all-gather, the older one where a torch lacks it
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


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
    # one buffer, the ranks' x one after another along the first axis (NCCL's and gloo's common form; one
    # allocation, which a CUDA graph takes from its pool), then each row's pieces side by side
    n, x = dist.get_world_size(_group), x.contiguous()
    out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
    _gather_single(out, x, group=_group)
    return out.view(n, *x.shape).movedim(0, -2).reshape(*x.shape[:-1], n * x.shape[-1])[..., :size]

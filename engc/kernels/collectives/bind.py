"""The nodes collectives serves: AllReduce and AllGather, on the CPU (gloo) and the GPU (NCCL).

No kernels of our own: NCCL's are the GPU's, and torch.distributed's calls are captured by the decode CUDA
graphs like any other launch on the stream (every rank captures the same graphs in the same order).
"""
import torch

from engc.bundle.program import ENGC_DOMAIN
from engc.kernels.collectives import all_gather, all_reduce

# gloo sums float32 (no bfloat16): half-precision partial sums are carried in float32, then rounded once
CPU_OPS = {(ENGC_DOMAIN, "AllReduce"): lambda x: (all_reduce(x, torch.float32 if x.is_floating_point() else None),),
           (ENGC_DOMAIN, "AllGather"): lambda x, size: (all_gather(x, size),)}


def gpu_ops(ctx) -> dict:
    # NCCL sums bfloat16 and float16 itself, as the other engines' tensor-parallel layers do
    return {(ENGC_DOMAIN, "AllReduce"): lambda x: (all_reduce(x),),
            (ENGC_DOMAIN, "AllGather"): lambda x, size: (all_gather(x, size),)}

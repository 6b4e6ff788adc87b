"""The CPU binding of an engine program: the standard ONNX ops here, every ai.engc op from its kernel folder
(kernels/<op>/bind.py: CPU_OPS, the plain-torch references, and HALF_OPS where a bfloat16 or float16 bundle
must round as HF transformers does).

Each entry takes the node's input tensors and attributes and returns its outputs as a tuple. The GPU
binding (runtime/gpu_ops.py) has the same shape, so the executor does not care which one it runs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from engc.bundle.program import torch_dtype
from engc.kernels import parts


def _gather(data, indices, axis=0):
    return (torch.index_select(data, axis, indices.long()),)


def _gemm(a, b, c=None, transB=0, transA=0, alpha=1.0, beta=1.0):
    if transA or alpha != 1.0 or beta != 1.0:
        raise NotImplementedError("Gemm with transA/alpha/beta")
    return (F.linear(a, b, c) if transB else a @ b + (c if c is not None else 0),)


ONNX_OPS = {
    ("", "Gather"): _gather,
    ("", "Gemm"): _gemm,
    ("", "Concat"): lambda *xs, axis: (torch.cat(xs, dim=axis),),
    ("", "Cast"): lambda x, to: (x.to(torch_dtype(to)),),
    ("", "Add"): lambda a, b: (a + b,),   # the residual sum where a family has no pre-norm to fuse it into (OLMo 2)
    ("", "Mul"): lambda a, b: (a * b,),   # the embedding (Gemma, Granite) or logits (Granite) scale, model dtype
}
_BINDS = parts("bind")
REFERENCE_OPS = {**ONNX_OPS, **{k: v for b in _BINDS for k, v in getattr(b, "CPU_OPS", {}).items()}}
# a bfloat16 / float16 bundle on the CPU: HF transformers' roundings where the references round otherwise
HALF_OPS = {**REFERENCE_OPS, **{k: v for b in _BINDS for k, v in getattr(b, "HALF_OPS", {}).items()}}


def reference_ops(dtype: torch.dtype) -> dict:
    """The CPU op table of a bundle of this dtype."""
    return REFERENCE_OPS if dtype == torch.float32 else HALF_OPS

"""GPTQ (Frantar et al. 2022): quantize a weight column by column, pushing each column's rounding error
onto the columns not yet quantized through the inverse Hessian of the layer's calibration inputs.

Follows the reference algorithm: H = 2/n * X^T X, dead inputs zeroed, dampening `damp * mean(diag H)`,
the upper Cholesky factor of H^-1, lazy batch updates in blocks of 128 columns, optional act-order
(columns in decreasing diag(H) order). Act-order's groups are either formed in that order as it meets the
columns (g_idx records each column's group: the runtime then gathers x into that order) or, with
static_groups, the groups of the channel order, their ranges taken from the weight before any column is
quantized (g_idx stays channel order: the bundle runs as a plain group-wise one).
"""
from __future__ import annotations

import torch

from engc.compiler.quantize.rtn import QuantizedWeight, params, quantize_with

BLOCK = 128


class Hessian:
    """Running 2/n * X^T X over calibration rows of one projection's input."""

    def __init__(self, columns: int):
        self.H = torch.zeros(columns, columns, dtype=torch.float32)
        self.n = 0

    def add(self, x: torch.Tensor) -> None:
        x = x.reshape(-1, x.shape[-1]).float()
        rows = x.shape[0]
        self.H *= self.n / (self.n + rows)
        self.n += rows
        x = x * (2 / self.n) ** 0.5
        self.H += x.T @ x


def gptq_quantize(w: torch.Tensor, hessian: torch.Tensor, group_size: int, damp: float = 0.01,
                  act_order: bool = False, static_groups: bool = False) -> QuantizedWeight:
    W = w.float().clone()
    H = hessian.clone()
    out, k = W.shape
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    n_groups = -(-k // group_size)  # a ragged last group is allowed
    static = act_order and static_groups
    if static:   # each channel-order group's range from the weight as it is, before any error reaches it
        fixed = [params(W[:, g * group_size:(g + 1) * group_size]) for g in range(n_groups)]
    perm = torch.argsort(torch.diag(H), descending=True) if act_order else torch.arange(k)
    if act_order:
        W, H = W[:, perm], H[perm][:, perm]
    H.diagonal().add_(damp * torch.mean(torch.diag(H)))
    # H^-1's upper Cholesky factor, never more than two K x K matrices alive besides the caller's H:
    # for a down_proj of width 8192 each is 256 MB, more than the rest of the layer's working set
    L = torch.linalg.cholesky(H)
    del H
    Hinv = torch.cholesky_inverse(L)
    del L
    Hinv = torch.linalg.cholesky(Hinv, upper=True)

    Q = torch.zeros_like(W)
    scales = torch.zeros(out, n_groups)
    zeros = torch.zeros(out, n_groups)
    if static:
        for g, (scale, zero) in enumerate(fixed):
            scales[:, g], zeros[:, g] = scale, zero
    for i1 in range(0, k, BLOCK):
        i2 = min(i1 + BLOCK, k)
        W1, Hinv1 = W[:, i1:i2].clone(), Hinv[i1:i2, i1:i2]
        Err1 = torch.zeros_like(W1)
        for i in range(i2 - i1):
            col = i1 + i
            if static:
                scale, zero = fixed[int(perm[col]) // group_size]
            elif col % group_size == 0:
                # the group's range from its columns as they are now, errors of earlier ones applied
                ahead = torch.cat([W1[:, i:], W[:, i2:]], dim=1)[:, :group_size]
                scale, zero = params(ahead)
                scales[:, col // group_size], zeros[:, col // group_size] = scale, zero
            w_col = W1[:, i]
            q = quantize_with(w_col, scale, zero)
            Q[:, col] = q
            err = (w_col - (q - zero) * scale) / Hinv1[i, i]
            W1[:, i:].addr_(err, Hinv1[i, i:], alpha=-1)  # in place: no [out, BLOCK] temporary a column
            Err1[:, i] = err
        W[:, i2:] -= Err1 @ Hinv[i1:i2, i2:]

    inverse = torch.argsort(perm)
    # group of each original input channel
    g_idx = (torch.arange(k) if static else inverse) // group_size
    g_idx = g_idx.to(torch.int32)
    return QuantizedWeight(Q[:, inverse].to(torch.uint8), scales, zeros.to(torch.uint8), g_idx, group_size)

"""W4A16 linear: y = x @ dequant(W) (+ bias), W stored as asymmetric uint4 with per-group scale and zero.

ONNX: ai.engc::QLinear(x, qweight, scales, zeros[, bias][, perm]) -> y, attributes group_size,
has_bias, act_order (flags for the optional inputs, so the input list never holds empty names).

The engc int4 layout (what every AWQ/GPTQ checkpoint is repacked into), for a K-in, N-out projection:
  qweight int32 [K // 8, N]   nibble j (bits 4j..4j+3) of word [r, n] holds q[8r + j, n], low nibble first
  scales  float [ceil(K / group_size), N]   (the last group may be short: K need not divide)
  zeros   uint8 [ceil(K / group_size), N]   zero points in [0, 15]
  W[k, n] = (q[k, n] - zeros[k // g, n]) * scales[k // g, n]
K-major packing keeps a GEMM tile's loads contiguous along N and lets fused projections (qkv, gate_up)
concatenate along N. act_order checkpoints (GPTQ desc_act) have their input channels sorted by group
at build time; perm (int64 [K]) then says which input channel each sorted row reads: y = x[:, perm] @ W.

Launch rule (GPU, triton.py): M <= 8 rows use the GEMV kernel, one program per BLOCK_N outputs and
split over K; larger M use the GEMM kernel, grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),).
"""
import torch

PACK = 8  # nibbles per int32 word
GEMV_MAX_ROWS = 8


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """q uint8-valued [K, N] (values 0..15), K % 8 == 0 -> int32 [K // 8, N]."""
    k, n = q.shape
    q = q.reshape(k // PACK, PACK, n)
    words = torch.zeros(k // PACK, n, dtype=torch.int32, device=q.device)
    for j in range(PACK):  # int32 shifts wrap in two's complement: nibble 7 lands in the sign bit
        words |= q[:, j].to(torch.int32) << (4 * j)
    return words


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [K // 8, N] -> uint8 [K, N]."""
    r, n = qweight.shape
    shifts = (torch.arange(PACK, dtype=torch.int32, device=qweight.device) * 4).view(1, PACK, 1)
    q = (qweight.unsqueeze(1) >> shifts) & 0xF
    return q.reshape(r * PACK, n).to(torch.uint8)


def dequantize(qweight, scales, zeros, group_size: int) -> torch.Tensor:
    """-> W [K, N] in scales' dtype."""
    q = unpack_int4(qweight)
    k = q.shape[0]
    s = scales.repeat_interleave(group_size, dim=0)[:k]
    z = zeros.repeat_interleave(group_size, dim=0)[:k]
    return ((q.to(torch.int16) - z.to(torch.int16)).to(scales.dtype) * s)


def int4_linear(x, qweight, scales, zeros, *extra, group_size: int, has_bias: int = 0,
                act_order: int = 0) -> torch.Tensor:
    bias = extra[0] if has_bias else None
    if act_order:
        x = x.index_select(-1, extra[int(bool(has_bias))])
    w = dequantize(qweight, scales, zeros, group_size).to(x.dtype)
    y = x @ w
    return y + bias if bias is not None else y

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

Launch rule (GPU, triton.py; launch() below): M <= gemv_max_rows rows (a launch constant) run the GEMV
variant for M rounded up to a power of two, which reads each weight word once for all rows, split over K
when N alone gives fewer than target_programs programs (then 'gemv_reduce' sums the fp32 partials);
larger M run the GEMM. Variants carry the group size, a kernel constant: gemv_m{1,2,4,8}_g{G}, gemm_g{G}.
"""
import torch

PACK = 8  # nibbles per int32 word
GEMV_ROWS = (1, 2, 4, 8)   # the GEMV's BLOCK_M specializations; M rounds up to one of them
# launch args of each kernel kind: how many lead pointers (the rest, before the 2 scratch slots, are scalars)
POINTER_ARGS = {"gemv": 7, "gemv_reduce": 3, "gemm": 6}


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


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def gemv_variant(rows: int, group_size: int) -> str:
    return f"gemv_m{rows}_g{group_size}"


def gemm_variant(group_size: int) -> str:
    return f"gemm_g{group_size}"


def variant_kind(variant: str) -> str:
    return "gemv_reduce" if variant == "gemv_reduce" else variant.split("_", 1)[0]


def variant_rows(variant: str) -> int:
    return int(variant.split("_")[1][1:])


def gemm_block_k(group_size: int, block_k: int) -> int:
    """The GEMM's K tile: at most block_k and a divisor of the group, so a tile never straddles groups."""
    while group_size % block_k:
        block_k //= 2
    if block_k < 16:
        raise ValueError(f"int4 group size {group_size} is not a multiple of 16, which the GPU GEMM needs")
    return block_k


def jit_consts(group_size: int, table: dict) -> dict:
    """Every variant's constants for one group size from a per-kind table (the JIT path's stand-in for
    the bundle's records)."""
    consts = {gemv_variant(r, group_size): dict(table["gemv"], gemv_max_rows=GEMV_ROWS[-1]) for r in GEMV_ROWS}
    consts["gemv_reduce"] = dict(table["gemv_reduce"])
    gemm = dict(table["gemm"])
    gemm["BLOCK_K"] = gemm_block_k(group_size, gemm["BLOCK_K"])
    consts[gemm_variant(group_size)] = gemm
    return consts


def gemv_splits(tiles_n: int, word_rows: int, c: dict) -> tuple[int, int]:
    """(splits, word rows per split) of the GEMV: split K only while the N tiles alone are fewer than
    target_programs (a split costs a partial write and the reduce launch), each split a whole number
    of BLOCK_R row tiles."""
    splits = 1
    if tiles_n < c["target_programs"]:
        splits = min(c["max_splits"], _cdiv(c["target_programs"], tiles_n), _cdiv(word_rows, c["BLOCK_R"]))
    rows_per_split = _cdiv(_cdiv(word_rows, splits), c["BLOCK_R"]) * c["BLOCK_R"]
    return _cdiv(word_rows, rows_per_split), rows_per_split


def launch(x, qweight, scales, zeros, bias, y, *, group_size: int, consts: dict):
    """Launch rule of the int4 kernels: [(variant, grid, args)], in launch order.

    x [M, K] and y [M, N] contiguous in the activation dtype; qweight, scales, zeros in the engc int4
    layout; bias [N] or None. consts: variant -> the record's 'launch' dict. Null pointers are 0.
    args of 'gemv_m{R}_g{G}' (grid (cdiv(N, BLOCK_N), splits)):
        x, qweight, scales, zeros, bias, y, part, M, N, K, rows_per_split, has_bias, 0, 0
        (part: fp32 [splits, M, N] partial sums when splits > 1, else 0)
    args of 'gemv_reduce' (grid (cdiv(N, BLOCK), M)): part, bias, y, M, N, splits, has_bias, 0, 0
    args of 'gemm_g{G}' (grid (cdiv(M, BLOCK_M) * cdiv(N, BLOCK_N),)): x, qweight, scales, zeros, bias, y,
        M, N, K, has_bias, 0, 0
    """
    m, k = x.shape
    n = qweight.shape[1]
    assert x.is_contiguous() and y.is_contiguous() and qweight.shape[0] * PACK == k and n % 8 == 0
    if m == 0:
        return []
    has_bias, b = (1, bias) if bias is not None else (0, 0)
    gemv = consts.get(gemv_variant(1, group_size))
    if gemv is not None and m <= gemv["gemv_max_rows"]:
        variant = gemv_variant(next(r for r in GEMV_ROWS if r >= m), group_size)
        c = consts[variant]
        tiles_n = _cdiv(n, c["BLOCK_N"])
        splits, rows_per_split = gemv_splits(tiles_n, k // PACK, c)
        part = torch.empty(splits * m * n, dtype=torch.float32, device=x.device) if splits > 1 else 0
        launches = [(variant, (tiles_n, splits, 1),
                     [x, qweight, scales, zeros, b, y, part, m, n, k, rows_per_split, has_bias, 0, 0])]
        if splits > 1:
            block = consts["gemv_reduce"]["BLOCK"]
            launches.append(("gemv_reduce", (_cdiv(n, block), m, 1), [part, b, y, m, n, splits, has_bias, 0, 0]))
        return launches
    c = consts[gemm_variant(group_size)]
    grid = (_cdiv(m, c["BLOCK_M"]) * _cdiv(n, c["BLOCK_N"]), 1, 1)
    return [(gemm_variant(group_size), grid, [x, qweight, scales, zeros, b, y, m, n, k, has_bias, 0, 0])]

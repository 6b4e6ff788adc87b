"""W4A16 linear: y = x @ dequant(W)^T (+ bias), W stored as asymmetric uint4 with per-group scale and zero.

ONNX: ai.engc::QLinear(x, qweight, scales, zeros[, bias][, perm][, offsets]) -> y, attributes group_size,
has_bias, act_order, has_offsets (flags for the optional inputs, so the input list never holds empty names).
offsets (a GGUF Q4_1 / Q4_K group's float minimum, layout.py) are no kernel's argument: the GPU adds their
term, the inputs' group sums times the offsets (offset_term), to what the kernels compute from the rest.
W is in the engc int4 layout (layout.py: the format, pack / unpack and the CPU reference dequantize;
re-exported here, as the CUDA GEMV's names below are).

Launch rule (GPU, triton.py): M <= gemv_max_rows rows (a launch constant) run the GEMV for M rounded up
to a power of two (gemv_m{1,2,4,8}_g{G}), which reads each weight once for all rows, split over K only
when N alone gives fewer than target_programs programs (then 'gemv_reduce' sums the fp32 partials).
Larger M (prefill) dequantize the weight into a bf16/fp16 scratch [N, K] (dequant_g{G}, bandwidth-bound)
and call cuBLAS: cheaper than any int4 tensor-core GEMM engc has, by far (bench/results/HISTORY.md).
Where the build had nvcc and the tune table turns it on, the bundle also holds the CUDA C++ GEMV; its launch
rule and packed scale / zero words are in cuda.py (re-exported here). run_quantized_linear picks among them.
"""
import torch

from engc.kernels.int4_linear.cuda import (  # noqa: F401  (the op's API: callers use int4_linear.<name>)
    _cdiv, CUDA_MAX_PASSES, CUDA_WIDE_ROWS, PackedScales, cuda_dequant_variant, cuda_launch, cuda_row_slices,
    cuda_shape_variant, cuda_silu_variant, cuda_splits, cuda_variant, cuda_variant_for, cuda_wide_variant,
    pack_scales_zeros, packed_flavours, run_quantized_partials, run_quantized_silu, silu_out_fits, uses_cuda_gemv)
from engc.kernels.int4_linear.layout import (  # noqa: F401
    CHUNK, LAYOUT, LAYOUT_WITH_OFFSETS, LAYOUTS, PACK, check_shape, dequantize, pack_int4, unpack_int4)

GEMV_ROWS = (1, 2, 4, 8)   # the GEMV's BLOCK_M specializations; M rounds up to one of them
# launch args of each kernel kind: how many lead pointers (the rest, before the 2 scratch slots, are scalars)
POINTER_ARGS = {"gemv": 7, "gemv_reduce": 3, "dequant": 4}


def int4_linear(x, qweight, scales, zeros, *extra, group_size: int, has_bias: int = 0,
                act_order: int = 0, has_offsets: int = 0) -> torch.Tensor:
    bias = extra[0] if has_bias else None
    if act_order:
        x = x.index_select(-1, extra[int(bool(has_bias))])
    offsets = extra[-1] if has_offsets else None
    w = dequantize(qweight, scales, zeros, group_size, offsets).to(x.dtype)
    return torch.nn.functional.linear(x, w, bias)


def offset_term(x, offsets, group_size: int) -> torch.Tensor:
    """What a projection's offsets add to x @ W^T: each input group's sum times its offset, summed over
    groups ([M, K] x [N, G] -> [M, N], fp32 sums). K % group_size == 0 wherever offsets exist (GGUF blocks)."""
    m, k = x.shape
    sums = x.reshape(m, k // group_size, group_size).float().sum(-1)
    return (sums @ offsets.float().t()).to(x.dtype)


def gemv_variant(rows: int, group_size: int) -> str:
    return f"gemv_m{rows}_g{group_size}"


def dequant_variant(group_size: int) -> str:
    return f"dequant_g{group_size}"


def variant_kind(variant: str) -> str:
    return "gemv_reduce" if variant == "gemv_reduce" else variant.split("_", 1)[0]


def variant_rows(variant: str) -> int:
    return int(variant.split("_")[1][1:])


def jit_consts(group_size: int, table: dict) -> dict:
    """Every variant's constants for one group size from a per-kind table (the JIT path's stand-in for
    the bundle's records)."""
    consts = {gemv_variant(r, group_size): dict(table["gemv"]) for r in GEMV_ROWS}
    consts["gemv_reduce"] = dict(table["gemv_reduce"])
    consts[dequant_variant(group_size)] = dict(table["dequant"])
    return consts


def uses_gemv(m: int, group_size: int, consts: dict) -> bool:
    """Whether M rows run the GEMV (else dequantize + cuBLAS)."""
    gemv = consts.get(gemv_variant(1, group_size))
    return gemv is not None and m <= min(gemv["gemv_max_rows"], GEMV_ROWS[-1])


def gemv_splits(tiles_n: int, chunks: int, c: dict) -> tuple[int, int]:
    """(splits, chunks per split) of the GEMV: split K only while the N tiles alone are fewer than
    target_programs (a split costs a partial write and the reduce launch), each split a whole number
    of BLOCK_C-chunk tiles."""
    splits = 1
    if tiles_n < c["target_programs"]:
        splits = min(c["max_splits"], _cdiv(c["target_programs"], tiles_n), _cdiv(chunks, c["BLOCK_C"]))
    per_split = _cdiv(_cdiv(chunks, splits), c["BLOCK_C"]) * c["BLOCK_C"]
    return _cdiv(chunks, per_split), per_split


def launch(x, qweight, scales, zeros, bias, y, *, group_size: int, consts: dict):
    """Launch rule of the GEMV (uses_gemv(M) true): [(variant, grid, args)], in launch order.

    x [M, K] and y [M, N] contiguous in the activation dtype; qweight, scales, zeros in the engc int4
    layout; bias [N] or None. consts: variant -> the record's 'launch' dict. Null pointers are 0.
    args of 'gemv_m{R}_g{G}' (grid (cdiv(N, BLOCK_N), splits)):
        x, qweight, scales, zeros, bias, y, part, M, N, K, chunks_per_split, has_bias, 0, 0
        (part: fp32 [splits, M, N] partial sums when splits > 1, else 0)
    args of 'gemv_reduce' (grid (cdiv(N, BLOCK), M)): part, bias, y, M, N, splits, has_bias, 0, 0
    """
    m, k = x.shape
    n = qweight.shape[0]
    assert x.is_contiguous() and y.is_contiguous() and qweight.shape[1] * PACK == k and k % CHUNK == 0
    if m == 0:
        return []
    has_bias, b = (1, bias) if bias is not None else (0, 0)
    variant = gemv_variant(next(r for r in GEMV_ROWS if r >= m), group_size)
    c = consts[variant]
    tiles_n = _cdiv(n, c["BLOCK_N"])
    splits, per_split = gemv_splits(tiles_n, k // CHUNK, c)
    part = torch.empty(splits * m * n, dtype=torch.float32, device=x.device) if splits > 1 else 0
    launches = [(variant, (tiles_n, splits, 1),
                 [x, qweight, scales, zeros, b, y, part, m, n, k, per_split, has_bias, 0, 0])]
    if splits > 1:
        block = consts["gemv_reduce"]["BLOCK"]
        launches.append(("gemv_reduce", (_cdiv(n, block), m, 1), [part, b, y, m, n, splits, has_bias, 0, 0]))
    return launches


def dequant_launch(qweight, scales, zeros, w, *, group_size: int, consts: dict):
    """Launch rule of the dequant kernel: W [N, K] (contiguous, the activation dtype) = dequantize(...).
    args of 'dequant_g{G}' (grid (cdiv(N, BLOCK_N), cdiv(K / 32, BLOCK_C))): qweight, scales, zeros, w,
    N, K, 0, 0; of 'cuda_dequant_g{G}' (preferred where the bundle has it; grid (cdiv(N * K / 32, BLOCK),)):
    the same without the scratch zeros"""
    n, k = w.shape
    assert w.is_contiguous() and qweight.shape == (n, k // PACK) and k % CHUNK == 0
    if n == 0:
        return []
    cuda = cuda_dequant_variant(group_size)   # the CUDA C++ twin, where built: 16-byte chunks, BLOCK per CTA
    if cuda in consts:
        return [(cuda, (_cdiv(n * (k // CHUNK), consts[cuda]["BLOCK"]), 1, 1), [qweight, scales, zeros, w, n, k])]
    variant = dequant_variant(group_size)
    c = consts[variant]
    grid = (_cdiv(n, c["BLOCK_N"]), _cdiv(k // CHUNK, c["BLOCK_C"]), 1)
    return [(variant, grid, [qweight, scales, zeros, w, n, k, 0, 0])]




def run_quantized_linear(x, qweight, scales, zeros, bias, *, group_size: int, consts: dict, run, counters=None,
                         gemm_consts=None, run_gemm=None, packed: PackedScales | None = None):
    """y = x @ dequant(W)^T (+ bias) on the GPU: the int4 GEMM of decode batches where the bundle has a
    variant for M rows of this K (kernels/int4_gemm: gemm_consts, run_gemm), else the CUDA GEMV where the
    bundle has one (counters: the runtime's zeroed split counters), else the Triton GEMV for decode-sized
    M, else the dequant kernel into a scratch [N, K] from torch's allocator (graph-safe: a captured graph
    keeps it in its pool) and cuBLAS. run(launches) launches the bundle's int4_linear kernels.
    x contiguous [M, K]. packed: the runtime's PackedScales (cuda_launch)."""
    m, k = x.shape
    n = qweight.shape[0]
    if gemm_consts and counters is not None:
        from engc.kernels import int4_gemm
        variant = int4_gemm.pick(gemm_consts, k, group_size, m)
        if variant is not None:
            y = torch.empty(m, n, dtype=x.dtype, device=x.device)
            run_gemm(int4_gemm.launch(x, qweight, scales, zeros, y, variant, gemm_consts[variant], counters))
            return y + bias if bias is not None else y
    slices = cuda_row_slices(m, group_size, consts) if counters is not None else []
    if slices:
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        for a, b in slices:   # row slices of contiguous x and y stay contiguous and 16-byte aligned
            run(cuda_launch(x[a:b], qweight, scales, zeros, bias, y[a:b], group_size=group_size, consts=consts,
                            counters=counters, packed=packed))
        return y
    if uses_gemv(m, group_size, consts):
        y = torch.empty(m, n, dtype=x.dtype, device=x.device)
        run(launch(x, qweight, scales, zeros, bias, y, group_size=group_size, consts=consts))
        return y
    w = torch.empty(n, k, dtype=x.dtype, device=x.device)
    run(dequant_launch(qweight, scales, zeros, w, group_size=group_size, consts=consts))
    return torch.nn.functional.linear(x, w, bias)

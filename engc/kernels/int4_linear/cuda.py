"""The CUDA C++ int4 GEMV's launch rule (templates/int4_gemv.cu.j2, rendered by kernels/int4_linear/cuda_specs.py)
and the packed scale / zero words some of its builds read.

Where the build had nvcc and the tune table turns it on, the bundle holds the CUDA C++ GEMV (variant cuda_g{G}:
dequant in registers, tensor-core mma, M = 1..8 for the cost of one); it runs first for M <= its max_m
(cuda_launch), splitting K in-kernel on the runtime's zeroed counters, with no reduce launch. Wider builds of it
(variants cuda_wide16_g{G}, cuda_wide32_g{G}: max_m / 8 n8 tiles of x on each dequantized W fragment) serve the M
the first one does not, up to 32 rows, where built; up to twice the widest one's rows run it once per slice of rows
(cuda_row_slices). A fused gate_up followed by SiLU-and-mul (ai.engc::QLinearSiluMul, passes/fuse_qlinear_silu_mul)
runs the SiLU-out twin of the first one (cuda_silu_g{G}) where built and M fits: it writes silu(gate) * up itself
(run_quantized_silu). CUDA GEMV builds whose launch constant packed_sz is on read a weight's scales and zeros as
one 8-byte word a pair of rows (pack_scales_zeros), made at load (int4_linear/bind.py: prepack_int4) and kept by the
runtime's PackedScales: a second copy, 4 bytes a row and group, where the layout's arrays take 3.
"""
import torch

from engc.kernels.int4_linear.layout import CHUNK, PACK
from engc.kernels.rms_norm import MAX_SPLITS as MAX_PARTIALS   # the most split partials its reader sums


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def pack_scales_zeros(scales: torch.Tensor, zeros: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """The packed scale / zero words a packed_sz build of the CUDA GEMV reads (templates/int4_gemv.cu.j2 PACKED_SZ)
    for one weight: int32 [tiles, groups, 8, 2]; [tile, group, g] = (s[lo] | s[hi] << 16, z[lo] | z[hi] << 8) for
    the two rows a lane reads together, lo = 16 tile + g and hi = lo + 8 (rows past N repeat row N - 1, as the
    kernel's clamped rows do); silu (the SiLU-out build of a fused [gate; up], N = 2I): lo = 8 tile + g, a gate
    row, and hi = I + lo, its up row. scales: 2-byte floats [N, groups]; zeros: uint8 [N, groups]."""
    n, groups = scales.shape
    assert scales.element_size() == 2 and zeros.shape == scales.shape, (scales.dtype, tuple(zeros.shape))
    s = scales.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    z = zeros.to(torch.int32)
    if silu:
        assert n % 16 == 0, n
        lo, hi = slice(0, n // 2), slice(n // 2, n)
        s_lo, s_hi, z_lo, z_hi = (a[r].reshape(-1, 8, groups) for a, r in ((s, lo), (s, hi), (z, lo), (z, hi)))
    else:
        pad = -n % 16
        if pad:
            s, z = torch.cat([s, s[-1:].expand(pad, -1)]), torch.cat([z, z[-1:].expand(pad, -1)])
        s, z = s.view(-1, 2, 8, groups), z.view(-1, 2, 8, groups)
        s_lo, s_hi, z_lo, z_hi = s[:, 0], s[:, 1], z[:, 0], z[:, 1]
    words = torch.stack([s_lo | (s_hi << 16), z_lo | (z_hi << 8)], -1)   # [tiles, 8, groups, 2]
    return words.permute(0, 2, 1, 3).contiguous()


class PackedScales:
    """pack_scales_zeros of each weight a packed_sz build launches on, kept with the weight (the runtime keeps one
    per model). The runtime makes them at load (int4_linear/bind.py: prepack_int4); elsewhere (bench harnesses) they
    are made at the weight's first such launch: the engine's first launches of a decode shape are eager (the
    warm-up before each CUDA graph capture runs the step first), so no packing is captured."""

    def __init__(self):
        self._words = {}

    def __call__(self, scales: torch.Tensor, zeros: torch.Tensor, silu: bool, sync: bool = True) -> torch.Tensor:
        """The words of (scales, zeros) in the plain or SiLU-out order, packed on first use. sync=False leaves the
        packing kernels in flight: the caller synchronizes before any launch reads the words (prepack_int4 does,
        once for all its weights)."""
        key = (scales.data_ptr(), zeros.data_ptr(), silu)
        hit = self._words.get(key)
        if hit is None:
            if scales.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError("an int4 weight's scales were first packed inside a CUDA graph capture: run the "
                                   "step eagerly before capturing it")
            # the sources are kept with their words: their addresses cannot be reused by another weight meanwhile
            hit = self._words[key] = (scales, zeros, pack_scales_zeros(scales, zeros, silu))
            if scales.is_cuda and sync:
                # an EARLY_W build reads the words before its PDL wait, the only thing that would make the packing
                # kernels' writes visible to it: finish them now (once a weight)
                torch.cuda.current_stream().synchronize()
        return hit[2]


def packed_flavours(n: int, k: int, group_size: int, consts: dict, silu_node: bool) -> set[bool]:
    """Which packed words (True: SiLU-out, False: plain) the packed_sz CUDA GEMV builds would ask of a [N, K]
    weight at any row count their launch rule gives them: a fused gate_up (silu_node) takes the SiLU-out build
    where silu_out_fits, every weight cuda_variant_for's build elsewhere. The runtime packs these at load
    (int4_linear/bind.py: prepack_int4), before the KV cache is sized from the memory left."""
    rows = max((c.get("max_m", 0) for c in consts.values()), default=0)
    flavours = set()
    for m in range(1, rows + 1):
        silu = silu_node and silu_out_fits(m, n, group_size, consts)
        variant = cuda_silu_variant(group_size) if silu else cuda_variant_for(m, group_size, consts, (n, k))
        if variant is not None and consts[variant].get("packed_sz"):
            flavours.add(silu)
    return flavours


def cuda_variant(group_size: int) -> str:
    return f"cuda_g{group_size}"


def cuda_silu_variant(group_size: int) -> str:
    """The up-to-8-rows CUDA GEMV that writes silu(gate) * up of a fused gate_up [gate; up] (SILU_OUT in
    templates/int4_gemv.cu.j2), where the bundle has it: QLinearSiluMul then needs no silu_mul launch."""
    return f"cuda_silu_g{group_size}"


def cuda_dequant_variant(group_size: int) -> str:
    """The CUDA C++ prefill dequant (templates/int4_dequant.cu.j2), where the bundle has it."""
    return f"cuda_dequant_g{group_size}"


# The row classes of the wider CUDA GEMV builds (tune entries int4_linear/cuda/gemv_wide{rows}): each x tile
# costs registers and issue slots for every row it holds, so 9-16 rows get a build of their own.
CUDA_WIDE_ROWS = (16, 32)


def cuda_wide_variant(group_size: int, rows: int) -> str:
    """The CUDA GEMV built for up to `rows` rows (rows / 8 n8 tiles of x), where the bundle has it."""
    return f"cuda_wide{rows}_g{group_size}"


def cuda_shape_variant(group_size: int, n: int, k: int) -> str:
    """The CUDA GEMV built for one projection shape [N, K] (tune entry int4_linear/cuda/gemv_n{N}_k{K}), where
    the bundle has it: the up-to-8-rows GEMV with the constants measured best for that shape."""
    return f"cuda_g{group_size}_n{n}_k{k}"


def cuda_variant_for(m: int, group_size: int, consts: dict, shape: tuple[int, int] | None = None) -> str | None:
    """The CUDA C++ GEMV that serves M rows of a [N, K] = shape weight: the build for that shape where the
    bundle has one that holds M, else of its builds for this group size the one with the fewest rows that
    still holds M; None where none does."""
    if shape is not None:
        own = cuda_shape_variant(group_size, *shape)
        if (c := consts.get(own)) is not None and 1 <= m <= c["max_m"]:
            return own
    names = [cuda_variant(group_size)] + [cuda_wide_variant(group_size, r) for r in CUDA_WIDE_ROWS]
    fits = [(c["max_m"], v) for v in names if (c := consts.get(v)) is not None and 1 <= m <= c["max_m"]]
    return min(fits)[1] if fits else None


# Rows past the widest CUDA GEMV build run it once per slice of that many rows, in at most this many passes:
# two passes beat the CUDA dequant + cuBLAS (bench/results/HISTORY.md); more would re-read W more often than
# the dequant's one bf16 write and read of it costs.
CUDA_MAX_PASSES = 2


def cuda_row_slices(m: int, group_size: int, consts: dict) -> list[tuple[int, int]]:
    """The (start, stop) row slices in which the CUDA C++ GEMV serves M rows: one where a build holds M,
    else slices of the widest build's max_m (at most CUDA_MAX_PASSES); [] where the bundle has none."""
    if cuda_variant_for(m, group_size, consts) is not None:
        return [(0, m)]
    names = [cuda_variant(group_size)] + [cuda_wide_variant(group_size, r) for r in CUDA_WIDE_ROWS]
    widest = max((consts[v]["max_m"] for v in names if v in consts), default=0)
    if not widest or m < 1 or -(-m // widest) > CUDA_MAX_PASSES:
        return []
    return [(i, min(i + widest, m)) for i in range(0, m, widest)]


def uses_cuda_gemv(m: int, group_size: int, consts: dict) -> bool:
    """Whether M rows run the CUDA C++ GEMV (the bundle has one for this group size that holds M, or the
    widest one does in a few passes)."""
    return bool(cuda_row_slices(m, group_size, consts))


def cuda_launch(x, qweight, scales, zeros, bias, y, *, group_size: int, consts: dict, counters, variant=None,
                partials=None, packed: PackedScales | None = None):
    """Launch rule of the CUDA GEMV (uses_cuda_gemv(M) true): [(variant, grid, args)].

    grid (cdiv(N, BLOCK_N), splits); K splits as kernels/gemv's split_count says (toward target_programs
    CTAs), whole BLOCK_K tiles each; the last split to arrive reduces. counters: int32, zero, at least one
    per N tile for a split launch (left zero again). args: x, qweight, scales, zeros, bias, y, partial
    (fp32 [splits, M, N] or 0), counter (or 0: no reduce), M, N, K, k_tiles_per_split, splits, has_bias.
    variant: the build to launch (default: cuda_variant_for M); for cuda_silu_g{G}, y is [M, N / 2].
    partials: where a split launch's output goes instead of y (then None), left unreduced (no counter): fp32
    [splits, M, N] as cuda_splits says, summed in split order by the kernel that reads it (rms_norm's
    add_rms_norm_partials); the launch then has no bias and is not the SiLU-out build.
    packed: where a packed_sz build gets the weight's packed words (its `scales`; `zeros` is then 0); without
    one they are packed for this launch alone (not inside a graph capture)."""
    m, k = x.shape
    n = qweight.shape[0]
    assert x.is_contiguous() and (y is None or y.is_contiguous()) and qweight.shape[1] * PACK == k and k % CHUNK == 0
    if m == 0:
        return []
    variant = variant or cuda_variant_for(m, group_size, consts, (n, k))
    c = consts[variant]
    assert m <= c["max_m"] and c["GROUP"] == group_size
    if variant == cuda_silu_variant(group_size):   # a CTA pairs BLOCK_N / 2 gate rows with their up rows
        assert n % c["BLOCK_N"] == 0 and y.shape == (m, n // 2), (n, c["BLOCK_N"], tuple(y.shape))
    n_tiles = _cdiv(n, c["BLOCK_N"])
    splits, per = _cuda_split(n, k, c, counters)
    has_bias, b = (1, bias) if bias is not None else (0, 0)
    if c.get("packed_sz"):
        scales, zeros = (packed or PackedScales())(scales, zeros, silu=variant == cuda_silu_variant(group_size)), 0
    if partials is not None:   # the output: no y, no counter (the kernel stores its partial and exits)
        assert splits > 1 and bias is None and variant != cuda_silu_variant(group_size)
        assert partials.shape == (splits, m, n) and partials.dtype == torch.float32 and partials.is_contiguous()
        partial, counter, y = partials, 0, 0
    else:
        partial = torch.empty(splits * m * n, dtype=torch.float32, device=x.device) if splits > 1 else 0
        counter = counters if splits > 1 else 0
    return [(variant, (n_tiles, splits, 1), [x, qweight, scales, zeros, b, y, partial, counter, m, n, k, per,
                                              splits, has_bias])]


def _cuda_split(n: int, k: int, c: dict, counters) -> tuple[int, int]:
    """(splits, K tiles a split) of a CUDA GEMV launch with constants c: kernels/gemv's split_count, one
    split where the counters could not hold the N tiles."""
    from engc.kernels.gemv import split_count
    n_tiles, k_tiles = _cdiv(n, c["BLOCK_N"]), _cdiv(k, c["BLOCK_K"])
    splits, per = split_count(n_tiles, k_tiles, c)
    return (1, k_tiles) if splits > 1 and n_tiles > counters.numel() else (splits, per)


def cuda_splits(m: int, n: int, k: int, group_size: int, consts: dict, counters) -> int:
    """The K splits of the CUDA GEMV launch that serves M rows of a [N, K] weight in one pass (0 where
    none does in one launch): more than one means its output can be left as partials (cuda_launch)."""
    variant = cuda_variant_for(m, group_size, consts, (n, k))
    return _cuda_split(n, k, consts[variant], counters)[0] if variant and counters is not None else 0


def silu_out_fits(m: int, n: int, group_size: int, consts: dict) -> bool:
    """Whether the bundle's SiLU-out GEMV takes M rows of a fused gate_up with N = 2I outputs."""
    c = consts.get(cuda_silu_variant(group_size))
    return c is not None and 1 <= m <= c["max_m"] and n % c["BLOCK_N"] == 0


def run_quantized_silu(x, qweight, scales, zeros, bias, *, group_size: int, consts: dict, run, counters,
                       packed: PackedScales | None = None):
    """silu(gate) * up of a fused gate_up, act [M, N / 2], by the SiLU-out CUDA GEMV where it takes M rows
    (silu_out_fits); None where it does not (the caller runs the projection, then silu_mul)."""
    m, n = x.shape[0], qweight.shape[0]
    if counters is None or not silu_out_fits(m, n, group_size, consts):
        return None
    act = torch.empty(m, n // 2, dtype=x.dtype, device=x.device)
    run(cuda_launch(x, qweight, scales, zeros, bias, act, group_size=group_size, consts=consts, counters=counters,
                    variant=cuda_silu_variant(group_size), packed=packed))
    return act


def run_quantized_partials(x, qweight, scales, zeros, *, group_size: int, consts: dict, run, counters,
                           gemm_consts=None, packed: PackedScales | None = None):
    """x @ dequant(W)^T left as the CUDA GEMV's unreduced split-K partials, fp32 [splits, M, N] (no bias),
    where run_quantized_linear would run that GEMV in one launch that splits K and its build's launch
    constant partials_out is on; None elsewhere (the caller runs run_quantized_linear). Their reader sums
    them in split order (kernels/rms_norm, partials)."""
    m, k = x.shape
    n = qweight.shape[0]
    if counters is None or m == 0:
        return None
    if gemm_consts:
        from engc.kernels import int4_gemm
        if int4_gemm.pick(gemm_consts, k, group_size, m) is not None:
            return None
    variant = cuda_variant_for(m, group_size, consts, (n, k))
    if variant is None or not consts[variant].get("partials_out"):   # the tune entry's switch
        return None
    splits = _cuda_split(n, k, consts[variant], counters)[0]
    if not 2 <= splits <= MAX_PARTIALS:
        return None
    partials = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    run(cuda_launch(x, qweight, scales, zeros, None, None, group_size=group_size, consts=consts, counters=counters,
                    partials=partials, packed=packed))
    return partials

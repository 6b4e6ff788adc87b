"""The CUDA C++ W4A16 GEMV (templates/int4_gemv.cu.j2): its per-lane math emulated under plain torch on the
engc int4 layout (magic-number dequant, x regrouping, mma fragments), render, nvcc compile for sm80/sm90
(skipped without nvcc), records vs the launch rule, and the build's selection by the tune table."""
from __future__ import annotations

import pytest
import torch

from engc.compiler import tune
from engc.compiler.codegen import cuda
from engc.kernels.int4_linear import cuda_specs as cuda_int4
from engc.kernels import int4_linear as op

ON = {"enabled": True}


# ------------------------------------------------------------------ the kernel's lane math, emulated

def _bf16_bits(v: torch.Tensor) -> list[int]:
    return [int(b) & 0xFFFF for b in v.to(torch.bfloat16).view(torch.int16)]


def _bf16_pair(word: int) -> tuple[float, float]:
    halves = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    return float(halves[0]), float(halves[1])


def _byte_perm(a: int, b: int, sel: int) -> int:
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(sel >> (4 * i)) & 0x7] << (8 * i) for i in range(4))


def _emulate_step(words, zeros, xs, zero_sum=False):
    """One 16-row tile and one 128-wide K step as the template computes it, for 8 rows of x.
    words [16, 16] int (4 chunks of 4 words per row), zeros [16], xs [8, 128] bf16 -> D [16, 8] = the
    sum of the 8 mmas' products of (q - zero) with x, built from the m16n8k16 fragment definitions.
    zero_sum: the pairs stay 128 + q, the same mmas with A = 1 sum x, and (128 + zero) * sum comes off."""
    d = torch.zeros(16, 8, dtype=torch.float64)
    xsum = torch.zeros(16, 8, dtype=torch.float64)
    for i in range(4):               # word i of every lane's chunk
        for mma in range(2):         # shifts (0, 1), then (2, 3)
            a, b = torch.zeros(16, 16, dtype=torch.float64), torch.zeros(16, 8, dtype=torch.float64)
            for lane in range(32):
                g, c = lane // 4, lane % 4
                xr = [lo | hi << 16 for lo, hi in zip(*[iter(_bf16_bits(xs[g, 32 * c:32 * c + 32]))] * 2)]
                pairs = {}
                for h in range(2):
                    w = words[g + 8 * h][4 * c + i] & 0xFFFFFFFF
                    for s in (2 * mma, 2 * mma + 1):
                        v = ((w >> (4 * s)) & 0x000F000F) | 0x43004300       # the magic-number trick
                        lo, hi = _bf16_pair(v)
                        off = 0 if zero_sum else 128 + zeros[g + 8 * h]
                        pairs[h, s] = (lo - off, hi - off)
                xp = {}
                for s in (2 * mma, 2 * mma + 1):
                    e = 4 * s + i
                    xp[s] = _bf16_pair(_byte_perm(xr[e // 2], xr[e // 2 + 8], 0x7632 if i & 1 else 0x5410))
                s0, s1 = 2 * mma, 2 * mma + 1
                # a0..a3: (row g | g+8) x (cols 2c, 2c+1 | 2c+8, 2c+9); b0, b1: (rows 2c, 2c+1 | 2c+8, 2c+9) x col g
                a[g, 2 * c:2 * c + 2] = torch.tensor(pairs[0, s0], dtype=torch.float64)
                a[g + 8, 2 * c:2 * c + 2] = torch.tensor(pairs[1, s0], dtype=torch.float64)
                a[g, 2 * c + 8:2 * c + 10] = torch.tensor(pairs[0, s1], dtype=torch.float64)
                a[g + 8, 2 * c + 8:2 * c + 10] = torch.tensor(pairs[1, s1], dtype=torch.float64)
                b[2 * c:2 * c + 2, g] = torch.tensor(xp[s0], dtype=torch.float64)
                b[2 * c + 8:2 * c + 10, g] = torch.tensor(xp[s1], dtype=torch.float64)
            d += a @ b
            xsum += torch.ones(16, 16, dtype=torch.float64) @ b
    if zero_sum:
        d -= (128 + torch.tensor(zeros, dtype=torch.float64))[:, None] * xsum
    return d


@pytest.mark.parametrize("zero_sum", [False, True])
def test_lane_math_matches_the_layout(zero_sum):
    """The nibble extraction, the x regrouping and the fragment placement together compute
    sum_k (q[n, k] - zero[n]) * x[m, k] over the step: any slip in the K renaming would mix inputs. With
    zero_sum the zero comes off the step's sum instead of every pair."""
    torch.manual_seed(0)
    q = torch.randint(0, 16, (16, 128), dtype=torch.uint8)
    zeros = [int(z) for z in torch.randint(0, 16, (16,))]
    xs = torch.randn(8, 128).to(torch.bfloat16)
    words = op.pack_int4(q).tolist()
    got = _emulate_step(words, zeros, xs, zero_sum)
    want = (q.double() - torch.tensor(zeros, dtype=torch.float64)[:, None]) @ xs.double().t()
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-9)


def test_dequant_lane_math_is_the_reference_bit_for_bit():
    """int4_dequant.cu.j2's pairs, scaling (one rounding) and byte permutes back to input order give
    exactly kernels/int4_linear.dequantize for one chunk."""
    torch.manual_seed(2)
    q = torch.randint(0, 16, (1, 32), dtype=torch.uint8)
    z, s = torch.tensor([[11]], dtype=torch.uint8), torch.tensor([[0.0123]], dtype=torch.bfloat16)
    words = [w & 0xFFFFFFFF for w in op.pack_int4(q)[0].tolist()]
    scale = s.view(torch.int16).item() & 0xFFFF
    p = {}
    for i in range(4):
        for sh in range(4):
            v = ((words[i] >> (4 * sh)) & 0x000F000F) | 0x43004300
            lo, hi = _bf16_pair(v)
            pair = torch.tensor([lo - (128 + 11), hi - (128 + 11)]).to(torch.bfloat16)   # exact integers
            prod = (pair.float() * torch.tensor([scale] * 2, dtype=torch.int32).to(torch.int16)
                    .view(torch.bfloat16).float()).to(torch.bfloat16)                  # fma(x, s, -0): one rounding
            b = [int(v) & 0xFFFF for v in prod.view(torch.int16)]
            p[i, sh] = b[0] | b[1] << 16
    out = []
    for r in range(16):
        e = (2 * r) % 16
        out.append(_byte_perm(p[e % 4, e // 4], p[(e + 1) % 4, e // 4], 0x5410 if r < 8 else 0x7632))
    got = torch.tensor([h for w in out for h in (w & 0xFFFF, w >> 16)], dtype=torch.int32).to(torch.int16)
    assert torch.equal(got.view(torch.bfloat16), op.dequantize(op.pack_int4(q), s, z, 128)[0])


def test_scale_after_is_within_tolerance_of_the_reference():
    """Scaling each step's fp32 sum (group % 128 == 0) instead of rounding every weight to bf16 stays
    well within the device checks' tolerance of the reference dequantize + matmul."""
    torch.manual_seed(1)
    n, k, g = 64, 1024, 128
    q = torch.randint(0, 16, (n, k), dtype=torch.uint8)
    s = (torch.rand(n, k // g) * 0.01 + 0.001).to(torch.bfloat16)
    z = torch.randint(0, 16, (n, k // g), dtype=torch.uint8)
    x = torch.randn(4, k).to(torch.bfloat16)
    ref = x.double() @ op.dequantize(op.pack_int4(q), s, z, g).double().t()
    ints = (q.double() - z.double().repeat_interleave(g, 1)).view(n, k // g, g)
    steps = torch.einsum("ngk,mgk->mng", ints, x.double().view(4, k // g, g))
    got = (steps * s.double()).sum(-1)   # before the output's bf16 rounding, which both paths share
    # the difference is the reference's own rounding of every weight to bf16 (~1e-3 per weight; the Triton
    # GEMV does not round them either); the device checks allow 1e-2
    assert float((got - ref).norm() / ref.norm()) < 4e-3


# ------------------------------------------------------------------ codegen, compile, launch rule

def test_render_specializes_group_and_tiles():
    spec, why = cuda_int4.int4_gemv_spec(64, "bf16", "sm90", {"TILES": 4, "UNROLL": 1})
    assert why == "" and spec.launch["BLOCK_N"] == 64 and spec.launch["BLOCK_K"] == 512
    src = cuda.render(spec.template, **spec.render)
    assert "constexpr int GROUP = 64;" in src and "0x43004300u" in src and spec.entry in src
    assert "constexpr int TILES = 4;" in src and "{{" not in src
    fp16 = cuda.render(spec.template, **cuda_int4.int4_gemv_spec(128, "fp16", "sm90")[0].render)
    assert "0x64006400u" in fp16 and "f16x2" in fp16
    # ZERO_SUM is a render switch, and the kernel keeps it off for fp16 itself (MAGIC 1024 would cancel bits)
    on, off = (cuda_int4.int4_gemv_spec(128, "bf16", "sm90", {"ZERO_SUM": z, "ACC_SPLIT": 1, "PACKED_SZ": False})[0]
               for z in (True, False))
    assert on.entry.endswith("z") and not off.entry.endswith("z")
    # ACC_SPLIT: a step's mmas over that many accumulators (the table's M <= 8 entry takes 2), named in the entry
    split = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", {"PACKED_SZ": False})[0]
    assert split.entry.endswith("zs2") and "constexpr int ACC_SPLIT = 2;" in cuda.render(split.template, **split.render)
    assert "constexpr int ACC_SPLIT = 1;" in cuda.render(on.template, **on.render)
    assert "constexpr bool ZERO_SUM = true &&" in cuda.render(on.template, **on.render)
    assert "constexpr bool ZERO_SUM = false &&" in cuda.render(off.template, **off.render)
    assert "&& false;" in fp16.split("constexpr bool ZERO_SUM")[1].split("\n")[0]
    assert cuda_int4.int4_gemv_spec(128, "fp32", "sm90")[0] is None


def test_early_w_requests_the_first_tile_before_the_pdl_wait():
    """EARLY_W: the CTA's first K tile of W (and its scales and zeros: the bundle's, not the step's) is loaded
    before griddepcontrol.wait, and x only after it; the stock build waits first."""
    early = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", {"EARLY_W": True, "PACKED_SZ": False})[0]
    stock = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", {"PACKED_SZ": False})[0]
    assert early.entry == stock.entry + "e"
    src = cuda.render(early.template, **early.render).split("extern \"C\" __global__")[1]
    wait = src.index("griddepcontrol.wait")
    assert src.index("w_first[u][t][h] = in_k ? load_w(") < wait < src.index("__ldg(reinterpret_cast<const uint4*>(x_row")
    assert src.count("griddepcontrol.wait") == 1
    plain = cuda.render(stock.template, **stock.render).split("extern \"C\" __global__")[1]
    assert "w_first" not in plain and plain.index("griddepcontrol.wait") < plain.index("load_w(")



def test_selected_only_where_enabled():
    from engc.kernels.int4_linear.specs import int4_linear_specs
    triton_specs = int4_linear_specs("bf16", "sm90", (128, 32))
    no_wide = {"gemv_wide16": {"enabled": False}, "gemv_wide32": {"enabled": False}}
    off, _ = cuda_int4.selected_int4_specs(triton_specs, {"gemv": {"enabled": False}, "dequant": {"enabled": False},
                                                          **no_wide})
    assert off == []
    plain = {"enabled": True, "silu_out": False}
    on, notes = cuda_int4.selected_int4_specs(triton_specs, {"gemv": plain, "dequant": {"enabled": False}, **no_wide})
    assert sorted(s.variant for s in on) == ["cuda_g128", "cuda_g32"] and notes == []
    both, _ = cuda_int4.selected_int4_specs(triton_specs, {"gemv": plain, "dequant": ON, **no_wide})
    assert sorted(s.variant for s in both) == ["cuda_dequant_g128", "cuda_dequant_g32", "cuda_g128", "cuda_g32"]
    silu, _ = cuda_int4.selected_int4_specs(triton_specs, {"gemv": dict(plain, silu_out=True),
                                                           "dequant": {"enabled": False}, **no_wide})
    assert sorted(s.variant for s in silu) == ["cuda_g128", "cuda_g32", "cuda_silu_g128", "cuda_silu_g32"]
    stock, notes = cuda_int4.selected_int4_specs(triton_specs)   # the table as it ships
    assert sorted(s.variant for s in stock) == sorted(f"{v}_g{g}" for g in (128, 32) for v in (
        "cuda", "cuda_silu", "cuda_wide16", "cuda_wide32", "cuda_dequant")) and notes == []


def test_a_projection_shape_gets_its_own_build_where_the_table_has_one():
    """gemv_n{N}_k{K} entries (the 8B's qkv on sm90): built only for a model with that shape, as variant
    cuda_g{G}_n{N}_k{K}, and preferred by the launch rule for that shape up to its max_m."""
    from engc.kernels.int4_linear.specs import int4_linear_specs
    triton_specs = int4_linear_specs("bf16", "sm90", (128,))
    no_dq = {"dequant": {"enabled": False}}
    specs, notes = cuda_int4.selected_int4_specs(triton_specs, no_dq, shapes={(6144, 4096), (4096, 4096)})
    own = [s for s in specs if s.variant == "cuda_g128_n6144_k4096"]
    assert len(own) == 1 and notes == [] and (own[0].render["tiles"], own[0].render["unroll"]) == (1, 2)
    assert own[0].launch["BLOCK_N"] == 16
    o_own = [s for s in specs if s.variant == "cuda_g128_n4096_k4096"]   # EARLY_W: behind the decode attention
    assert len(o_own) == 1 and o_own[0].render["early_w"] and o_own[0].entry.endswith("e")   # PACKED_SZ off: no gain
    assert not any("_n" in s.variant for s in cuda_int4.selected_int4_specs(triton_specs, no_dq)[0])
    sm80 = cuda_int4.selected_int4_specs(int4_linear_specs("bf16", "sm80", (128,)), no_dq, shapes={(6144, 4096)})
    assert not any("_n" in s.variant for s in sm80[0])   # measured on sm90 only
    consts = {s.variant: s.launch for s in specs}
    qkv, o = (6144, 4096), (4096, 4096)
    assert [op.cuda_variant_for(m, 128, consts, qkv) for m in (1, 8, 9)] == [own[0].variant] * 2 + ["cuda_wide16_g128"]
    assert op.cuda_variant_for(1, 128, consts, o) == o_own[0].variant
    assert op.cuda_variant_for(1, 128, consts) == "cuda_g128"
    counters = torch.zeros(1 << 16, dtype=torch.int32)
    for (n, k), variant, block_n in ((qkv, own[0].variant, 16), (o, o_own[0].variant, 32)):
        x, y = torch.zeros(2, k, dtype=torch.bfloat16), torch.empty(2, n, dtype=torch.bfloat16)
        qw = torch.zeros(n, k // 8, dtype=torch.int32)
        s, z = torch.ones(n, k // 128, dtype=torch.bfloat16), torch.zeros(n, k // 128, dtype=torch.uint8)
        (got, grid, _), = op.cuda_launch(x, qw, s, z, None, y, group_size=128, consts=consts, counters=counters)
        assert got == variant and grid[0] == n // block_n


def test_maxnreg_caps_the_registers_in_place_of_the_launch_bounds():
    """MAXNREG (the tune entry's key, 0 = off): the kernel is declared __maxnreg__(N) instead of
    __launch_bounds__(THREADS, MIN_BLOCKS) (nvcc refuses both on one kernel) and its entry name says so; the stock
    build is unchanged. Where nvcc is, the capped build compiles."""
    capped = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", {"MAXNREG": 96})[0]
    stock = cuda_int4.int4_gemv_spec(128, "bf16", "sm90")[0]
    assert capped.entry == stock.entry + "r96" and stock.render["maxnreg"] == 0
    head = cuda.render(capped.template, **capped.render).split("extern \"C\" __global__")[1].split(capped.entry)[0]
    assert head.split() == ["void", "__maxnreg__(96)"]
    plain = cuda.render(stock.template, **stock.render).split("extern \"C\" __global__")[1].split(stock.entry)[0]
    assert plain.split() == ["void", "__launch_bounds__(THREADS,", "MIN_BLOCKS)"]
    if cuda.nvcc_path() is not None:
        (record,) = cuda.compile_cuda([capped]).records
        assert record["variant"] == "cuda_g128" and record["arch"] == "sm90"


@pytest.fixture(scope="module")
def records():
    if cuda.nvcc_path() is None:
        pytest.skip("nvcc not found")
    specs = [make(128, "bf16", arch)[0] for arch in ("sm80", "sm90")
             for make in (cuda_int4.int4_gemv_spec, cuda_int4.int4_dequant_spec)]
    specs += [cuda_int4.int4_gemv_spec(128, "bf16", arch, ON, "gemv_wide32")[0] for arch in ("sm80", "sm90")]
    specs += [cuda_int4.int4_gemv_spec(128, "bf16", arch, ON, silu_out=True)[0] for arch in ("sm80", "sm90")]
    specs.append(cuda_int4.int4_gemv_spec(128, "bf16", "sm90", None, "gemv_n4096_k4096")[0])   # o: EARLY_W
    return cuda.compile_cuda(specs).records


def test_compiles_for_sm80_and_sm90(records):
    assert {(r["arch"], r["variant"]) for r in records} == {
        (a, v) for a in ("sm80", "sm90")
        for v in ("cuda_g128", "cuda_dequant_g128", "cuda_wide32_g128", "cuda_silu_g128")} | {
        ("sm90", "cuda_g128_n4096_k4096")}
    for r in records:
        assert r["scratch_params"] == 0 and r["launch"]["impl"] == "cuda" and r["launch"]["GROUP"] == 128


def test_dequant_launch_rule_matches_records(records):
    rec = next(r for r in records if (r["arch"], r["variant"]) == ("sm90", "cuda_dequant_g128"))
    n, k = 1000, 4128
    qw, w = torch.zeros(n, k // 8, dtype=torch.int32), torch.empty(n, k, dtype=torch.bfloat16)
    s, z = torch.ones(n, 33, dtype=torch.bfloat16), torch.zeros(n, 33, dtype=torch.uint8)
    (variant, grid, args), = op.dequant_launch(qw, s, z, w, group_size=128, consts={variant_: rec["launch"]
                                                                                   for variant_ in [rec["variant"]]})
    assert variant == rec["variant"] and len(args) == len(rec["args"]) and args[4:] == [n, k]
    assert grid == (-(-n * k // 32 // rec["launch"]["BLOCK"]), 1, 1)


@pytest.mark.parametrize("rows,n,k,bias", [(1, 4096, 4096, False), (8, 4096, 14336, True), (3, 28672, 4096, False),
                                           (5, 96, 8192, True)])
def test_launch_rule_matches_records(records, rows, n, k, bias):
    rec = next(r for r in records if (r["arch"], r["variant"]) == ("sm90", "cuda_g128"))
    consts = {rec["variant"]: rec["launch"]}
    counters = torch.zeros(1 << 16, dtype=torch.int32)
    x, y = torch.zeros(rows, k, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    s, z = torch.ones(n, k // 128, dtype=torch.bfloat16), torch.zeros(n, k // 128, dtype=torch.uint8)
    b = torch.zeros(n, dtype=torch.bfloat16) if bias else None
    assert op.cuda_variant_for(rows, 128, consts) == rec["variant"] and op.cuda_variant_for(9, 128, consts) is None
    (variant, grid, args), = op.cuda_launch(x, qw, s, z, b, y, group_size=128, consts=consts, counters=counters)
    assert variant == rec["variant"] and len(args) == len(rec["args"])
    c = rec["launch"]
    n_tiles, k_tiles = -(-n // c["BLOCK_N"]), -(-k // c["BLOCK_K"])
    splits, per = grid[1], args[11]
    assert grid == (n_tiles, splits, 1) and args[12] == splits and -(-k_tiles // per) == splits
    assert (n_tiles * splits >= c["target_programs"] or splits == 1 or per == 1) if n_tiles < 600 else splits == 1
    for value, spec in zip(args, rec["args"]):
        if spec["type"].startswith("*") and isinstance(value, int):   # packed_sz: the words replace the zeros
            assert value == 0 and (spec["name"] == "bias_ptr" or splits == 1 or spec["name"] == "z_ptr" and c["packed_sz"])
        elif spec["type"].startswith("*"):
            want = {"bf16": torch.bfloat16, "fp32": torch.float32, "i32": torch.int32, "u8": torch.uint8}
            assert value.dtype == want[spec["type"][1:]], spec
        else:
            assert isinstance(value, int) and not isinstance(value, bool), spec
    assert args[13] == int(bias)
    if c["packed_sz"]:   # the table's M <= 8 build reads the packed words
        assert torch.equal(args[2], op.pack_scales_zeros(s, z)) and args[3] == 0


def _kernel_reads(words, n, groups, tiles_per_cta, silu):
    """What templates/int4_gemv.cu.j2 reads, by its own index arithmetic, for every (CTA, tile, lane row g, group):
    {(weight row lo, weight row hi, group): (s[lo] bits, s[hi] bits, z[lo], z[hi])} from the packed words, the
    rows being the ones its W loads read (w_row: clamped to N - 1; SILU_OUT: gate row a, up row I + a)."""
    rows, inter = 16 * tiles_per_cta, n // 2
    sz_tiles = inter // 8 if silu else -(-n // 16)
    flat = words.reshape(-1, 2)
    got = {}
    for cta in range(-(-(inter if silu else n) // (rows // 2 if silu else rows))):
        for t in range(tiles_per_cta):
            for g in range(8):
                if silu:
                    a = min(cta * (rows // 2) + 8 * t + g, inter - 1)
                    lo, hi = a, inter + a
                else:
                    lo, hi = (min(cta * rows + 16 * t + 8 * h + g, n - 1) for h in (0, 1))
                tile = min(cta * tiles_per_cta + t, sz_tiles - 1)
                for grp in range(groups):
                    w0, w1 = (int(v) & 0xFFFFFFFF for v in flat[(tile * groups + grp) * 8 + g])
                    got[lo, hi, grp] = (w0 & 0xFFFF, w0 >> 16, w1 & 0xFF, (w1 >> 8) & 0xFF)
    return got


@pytest.mark.parametrize("n,silu", [(40, False), (64, False), (64, True), (96, True)])
def test_packed_scales_zeros_are_what_the_kernel_reads(n, silu):
    """PACKED_SZ: the words pack_scales_zeros makes, read at the template's indices, give every lane the scales and
    zeros of exactly the two W rows it reads (plain: rows g, g + 8 of a 16-row tile, N not a multiple of 16 included;
    SiLU-out: a gate row and its up row), for one and two tiles a CTA."""
    gen = torch.Generator().manual_seed(n)
    groups = 3
    s = (torch.rand(n, groups, generator=gen) + 0.5).to(torch.bfloat16)
    z = torch.randint(0, 16, (n, groups), generator=gen, dtype=torch.uint8)
    words = op.pack_scales_zeros(s, z, silu)
    assert words.dtype == torch.int32 and words.shape == ((n // 16 if silu else -(-n // 16)), groups, 8, 2)
    bits = s.view(torch.int16).to(torch.int32) & 0xFFFF
    for tiles_per_cta in (1, 2):
        got = _kernel_reads(words, n, groups, tiles_per_cta, silu)
        pairs = ({(a, n // 2 + a) for a in range(n // 2)} if silu else
                 {(16 * (r // 16) + r % 8, min(16 * (r // 16) + r % 8 + 8, n - 1)) for r in range(n) if r % 16 < 8})
        assert {(lo, hi) for lo, hi, _ in got} == pairs
        for (lo, hi, grp), value in got.items():
            assert value == (bits[lo, grp], bits[hi, grp], z[lo, grp], z[hi, grp]), (lo, hi, grp)


def test_packed_scales_are_made_once_a_weight_and_flavour():
    """PackedScales: one pack a (weight, plain or SiLU-out) kept for later launches; cuda_launch without one packs
    for that launch alone."""
    s, z = (torch.arange(64).view(32, 2) / 64 + 1).to(torch.bfloat16), torch.arange(64).view(32, 2).to(torch.uint8) % 16
    packed = op.PackedScales()
    plain = packed(s, z, silu=False)
    assert packed(s, z, silu=False) is plain and torch.equal(plain, op.pack_scales_zeros(s, z))
    assert torch.equal(packed(s, z, silu=True), op.pack_scales_zeros(s, z, silu=True))
    assert not torch.equal(packed(s, z, silu=True), plain)
    x, y = torch.zeros(1, 128, dtype=torch.bfloat16), torch.empty(1, 32, dtype=torch.bfloat16)
    qw = torch.zeros(32, 16, dtype=torch.int32)
    consts = {"cuda_g64": dict(GROUP=64, max_m=8, BLOCK_N=32, BLOCK_K=512, target_programs=1, max_splits=1,
                               min_split_k_tiles=1, impl="cuda", PDL=1, partials_out=0, packed_sz=1)}
    counters = torch.zeros(4, dtype=torch.int32)
    (_, _, args), = op.cuda_launch(x, qw, s, z, None, y, group_size=64, consts=consts, counters=counters, packed=packed)
    assert args[2] is plain and args[3] == 0
    (_, _, args), = op.cuda_launch(x, qw, s, z, None, y, group_size=64, consts=consts, counters=counters)
    assert args[2] is not plain and torch.equal(args[2], plain)


def test_packed_words_are_made_at_load_for_what_the_builds_will_read(tiny_dir, tmp_path):
    """packed_flavours follows the launch rule over every row count (the table's sm90 builds at the 8B's shapes:
    gate_up's SiLU-out build and the plain one are packed, qkv's own build is not, o's EARLY_W build as the table
    says); prepack_int4 packs exactly those for the int4 nodes of a real int4 bundle's program (its inputs: x,
    then qweight, scales, zeros), so the engine's KV sizing sees them."""
    from engc.bundle.program import parse_program
    from engc.bundle.reader import open_bundle
    from engc.compiler.build import BuildOptions, build
    from engc.kernels.int4_linear.specs import int4_linear_specs
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    from engc.kernels.int4_linear.bind import prepack_int4
    from engc.runtime.loader import read_weights
    shapes = {(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)}
    specs, _ = cuda_int4.selected_int4_specs(int4_linear_specs("bf16", "sm90", (128, 32)),
                                             {"dequant": {"enabled": False}}, shapes=shapes)
    consts = {s.variant: s.launch for s in specs}
    assert consts["cuda_g128"]["packed_sz"] and consts["cuda_silu_g128"]["packed_sz"]
    assert op.packed_flavours(28672, 4096, 128, consts, silu_node=True) == {True}
    assert op.packed_flavours(28672, 4096, 128, consts, silu_node=False) == {False}
    assert op.packed_flavours(4096, 14336, 128, consts, silu_node=False) == {False}
    assert op.packed_flavours(6144, 4096, 128, consts, silu_node=False) == set()   # qkv: its own, unpacked build
    o_packed = bool(consts["cuda_g128_n4096_k4096"].get("packed_sz"))
    assert op.packed_flavours(4096, 4096, 128, consts, silu_node=False) == ({False} if o_packed else set())
    assert op.packed_flavours(28672, 4096, 128, {}, silu_node=True) == set()
    # a gate_up whose I the SiLU-out tiles do not divide: the plain build serves it
    assert op.packed_flavours(2 * 8200, 4096, 128, consts, silu_node=True) == {False}

    quantize_checkpoint(str(tiny_dir("llama", intermediate_size=1024)), tmp_path / "q",
                        QuantOptions(method="rtn", group_size=32))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions(dtype="bfloat16"))
    bundle = open_bundle(tmp_path / "b")
    program = parse_program(bundle.read(bundle.manifest["program"]))
    weights = {}
    for rel in bundle.manifest["weights"]:
        weights.update(read_weights(bundle.file(rel), torch.device("cpu")))
    nodes = [n for n in program.nodes if n.op in ("QLinear", "QLinearSiluMul", "QLinearAddRMSNorm")]
    assert {n.op for n in nodes} == {"QLinear", "QLinearSiluMul", "QLinearAddRMSNorm"}

    packed = op.PackedScales()
    prepack_int4(program, weights, consts, packed)
    # at these tiny shapes every node runs the generic g32 build (packed), gate_up its SiLU-out twin
    want = {(weights[n.inputs[2]].data_ptr(), n.op == "QLinearSiluMul") for n in nodes}
    assert {(key[0], key[2]) for key in packed._words} == want
    gate_up = next(n for n in nodes if n.op == "QLinearSiluMul")
    s, z = weights[gate_up.inputs[2]], weights[gate_up.inputs[3]]
    assert torch.equal(packed(s, z, silu=True), op.pack_scales_zeros(s, z, silu=True))
    untouched = op.PackedScales()
    prepack_int4(program, weights, {v: dict(c, packed_sz=0) for v, c in consts.items()}, untouched)
    assert untouched._words == {}


def test_silu_out_build_and_launch_rule(records):
    """cuda_silu_g{G}: the 'gemv' entry's config with SILU_OUT, launched over the fused gate_up's N = 2I rows
    in BLOCK_N tiles (each CTA's BLOCK_N / 2 outputs pair gate and up rows), writing act [M, I]; it serves the
    rows its max_m holds and an I the tiles divide, else run_quantized_silu leaves it to QLinear + silu_mul."""
    spec = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON, silu_out=True)[0]
    plain = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON)[0]
    assert spec.variant == op.cuda_silu_variant(128) == "cuda_silu_g128" and spec.entry == plain.entry + "_silu"
    assert spec.render["silu_out"] and not plain.render["silu_out"] and spec.launch == plain.launch
    assert "constexpr bool SILU_OUT = true;" in cuda.render(spec.template, **spec.render)
    assert cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON, "gemv_wide16", silu_out=True)[0] is None
    rec = next(r for r in records if (r["arch"], r["variant"]) == ("sm90", "cuda_silu_g128"))
    consts = {rec["variant"]: rec["launch"]}
    counters = torch.zeros(1 << 16, dtype=torch.int32)
    n, k = 2 * 14336, 4096
    x, act = torch.zeros(3, k, dtype=torch.bfloat16), torch.empty(3, n // 2, dtype=torch.bfloat16)
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    s, z = torch.ones(n, k // 128, dtype=torch.bfloat16), torch.zeros(n, k // 128, dtype=torch.uint8)
    (variant, grid, args), = op.cuda_launch(x, qw, s, z, None, act, group_size=128, consts=consts, counters=counters,
                                            variant="cuda_silu_g128")
    assert variant == "cuda_silu_g128" and grid[0] == n // rec["launch"]["BLOCK_N"] and args[5] is act
    assert op.silu_out_fits(3, n, 128, consts) and op.silu_out_fits(8, n, 128, consts)
    assert not op.silu_out_fits(9, n, 128, consts) and not op.silu_out_fits(3, n + 16, 128, consts)
    assert not op.silu_out_fits(3, n, 32, consts)   # no build for that group size
    assert op.run_quantized_silu(torch.zeros(9, k, dtype=torch.bfloat16), qw, s, z, None, group_size=128,
                                 consts=consts, run=None, counters=counters) is None


def test_wide_builds_serve_the_rows_the_first_cannot():
    """cuda_wide{16,32}_g{G} (the 'gemv_wide16/32' entries: max_m / 8 n8 tiles of x) take M past the first
    GEMV's max_m, each up to its own; the build with the fewest rows that holds M runs it (fewer x tiles,
    the same W reads)."""
    narrow = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON)[0]
    w16 = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON, "gemv_wide16")[0]
    w32 = cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON, "gemv_wide32")[0]
    assert (narrow.variant, w16.variant, w32.variant) == ("cuda_g128", "cuda_wide16_g128", "cuda_wide32_g128")
    assert [s.render["x_tiles"] for s in (narrow, w16, w32)] == [1, 2, 4]
    assert [s.launch["max_m"] for s in (narrow, w16, w32)] == [8, 16, 32]
    assert "constexpr int X_TILES = 4;" in cuda.render(w32.template, **w32.render)
    every = {s.variant: s.launch for s in (narrow, w16, w32)}
    picks = {m: op.cuda_variant_for(m, 128, every) for m in (1, 8, 9, 16, 17, 32, 33)}
    assert picks == {1: "cuda_g128", 8: "cuda_g128", 9: "cuda_wide16_g128", 16: "cuda_wide16_g128",
                     17: "cuda_wide32_g128", 32: "cuda_wide32_g128", 33: None}
    no16 = {s.variant: s.launch for s in (narrow, w32)}
    assert op.cuda_variant_for(12, 128, no16) == "cuda_wide32_g128"
    assert op.cuda_variant_for(1, 128, {w32.variant: w32.launch}) == "cuda_wide32_g128"
    counters = torch.zeros(1 << 16, dtype=torch.int32)
    n, k = 64, 256
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    s, z = torch.ones(n, k // 128, dtype=torch.bfloat16), torch.zeros(n, k // 128, dtype=torch.uint8)
    for rows, variant in ((4, "cuda_g128"), (12, "cuda_wide16_g128"), (24, "cuda_wide32_g128")):
        x, y = torch.zeros(rows, k, dtype=torch.bfloat16), torch.empty(rows, n, dtype=torch.bfloat16)
        (got, _grid, args), = op.cuda_launch(x, qw, s, z, None, y, group_size=128, consts=every, counters=counters)
        assert got == variant and args[8] == rows
    # a class's max_m stays within the rows its name promises (and four n8 tiles)
    assert cuda_int4.int4_gemv_spec(128, "bf16", "sm90", dict(ON, max_m=40), "gemv_wide32")[0] is None
    assert cuda_int4.int4_gemv_spec(128, "bf16", "sm90", dict(ON, max_m=24), "gemv_wide16")[0] is None
    # on in the table for sm80 and sm90; each can be turned off alone
    from engc.kernels.int4_linear.specs import int4_linear_specs
    triton_specs = int4_linear_specs("bf16", "sm90", (128,))
    assert sorted(s.variant for s in cuda_int4.selected_int4_specs(triton_specs, {"dequant": {"enabled": False}})[0]) \
        == ["cuda_g128", "cuda_silu_g128", "cuda_wide16_g128", "cuda_wide32_g128"]
    off = {"gemv_wide16": {"enabled": False}, "dequant": {"enabled": False}}
    assert sorted(s.variant for s in cuda_int4.selected_int4_specs(triton_specs, off)[0]) == [
        "cuda_g128", "cuda_silu_g128", "cuda_wide32_g128"]


def test_runtime_prefers_cuda_then_triton_then_dequant():
    triton_only = op.jit_consts(128, {"gemv": tune.TUNE["sm90/int4_linear/*/gemv_m1"],
                                      "gemv_reduce": tune.TUNE["sm90/int4_linear/*/gemv_reduce"],
                                      "dequant": tune.TUNE["sm90/int4_linear/*/dequant"]})
    narrow = dict(triton_only, cuda_g128=cuda_int4.int4_gemv_spec(128, "bf16", "sm90", dict(ON, max_m=4))[0].launch)
    wide = dict(narrow, cuda_wide32_g128=cuda_int4.int4_gemv_spec(128, "bf16", "sm90", ON, "gemv_wide32")[0].launch)
    counters = torch.zeros(1 << 16, dtype=torch.int32)
    n, k = 64, 256
    qw = torch.zeros(n, k // 8, dtype=torch.int32)
    s, z = torch.ones(n, k // 128, dtype=torch.bfloat16), torch.zeros(n, k // 128, dtype=torch.uint8)
    # (consts, rows) -> the variants launched and the rows each launch covers
    cases = [(narrow, 2, [("cuda_g128", 2)]),
             (narrow, 6, [("cuda_g128", 4), ("cuda_g128", 2)]),       # two passes of the widest build
             (narrow, 9, [("dequant_g128", None)]),                     # three would be too many
             (triton_only, 6, [("gemv_m8_g128", None)]),
             (wide, 20, [("cuda_wide32_g128", 20)]),
             (wide, 48, [("cuda_wide32_g128", 32), ("cuda_wide32_g128", 16)]),
             (wide, 65, [("dequant_g128", None)])]
    for consts, rows, want in cases:
        seen = []
        x = torch.randn(rows, k).to(torch.bfloat16)
        y = op.run_quantized_linear(x, qw, s, z, None, group_size=128, consts=consts, counters=counters,
                                    run=lambda launches: seen.extend((v, a) for v, _, a in launches))
        got = [(v, a[8] if op.variant_kind(v) == "cuda" else None) for v, a in seen]
        assert got[:len(want)] == want, (rows, got)
        if op.variant_kind(want[0][0]) == "cuda":   # the slices are views of x and y, in order
            starts = [a[0].data_ptr() for _, a in seen]
            assert starts == [x[i:].data_ptr() for i in range(0, rows, want[0][1])] and y.shape == (rows, n)
            assert all(a[5].data_ptr() == y[i:].data_ptr() for (_, a), i in zip(seen, range(0, rows, want[0][1])))


def test_build_adds_the_cuda_gemv_where_enabled(monkeypatch):
    """The build's CUDA step (cuda.add_selected) compiles one cuda_g{G} per arch and group size of the
    program's Triton int4 kernels when the tune entry is on; the Triton ones stay (fallback, prefill)."""
    if cuda.nvcc_path() is None:
        pytest.skip("nvcc not found")
    from engc.compiler.codegen.record import CodegenResult
    from engc.kernels.int4_linear.specs import int4_linear_specs
    from test_int4_codegen import TINY
    monkeypatch.setitem(tune.TUNE, "sm90/int4_linear/cuda/gemv",
                        dict(tune.TUNE["sm90/int4_linear/cuda/gemv"], enabled=True))
    monkeypatch.setitem(tune.TUNE, "sm80/int4_linear/cuda/gemv",
                        dict(tune.TUNE["sm80/int4_linear/cuda/gemv"], enabled=False))
    triton_specs = [s for arch in ("sm80", "sm90") for s in int4_linear_specs("bf16", arch, (128,))]
    for arch in ("sm80", "sm90"):
        for kind in ("dequant", "gemv_wide16", "gemv_wide32"):   # their own tests cover them
            monkeypatch.setitem(tune.TUNE, f"{arch}/int4_linear/cuda/{kind}",
                                dict(tune.TUNE[f"{arch}/int4_linear/cuda/{kind}"], enabled=False))
    result = cuda.add_selected(CodegenResult(), triton_specs, TINY)
    assert [(r["arch"], r["variant"]) for r in result.records] == [("sm90", "cuda_g128"), ("sm90", "cuda_silu_g128")]
    assert "kernels/sm90/int4_linear.cuda_g128.cubin" in result.files

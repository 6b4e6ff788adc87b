"""The GPU path against the CPU reference path (skipped without a CUDA device and engc._native).

On the H200: ENGC_KERNEL_CACHE=.kcache python3 -m pytest tests/test_gpu.py, with the cache filled on a
CPU machine by the same builds, so the cubins under test are the ones compiled there (bench/fake_sm90.py
says how).
"""
import os

import pytest
import torch

from engc.compiler.build import BuildOptions, build
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams

PROMPTS = ["The quick brown fox", "Paris is", "Hello, world! How", "0123", "ünïcödé 日本語 🙂 and more"]


def gpu_ready() -> bool:
    from engc.cuda.cubin import cuda_available
    return torch.cuda.is_available() and cuda_available()


def sm_arch() -> str:
    major, minor = torch.cuda.get_device_capability() if torch.cuda.is_available() else (9, 0)
    return f"sm{major}{minor}"


@pytest.fixture(scope="module")
def gpu_bundle(tiny_dir, tmp_path_factory):
    """A float32 tiny llama built for the CPU and this GPU's arch (compiling needs no GPU)."""
    out = tmp_path_factory.mktemp("gpu") / "b"
    build(str(tiny_dir("llama")), out, BuildOptions(archs=("cpu", sm_arch()), dtype="float32",
                                                    kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    return out


def test_bundle_for_a_gpu_builds_without_one(gpu_bundle):
    from engc.bundle.reader import open_bundle
    kernels = open_bundle(gpu_bundle).manifest["kernels"]
    assert {k["op"] for k in kernels} >= {"rms_norm", "rotary", "paged_attention", "silu_mul", "sampling"}
    assert all((gpu_bundle / k["cubin"]).is_file() and (gpu_bundle / k["ptx"]).is_file() for k in kernels)


def greedy(bundle, device, graphs=True, n=24):
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=8, cuda_graphs=graphs))
    p = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(model.tokenizer.encode(t), p) for t in PROMPTS]
    engine.run_to_completion()
    return [s.output_ids for s in seqs]


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_gpu_greedy_matches_cpu_reference_token_for_token(gpu_bundle):
    cpu = greedy(gpu_bundle, "cpu")
    assert greedy(gpu_bundle, "cuda") == cpu
    assert greedy(gpu_bundle, "cuda", graphs=False) == cpu


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_gpu_sampling_is_seeded_and_top_k_1_is_greedy(gpu_bundle):
    model = load(gpu_bundle, device="cuda")
    assert model.sampler is not None
    ids = model.tokenizer.encode(PROMPTS[0])

    def run(**kw):
        engine = Engine(model, EngineConfig(num_blocks=64, max_num_seqs=4))
        seq = engine.add_request(ids, SamplingParams(max_tokens=16, ignore_eos=True, **kw))
        engine.run_to_completion()
        return seq.output_ids

    a = run(temperature=0.9, top_p=0.9, seed=1)
    assert a == run(temperature=0.9, top_p=0.9, seed=1)
    assert all(0 <= t < model.config.vocab_size for t in a)
    assert run(temperature=0.7, top_k=1, seed=3) == run(temperature=0)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not gpu_ready(), reason="needs a CUDA device and engc._native"))])
def test_a_seeded_request_draws_the_same_tokens_alone_and_in_a_batch_of_64(gpu_bundle, device):
    """A seed names a request's draws whatever shares its steps: the other 63 rows (other prompts, seeds and
    settings, some greedy) change the batch's shape and its GEMM tiles, not the request's tokens."""
    model = load(gpu_bundle, device=device)
    ids = model.tokenizer.encode(PROMPTS[1])
    mine = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.8, top_k=50, top_p=0.95, seed=7)

    def run(others: int):
        engine = Engine(model, EngineConfig(num_blocks=512, max_num_seqs=64))
        rng = torch.Generator().manual_seed(0)
        for i in range(others):
            prompt = torch.randint(3, model.config.vocab_size, (3 + i % 9,), generator=rng).tolist()
            engine.add_request(prompt, SamplingParams(max_tokens=8 + i % 12, ignore_eos=True,
                                                      temperature=0 if i % 4 == 0 else 0.5 + i % 5 / 4,
                                                      top_k=i % 3 * 20, top_p=1 - i % 2 / 10, seed=i))
            if i == others // 2:
                seq = engine.add_request(ids, mine)
        if not others:
            seq = engine.add_request(ids, mine)
        engine.run_to_completion()
        return seq.output_ids

    alone = run(0)
    assert len(alone) == 16 and alone == run(63)


def test_kernel_selection_by_arch():
    """Own arch: cubins; same major: the older cubins; newer major: portable PTX; older GPU: refused."""
    from engc.errors import BundleError
    from engc.runtime.gpu_ops import select_kernels
    records = [{"arch": "sm80", "op": "x", "ptx_target": "sm_80"},
               {"arch": "sm90", "op": "x", "ptx_target": "sm_90a"}]
    assert select_kernels(records, "sm90") == ([records[1]], "cubin")
    assert select_kernels(records, "sm89") == ([records[0]], "cubin")
    assert select_kernels(records, "sm100") == ([records[0]], "ptx")  # sm_90a PTX cannot JIT elsewhere
    with pytest.raises(BundleError, match="sm80, sm90; this GPU is sm75"):
        select_kernels(records, "sm75")
    with pytest.raises(BundleError, match="none"):
        select_kernels([], "sm90")


@pytest.mark.parametrize("value,expected", [("", None), ("smem-carveout=100", 100), ("no-pdl,smem-carveout=0", 0),
                                            ("smem-carveout=-1", -1), ("smem-carveout=101", "error"),
                                            ("smem-carveout=max", "error"), ("smem-carveout=-2", "error"),
                                            ("carveout=5", "error")])
def test_debug_switches_read_a_carveout_percent(monkeypatch, value, expected):
    from engc.errors import UserError
    from engc.cuda.records import shared_carveout
    monkeypatch.setenv("ENGC_DEBUG", value)
    if expected == "error":
        with pytest.raises(UserError, match="ENGC_DEBUG"):
            shared_carveout()
    else:
        assert shared_carveout() == expected


def test_debug_switches_turn_pdl_and_templates_off(monkeypatch):
    from engc.cuda.records import cuda_templates_enabled, pdl_enabled
    monkeypatch.setenv("ENGC_DEBUG", "")
    assert pdl_enabled() and cuda_templates_enabled()
    monkeypatch.setenv("ENGC_DEBUG", " no-pdl , no-cuda-templates")
    assert not pdl_enabled() and not cuda_templates_enabled()


@pytest.mark.parametrize("env,record,expected", [("", None, None), ("", 40, 40), ("100", 40, 100), ("-1", 40, -1)])
def test_a_record_carveout_is_set_unless_the_switch_overrides_it(monkeypatch, env, record, expected):
    """load_record gives a kernel its record's smem_carveout (the tune table's); ENGC_DEBUG's smem-carveout,
    where set, overrides every kernel's."""
    from engc.cuda import records
    seen = {}
    monkeypatch.setattr(records, "load_kernel", lambda *a, **kw: seen.update(kw))
    monkeypatch.setenv("ENGC_DEBUG", f"smem-carveout={env}" if env else "")
    r = {"args": [{"name": "x", "type": "*bf16"}], "scratch_params": 0, "entry": "k", "num_warps": 4,
         "shared_mem": 0, "launch": {"PDL": 1, **({"smem_carveout": record} if record is not None else {})}}
    records.load_record(b"", r, pdl=True)
    assert seen["carveout"] == expected and seen["pdl"] is True


@pytest.mark.skipif(not gpu_ready() or sm_arch() != "sm90", reason="needs an sm90 GPU (PDL) and engc._native")
def test_pdl_and_carveout_change_no_token(tiny_dir, tmp_path, monkeypatch):
    """Programmatic dependent launch only moves kernel starts earlier: a missing wait would be a race, seen
    as other tokens. bf16 on sm90, so the decode GEMVs and the fused rotary attention run too. The same for
    a carveout set by ENGC_DEBUG, which every kernel of the bundle then carries."""
    from engc.bundle.reader import open_bundle
    from engc.runtime.gpu_ops import BundleKernels
    out = tmp_path / "bf16"
    build(str(tiny_dir("llama")), out, BuildOptions(archs=("sm90",), dtype="bfloat16",
                                                    kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    runs = {}
    for switches in ("", "no-pdl", "smem-carveout=100"):
        monkeypatch.setenv("ENGC_DEBUG", switches)   # read when the bundle's kernels load
        runs[switches] = greedy(out, "cuda", n=32)
    assert runs[""] == runs["no-pdl"] == runs["smem-carveout=100"]
    kernels = BundleKernels(open_bundle(out), "sm90").kernels.values()
    assert kernels and {k.attributes()["preferred_shared_carveout"] for k in kernels} == {100}


@pytest.mark.skipif(not gpu_ready() or sm_arch() != "sm90", reason="needs an sm90 GPU and engc._native")
def test_skinny_gemm_of_the_8b_widths_matches_reference(tmp_path):
    """The skinny GEMM where sm90's tune table turns it on by width (K 4096 and the SiLU-fused down of K 14336,
    9-16 and 17-32 rows): a one-layer bf16 checkpoint of the 8B's widths, built, its skinny kernels through their launch
    rule against float64 at the M class's edges and between, on the 8B's projection shapes; split-K
    counters left zero."""
    from tiny_models import write_random_llama
    from engc.bundle.reader import open_bundle
    from engc.kernels import skinny_gemm as op
    from engc.runtime.gpu_ops import BundleKernels
    write_random_llama(tmp_path / "ckpt", hidden=4096, intermediate=14336, layers=1, heads=32, kv_heads=8,
                       head_dim=128, vocab=512)
    build(str(tmp_path / "ckpt"), tmp_path / "b", BuildOptions(archs=("sm90",), dtype="bfloat16",
                                                               kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    kernels = BundleKernels(open_bundle(tmp_path / "b"), "sm90")
    consts = kernels.consts["skinny_gemm"]
    assert set(consts) == {f"{p}_m{m}" for p in ("k4096", "silu_k14336") for m in (16, 32)}
    table = op.variant_table(consts)
    counters = torch.zeros(op.NUM_COUNTERS, dtype=torch.int32, device="cuda")
    gen = torch.Generator().manual_seed(0)
    for k, silu, n in ((4096, False, 6144), (4096, False, 4096), (4096, False, 28672), (4096, False, 512),
                       (14336, True, 4096)):
        w = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16).cuda()
        for m in (9, 12, 16, 17, 24, 32):
            x = torch.randn(m, 2 * k if silu else k, generator=gen).to(torch.bfloat16).cuda()
            variant = op.pick(table, k, silu, m, n)
            assert variant == f"{'silu_' if silu else ''}k{k}_m{16 if m <= 16 else 32}", (k, silu, m, variant)
            out = torch.full((m, n), float("nan"), dtype=torch.bfloat16, device="cuda")
            kernels.run("skinny_gemm", op.launch(x, w, out, variant, consts[variant], counters))
            a = x.double()
            if silu:   # the kernel multiplies the product as the model dtype rounds it (silu_mul's output)
                a = (torch.nn.functional.silu(a[:, :k]) * a[:, k:]).to(torch.bfloat16).double()
            ref = a @ w.double().t()
            err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
            assert err < 2e-2 and counters.eq(0).all(), (k, silu, n, m, err)


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_int4_add_norm_fusion_changes_no_token(tiny_dir, tmp_path, monkeypatch):
    """A bf16 int4 bundle decodes the same tokens on the GPU with QLinearAddRMSNorm (down's split-K partials
    summed by the norm) as without the pass (the GEMV's own reduce, then AddRMSNorm): the same bits."""
    from engc.bundle.reader import open_bundle
    from engc.compiler import build as build_mod
    from engc.compiler.passes.fuse_qlinear_add_norm import fuse_qlinear_add_norm
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    from engc.kernels import int4_linear, rms_norm
    from engc.runtime.gpu_ops import BundleKernels
    # intermediate 1024: down's K is two of the GEMV's K tiles, so its launch splits (o's K of 64 cannot)
    quantize_checkpoint(str(tiny_dir("llama", intermediate_size=1024)), tmp_path / "q",
                        QuantOptions(method="rtn", group_size=32))
    opts = BuildOptions(archs=(sm_arch(),), dtype="bfloat16", kernel_cache=os.environ.get("ENGC_KERNEL_CACHE"))
    build_mod.build(str(tmp_path / "q"), tmp_path / "fused", opts)
    kernels = BundleKernels(open_bundle(tmp_path / "fused"), sm_arch())
    assert rms_norm.PARTIALS_VARIANT in kernels.consts["rms_norm"]
    assert int4_linear.cuda_splits(len(PROMPTS), 64, 1024, 32, kernels.consts["int4_linear"],
                                   torch.zeros(64, dtype=torch.int32)) > 1
    monkeypatch.setattr(build_mod, "PASSES", [p for p in build_mod.PASSES if p is not fuse_qlinear_add_norm])
    build_mod.build(str(tmp_path / "q"), tmp_path / "plain", opts)
    fused = greedy(tmp_path / "fused", "cuda")
    assert fused == greedy(tmp_path / "plain", "cuda")
    assert greedy(tmp_path / "fused", "cuda", graphs=False) == fused


@pytest.mark.skipif(not gpu_ready(), reason="needs a CUDA device and engc._native")
def test_int4_linear_matches_reference_at_every_row_count(tiny_dir, tmp_path):
    """A bf16 int4 bundle's QLinear kernels, through the runtime's own launch rule, against the dequantized
    weight in float64 at row counts of each path: the CUDA GEMV (M <= 8), its 16- and 32-row builds, two
    passes of the 32-row one, dequant + cuBLAS (where the build had nvcc; else the Triton GEMV and dequant),
    and the int4 GEMM at the edges of its M classes (where the tune table turns one on for the arch)."""
    from engc.bundle.reader import open_bundle
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    from engc.kernels import int4_linear as op
    from engc.runtime.gpu_ops import BundleKernels
    quantize_checkpoint(str(tiny_dir("llama")), tmp_path / "q", QuantOptions(method="rtn", group_size=32))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions(archs=(sm_arch(),), dtype="bfloat16",
                                                            kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    kernels = BundleKernels(open_bundle(tmp_path / "b"), sm_arch())
    consts = kernels.consts["int4_linear"]
    seen = []

    def run(launches):
        seen.extend(v for v, _, _ in launches)
        kernels.run("int4_linear", launches)

    gen = torch.Generator().manual_seed(0)
    n, k = 200, 1024 + 32   # N and K are run-time arguments; K not a whole number of the GEMV's K tiles
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 32), generator=gen).to(torch.uint8)
    w = [t.cuda() for t in (op.pack_int4(q), scales, zeros)]
    bias = torch.randn(n, generator=gen).to(torch.bfloat16).cuda()
    ref_w = op.dequantize(*w, 32).double()
    counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
    for rows in (1, 5, 12, 24, 32, 48, 64, 80):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
        seen.clear()
        y = op.run_quantized_linear(x, *w, bias, group_size=32, consts=consts, run=run, counters=counters)
        ref = x.double() @ ref_w.t() + bias.double()
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2, (rows, seen, err)
        assert counters.eq(0).all(), (rows, seen)
        if "cuda_wide32_g32" in consts and rows in (48, 64):   # two passes; the second's build fits its rows
            assert seen == ["cuda_wide32_g32", "cuda_wide16_g32" if rows == 48 else "cuda_wide32_g32"], seen
    # QLinearSiluMul's SiLU-out build (where the bundle has it): silu(gate) * up of a fused gate_up [gate; up],
    # against the projection rounded to bf16, then silu_mul, as the unfused pair computes it
    if op.cuda_silu_variant(32) in consts:
        from engc.kernels.silu_mul import silu_mul
        inter = 128
        q = torch.randint(0, 16, (2 * inter, k), generator=gen)
        scales = (torch.rand(2 * inter, k // 32, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (2 * inter, k // 32), generator=gen).to(torch.uint8)
        gate_up = [t.cuda() for t in (op.pack_int4(q), scales, zeros)]
        gate_up_bias = torch.randn(2 * inter, generator=gen).to(torch.bfloat16).cuda()
        gate_up_w = op.dequantize(*gate_up, 32).double()
        for rows in (1, 5, 8):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
            seen.clear()
            act = op.run_quantized_silu(x, *gate_up, gate_up_bias, group_size=32, consts=consts, run=run,
                                        counters=counters)
            ref = silu_mul((x.double() @ gate_up_w.t() + gate_up_bias.double()).to(torch.bfloat16)).double()
            err = ((act.double() - ref).abs().max() / ref.abs().max()).item()
            assert seen == ["cuda_silu_g32"] and act.shape == (rows, inter) and err < 1e-2, (rows, seen, err)
            assert counters.eq(0).all(), rows
        assert op.run_quantized_silu(torch.zeros(12, k, dtype=torch.bfloat16, device="cuda"), *gate_up,
                                     gate_up_bias, group_size=32, consts=consts, run=run, counters=counters) is None
    # QLinearAddRMSNorm (o, down): where the GEMV splits K its partials go unreduced to the norm, which sums
    # them: the same bits as QLinear then AddRMSNorm on the GPU (the norm is built for the model's hidden 64)
    from engc.bundle.program import ENGC_DOMAIN
    from engc.kernels import rms_norm
    from engc.runtime.gpu_ops import StepFacts, gpu_ops
    if rms_norm.PARTIALS_VARIANT in kernels.consts["rms_norm"]:
        ops = gpu_ops(kernels, StepFacts())
        hidden = 64
        q = torch.randint(0, 16, (hidden, k), generator=gen)
        scales = (torch.rand(hidden, k // 32, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
        zeros = torch.randint(0, 16, (hidden, k // 32), generator=gen).to(torch.uint8)
        o_w = [t.cuda() for t in (op.pack_int4(q), scales, zeros)]
        norm_w = torch.randn(hidden, generator=gen).to(torch.bfloat16).cuda()
        for rows in (1, 5, 8, 12, 24):
            x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
            residual = torch.randn(rows, hidden, generator=gen).to(torch.bfloat16).cuda()
            splits = op.cuda_splits(rows, hidden, k, 32, consts, counters)
            fused = ops[(ENGC_DOMAIN, "QLinearAddRMSNorm")](x, *o_w, residual, norm_w, group_size=32, eps=1e-5)
            y = ops[(ENGC_DOMAIN, "QLinear")](x, *o_w, group_size=32)[0]
            plain = ops[(ENGC_DOMAIN, "AddRMSNorm")](y, residual, norm_w, eps=1e-5)
            assert splits > 1 or rows > 8, (rows, splits)   # the partials path ran at least at M <= 8
            assert all(torch.equal(a, b) for a, b in zip(fused, plain)), (rows, splits)
            assert counters.eq(0).all(), rows
    # the int4 GEMM of decode batches (kernels/int4_gemm), where the bundle has it: its variants are per K
    # of the model (tiny: hidden 64, intermediate 128), so a weight of the model's intermediate width
    gemm_consts = kernels.consts.get("int4_gemm", {})
    gemm_ks = {c["K"] for c in gemm_consts.values()}
    if not gemm_ks:
        return
    n, k = 200, max(gemm_ks)
    q = torch.randint(0, 16, (n, k), generator=gen)
    scales = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.005).to(torch.bfloat16)
    zeros = torch.randint(0, 16, (n, k // 32), generator=gen).to(torch.uint8)
    w = [t.cuda() for t in (op.pack_int4(q), scales, zeros)]
    ref_w = op.dequantize(*w, 32).double()
    for rows in sorted({c["min_m"] for c in gemm_consts.values()} | {c["max_m"] for c in gemm_consts.values()}):
        x = torch.randn(rows, k, generator=gen).to(torch.bfloat16).cuda()
        seen.clear()
        y = op.run_quantized_linear(x, *w, bias, group_size=32, consts=consts, run=run, counters=counters,
                                    gemm_consts=gemm_consts,
                                    run_gemm=lambda launches: (seen.extend(v for v, _, _ in launches),
                                                               kernels.run("int4_gemm", launches)))
        ref = x.double() @ ref_w.t() + bias.double()
        err = ((y.double() - ref).abs().max() / ref.abs().max()).item()
        assert err < 1e-2 and counters.eq(0).all(), (rows, seen, err)
        assert seen and all(v.startswith(f"k{k}_g32_") for v in seen), seen

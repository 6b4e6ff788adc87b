"""The cluster AddRMSNorm over a split-K GEMV's fp32 partials (templates/add_rms_norm_cluster.cu.j2, variant
rms_norm.CLUSTER_VARIANT): rendered per hidden size, built by nvcc for sm90 beside the Triton partials variant
where the tune table enables it, picked by the launch rule; on an sm90 GPU, checked against the torch
reference. Compiling tests skip where nvcc is missing; the GPU test where there is no sm90 device."""

import pytest
import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.codegen import cuda, tune
from engc.compiler.codegen.cuda_norm import norm_cluster_spec, selected_norm_specs
from engc.kernels import rms_norm
from test_gpu import gpu_ready, sm_arch

needs_nvcc = pytest.mark.skipif(cuda.nvcc_path() is None, reason="nvcc is not installed")
KEY = f"sm90/rms_norm/{rms_norm.CLUSTER_VARIANT}/any"


def cfg(hidden=4096):
    return ModelConfig(family="llama", vocab_size=256, hidden_size=hidden, intermediate_size=256, num_layers=1,
                       num_heads=8, num_kv_heads=8, head_dim=hidden // 8, rms_norm_eps=1e-5, rope_theta=10000.0,
                       max_position_embeddings=8192, tie_word_embeddings=True)


def test_spec_renders_the_shape_and_sizes_its_block():
    spec, why = norm_cluster_spec(cfg(), "bf16", "sm90")
    cluster = tune.TUNE[KEY]["cluster"]
    assert why == "" and spec.variant == rms_norm.CLUSTER_VARIANT and spec.launch == {"cluster": cluster, "PDL": 1}
    assert spec.num_warps * 32 * 4 * cluster == 4096          # a thread owns 4 columns of its CTA's share
    text = cuda.render(spec.template, **spec.render)
    for line in ("constexpr int HIDDEN = 4096;", f"constexpr int CLUSTER = {cluster};",
                 f"constexpr int MAX_SPLITS = {rms_norm.MAX_SPLITS};", "typedef __nv_bfloat16 T;"):
        assert line in text
    assert "__cluster_dims__(1, 1, CLUSTER)" in text


@pytest.mark.parametrize("hidden,arch,t,why", [
    (4096, "sm80", "bf16", "no thread-block clusters"),
    (4096, "sm90", "fp32", "bf16 or fp16"),
    (64, "sm90", "bf16", "hidden 64 does not split"),
    (4096 + 512, "sm90", "bf16", "hidden 4608 does not split"),
])
def test_shapes_it_does_not_cover_are_refused_with_a_reason(hidden, arch, t, why):
    spec, reason = norm_cluster_spec(cfg(hidden), t, arch)
    assert spec is None and why in reason


def _norm_specs(partials: bool, arch="sm90"):
    from engc.compiler.codegen.specs import rms_norm_specs
    return rms_norm_specs(cfg(), "bf16", arch, partials=partials)


def test_selected_beside_the_partials_variant_where_the_table_enables_it():
    assert tune.TUNE[KEY]["enabled"]
    specs, notes = selected_norm_specs(_norm_specs(True), cfg())
    assert [s.variant for s in specs] == [rms_norm.CLUSTER_VARIANT] and notes == []
    assert selected_norm_specs(_norm_specs(False), cfg()) == ([], [])        # no int4 program, no partials
    assert selected_norm_specs(_norm_specs(True, "sm80"), cfg()) == ([], [])  # sm80 has no entry
    with tune.overridden({KEY: {"enabled": False}}):
        assert selected_norm_specs(_norm_specs(True), cfg()) == ([], [])
    specs, notes = selected_norm_specs(_norm_specs(True), cfg(64))
    assert specs == [] and notes == ["sm90: no cluster partials norm (hidden 64 does not split into 8 CTAs of "
                                     "32-1024 threads of 4 columns); the Triton one runs"]


def test_launch_rule_takes_the_cluster_kernel_for_partials_only():
    partials = torch.zeros(4, 3, 64)
    residual, weight = torch.zeros(3, 64, dtype=torch.bfloat16), torch.ones(64, dtype=torch.bfloat16)
    out, r_out = torch.empty_like(residual), torch.empty_like(residual)
    consts = {rms_norm.CLUSTER_VARIANT: {"cluster": 8, "PDL": 1}}
    (launch,) = rms_norm.launch(partials, weight, 1e-5, out, residual=residual, residual_out=r_out, partials=True,
                                consts=consts)
    assert launch[:2] == (rms_norm.CLUSTER_VARIANT, (3, 1, 8))
    assert [a is b for a, b in zip(launch[2][:5], (partials, residual, weight, out, r_out))] == [True] * 5
    assert launch[2][5:] == [1e-5, 4]
    (launch,) = rms_norm.launch(partials, weight, 1e-5, out, residual=residual, residual_out=r_out, partials=True)
    assert launch[:2] == (rms_norm.PARTIALS_VARIANT, (3, 1, 1))               # not built: the Triton variant
    x = torch.zeros(3, 64, dtype=torch.bfloat16)
    (launch,) = rms_norm.launch(x, weight, 1e-5, out, residual=residual, consts=consts)
    assert launch[0] == "add_rms_norm"                                          # no partials: never the cluster


@needs_nvcc
def test_compiles_for_sm90_as_a_cluster_kernel():
    spec, _ = norm_cluster_spec(cfg(), "bf16", "sm90")
    (record,) = cuda.compile_cuda([spec]).records
    assert record["variant"] == rms_norm.CLUSTER_VARIANT and record["scratch_params"] == 0
    assert [a["type"] for a in record["args"]] == ["*fp32", "*bf16", "*bf16", "*bf16", "*bf16", "fp32", "i32"]
    assert record["launch"]["cluster"] == spec.launch["cluster"] and record["num_warps"] == spec.num_warps


def reference(partials, residual, weight, eps):
    """(out, residual_out) as the Triton partials variant rounds them: the splits summed in order in fp32 and
    rounded, plus the residual, rounded; normalized in float64 (the kernel's fp32 rstd is within an ulp)."""
    total = torch.zeros_like(partials[0])
    for p in partials:
        total = total + p
    s = (total.to(residual.dtype).float() + residual.float()).to(residual.dtype)
    sd = s.double()
    rstd = torch.rsqrt(sd.pow(2).mean(-1, keepdim=True) + eps)
    return weight.double() * (sd * rstd).to(residual.dtype).double(), s


@pytest.mark.skipif(not gpu_ready() or sm_arch() != "sm90", reason="needs an sm90 GPU and engc._native")
@pytest.mark.parametrize("hidden,t", [(4096, torch.bfloat16), (2048, torch.float16), (1024, torch.bfloat16)])
def test_matches_the_reference_on_the_gpu(hidden, t):
    """Rows 1-24, 1-16 splits (the GEMV's most), through the bundle loader's own kernel path: the residual sum
    bit for bit, the normalized row within a rounding of the reference."""
    from engc.runtime.cubin import current_stream
    from engc.runtime.gpu_ops import load_record
    spec, why = norm_cluster_spec(cfg(hidden), {torch.bfloat16: "bf16", torch.float16: "fp16"}[t], "sm90")
    assert spec is not None, why
    result = cuda.compile_cuda([spec])
    (record,) = result.records
    kernel = load_record(result.files[record["cubin"]], record, pdl=False)
    consts = {rms_norm.CLUSTER_VARIANT: record["launch"]}
    gen = torch.Generator().manual_seed(hidden)
    for rows, splits in ((1, 4), (1, 1), (5, 16), (8, 3), (24, 2)):
        partials = torch.randn(splits, rows, hidden, generator=gen)
        residual = torch.randn(rows, hidden, generator=gen).to(t)
        weight = (torch.rand(hidden, generator=gen) + 0.5).to(t)
        ref_out, ref_sum = reference(partials, residual, weight, 1e-5)
        g = [a.cuda() for a in (partials, residual, weight)]
        out = torch.full((rows, hidden), float("nan"), dtype=t, device="cuda")
        r_out = torch.full_like(out, float("nan"))
        (launch,) = rms_norm.launch(g[0], g[2], 1e-5, out, residual=g[1], residual_out=r_out, partials=True,
                                    consts=consts)
        assert launch[0] == rms_norm.CLUSTER_VARIANT
        kernel.launch(launch[1], [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in launch[2]],
                      current_stream())
        torch.cuda.synchronize()
        assert torch.equal(r_out.cpu(), ref_sum), (rows, splits)
        err = (out.cpu().double() - ref_out).abs().max().item() / ref_out.abs().max().item()
        assert err < 1e-2, (rows, splits, err)

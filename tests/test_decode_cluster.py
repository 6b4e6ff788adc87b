"""The cluster decode attention (templates/paged_decode_cluster.cu.j2, variant decode_rotary_cluster): rendered
per shape, built by nvcc for sm90 where the tune table enables it, picked by the launch rule for small decode
batches; on an sm90 GPU, checked against the torch reference (rotary_kv_write, then paged_attention).
Compiling tests skip where nvcc is missing; the GPU test where there is no sm90 device."""

import pytest
import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen import cuda
from engc.kernels.paged_attention import cuda_specs as attention_cuda
from engc.kernels import paged_attention as pa
from test_gpu import gpu_ready, sm_arch

needs_nvcc = pytest.mark.skipif(cuda.nvcc_path() is None, reason="nvcc is not installed")
KEY = "sm90/paged_attention/decode_cluster/d<=128"


def cfg(heads=32, kv_heads=8, head_dim=128):
    return ModelConfig(family="llama", vocab_size=256, hidden_size=heads * head_dim, intermediate_size=256,
                       num_layers=1, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                       rope_theta=10000.0, max_position_embeddings=8192, tie_word_embeddings=True)


def test_spec_renders_the_shape_and_sizes_its_shared_memory():
    spec, why = attention_cuda.decode_cluster_spec(cfg(), "bf16", "sm90", 16)
    assert why == "" and spec.variant == "decode_rotary_cluster"
    assert spec.launch["cluster"] == tune.TUNE[KEY]["cluster"] and spec.launch["PDL"] == 1
    text = cuda.render(spec.template, **spec.render)
    for line in ("constexpr int NUM_HEADS = 32;", "constexpr int NUM_KV_HEADS = 8;", "constexpr int HEAD_DIM = 128;",
                 "constexpr int PAGE = 16;", f"constexpr int CLUSTER = {spec.launch['cluster']};",
                 f"static_assert(SHARED_BYTES == {spec.shared_mem},"):
        assert line in text
    assert "__cluster_dims__(1, 1, CLUSTER)" in text and ".f32.bf16.bf16.f32" in text
    assert spec.shared_mem > cuda.SHARED_LIMIT   # dynamic: the loader raises the function's limit


@pytest.mark.parametrize("shape,arch,t,block,why", [
    (dict(), "sm80", "bf16", 16, "no thread-block clusters"),
    (dict(), "sm90", "fp32", 16, "bf16 or fp16"),
    (dict(heads=32, kv_heads=2), "sm90", "bf16", 16, "GQA group 16"),
    (dict(head_dim=72, heads=8, kv_heads=8), "sm90", "bf16", 16, "head_dim 72"),
    (dict(), "sm90", "bf16", 8, "KV block size 8"),
])
def test_shapes_it_does_not_cover_are_refused_with_a_reason(shape, arch, t, block, why):
    spec, reason = attention_cuda.decode_cluster_spec(cfg(**shape), t, arch, block)
    assert spec is None and why in reason


def _decode_rotary_spec(overrides=None):
    from engc.compiler.codegen.specs import model_specs
    with tune.overridden(overrides):
        return [s for s in model_specs(cfg(), torch.bfloat16, "sm90", 16)
                if (s.op, s.variant) == ("paged_attention", "decode_rotary")]


def test_selected_only_where_the_table_enables_it():
    assert tune.TUNE[KEY]["enabled"]               # on for sm90 (the tune table: what the H200 measured)
    specs, notes = attention_cuda.cuda_specs(_decode_rotary_spec(), cfg())
    assert [s.variant for s in specs] == ["decode_rotary_cluster"] and notes == []
    off = {KEY: {"enabled": False}}
    with tune.overridden(off):
        specs, notes = attention_cuda.cuda_specs(_decode_rotary_spec(off), cfg())
    assert specs == [] and notes == []
    specs, notes = attention_cuda.cuda_specs(_decode_rotary_spec(), cfg(kv_heads=2))   # a group of 16
    assert specs == [] and notes == ["sm90: no cluster decode kernel (GQA group 16 is more than the 8 rows it "
                                     "gives the query heads); Triton's decode is used"]


def _inputs(contexts, heads=4, kv_heads=2, head_dim=64, seed=0):
    """A bf16 decode step (tests/test_kernels.rotary_decode_batch): a row per context and a padded row (slot -1)."""
    from test_kernels import rotary_decode_batch
    qkv, pos, inv_freq, kv, slots, tables, ctx, starts, _ = rotary_decode_batch(
        contexts, heads, kv_heads, head_dim, 16, torch.bfloat16, torch.Generator().manual_seed(seed))
    return qkv, pos, inv_freq, kv, slots, tables, ctx, starts


def test_launch_rule_takes_the_cluster_kernel_for_small_batches_only():
    qkv, pos, inv_freq, kv, slots, tables, ctx, starts = _inputs([20, 40])   # 3 rows with the padded one
    out = torch.empty(3, 4 * 64, dtype=torch.bfloat16)
    triton = {"BLOCK_N": 32, "target_programs": 264, "max_splits": 64, "min_split_tokens": 32,
              "min_split_tokens_busy": 64, "in_kernel_reduce": True}
    consts = {"decode_rotary": triton,
              "decode_rotary_cluster": {"cluster": 8, "max_seqs": 3, "max_context": 255, "PDL": 1}}
    kw = dict(num_heads=4, num_kv_heads=2, head_dim=64, scale=0.125, consts=consts, max_context_len=255,
              counters=torch.zeros(16, dtype=torch.int32))
    launches = pa.launch_rotary_decode(qkv, pos, inv_freq, kv, slots, tables, ctx, starts, out, **kw)
    assert [(v, grid) for v, grid, _ in launches] == [("decode_rotary_cluster", (3, 2, 8))]
    args = launches[0][2]
    expected = [qkv, pos, inv_freq, slots, kv[0], kv[1], tables, ctx, starts, out]
    assert all(a.data_ptr() == e.data_ptr() and a.shape == e.shape for a, e in zip(args[:10], expected))
    assert args[10:] == [0.125, 0, tables.stride(0)]
    consts["decode_rotary_cluster"]["max_seqs"] = 2       # more sequences than it takes: Triton's kernel
    launches = pa.launch_rotary_decode(qkv, pos, inv_freq, kv, slots, tables, ctx, starts, out, **kw)
    assert [v for v, _, _ in launches] == ["decode_rotary"]
    consts["decode_rotary_cluster"]["max_seqs"] = 3       # a longer context bound (a graph sized for the
    for longer in (256, None):                            # table's capacity, 48 here): Triton's kernel
        launches = pa.launch_rotary_decode(qkv, pos, inv_freq, kv, slots, tables, ctx, starts, out,
                                           **{**kw, "max_context_len": longer})
        assert [v for v, _, _ in launches] == (["decode_rotary"] if longer else ["decode_rotary_cluster"])
    kv8 = torch.zeros(kv.shape, dtype=torch.int8)        # a quantized cache: Triton's kernel
    launches = pa.launch_rotary_decode(qkv, pos, inv_freq, kv8, slots, tables, ctx, starts, out, **kw,
                                       kv_scale=torch.ones(kv.shape[:-1]))
    assert [v for v, _, _ in launches] == ["decode_rotary"]


@needs_nvcc
@pytest.mark.parametrize("t,shape", [("bf16", dict()), ("fp16", dict(heads=16, kv_heads=2, head_dim=64))])
def test_compiles_for_sm90_with_its_parameters_and_shared_memory(t, shape):
    spec, _ = attention_cuda.decode_cluster_spec(cfg(**shape), t, "sm90", 16)
    result = cuda.compile_cuda([spec])
    (record,) = result.records
    assert record["variant"] == "decode_rotary_cluster" and record["shared_mem"] == spec.shared_mem
    assert record["static_shared"] + record["shared_mem"] <= cuda.DYNAMIC_SHARED_LIMIT["sm90"]
    ptx = result.files[record["ptx"]].decode()
    assert ".reqnctapercluster 1, 1, 8" in ptx or ".explicitcluster" in ptx
    assert f"mma.sync.aligned.m16n8k16.row.col.f32.{cuda.MMA_TYPE[t]}.{cuda.MMA_TYPE[t]}.f32" in ptx


@pytest.mark.skipif(not gpu_ready() or sm_arch() != "sm90", reason="needs an sm90 GPU and engc._native")
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(32, 8, 128), (32, 8, 64), (6, 6, 128)])
def test_matches_the_reference_on_the_gpu(tmp_path, heads, kv_heads, head_dim):
    """Contexts from 1 token to several rounds of every warp of the cluster, a sliding window, a padded row
    (slot -1: writes nothing), through the bundle loader's own kernel path; the output and the new cache rows
    against rotary_paged_attention in float64 on the same inputs."""
    from engc.cuda.cubin import current_stream
    from engc.cuda.records import load_record
    c = cfg(heads, kv_heads, head_dim)
    with tune.overridden({f"sm90/paged_attention/decode_cluster/{tune.head_dim_bucket(head_dim)}": {"enabled": True}}):
        spec, why = attention_cuda.decode_cluster_spec(c, "bf16", "sm90", 16)
    assert spec is not None, why
    result = cuda.compile_cuda([spec])
    (record,) = result.records
    kernel = load_record(result.files[record["cubin"]], record, pdl=False)
    # every batch and context here to the cluster kernel (the table keeps it to one sequence and short contexts)
    consts = {"decode_rotary_cluster": {**record["launch"], "max_seqs": 1 << 20, "max_context": 1 << 30}}
    for contexts, window in (([1], 0), ([17], 0), ([192], 0), ([5000, 33, 130, 1000], 0), ([600, 31], 100)):
        qkv, pos, inv_freq, kv, slots, tables, ctx, starts = _inputs(contexts, heads, kv_heads, head_dim,
                                                                     seed=len(contexts) + window)
        written = kv.double()                       # the cache as the step leaves it
        ref = pa.rotary_paged_attention(qkv.double(), pos, inv_freq, written, slots, tables, ctx, starts, heads,
                                        kv_heads, head_dim, head_dim ** -0.5, window)
        keep = slots >= 0       # a padded row reads its new token from registers, the reference a stale row
        g = [t.cuda() for t in (qkv, pos, inv_freq, kv, slots, tables, ctx, starts)]
        out = torch.full((len(ctx), heads * head_dim), float("nan"), dtype=torch.bfloat16, device="cuda")
        for variant, grid, args in pa.launch_rotary_decode(*g, out, num_heads=heads, num_kv_heads=kv_heads,
                                                           head_dim=head_dim, scale=head_dim ** -0.5,
                                                           sliding_window=window, consts=consts):
            assert variant == "decode_rotary_cluster"
            kernel.launch(grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args],
                          current_stream())
        torch.cuda.synchronize()
        err = ((out.cpu().double() - ref)[keep].abs().max() / ref[keep].abs().max()).item()
        assert err < 2e-2, (contexts, window, err)
        new = g[3].cpu().float()
        for slot in slots[keep].tolist():
            block, off = divmod(slot, 16)
            assert torch.allclose(new[:, block, off], written[:, block, off].float(), atol=2e-2, rtol=2e-2)
        untouched = kv.float().clone()
        for slot in slots.tolist():
            if slot >= 0:
                untouched[:, slot // 16, slot % 16] = new[:, slot // 16, slot % 16]
        assert torch.equal(new, untouched), "the kernel wrote cache rows other than the new tokens'"

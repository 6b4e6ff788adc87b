"""The GPU path of the mixture-of-experts and latent-attention families against the CPU path (skipped without
a CUDA device and engc._native).

float32 bundles: greedy tokens on the GPU (CUDA graphs on and off) are the CPU reference's, through the MoE
kernels' decode path (a few (token, expert) pairs; the fused three launches of a routing without a shared
expert, where the tune table turns them on, checked at batch 1) and grouped path (a prefill's pairs sorted
per expert), and MLA's cache write, absorbed split-KV decode and reduce. bfloat16 bundles: each prompt
token's log-probability on the GPU (the prefill's kernels, tensor-core math) within bf16's reach of the float32
CPU's; `--quant fp8` bundles (float8 experts, W8A8 projections) and int4 experts (engc quantize's): the GPU's
within the same reach of the same bundle on the CPU.

As tests/test_gpu.py: ENGC_KERNEL_CACHE names a kernel cache filled on a CPU machine (bench/fake_sm90.py).
"""
import json
import os

import pytest
import torch

from engc.compiler.build import BuildOptions, build
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams
from test_gpu import PROMPTS, greedy, gpu_ready, sm_arch

FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "deepseek_v2", "deepseek_v3", "granitemoe", "glm4_moe",
            "ernie4_5_moe"]
# a prompt long enough that its prefill runs the grouped MoE path and MLA's decompressed prefill
LONG = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France. Hello, world! How are "
        "you today? engc compiles a checkpoint into a bundle of weights, a program and kernels.")

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def _build(src, out, dtype, quant="auto", tune=None):
    build(str(src), out, BuildOptions(archs=("cpu", sm_arch()), dtype=dtype, quant=quant, tune=tune,
                                      kernel_cache=os.environ.get("ENGC_KERNEL_CACHE")))
    return out


@pytest.fixture(autouse=True)
def _native():
    if torch.cuda.is_available() and not gpu_ready():
        pytest.skip("needs engc._native")


@needs_gpu
@pytest.mark.parametrize("family", FAMILIES)
def test_float32_greedy_on_the_gpu_is_the_cpus(family, tiny_dir, tmp_path):
    # OLMoE's q/k norm spans the whole projection: its GPU kernel needs q and k as wide as the hidden size, as
    # in the released model (multi-head attention), not the tiny default's grouped KV heads
    src = tiny_dir(family, num_key_value_heads=4) if family == "olmoe" else tiny_dir(family)
    bundle = _build(src, tmp_path / "b", "float32")
    cpu = greedy(bundle, "cpu")
    assert greedy(bundle, "cuda") == cpu
    assert greedy(bundle, "cuda", graphs=False) == cpu


def _greedy_one_at_a_time(bundle, device):
    """greedy()'s prompts one sequence at a time (batch 1, CUDA graphs on)."""
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=1, cuda_graphs=True))
    seqs = []
    for text in PROMPTS:
        seqs.append(engine.add_request(model.tokenizer.encode(text),
                                       SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)))
        engine.run_to_completion()
    return [s.output_ids for s in seqs]


@needs_gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fused_decode_at_batch_one_is_the_cpus(family, tiny_dir, tmp_path):
    """A routing without a shared expert, built with both decode fusions on (the tune field "fused": gate_up
    routing its own pairs, down summing each token's, three MoE launches a layer), decodes at batch 1 from the
    CUDA graphs to the CPU's greedy tokens."""
    arch = sm_arch()
    bundle = _build(tiny_dir(family), tmp_path / "b", "float32",
                    tune={f"{arch}/moe/{v}/any": {"fused": 1} for v in ("gate_up_decode", "down_decode")})
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert {r["variant"]: r["launch"].get("fused") for r in manifest["kernels"]
            if r["op"] == "moe" and r["variant"].endswith("_decode")} == {"gate_up_decode": 1, "down_decode": 1}
    assert _greedy_one_at_a_time(bundle, "cuda") == _greedy_one_at_a_time(bundle, "cpu")


def _prompt_logprobs(bundle, device, ids):
    model = load(bundle, device=device)
    engine = Engine(model, EngineConfig(num_blocks=256, max_num_seqs=8))
    seq = engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    engine.run_to_completion()
    return torch.tensor([s.logprob for s in seq.prompt_logprobs[1:]])


@needs_gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_bfloat16_prompt_logprobs_near_float32(family, tiny_dir, tmp_path):
    ref_bundle = _build(tiny_dir(family), tmp_path / "f32", "float32")
    bf16_bundle = _build(tiny_dir(family), tmp_path / "bf16", "bfloat16")
    ids = load(ref_bundle).tokenizer.encode(LONG)
    ref = _prompt_logprobs(ref_bundle, "cpu", ids)
    gpu = _prompt_logprobs(bf16_bundle, "cuda", ids)
    assert len(ids) > 32 and gpu.shape == ref.shape
    # bf16 weights and activations: a few hundredths of a nat on the tiny models' flat distributions
    assert (gpu - ref).abs().max() < 0.1, (gpu - ref).abs().max()


@needs_gpu
@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_fp8_prompt_logprobs_near_the_cpus(family, tiny_dir, tmp_path):
    # the fp8 GEMM's widths are multiples of 16: DeepSeek's latent plus rope key (kv_a's rows) is 56 + 8 wide
    src = tiny_dir(family, kv_lora_rank=56) if family == "deepseek_v2" else tiny_dir(family)
    bundle = _build(src, tmp_path / "fp8", "bfloat16", quant="fp8")
    ids = load(bundle).tokenizer.encode(LONG)
    cpu = _prompt_logprobs(bundle, "cpu", ids)
    gpu = _prompt_logprobs(bundle, "cuda", ids)
    assert gpu.shape == cpu.shape
    assert (gpu - cpu).abs().max() < 0.1, (gpu - cpu).abs().max()


@needs_gpu
def test_int4_experts_prompt_logprobs_near_the_cpus(tiny_dir, tmp_path):
    """An int4 MoE checkpoint (engc quantize's RTN, groups of 32): the GPU's INT4_W expert kernels (decode and
    the prefill's grouped pairs) against the same bundle on the CPU."""
    from test_cli import engc
    r = engc("quantize", tiny_dir("qwen3_moe"), "--method", "rtn", "--group-size", "32", "-o", tmp_path / "q")
    assert r.returncode == 0, r.stderr
    bundle = _build(tmp_path / "q", tmp_path / "b", "bfloat16")
    ids = load(bundle).tokenizer.encode(LONG)
    cpu = _prompt_logprobs(bundle, "cpu", ids)
    gpu = _prompt_logprobs(bundle, "cuda", ids)
    assert gpu.shape == cpu.shape
    assert (gpu - cpu).abs().max() < 0.1, (gpu - cpu).abs().max()

"""Mixture-of-experts: the MoE op's routing variants, both checkpoint layouts, GGUF input and the refusals.

Greedy parity of each MoE family with HF transformers is in test_hf_parity.py; here the same oracle checks the
fused-expert layout and GGUF files, and the reference is checked against the routing math it implements.
"""
from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from engc.compiler.build import BuildOptions, build
from engc.errors import UserError
from engc.kernels.moe import moe, route
from engc.kernels.moe.launch import sort_by_expert
from gguf_writer import STEMS, add_hparams, permute_qk, tensor_name

transformers = pytest.importorskip("transformers")


def _engine_greedy(bundle, prompts, n):
    from engc.runtime.engine import Engine
    from engc.runtime.loader import load
    from engc.runtime.sampling import SamplingParams
    engine = Engine(load(bundle))
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, logprobs=0)
    seqs = [engine.add_request(ids, params) for ids in prompts]
    engine.run_to_completion()
    return seqs


def _assert_matches_hf(bundle, hf_folder, prompts, n=12):
    from test_hf_parity import hf_greedy
    for ids, seq in zip(prompts, _engine_greedy(bundle, prompts, n)):
        expected, hf_logits = hf_greedy(hf_folder, ids, n)
        assert seq.output_ids == expected
        ours = torch.tensor([s.logprob for s in seq.logprobs])
        theirs = torch.log_softmax(hf_logits, -1).gather(1, torch.tensor(expected)[:, None])[:, 0]
        assert torch.allclose(ours, theirs, atol=1e-4, rtol=1e-4)


PROMPT_IDS = [[5, 17, 200, 33, 9], [250, 3, 3, 3], [64, 65, 66, 67, 68, 69, 70, 71]]


# ---- the reference's routing math -------------------------------------------------------------------

def test_routing_variants():
    torch.manual_seed(0)
    x, router = torch.randn(7, 16), torch.randn(6, 16)
    w, ids = route(x, router, top_k=2, softmax_first=1, renormalize=0)
    probs = torch.softmax(x @ router.T, -1)
    assert torch.allclose(w, probs.gather(1, ids)) and (w[:, 0] >= w[:, 1]).all()
    assert torch.allclose(w.sum(-1), probs.topk(2).values.sum(-1))
    wn, idn = route(x, router, top_k=2, softmax_first=1, renormalize=1)
    assert torch.equal(idn, ids) and torch.allclose(wn.sum(-1), torch.ones(7))
    # top-k of the logits, then softmax over those k: the same experts and the renormalized weights
    wt, idt = route(x, router, top_k=2, softmax_first=0)
    assert torch.equal(idt, ids) and torch.allclose(wt, wn, atol=1e-6)


def test_moe_equals_a_dense_loop():
    torch.manual_seed(1)
    t, h, inter, e, k = 9, 16, 8, 5, 3
    x, router = torch.randn(t, h), torch.randn(e, h)
    gate_up, down = torch.randn(e, 2 * inter, h), torch.randn(e, h, inter)
    shared, sg = torch.randn(t, h), torch.randn(1, h)   # the shared expert's output (the program's dense MLP)
    out = moe(x, router, gate_up, down, shared, sg, top_k=k, renormalize=1, has_shared_expert=1)
    ungated = moe(x, router, gate_up, down, shared, top_k=k, renormalize=1, has_shared_expert=1, shared_ungated=1)
    w, ids = route(x, router, k, renormalize=1)
    for i in range(t):
        want = torch.zeros(h)
        for j in range(k):
            g, u = (gate_up[ids[i, j]] @ x[i]).chunk(2)
            want += w[i, j] * (down[ids[i, j]] @ (torch.nn.functional.silu(g) * u))
        assert torch.allclose(out[i], want + torch.sigmoid(sg @ x[i]) * shared[i], atol=1e-4, rtol=1e-4)
        assert torch.allclose(ungated[i], want + shared[i], atol=1e-4, rtol=1e-4)


def test_sort_by_expert_pads_each_expert_to_whole_blocks():
    ids = torch.tensor([[2, 0], [2, 1], [0, 2], [2, 3]])
    rows, block_expert = sort_by_expert(ids, num_experts=5, block_m=2)
    assert rows.numel() == 2 * len(block_expert)
    flat, pad = ids.reshape(-1), ids.numel()
    for b, e in enumerate(block_expert.tolist()):
        for r in rows[2 * b: 2 * b + 2].tolist():
            assert r == pad or flat[r] == e
    assert sorted(r for r in rows.tolist() if r != pad) == list(range(ids.numel()))
    # expert 4 has no tokens, expert 2 three (padded to 4); the sizes are the shapes' bound (every expert
    # padded), so the blocks past the last expert's are -1 and all padding
    assert block_expert.tolist() == [0, 1, 2, 2, 3, -1, -1]
    assert (rows[2 * 5:] == pad).all()


# ---- checkpoint layouts -----------------------------------------------------------------------------

def _fuse_experts(src, dst, family):
    """The folder as transformers' fused experts: mlp.experts.gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    from safetensors.torch import load_file, save_file
    shutil.copytree(src, dst)
    (shard,) = dst.glob("*.safetensors")
    tensors = load_file(str(shard))
    cfg = json.loads((dst / "config.json").read_text())
    experts = cfg.get("num_experts") or cfg["num_local_experts"]
    gate, up, down = ("w1", "w3", "w2") if family == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}.{block}."
        if p + "experts.0.w1.weight" not in tensors and p + "experts.0.gate_proj.weight" not in tensors:
            continue
        per = [{n: tensors.pop(f"{p}experts.{e}.{n}.weight") for n in (gate, up, down)} for e in range(experts)]
        q = f"model.layers.{i}.mlp."
        tensors[q + "experts.gate_up_proj"] = torch.stack([torch.cat([w[gate], w[up]]) for w in per])
        tensors[q + "experts.down_proj"] = torch.stack([w[down] for w in per])
        tensors[q + "gate.weight"] = tensors.pop(p + "gate.weight")
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_fused_expert_layout_builds_the_same_bundle(family, tiny_dir, tiny_bundle, tmp_path):
    fused = _fuse_experts(tiny_dir(family), tmp_path / "fused", family)
    # transformers reads the fused layout as the same model
    a = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir(family), dtype=torch.float32).state_dict()
    b = transformers.AutoModelForCausalLM.from_pretrained(fused, dtype=torch.float32).state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
    build(str(fused), tmp_path / "b", BuildOptions())
    per_expert = tiny_bundle(family)
    assert (tmp_path / "b/weights/rank0.safetensors").read_bytes() == \
        (per_expert / "weights/rank0.safetensors").read_bytes()
    assert (tmp_path / "b/program.onnx").read_bytes() == (per_expert / "program.onnx").read_bytes()


# ---- refusals ---------------------------------------------------------------------------------------

def _with_config(src, dst, **changes):
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("changes,fragment", [
    ({"scoring_func": "sigmoid"}, "scoring_func = 'sigmoid'"),
    ({"topk_method": "group_limited_greedy"}, "topk_method"),
    ({"hidden_act": "gelu"}, "hidden_act = 'gelu'"),
    ({"clip_qkv": 8.0}, "clip_qkv"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok 9"),
])
def test_unsupported_variant_is_refused_in_one_line(changes, fragment, tiny_dir, tmp_path):
    src = _with_config(tiny_dir("qwen3_moe"), tmp_path / "src", **changes)
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
        build(str(src), tmp_path / "b", BuildOptions())


def test_router_bias_is_refused(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    src = tmp_path / "src"
    shutil.copytree(tiny_dir("qwen3_moe"), src)
    (shard,) = src.glob("*.safetensors")
    tensors = load_file(str(shard))
    tensors["model.layers.0.mlp.gate.e_score_correction_bias"] = torch.zeros(8)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    with pytest.raises(UserError, match="e_score_correction_bias"):
        build(str(src), tmp_path / "b", BuildOptions())


def test_olmoe_qkv_is_one_gemm_and_one_norm(tiny_dir, tmp_path):
    """OLMoE's q and k norms over the whole projections move behind the qkv Concat (QKNormProjection), so q, k
    and v are one GEMM; the GPU build has the norm's kernel for any projection widths (the tiny model's k is
    narrower than q and than the hidden size)."""
    from engc.bundle.program import parse_program
    build(str(tiny_dir("olmoe")), tmp_path / "b", BuildOptions(archs=("cpu", "sm90")))
    nodes = parse_program((tmp_path / "b" / "program.onnx").read_bytes()).nodes
    ops = [n.op for n in nodes]
    assert ops.count("QKNormProjection") == 2 and "Concat" not in ops
    assert ops.count("RMSNorm") == 1   # the final norm: no norm of a projection is left
    layer0 = [n.op for n in nodes if n.outputs[0].startswith("layers.0.")]
    assert layer0[:4] == ["RMSNorm", "Gemm", "QKNormProjection", "RotaryPagedAttention"]
    manifest = json.loads((tmp_path / "b/manifest.json").read_text())
    assert [r["variant"] for r in manifest["kernels"] if r["op"] == "qk_norm"] == ["projection"]


# the tiny DeepSeek's latent width (40) is not one _scaled_mm takes, so its fp8 GPU build is refused
@pytest.mark.parametrize("family,width,quants", [("qwen2_moe", 48, ("auto", "fp8")), ("deepseek_v2", 32, ("auto",))])
def test_shared_expert_is_a_dense_mlp_beside_the_moe_node(family, width, quants, tiny_dir, tmp_path):
    """A shared expert (Qwen2-MoE's gated one, DeepSeek's ungated ones) is lowered as the dense MLP: one fused
    gate_up Gemm, the SiLU GLU, down; the MoE node takes its output (and Qwen2-MoE's gate). Its width differs
    from the dense layer's, so the GPU build has the GLU kernels of that width too: the SiLU-fused decode GEMV,
    the silu_mul variant of its own. --quant fp8 leaves it in the model dtype (passes/quantize_fp8 says why)."""
    from engc.bundle.program import parse_program
    for quant in quants:
        out = tmp_path / quant
        build(str(tiny_dir(family)), out, BuildOptions(archs=("cpu", "sm90"), dtype="bfloat16", quant=quant))
        nodes = parse_program((out / "program.onnx").read_bytes()).nodes
        moe = next(n for n in nodes if n.op == "MoE")
        layer = moe.outputs[0].split(".")[1]
        shared = [n for n in nodes if n.outputs[0].startswith(f"layers.{layer}.shared_expert.")
                  and not n.outputs[0].endswith(".decode")]
        ops = [n.op for n in shared]
        assert ops == ["Gemm", "SiluMulLinear"], ops   # gate and up one GEMM, then the SiLU-fused down
        assert moe.inputs[4] == shared[-1].outputs[0]   # the node adds the down projection's output
        gated = list(moe.inputs[5:6]) == [f"layers.{layer}.shared_expert_gate.weight"]
        assert gated == (family == "qwen2_moe") and bool(moe.attrs.get("shared_ungated")) == (not gated)
        manifest = json.loads((out / "manifest.json").read_text())
        variants = {(r["op"], r["variant"]) for r in manifest["kernels"]}
        assert ("silu_mul", f"default_i{width}") in variants
        assert any(op == "gemv" and v.startswith(f"silu_k{width}_") for op, v in variants), variants
        assert not any(op == "fp8_quant" and v.endswith(f"k{width}") for op, v in variants), variants


def test_what_moe_lacks_is_refused_in_one_line(tiny_dir, tmp_path):
    from test_cli import assert_one_line_error, engc
    # fp8 experts need the FP8 conversions of sm89+, as the dense fp8 projections do
    assert_one_line_error(engc("build", tiny_dir("mixtral"), "-o", tmp_path / "b", "--arch", "sm80", "--quant", "fp8"),
                          "fp8", "sm80")
    # Granite MoE's stacked experts have no int4 checkpoint layout to write them in
    assert_one_line_error(engc("quantize", tiny_dir("granitemoe"), "-o", tmp_path / "q", "--method", "rtn"),
                          "granitemoe", "stacked experts")


def test_int4_experts_build_for_the_gpu(tiny_dir, tmp_path):
    """An int4 MoE checkpoint (engc quantize's, AWQ/GPTQ's) builds for the GPU: its expert GEMMs are the INT4_W
    specialization, reading the engc int4 layout's words, scales and zero points."""
    from test_cli import engc
    r = engc("quantize", tiny_dir("qwen3_moe"), "--method", "rtn", "--group-size", "32", "-o", tmp_path / "q")
    assert r.returncode == 0, r.stderr
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions(archs=("cpu", "sm90")))
    manifest = json.loads((tmp_path / "b/manifest.json").read_text())
    gemms = [r for r in manifest["kernels"] if r["op"] == "moe" and r["variant"].startswith(("gate_up", "down"))]
    assert len(gemms) == 6
    for r in gemms:
        types = {a["name"]: a["type"] for a in r["args"]}
        assert (types["w_ptr"], types["w_zero_ptr"]) == ("*i32", "*u8"), r["variant"]


# ---- fp8 experts (engc build --quant fp8) -------------------------------------------------------------

def fp8_experts_bundle(src, float_bundle, out, archs=("cpu", "sm90")) -> dict:
    """Builds src with --quant fp8 for archs and checks what it holds: every MoE node's experts float8 with a float32
    scale per channel per expert, the router and the shared expert (a dense MLP beside the node) in the model dtype,
    the GPU's expert kernels the FP8_W specialization. Then its CPU logits and greedy tokens against the float
    bundle's: returns the largest logit error relative to the logits' range, the share of argmaxes alike, and for
    each greedy token the fp8 bundle picks how far below the float bundle's best it scores (in logit stds)."""
    from engc.runtime.eval import _forward
    from engc.runtime.kv_cache import KVCache
    from engc.runtime.loader import load
    build(str(src), out, BuildOptions(archs=archs, quant="fp8"))
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["quantization"]["method"] == "fp8" and "experts" in manifest["quantization"]
    experts = {r["arch"]: {a["name"]: a["type"] for a in r["args"]}["w_ptr"] for r in manifest["kernels"]
               if r["op"] == "moe" and r["variant"] in ("gate_up", "down", "gate_up_decode", "down_decode")}
    assert experts == {a: "*fp8e4nv" for a in archs if a != "cpu"}
    model = load(out)
    cfg, w = model.config, model.executor.weights
    moes = [n for n in model.executor.program.nodes if n.op == "MoE" and not n.outputs[0].endswith(".decode")]
    assert moes and all(n.attrs.get("fp8_experts") for n in moes)
    e, inter, h = cfg.num_experts, cfg.moe_intermediate_size, cfg.hidden_size
    for n in moes:
        gate_up, down = w[n.inputs[2]], w[n.inputs[3]]
        assert gate_up.dtype == down.dtype == torch.float8_e4m3fn
        assert gate_up.shape == (e, 2 * inter, h) and down.shape == (e, h, inter)
        scales = [w[i] for i in n.inputs if i.endswith("_scale")]
        assert [(s.dtype, tuple(s.shape)) for s in scales] == [(torch.float32, (e, 2 * inter)), (torch.float32, (e, h))]
        float_inputs = list(n.inputs[1:2]) + (list(n.inputs[4:6]) if n.attrs.get("has_shared_expert") else [])
        assert all(w[i].dtype == model.dtype for i in float_inputs if i in w and not i.endswith("_scale"))
        if n.attrs.get("has_shared_expert"):
            down = next(p for p in model.executor.program.nodes if p.outputs[0] == n.inputs[4])
            assert down.op in ("Gemm", "SiluMulLinear") and w[down.inputs[1]].dtype == model.dtype, down

    reference = load(float_bundle)
    kv = lambda m: KVCache(m.config, 8, m.block_size, m.dtype, m.device)  # noqa: E731
    ids = torch.randint(2, 300, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    a, b = _forward(reference, kv(reference), ids).float(), _forward(model, kv(model), ids).float()
    gaps = []
    for prompt, seq in zip(PROMPT_IDS, _engine_greedy(out, PROMPT_IDS, 12)):
        logits = _forward(reference, kv(reference), prompt + seq.output_ids).float()
        for i, token in enumerate(seq.output_ids):
            row = logits[len(prompt) + i - 1]
            gaps.append(float((row.max() - row[token]) / row.std()))   # 0: the float bundle picks it too
    return {"rel": float((a - b).abs().max() / a.abs().max()),
            "argmax": float((a.argmax(-1) == b.argmax(-1)).float().mean()), "gaps": gaps}


def check_fp8_close(r: dict) -> None:
    """fp8_experts_bundle's result within what fp8 rounding gives: each GEMM rounds one or both operands to 3
    mantissa bits (~3-4% relative error a dot product; the dense models of test_fp8.py measure 3-6% at the
    logits, the tiny MoE models 4-8% with 90-95% of argmaxes alike); a wrong scale or layout gives errors of
    order 100%. A tiny random model has near-ties, so greedy tokens are compared one step at a time on the same
    prefix."""
    assert r["rel"] < 0.15 and r["argmax"] >= 0.85, r
    assert sum(g == 0 for g in r["gaps"]) >= 0.85 * len(r["gaps"]) and max(r["gaps"]) < 0.3, r["gaps"]


@pytest.mark.parametrize("family,archs", [("qwen3_moe", ("cpu", "sm90")), ("mixtral", ("cpu", "sm90")),
                                          ("qwen2_moe", ("cpu", "sm90")), ("olmoe", ("cpu", "sm90"))])
def test_fp8_experts_bundle_close_to_float_bundle(family, archs, tiny_dir, tiny_bundle, tmp_path):
    """--quant fp8 on an MoE model: the experts float8 too (Qwen2-MoE's shared expert, a dense MLP beside the
    node, stays in the model dtype)."""
    check_fp8_close(fp8_experts_bundle(tiny_dir(family), tiny_bundle(family), tmp_path / "b", archs))


# ---- GGUF -------------------------------------------------------------------------------------------

# llama.cpp's names of the MoE layer's tensors, beside the dense families'
_GGUF_STEMS = {**STEMS, "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
               "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
               "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def _write_moe_gguf(path, arch: str, model, encode=None) -> None:
    """A float32 GGUF laid out as llama.cpp's converter writes the family: experts stacked per projection
    (ffn_{gate,up,down}_exps), Mixtral as a "llama" with its q/k rows permuted, Qwen2-MoE's shared gate 1-D.
    encode(gguf_name, array) -> (data, GGML type or None for float32), as test_gguf's writer takes it."""
    import gguf
    from transformers.convert_slow_tokenizer import bytes_to_unicode
    cfg = model.config
    w = gguf.GGUFWriter(str(path), arch)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    add_hparams(w, {**{k: getattr(cfg, k) for k in ("num_hidden_layers", "max_position_embeddings", "hidden_size",
                                                  "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                                  "rms_norm_eps")},
                    "head_dim": head_dim, "rope_theta": cfg.rope_parameters["rope_theta"]})
    experts = getattr(cfg, "num_local_experts", None) or cfg.num_experts
    w.add_expert_count(experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if getattr(cfg, "moe_intermediate_size", None):
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "shared_expert_intermediate_size", None):
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    w.add_tokenizer_model("gpt2")
    tokens = [bytes_to_unicode()[b] for b in range(256)]
    w.add_token_list(tokens + [f"<extra_{i}>" for i in range(cfg.vocab_size - len(tokens))])
    w.add_token_merges([])
    w.add_token_types([1] * cfg.vocab_size)
    w.add_token_scores([0.0] * cfg.vocab_size)
    w.add_eos_token_id(1)
    for name, tensor in model.state_dict().items():
        array = tensor.float().numpy()
        if name.endswith("experts.gate_up_proj"):
            layer = name.split(".")[2]
            gate, up = np.split(array, 2, axis=1)
            w.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(gate))
            w.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(up))
            continue
        if name.endswith("experts.down_proj"):
            w.add_tensor(f"blk.{name.split('.')[2]}.ffn_down_exps.weight", array)
            continue
        module = name.rsplit(".", 1)[0]
        gguf_name = tensor_name(name, _GGUF_STEMS)
        if arch == "llama" and module.endswith(("q_proj", "k_proj")):
            array = permute_qk(array, cfg.num_attention_heads if module.endswith("q_proj") else cfg.num_key_value_heads)
        if ".ffn_gate_inp_shexp." in gguf_name:
            array = array.reshape(-1)
        data, raw_dtype = encode(gguf_name, np.ascontiguousarray(array)) if encode else (array, None)
        w.add_tensor(gguf_name, np.ascontiguousarray(data), raw_dtype=raw_dtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("family,arch,transformers_reads", [
    ("qwen2_moe", "qwen2moe", True), ("qwen3_moe", "qwen3moe", True),
    ("mixtral", "llama", False), ("olmoe", "olmoe", False),
])
def test_gguf_moe_matches_transformers(family, arch, transformers_reads, tiny_dir, tmp_path):
    """qwen2moe/qwen3moe: our tensors equal transformers' own GGUF reading; Mixtral-as-llama and OLMoE GGUFs,
    which transformers does not read, are checked against the model they were written from. Either way the
    bundle built from the GGUF decodes as HF does."""
    pytest.importorskip("gguf")
    from engc.compiler.frontend.gguf import read_gguf
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir(family), dtype=torch.float32)
    path = tmp_path / f"{arch}.gguf"
    _write_moe_gguf(path, arch, model)
    ckpt = read_gguf(path)
    assert ckpt.hf_config["model_type"] == family
    source = model.state_dict()
    assert set(ckpt.names()) == set(source)
    for name, expected in source.items():
        assert torch.equal(ckpt.get(name), expected), name
    if transformers_reads:
        pytest.importorskip("accelerate")
        # transformers' GGUF config reading skips the expert sizes: give it the config, test its tensor mapping
        ref = transformers.AutoModelForCausalLM.from_pretrained(
            str(tmp_path), gguf_file=path.name, config=model.config, dtype=torch.float32).state_dict()
        for name, expected in ref.items():
            # (transformers' qwen2moe tensor map has no dense-layer MLP: Qwen's released MoE models have none,
            # so the tiny model's mlp_only_layers layer is left as transformers initialized it)
            if not any(f".mlp.{n}_proj." in name for n in ("gate", "up", "down")):
                assert torch.equal(ckpt.get(name), expected), name
    build(str(path), tmp_path / "b", BuildOptions())
    _assert_matches_hf(tmp_path / "b", tiny_dir(family), PROMPT_IDS)


def test_gguf_4bit_shared_expert_is_kept_4bit(tiny_dir, tmp_path):
    """--quant keep on a Qwen2-MoE GGUF whose shared expert's gate and up are Q4_0 (its down, 48 inputs wide,
    is no whole number of Q4_0's 32-input blocks, so it stays float; layer 1 is dense): the shared expert is a
    dense MLP, so they stay 4-bit as a dense layer's do (QLinear), and the bundle computes what the float build
    of the same GGUF computes."""
    import gguf
    from engc.bundle.program import parse_program
    from engc.runtime.eval import _forward
    from engc.runtime.kv_cache import KVCache
    from engc.runtime.loader import load

    def encode(name, array):
        if ".ffn_gate_shexp." in name or ".ffn_up_shexp." in name:
            return gguf.quants.quantize(array, gguf.GGMLQuantizationType.Q4_0), gguf.GGMLQuantizationType.Q4_0
        return array, None
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir("qwen2_moe"), dtype=torch.float32)
    path = tmp_path / "qwen2moe-q4.gguf"
    _write_moe_gguf(path, "qwen2moe", model, encode)
    build(str(path), tmp_path / "keep", BuildOptions(quant="keep"))
    build(str(path), tmp_path / "float", BuildOptions())
    nodes = parse_program((tmp_path / "keep/program.onnx").read_bytes()).nodes
    shared = [n.op for n in nodes if n.outputs[0].startswith("layers.0.shared_expert.")
              and not n.outputs[0].endswith(".decode")]
    assert shared[0].startswith("QLinear"), shared
    assert json.loads((tmp_path / "keep/manifest.json").read_text())["quantization"]["kept"] == {"Q4_0": 2}
    kept, floats = load(tmp_path / "keep"), load(tmp_path / "float")
    kv = lambda m: KVCache(m.config, 8, m.block_size, m.dtype, m.device)  # noqa: E731
    a, b = (_forward(m, kv(m), PROMPT_IDS[0]).float() for m in (floats, kept))
    assert float((a - b).abs().max() / a.abs().max()) < 1e-5


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "granitemoe", "glm4_moe",
                                    "ernie4_5_moe"])
def test_bfloat16_bundle_decodes_as_hf_bfloat16(family, tiny_dir, tmp_path):
    """A bfloat16 MoE bundle on the CPU rounds as transformers' default (grouped) experts do: Mixtral's float32
    routing weights, the others' cast to bfloat16, the slots summed then rounded once. Granite MoE's multipliers
    are powers of two here, as released models' are where bfloat16 must hold them exactly (its residual one
    folded into the experts' down weights)."""
    from test_bf16_cpu import engine_greedy, hf_greedy, one_ulp
    from engc.runtime.loader import load
    exact = dict(embedding_multiplier=4.0, attention_multiplier=0.25, residual_multiplier=0.5, logits_scaling=2.0)
    src = tiny_dir(family, **(exact if family == "granitemoe" else {}))
    build(str(src), tmp_path / "b", BuildOptions(dtype="bfloat16"))
    model = load(tmp_path / "b")
    hf = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16).eval()
    for ids in PROMPT_IDS:
        expected, hf_logits = hf_greedy(hf, ids, 16)
        tokens, logits = engine_greedy(model, ids, 16)
        assert tokens == expected
        # ERNIE 4.5 MoE: up to 1.5 ulps measured (its float32 oracle test holds 1e-4, the dense ERNIE's bfloat16
        # one ulp; the rounding that differs is not located)
        assert float((logits - hf_logits).abs().max()) <= (2 if family == "ernie4_5_moe" else 1) * one_ulp(hf_logits)


"""engc quantize of DeepSeek-V2/V3 (multi-head latent attention, DeepSeek's MoE), and engc build of pre-quantized
DeepSeek checkpoints as AutoAWQ writes them.

The oracle is transformers' float32 model with the weights dequantized from the written files
(test_quant_families' oracle_of, test_quant_e2e's unpacking), in DeepSeek's own tensor names. The tiny V3 has a
q_lora_rank of 32: the engc int4 layout takes projections whose inputs are a multiple of 32, q_b_proj's too.
"""
import json

import pytest
import torch
from safetensors.torch import load_file

from engc.compiler.build import BuildOptions, build
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.stream import quantize_checkpoint
from test_dense_families import _relaid
from test_quant_families import CALIB, IDS, assert_bundle_matches, assert_layers_match_hf, awq_pack, oracle_of

transformers = pytest.importorskip("transformers")

OVERRIDES = {"deepseek_v2": {}, "deepseek_v3": {"q_lora_rank": 32}}
# the latent attentions AWQ's search meets: q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj
MLA_VARIANTS = {"deepseek_v2": ("deepseek_v2", {}), "deepseek_v2-q_lora": ("deepseek_v2", {"q_lora_rank": 32}),
                "deepseek_v3": ("deepseek_v3", OVERRIDES["deepseek_v3"])}


def source(family, tiny_dir):
    return tiny_dir(family, **OVERRIDES[family])


def tensors_of(folder) -> dict:
    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(str(f)).items()}


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_prequantized_awq_deepseek_builds(family, tiny_dir, tmp_path):
    """Every projection int4 as AutoAWQ writes DeepSeek: q (or q_a and q_b), kv_a_proj_with_mqa, kv_b_proj
    (dequantized at build for its per-head split), o_proj, the dense first layer's MLP, each expert, the shared
    experts (dequantized at build); the router, its bias and the norms float."""
    src = source(family, tiny_dir)
    out = {}
    for k, v in tensors_of(src).items():
        if ".layers." in k and k.endswith("proj.weight") or k.endswith("proj_with_mqa.weight"):
            out.update({k[:-len("weight")] + part: t for part, t in awq_pack(v, 32).items()})
        else:
            out[k] = v
    q = "self_attn.q_b_proj" if family == "deepseek_v3" else "self_attn.q_proj"
    for name in ("self_attn.kv_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.experts.0.down_proj",
                 "mlp.shared_experts.gate_proj", q):
        assert f"model.layers.1.{name}.qweight" in out, name
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": ["gate"]}
    _relaid(src, tmp_path / "q", cfg, lambda t: out)
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    assert_bundle_matches(tmp_path / "b", oracle_of(tmp_path / "q", None, tmp_path))


@pytest.mark.parametrize("method", ["rtn", "gptq", "awq"])
@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_quantized_deepseek_builds_and_matches_its_dequantized_weights(family, method, tiny_dir, tmp_path):
    """engc quantize writes DeepSeek's own checkpoint: every attention projection but kv_b_proj int4, each
    expert and the shared experts int4, the dense first layer's MLP int4; kv_b_proj, the router and its bias
    float, kv_b_proj named in modules_to_not_convert. engc build reads it (the shared experts as the dense MLP's
    int4 projections), and the bundle's logits, greedy tokens and their log-probs are the float model's of the
    dequantized weights."""
    from engc.bundle.program import parse_program
    from test_moe import PROMPT_IDS, _assert_matches_hf
    src = source(family, tiny_dir)
    quantize_checkpoint(str(src), tmp_path / "q", QuantOptions(method=method, group_size=32, **CALIB))
    written = json.loads((tmp_path / "q" / "model.safetensors.index.json").read_text())["weight_map"]
    q = ("self_attn.q_a_proj", "self_attn.q_b_proj") if family == "deepseek_v3" else ("self_attn.q_proj",)
    for name in q + ("self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.experts.7.down_proj",
                     "mlp.shared_experts.gate_proj", "mlp.shared_experts.down_proj"):
        assert f"model.layers.1.{name}.qweight" in written and f"model.layers.1.{name}.weight" not in written
    assert "model.layers.0.mlp.gate_proj.qweight" in written   # the dense first layer
    for name in ("self_attn.kv_b_proj.weight", "mlp.gate.weight"):
        assert f"model.layers.1.{name}" in written
    qc = json.loads((tmp_path / "q" / "config.json").read_text())["quantization_config"]
    assert qc["modules_to_not_convert"] == ["kv_b_proj"]
    assert qc["quant_method"] == ("awq" if method == "awq" else "gptq")
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    nodes = parse_program((tmp_path / "b/program.onnx").read_bytes()).nodes
    shared = {n.op for n in nodes if n.outputs[0].startswith("layers.1.shared_expert.")}
    assert shared and all(op.startswith("QLinear") for op in shared), shared   # gate_up (SiLU fused) and down
    oracle = oracle_of(tmp_path / "q", None, tmp_path)
    assert_bundle_matches(tmp_path / "b", oracle)
    _assert_matches_hf(tmp_path / "b", oracle, PROMPT_IDS)
    if method == "rtn":   # no calibration moved the weights: each is its float source's, rounded, in its rows
        expected, dequantized = tensors_of(src), load_file(str(oracle / "model.safetensors"))
        for name, w in expected.items():
            if ".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight")):
                err = (dequantized[name] - w).norm() / w.norm()
                assert 0 <= err < 0.1, (name, err)


@pytest.mark.parametrize("family", ["deepseek_v2", "deepseek_v3"])
def test_quantizer_layer_is_the_hf_layer(family, tiny_dir):
    """The quantizer's layer (MLA from kernels/mla_attention's references, DeepSeek's routing from kernels/moe,
    ungated shared experts) against HF's decoder layers: the dense first one and an MoE one."""
    from engc.compiler.quantize.mla_layer import MlaLayer
    layers = assert_layers_match_hf(source(family, tiny_dir), torch.tensor([IDS[:20]]))
    assert all(isinstance(layer, MlaLayer) for layer in layers)
    assert [layer.moe is None for layer in layers] == [True, False]   # first_k_dense_replace = 1


def test_engc_quantize_of_deepseek_is_awq_by_default(tiny_dir, tmp_path):
    """`engc quantize` of DeepSeek with the default method: an AWQ checkpoint, whose float kv_b_proj carries
    o_proj's scales in its value rows (its key rows as the source's)."""
    from test_quant_bad_input import quantize
    src = source("deepseek_v2", tiny_dir)
    result = quantize(src, tmp_path, "--calib-samples", "4", "--calib-seqlen", "32")
    assert result.exit_code == 0, result.output
    assert json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["quant_method"] == "awq"
    cfg = json.loads((src / "config.json").read_text())
    heads, nope = cfg["num_attention_heads"], cfg["qk_nope_head_dim"]
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    before, after = (tensors_of(f)[kv_b].view(heads, nope + cfg["v_head_dim"], -1) for f in (src, tmp_path / "o"))
    assert torch.equal(after[:, :nope], before[:, :nope])
    assert not torch.allclose(after[:, nope:], before[:, nope:])


@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_awq_scales_leave_the_float_mla_layers_and_their_routing_unchanged(variant, tiny_dir, monkeypatch):
    """AWQ's scales folded alone (the clipping, which does change weights, left out), in the dense first layer and
    an MoE one: input_layernorm divided by s and q (or q_a) and kv_a multiplied by it, q_a_layernorm and q_b_proj
    likewise, kv_b_proj's value rows divided by o_proj's s (its key rows as they were), the MLP's as every family's.
    The float layer's output and the experts each token is routed to are as they were."""
    from test_moe_quantize import layer_maker, outlier_inputs
    from engc.compiler.quantize import awq
    from engc.compiler.quantize.experts import awq_experts
    from engc.compiler.quantize.mla_layer import KV_B, O, Q_A_NORM
    monkeypatch.setattr(awq, "clip_weight", lambda w, *args: w)
    family, overrides = MLA_VARIANTS[variant]
    for index in (0, 1):   # first_k_dense_replace = 1
        make, _ = layer_maker(tiny_dir(family, **overrides), index)
        ref, layer = make(), make()
        c = ref.cfg
        x, _ = outlier_inputs(c.hidden_size)
        with torch.no_grad():
            if ref.moe is None:
                awq.awq_layer(layer, x, 32, grid=4)
            else:
                awq.awq_attention(layer, x, 32, grid=4)
                awq_experts(layer, x, 32, grid=4)
            assert torch.allclose(layer.forward(x), ref.forward(x), atol=1e-5, rtol=1e-5), index
            for norm in ["input_layernorm", ref.mlp_norm] + [Q_A_NORM] * bool(c.q_lora_rank):
                s = ref.w[norm + ".weight"] / layer.w[norm + ".weight"]
                assert s.max() / s.min() > 1.5, norm   # the channels' scales differ: the fold moved the weights
            kv_b = {L: L.w[KV_B + ".weight"].view(c.num_heads, c.qk_nope_head_dim + c.v_head_dim, -1)
                    for L in (ref, layer)}
            s = layer.w[O + ".weight"][0] / ref.w[O + ".weight"][0]
            assert s.max() / s.min() > 1.5
            assert torch.equal(kv_b[layer][:, :c.qk_nope_head_dim], kv_b[ref][:, :c.qk_nope_head_dim])
            assert torch.allclose(kv_b[layer][:, c.qk_nope_head_dim:] * s.view(c.num_heads, c.v_head_dim, 1),
                                  kv_b[ref][:, c.qk_nope_head_dim:], rtol=1e-5, atol=1e-7)
            if ref.moe is not None:
                h_ref, h = (L.mlp_in(x + L.attention(L.attn_in(x))).reshape(-1, c.hidden_size) for L in (ref, layer))
                assert torch.equal(layer.moe.routed(layer, h)[1], ref.moe.routed(ref, h_ref)[1])


@pytest.mark.parametrize("variant", list(MLA_VARIANTS))
def test_awq_of_latent_attention_beats_rtn_on_outlier_channels(variant, tiny_dir):
    """On held-out inputs with outlier channels (the calibration's distribution), AWQ's scales and clipping bring
    an MoE layer's latent attention output, and the dense first layer's whole output, closer to the float layer's
    than RTN's (every projection quantized RTN after AWQ's search)."""
    from test_moe_quantize import layer_maker, outlier_inputs
    from engc.compiler.quantize.awq import awq_attention, awq_layer
    from engc.compiler.quantize.rtn import quantize_rtn
    family, overrides = MLA_VARIANTS[variant]
    err = {}
    for index in (0, 1):
        make, linears = layer_maker(tiny_dir(family, **overrides), index)
        ref, rtn, layer_awq = make(), make(), make()
        calib, held = outlier_inputs(ref.cfg.hidden_size)
        with torch.no_grad():
            (awq_layer if ref.moe is None else awq_attention)(layer_awq, calib, 32)
            for L in (rtn, layer_awq):
                for n in linears:
                    L.w[n + ".weight"] = quantize_rtn(L.w[n + ".weight"], 32).dequantize()
            out = (lambda L: L.forward(held)) if ref.moe is None else (lambda L: L.attention(L.attn_in(held)))
            want = out(ref)
            err[index] = {k: (out(L) - want).pow(2).mean().item() for k, L in (("rtn", rtn), ("awq", layer_awq))}
    for e in err.values():
        assert e["awq"] < 0.7 * e["rtn"], err   # measured 0.46-0.52x


def test_dequantized_act_order_projection_is_in_channel_order():
    """An act-order int4 kv_b_proj or shared expert (GPTQ desc_act: its input columns sorted by group, `perm`
    saying which input each sorted column reads) is dequantized back into the checkpoint's channel order."""
    from engc.compiler.frontend.quantized import dequantized
    from engc.kernels.int4_linear import pack_int4
    gen = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 16, (8, 64), generator=gen, dtype=torch.uint8)
    scales, zeros = torch.rand(8, 2, generator=gen) + 0.5, torch.randint(0, 16, (8, 2), generator=gen, dtype=torch.uint8)
    perm = torch.randperm(64, generator=gen)
    sorted_w = (codes.float() - zeros.float().repeat_interleave(32, 1)) * scales.repeat_interleave(32, 1)
    tensors = {"p.qweight": pack_int4(codes), "p.scales": scales, "p.zeros": zeros, "p.perm": perm}
    w = dequantized(tensors.__getitem__, tensors.__contains__, "p", {"group_size": 32}, 64)()
    assert torch.equal(w[:, perm], sorted_w)   # x @ w.T == x[:, perm] @ sorted_w.T, QLinear's act-order math

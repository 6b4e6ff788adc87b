"""engc quantize of MoE models: each expert quantized one by one (RTN, GPTQ from its routed tokens), written
one int4 projection per expert, built into the MoE op's int4 stacks; the oracle is HF's float model of the
dequantized weights."""
from __future__ import annotations

import json

import pytest
import torch

from engc.compiler.build import BuildOptions, build
from engc.errors import UserError
from engc.kernels.moe import moe
from test_moe import PROMPT_IDS, _assert_matches_hf, _fuse_experts

transformers = pytest.importorskip("transformers")


@pytest.mark.parametrize("family,fused,method", [
    ("qwen3_moe", False, "rtn"), ("qwen2_moe", False, "rtn"), ("mixtral", True, "rtn"),
    ("qwen3_moe", False, "gptq"), ("qwen2_moe", False, "gptq")],
    ids=["qwen3_moe-rtn", "qwen2_moe-shared-expert-and-dense-layer-rtn", "mixtral-fused-experts-rtn",
         "qwen3_moe-gptq", "qwen2_moe-gptq"])
def test_quantize_quantizes_each_expert_and_builds(family, fused, method, tiny_dir, tmp_path):
    """engc quantize writes one int4 projection per expert (from fused experts too), engc build stacks them for
    the MoE op, and the bundle decodes as HF's float model of the dequantized weights (the unpacking in
    test_quant_e2e, written from the GPTQ format independently of engc's)."""
    from safetensors.torch import load_file, save_file
    from test_quant_e2e import dequant_gptq
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    src = _fuse_experts(tiny_dir(family), tmp_path / "fused", family) if fused else tiny_dir(family)
    calib = dict(calib_samples=8, calib_seqlen=32) if method == "gptq" else {}
    quantize_checkpoint(str(src), tmp_path / "q", QuantOptions(method=method, group_size=32, **calib))
    tensors = {}
    for f in sorted((tmp_path / "q").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    experts = {k for k in tensors if ".experts." in k}
    assert experts and all(k.endswith(("qweight", "qzeros", "scales", "g_idx")) for k in experts)
    assert not any("shared_expert" in k and k.endswith("qweight") for k in tensors)   # kept float
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    # the oracle: the dequantized weights as a float checkpoint of the same family
    state = {k: v.float() for k, v in tensors.items() if not k.endswith(("qweight", "qzeros", "scales", "g_idx"))}
    for name in [k[:-len("qweight")] for k in tensors if k.endswith("qweight")]:
        state[name + "weight"] = dequant_gptq(tensors, name).contiguous()
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    save_file(state, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((tmp_path / "q/config.json").read_text())
    cfg.pop("quantization_config")
    (oracle / "config.json").write_text(json.dumps(cfg))
    _assert_matches_hf(tmp_path / "b", oracle, PROMPT_IDS)


def test_quantize_refuses_what_it_cannot_calibrate(tiny_dir, tmp_path):
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    with pytest.raises(UserError, match="rtn or gptq, not awq"):
        quantize_checkpoint(str(tiny_dir("qwen3_moe")), tmp_path / "q", QuantOptions(method="awq", group_size=32))
    with pytest.raises(UserError, match="rtn, not gptq"):   # OLMoE's whole-projection q/k norm
        quantize_checkpoint(str(tiny_dir("olmoe")), tmp_path / "q", QuantOptions(method="gptq", group_size=32))


def test_quantizer_moe_layer_computes_the_moe_op(tiny_dir):
    """GPTQ's next layer sees the quantized layer through MoeMlp: it must be the MoE op's math (the shared
    expert and its gate included), on the per-expert weights the quantizer holds."""
    from safetensors.torch import load_file
    from engc.compiler.quantize.experts import MoeMlp, moe_linears
    from engc.compiler.quantize.layer import DecoderLayer
    src = tiny_dir("qwen2_moe")
    hf = json.loads((src / "config.json").read_text())
    tensors = load_file(str(next(src.glob("*.safetensors"))))
    prefix = "model.layers.0."
    weights = {k[len(prefix):]: v.float() for k, v in tensors.items() if k.startswith(prefix)}
    linears = moe_linears(hf, 0, weights, {k: v.dtype for k, v in weights.items()})
    layer = DecoderLayer(None, weights, None)
    mlp = MoeMlp(hf, linears)
    h = torch.randn(2, 7, 64)
    experts = [f"mlp.experts.{e}." for e in range(4)]
    w = lambda n: weights[n + ".weight"]  # noqa: E731
    expected = moe(h.reshape(-1, 64), w("mlp.gate"),
                   torch.stack([torch.cat([w(e + "gate_proj"), w(e + "up_proj")]) for e in experts]),
                   torch.stack([w(e + "down_proj") for e in experts]),
                   torch.cat([w("mlp.shared_expert.gate_proj"), w("mlp.shared_expert.up_proj")]),
                   w("mlp.shared_expert.down_proj"), w("mlp.shared_expert_gate"),
                   top_k=2, renormalize=0, has_shared_expert=1)
    assert torch.allclose(mlp(layer, h).reshape(-1, 64), expected, atol=1e-6)


def test_gptq_experts_beat_rtn_on_the_moe_output(tiny_dir):
    """Each expert's GPTQ from the tokens routed to it: on held-out inputs of the calibration's distribution
    (channels of very different scales, as real activations have), the MoE output is closer to the float
    layer's than with RTN experts (the same RTN attention in both)."""
    from safetensors.torch import load_file
    from engc.compiler.frontend.decoder import resolve_config
    from engc.compiler.frontend.rope import inv_freq
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.experts import MoeMlp, gptq_experts, moe_linears
    from engc.compiler.quantize.formats import to_gptq
    from engc.compiler.quantize.layer import DecoderLayer
    from engc.compiler.quantize.rtn import quantize_rtn
    src = tiny_dir("qwen3_moe")
    hf = json.loads((src / "config.json").read_text())
    cfg = resolve_config(hf)
    rope = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    tensors = load_file(str(next(src.glob("*.safetensors"))))

    def layer0():
        w = {k[len("model.layers.0."):]: v.float() for k, v in tensors.items() if k.startswith("model.layers.0.")}
        linears = moe_linears(hf, 0, w, {k: v.dtype for k, v in w.items()})
        layer = DecoderLayer(cfg, w, rope)
        layer.moe = MoeMlp(hf, linears)
        return layer, linears

    g = torch.Generator().manual_seed(0)
    scale = torch.exp(1.5 * torch.randn(64, generator=g))
    calib, held = torch.randn(16, 32, 64, generator=g) * scale, torch.randn(8, 32, 64, generator=g) * scale
    (ref, linears), (rtn, _), (gptq, _) = layer0(), layer0(), layer0()
    for n in linears[:4]:
        rtn.w[n + ".weight"] = gptq.w[n + ".weight"] = quantize_rtn(ref.w[n + ".weight"], 32).dequantize()
    for n in linears[4:]:
        rtn.w[n + ".weight"] = quantize_rtn(rtn.w[n + ".weight"], 32).dequantize()
    gptq_experts(gptq, calib, QuantOptions(method="gptq", group_size=32), to_gptq)
    h = gptq.mlp_in(held + gptq.attention(gptq.attn_in(held)))
    want = ref.moe(ref, h)
    err = {name: float((q.moe(q, h) - want).norm() / want.norm()) for name, q in (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < 0.97 * err["rtn"], err

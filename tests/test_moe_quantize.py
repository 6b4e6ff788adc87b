"""engc quantize of MoE models: each expert quantized one by one (RTN, GPTQ from its routed tokens, AWQ's one scale
over the MLP's input for all experts, then each expert's down scale and clipping from its routed tokens), written
one int4 projection per expert, built into the MoE op's int4 stacks; the oracle is HF's float model of the
dequantized weights."""
from __future__ import annotations

import json

import pytest
import torch

from engc.compiler.build import BuildOptions, build
from engc.kernels.moe import glu, moe
from test_moe import PROMPT_IDS, _assert_matches_hf, _fuse_experts

transformers = pytest.importorskip("transformers")

AWQ_CALIB = dict(calib_samples=8, calib_seqlen=32, awq_grid=10)


# a tiny Qwen2-MoE's shared expert 64 wide: its down's inputs fit the engc int4 layout, so it is quantized
# (the default tiny one's 48 keep it float)
INT4_SHARED = {"shared_expert_intermediate_size": 64}


@pytest.mark.parametrize("family,fused,method,config", [
    ("qwen3_moe", False, "rtn", {}), ("qwen2_moe", False, "rtn", {}), ("mixtral", True, "rtn", {}),
    ("qwen3_moe", False, "gptq", {}), ("qwen2_moe", False, "gptq", {}),
    ("qwen2_moe", False, "awq", {}), ("mixtral", True, "awq", {}), ("olmoe", False, "gptq", {}),
    ("olmoe", False, "awq", {}), ("qwen2_moe", False, "rtn", INT4_SHARED), ("qwen2_moe", False, "gptq", INT4_SHARED),
    ("qwen2_moe", False, "awq", INT4_SHARED), ("glm4_moe", False, "gptq", {}), ("glm4_moe", False, "awq", {}),
    ("ernie4_5_moe", False, "gptq", {})],
    ids=["qwen3_moe-rtn", "qwen2_moe-float-shared-expert-and-dense-layer-rtn", "mixtral-fused-experts-rtn",
         "qwen3_moe-gptq", "qwen2_moe-float-shared-expert-gptq",
         "qwen2_moe-float-shared-expert-and-dense-layer-awq", "mixtral-fused-experts-awq",
         "olmoe-qk-norm-over-the-projection-gptq", "olmoe-qk-norm-over-the-projection-awq",
         "qwen2_moe-int4-shared-expert-rtn", "qwen2_moe-int4-shared-expert-gptq", "qwen2_moe-int4-shared-expert-awq",
         "glm4_moe-grouped-sigmoid-routing-partial-rotary-gptq", "glm4_moe-grouped-sigmoid-routing-partial-rotary-awq",
         "ernie4_5_moe-softmax-scores-correction-bias-gptq"])
def test_quantize_quantizes_each_expert_and_builds(family, fused, method, config, tiny_dir, tmp_path):
    """engc quantize writes one int4 projection per expert (from fused experts too), engc build stacks them for
    the MoE op, and the bundle decodes as HF's float model of the dequantized weights (the unpacking in
    test_quant_e2e, written from the AWQ and GPTQ formats independently of engc's). A shared expert is int4 where
    the engc int4 layout holds it (built as the dense MLP's QLinear projections), its sigmoid gate float; one
    48 wide stays float, and modules_to_not_convert names what stayed float."""
    from safetensors.torch import load_file
    from test_quant_families import oracle_of
    from engc.bundle.program import parse_program
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.stream import quantize_checkpoint
    # the int4 layout's inputs are whole 32-wide chunks: the tiny OLMoE's experts are 16 wide
    src = tiny_dir(family, **({"intermediate_size": 32} if family == "olmoe" else {}), **config)
    src = _fuse_experts(src, tmp_path / "fused", family) if fused else src
    calib = {"gptq": dict(calib_samples=8, calib_seqlen=32), "awq": AWQ_CALIB}.get(method, {})
    quantize_checkpoint(str(src), tmp_path / "q", QuantOptions(method=method, group_size=32, **calib))
    tensors = {}
    for f in sorted((tmp_path / "q").glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    experts = {k for k in tensors if ".experts." in k}
    assert experts and all(k.endswith(("qweight", "qzeros", "scales", "g_idx")) for k in experts)
    qc = json.loads((tmp_path / "q/config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == ("awq" if method == "awq" else "gptq")
    shared = {k.split(".mlp.")[1] for k in tensors if ".layers.0.mlp.shared_expert" in k}
    if config:   # packed as each expert's projections are; the sigmoid gate float
        packed = {k.rsplit(".", 1)[1] for k in tensors if ".layers.0.mlp.experts.0.down_proj." in k}
        assert shared == {"shared_expert_gate.weight"} | {
            f"shared_expert.{n}_proj.{part}" for n in ("gate", "up", "down") for part in packed}
        assert qc["modules_to_not_convert"] == ["shared_expert_gate"]
    elif family == "qwen2_moe":
        assert not any(k.endswith("qweight") for k in shared) and shared
        assert qc["modules_to_not_convert"] == ["shared_expert"]
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    if config:
        nodes = parse_program((tmp_path / "b/program.onnx").read_bytes()).nodes
        ops = {n.op for n in nodes if n.outputs[0].startswith("layers.0.shared_expert.")}
        assert ops and all(op.startswith("QLinear") for op in ops), ops
    # the oracle: the dequantized weights as a float checkpoint of the same family
    _assert_matches_hf(tmp_path / "b", oracle_of(tmp_path / "q", None, tmp_path), PROMPT_IDS)


@pytest.mark.parametrize("family", ["olmoe", "qwen3_moe", "glm4_moe", "ernie4_5_moe"])
def test_quantizer_moe_layer_is_the_hf_layer(family, tiny_dir):
    """The quantizer's MoE layers against HF's decoder layers on the same input: OLMoE's q/k norms over the whole
    projection and its unrenormalized top-8 routing, Qwen3-MoE's per-head q/k norms and renormalized routing,
    GLM-4.5's grouped sigmoid routing and shared expert after its dense first layer (with its q/k norm on),
    ERNIE 4.5's softmax scores with a correction bias in its range of MoE layers."""
    from test_quant_families import assert_layers_match_hf
    src = tiny_dir(family, **({"use_qk_norm": True} if family == "glm4_moe" else {}))
    layers = assert_layers_match_hf(src, torch.tensor([PROMPT_IDS[0] * 3]))
    moe_layers = {"glm4_moe": [1], "ernie4_5_moe": [1]}.get(family, range(len(layers)))
    assert [i for i, layer in enumerate(layers) if layer.moe is not None] == list(moe_layers)


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
    x = h.reshape(-1, 64)
    shared = glu(x, torch.cat([w("mlp.shared_expert.gate_proj"), w("mlp.shared_expert.up_proj")]),
                 w("mlp.shared_expert.down_proj"))   # the program's dense MLP beside the node
    expected = moe(x, w("mlp.gate"), torch.stack([torch.cat([w(e + "gate_proj"), w(e + "up_proj")]) for e in experts]),
                   torch.stack([w(e + "down_proj") for e in experts]), shared, w("mlp.shared_expert_gate"),
                   top_k=2, renormalize=0, has_shared_expert=1)
    assert torch.allclose(mlp(layer, h).reshape(-1, 64), expected, atol=1e-6)


@pytest.mark.parametrize("family,config", [("qwen3_moe", {}), ("qwen2_moe", INT4_SHARED)],
                         ids=["qwen3_moe", "qwen2_moe-int4-shared-expert"])
def test_gptq_experts_beat_rtn_on_the_moe_output(family, config, tiny_dir):
    """Each expert's GPTQ from the tokens routed to it, the shared expert's from all: on held-out inputs of the
    calibration's distribution (channels of very different scales, as real activations have), the MoE output
    is closer to the float layer's than with RTN experts (the same RTN attention in both), and so is the
    shared expert's own output."""
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.experts import gptq_experts
    from engc.compiler.quantize.formats import to_gptq
    from engc.compiler.quantize.rtn import quantize_rtn
    make, linears = layer_maker(tiny_dir(family, **config))

    g = torch.Generator().manual_seed(0)
    scale = torch.exp(1.5 * torch.randn(64, generator=g))
    calib, held = torch.randn(16, 32, 64, generator=g) * scale, torch.randn(8, 32, 64, generator=g) * scale
    ref, rtn, gptq = make(), make(), make()
    for n in linears[:4]:
        rtn.w[n + ".weight"] = gptq.w[n + ".weight"] = quantize_rtn(ref.w[n + ".weight"], 32).dequantize()
    for n in linears[4:]:
        rtn.w[n + ".weight"] = quantize_rtn(rtn.w[n + ".weight"], 32).dequantize()
    gptq_experts(gptq, calib, QuantOptions(method="gptq", group_size=32), to_gptq)
    h = gptq.mlp_in(held + gptq.attention(gptq.attn_in(held)))
    want = ref.moe(ref, h)
    err = {name: float((q.moe(q, h) - want).norm() / want.norm()) for name, q in (("rtn", rtn), ("gptq", gptq))}
    assert err["gptq"] < 0.97 * err["rtn"], err
    if config:
        assert gptq.moe.quantized_shared and linears[-3:] == gptq.moe.shared
        want = ref.moe.shared_out(ref, h)
        err = {name: float((q.moe.shared_out(q, h) - want).norm() / want.norm())
               for name, q in (("rtn", rtn), ("gptq", gptq))}
        assert err["gptq"] < 0.97 * err["rtn"], err   # measured 0.92x


def layer_maker(src, index: int = 0):
    """(make, linears): make() is the quantizer's layer `index` of the checkpoint src as stream.quantize_layer
    reads it (the build's view of the weights, experts one per name), with fresh weight dicts each call."""
    from engc.compiler.build import read_source
    from engc.compiler.frontend.decoder import _rope_table, resolve_config
    from engc.compiler.quantize.stream import calibration_layer, llama_view
    source = read_source(str(src))
    cfg = resolve_config(source.hf_config)
    view = llama_view(source, cfg)
    rope = (_rope_table(cfg, cfg.rope_theta, cfg.rope_scaling), None)
    prefix = f"model.layers.{index}."
    weights = {n[len(prefix):]: view.get(n).float() for n in view.names() if n.startswith(prefix)}
    dtypes = {k: v.dtype for k, v in weights.items()}

    def make():
        return calibration_layer(view.hf_config, cfg, rope, index, dict(weights), dict(dtypes))
    return (lambda: make()[0]), make()[1]


def outlier_inputs(hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Calibration [16, 32, hidden] and held-out [8, 32, hidden] layer inputs whose first four channels are 20x
    the others, as real activations have outlier channels (seeded)."""
    g = torch.Generator().manual_seed(0)
    scale = torch.ones(hidden)
    scale[:4] = 20
    return torch.randn(16, 32, hidden, generator=g) * scale, torch.randn(8, 32, hidden, generator=g) * scale


@pytest.mark.parametrize("family,readers,config", [
    ("qwen2_moe", ["mlp.gate", "mlp.shared_expert_gate", "mlp.shared_expert.gate_proj", "mlp.shared_expert.up_proj"],
     {}),
    ("qwen2_moe", ["mlp.gate", "mlp.shared_expert_gate"], INT4_SHARED),
    ("qwen3_moe", ["mlp.gate"], {}), ("mixtral", ["block_sparse_moe.gate"], {})],
    ids=["qwen2_moe-float-shared-expert", "qwen2_moe-int4-shared-expert", "qwen3_moe", "mixtral"])
def test_awq_expert_scales_leave_the_float_layer_and_its_routing_unchanged(family, readers, config, tiny_dir,
                                                                          monkeypatch):
    """AWQ's scales folded alone (the clipping, which does change weights, left out): the MLP's input norm divided
    by s, every expert's gate and up multiplied by it (an int4 shared expert's too), and the other readers of the
    norm's output compensated (the router's columns, Qwen2-MoE's sigmoid gate of the shared expert, a float shared
    expert), so the float layer's output and the experts each calibration token is routed to are as they were."""
    from engc.compiler.quantize import awq
    from engc.compiler.quantize.experts import awq_experts
    monkeypatch.setattr(awq, "clip_weight", lambda w, *args: w)
    make, linears = layer_maker(tiny_dir(family, **config))
    ref, layer = make(), make()
    x, _ = outlier_inputs(ref.cfg.hidden_size)
    with torch.no_grad():
        awq.awq_attention(layer, x, 32, grid=4)
        awq_experts(layer, x, 32, grid=4)
        norm = ref.mlp_norm + ".weight"
        s = ref.w[norm] / layer.w[norm]
        assert s.max() / s.min() > 1.5   # the channels' scales differ: the fold moved the weights
        assert layer.moe.float_readers(layer) == readers
        for n in readers:
            assert torch.allclose(layer.w[n + ".weight"], ref.w[n + ".weight"] * s, rtol=1e-5)
        for gate in (linears[4], *(["mlp.shared_expert.gate_proj"] if config else [])):   # searched with s
            assert torch.allclose(layer.w[gate + ".weight"], ref.w[gate + ".weight"] * s, rtol=1e-5)
        assert torch.allclose(layer.forward(x), ref.forward(x), atol=1e-5, rtol=1e-5)
        h_ref, h = (L.mlp_in(x + L.attention(L.attn_in(x))).reshape(-1, x.shape[-1]) for L in (ref, layer))
        want = ref.moe(ref, h_ref)
        assert (layer.moe(layer, h) - want).abs().max() < 1e-5 * want.abs().max()   # the MLP's own, not the residual's
        assert torch.equal(layer.moe.routed(layer, h)[1], ref.moe.routed(ref, h_ref)[1])


@pytest.mark.parametrize("family,config", [("qwen3_moe", {}), ("qwen2_moe", {}), ("qwen2_moe", INT4_SHARED),
                                           ("mixtral", {})],
                         ids=["qwen3_moe", "qwen2_moe-float-shared-expert", "qwen2_moe-int4-shared-expert", "mixtral"])
def test_awq_experts_beat_rtn_on_outlier_channels(family, config, tiny_dir):
    """On held-out inputs with outlier channels (the calibration's distribution), AWQ's experts (and int4 shared
    expert) bring the MoE output closer to the float layer's than RTN's (the same RTN attention before both), and
    AWQ's whole layer (its attention's scales too) the layer's output."""
    from engc.compiler.quantize.awq import awq_attention
    from engc.compiler.quantize.experts import awq_experts
    from engc.compiler.quantize.rtn import quantize_rtn
    make, linears = layer_maker(tiny_dir(family, **config))
    ref, rtn, experts_awq, layer_awq = make(), make(), make(), make()
    calib, held = outlier_inputs(ref.cfg.hidden_size)

    def rtn_of(layer, names):
        for n in names:
            layer.w[n + ".weight"] = quantize_rtn(layer.w[n + ".weight"], 32).dequantize()

    with torch.no_grad():
        rtn_of(rtn, linears)
        rtn_of(experts_awq, linears[:4])
        awq_experts(experts_awq, calib, 32)
        rtn_of(experts_awq, linears[4:])
        awq_attention(layer_awq, calib, 32)
        awq_experts(layer_awq, calib, 32)
        rtn_of(layer_awq, linears)
        x_mid = held + rtn.attention(rtn.attn_in(held))   # the RTN attention: experts_awq's too
        want = ref.moe(ref, ref.mlp_in(x_mid))
        moe = {k: (L.moe(L, L.mlp_in(x_mid)) - want).pow(2).mean().item()
               for k, L in (("rtn", rtn), ("awq", experts_awq))}
        want = ref.forward(held)
        whole = {k: (L.forward(held) - want).pow(2).mean().item() for k, L in (("rtn", rtn), ("awq", layer_awq))}
    assert moe["awq"] < 0.7 * moe["rtn"], moe       # measured 0.47-0.49x
    assert whole["awq"] < 0.7 * whole["rtn"], whole   # measured 0.43-0.50x


def test_awq_expert_no_calibration_token_reaches_is_rtn_and_builds(tiny_dir, tmp_path):
    """32 experts, top-2, calibrated on 8 tokens: at most 16 experts a layer see a calibration token, so at least
    16 do not. Their down_proj keeps s = 1 and no clipping: its codes, zeros and scales are RTN's of the float
    weight, where a reached expert's are not. The bundle decodes prompts that reach such an expert as HF's float
    model of the dequantized weights."""
    from safetensors.torch import load_file
    from test_quant_e2e import dequant_awq
    from test_quant_families import oracle_of
    from engc.compiler.quantize import QuantOptions
    from engc.compiler.quantize.formats import to_awq
    from engc.compiler.quantize.rtn import quantize_rtn
    from engc.compiler.quantize.stream import quantize_checkpoint
    src = tiny_dir("qwen3_moe", num_experts=32)
    quantize_checkpoint(str(src), tmp_path / "q", QuantOptions(method="awq", group_size=32, calib_samples=1,
                                                               calib_seqlen=8, awq_grid=10))
    source = load_file(str(next(src.glob("*.safetensors"))))
    written = {k: v for f in sorted((tmp_path / "q").glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    unreached = {}
    for i in range(2):
        down = [f"model.layers.{i}.mlp.experts.{e}.down_proj." for e in range(32)]
        unreached[i] = {e for e, p in enumerate(down) if torch.equal(
            dequant_awq(written, p, 32), dequant_awq(to_awq(quantize_rtn(source[p + "weight"], 32)), "", 32))}
        assert 16 <= len(unreached[i]) < 32, (i, sorted(unreached[i]))
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    oracle = oracle_of(tmp_path / "q", None, tmp_path)
    model = transformers.AutoModelForCausalLM.from_pretrained(oracle, dtype=torch.float32).eval()
    routed = []
    hook = model.model.layers[0].mlp.gate.register_forward_hook(lambda m, args, out: routed.append(out[-1]))
    with torch.no_grad():
        for ids in PROMPT_IDS:
            model(torch.tensor([ids]))
    hook.remove()
    assert unreached[0] & set(torch.cat(routed).flatten().tolist())   # the prompts use an uncalibrated expert
    _assert_matches_hf(tmp_path / "b", oracle, PROMPT_IDS)

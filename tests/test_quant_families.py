"""engc build of pre-quantized fused (Phi-3) and grouped (InternLM2) checkpoints.

The oracle is transformers' float32 model with the weights dequantized from the written files by
test_quant_e2e's unpacking (written from the AWQ / GPTQ format descriptions, not from engc's code), in the
source family's own tensor names: a checkpoint that unpacks into the family's float checkpoint is one that
other tools read as that family's. transformers has no InternLM2 class; InternLM2 is Llama's network under a
grouped `wqkv` (test_dense_families), so its oracle is HF Llama on the ungrouped weights.
"""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from engc.compiler.build import BuildOptions, build
from test_dense_families import _internlm2_tensors, _relaid
from test_quant_e2e import bundle_logits, dequant_awq, dequant_gptq

transformers = pytest.importorskip("transformers")

CALIB = dict(calib_samples=4, calib_seqlen=32, awq_grid=10)
IDS = list(range(3, 40))   # longer than the tiny models' sliding window of 8
PACKED = ("qweight", "qzeros", "scales", "g_idx")


@pytest.fixture(scope="module")
def internlm2_src(tmp_path_factory):
    """A tiny InternLM2 checkpoint (two q heads a KV head) and the HF Llama checkpoint it re-lays."""
    from tiny_models import make_tiny
    llama = make_tiny("llama", tmp_path_factory.mktemp("llama"), seed=5, rope_scaling=None)
    cfg = json.loads((llama / "config.json").read_text())
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    internlm2 = {k: cfg[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                     "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
                                     "rms_norm_eps", "tie_word_embeddings", "bos_token_id", "eos_token_id")}
    internlm2.update(model_type="internlm2", architectures=["InternLM2ForCausalLM"], bias=False, hidden_act="silu",
                     rope_theta=cfg["rope_parameters"]["rope_theta"], rope_scaling=None)
    folder = tmp_path_factory.mktemp("internlm2") / "m"
    _relaid(llama, folder, internlm2, lambda t: _internlm2_tensors(t, heads, kv, cfg["hidden_size"] // heads))
    return folder, llama


def source_of(family, tiny_dir, internlm2_src):
    return internlm2_src[0] if family == "internlm2" else tiny_dir(family)


def _llama_of_internlm2(state: dict, cfg: dict) -> dict:
    """An InternLM2 state dict under HF Llama's names, wqkv ungrouped (test_dense_families' re-lay, inverted)."""
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, group = cfg["hidden_size"] // heads, heads // kv
    names = {"attention.wo": "self_attn.o_proj", "feed_forward.w1": "mlp.gate_proj", "feed_forward.w3": "mlp.up_proj",
             "feed_forward.w2": "mlp.down_proj", "attention_norm": "input_layernorm",
             "ffn_norm": "post_attention_layernorm"}
    out = {}
    for k, v in state.items():
        k = k.replace("model.tok_embeddings.", "model.embed_tokens.").replace("output.", "lm_head.")
        for old, new in names.items():
            k = k.replace(f".{old}.", f".{new}.")
        if k.endswith("attention.wqkv.weight"):
            p = k[:-len("attention.wqkv.weight")]
            rows = v.reshape(kv, group + 2, hd, v.shape[-1])
            for n, part in (("q", rows[:, :group]), ("k", rows[:, group]), ("v", rows[:, group + 1])):
                out[f"{p}self_attn.{n}_proj.weight"] = part.reshape(-1, v.shape[-1]).contiguous()
        else:
            out[k] = v
    return out


def oracle_of(folder, internlm2_src, tmp_path):
    """The written checkpoint dequantized into a float HF checkpoint the oracle loads (InternLM2: HF Llama's)."""
    cfg = json.loads((folder / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    tensors = {}
    for f in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    state = {k: v.float() for k, v in tensors.items() if not k.endswith(PACKED)}
    for name in [k[:-len("qweight")] for k in tensors if k.endswith("qweight")]:
        w = dequant_awq(tensors, name, qc["group_size"]) if qc["quant_method"] == "awq" else dequant_gptq(tensors, name)
        state[name + "weight"] = w.contiguous()
    oracle = tmp_path / "oracle"
    oracle.mkdir()
    if cfg["model_type"] == "internlm2":
        state = _llama_of_internlm2(state, cfg)
        cfg = json.loads((internlm2_src[1] / "config.json").read_text())
    save_file(state, str(oracle / "model.safetensors"), metadata={"format": "pt"})
    (oracle / "config.json").write_text(json.dumps(cfg))
    return oracle


def hf_logits(folder) -> torch.Tensor:
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([IDS])).logits[0]


def assert_bundle_matches(bundle, oracle):
    ours, theirs = bundle_logits(bundle, IDS), hf_logits(oracle)
    assert torch.allclose(ours, theirs, atol=2e-4, rtol=1e-4), (ours - theirs).abs().max()
    assert (ours.argmax(-1) == theirs.argmax(-1)).all()




def awq_pack(w: torch.Tensor, group: int) -> dict:
    """w [out, in] min/max-quantized per group and packed as AutoAWQ GEMM writes it (this file's own packing)."""
    order = [0, 2, 4, 6, 1, 3, 5, 7]
    g = w.T.reshape(-1, group, w.shape[0])                          # [groups, group, out]
    lo, hi = g.amin(1).clamp(max=0), g.amax(1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).half()
    zeros = torch.round(-lo / scales.float()).clamp(0, 15)
    q = torch.round(g / scales.float()[:, None] + zeros[:, None]).clamp(0, 15).reshape(w.shape[1], -1)

    def pack(codes):   # [rows, out] -> int32 [rows, out / 8], nibble i holding column order[i] of its 8
        codes = codes.to(torch.int64).reshape(codes.shape[0], -1, 8)[..., order]
        return sum(codes[..., i] << (4 * i) for i in range(8)).to(torch.int32).contiguous()
    return {"qweight": pack(q), "qzeros": pack(zeros), "scales": scales.contiguous()}


@pytest.mark.parametrize("family", ["phi3", "internlm2"])
def test_prequantized_fused_checkpoint_builds(family, tiny_dir, internlm2_src, tmp_path):
    """An AWQ checkpoint as AutoAWQ writes these families: phi3's qkv_proj and gate_up_proj, internlm2's
    grouped wqkv quantized whole."""
    src = source_of(family, tiny_dir, internlm2_src)
    tensors = {}
    for f in src.glob("*.safetensors"):
        tensors.update(load_file(str(f)))
    out = {}
    for k, v in tensors.items():
        if ".layers." in k and k.endswith(".weight") and v.dim() == 2:
            out.update({k[:-len("weight")] + part: t for part, t in awq_pack(v, 32).items()})
        else:
            out[k] = v
    assert "model.layers.0.self_attn.qkv_proj.qweight" in out or "model.layers.0.attention.wqkv.qweight" in out
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm"}
    _relaid(src, tmp_path / "q", cfg, lambda t: out)
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    assert_bundle_matches(tmp_path / "b", oracle_of(tmp_path / "q", internlm2_src, tmp_path))

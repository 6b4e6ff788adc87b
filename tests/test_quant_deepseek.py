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
from engc.compiler.frontend.decoder import _rope_table, resolve_config
from engc.compiler.quantize import QuantOptions
from engc.compiler.quantize.stream import first_layer_input, llama_view, quantize_checkpoint
from test_dense_families import _relaid
from test_quant_families import CALIB, IDS, assert_bundle_matches, awq_pack, oracle_of

transformers = pytest.importorskip("transformers")

OVERRIDES = {"deepseek_v2": {}, "deepseek_v3": {"q_lora_rank": 32}}


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
    for name in ("self_attn.kv_b_proj", "self_attn.kv_a_proj_with_mqa", "self_attn.o_proj", "mlp.experts.0.down_proj",
                 "mlp.shared_experts.gate_proj", "self_attn.q_b_proj" if family == "deepseek_v3" else "self_attn.q_proj"):
        assert f"model.layers.1.{name}.qweight" in out, name
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True,
                                  "version": "gemm", "modules_to_not_convert": ["gate"]}
    _relaid(src, tmp_path / "q", cfg, lambda t: out)
    build(str(tmp_path / "q"), tmp_path / "b", BuildOptions())
    assert_bundle_matches(tmp_path / "b", oracle_of(tmp_path / "q", None, tmp_path))

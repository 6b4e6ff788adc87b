"""Layer streaming: quantizing a model several times bigger than one layer grows memory by about a layer.

The model is random, written a layer at a time straight to safetensors (so making it is bounded too),
and quantized in a child process whose ru_maxrss is the peak of the quantizer alone.
"""
import json
import subprocess
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from tiny_models import make_tokenizer

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=8)


def write_random_model(folder: Path) -> float:
    folder.mkdir(parents=True)
    vocab = make_tokenizer(folder)
    h, i, n = SHAPE["hidden_size"], SHAPE["intermediate_size"], SHAPE["num_hidden_layers"]
    config = dict(SHAPE, model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=vocab,
                  max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=1)
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    total = 0
    save_file({"model.embed_tokens.weight": torch.randn(vocab, h, generator=gen),
               "model.norm.weight": torch.ones(h)}, str(folder / "model-globals.safetensors"))
    for layer in range(n):
        p = f"model.layers.{layer}."
        shapes = {"self_attn.q_proj": (h, h), "self_attn.k_proj": (h, h), "self_attn.v_proj": (h, h),
                  "self_attn.o_proj": (h, h), "mlp.gate_proj": (i, h), "mlp.up_proj": (i, h),
                  "mlp.down_proj": (h, i)}
        tensors = {p + k + ".weight": torch.randn(*s, generator=gen) * 0.02 for k, s in shapes.items()}
        tensors[p + "input_layernorm.weight"] = torch.ones(h)
        tensors[p + "post_attention_layernorm.weight"] = torch.ones(h)
        total += sum(t.numel() * 4 for t in tensors.values())
        save_file(tensors, str(folder / f"model-layer{layer:02d}.safetensors"))
    return total / 2**20


def test_peak_memory_is_about_one_layer(tmp_path):
    model_mb = write_random_model(tmp_path / "m")
    code = ("import json, sys; from pathlib import Path; from engc.compiler.quantize import QuantOptions; "
            "from engc.compiler.quantize.stream import quantize_checkpoint; "
            "print(json.dumps(quantize_checkpoint(sys.argv[1], Path(sys.argv[2]), "
            "QuantOptions(method='rtn', group_size=128))))")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path / "m"), str(tmp_path / "q")],
                          capture_output=True, text=True, timeout=300, env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    s = json.loads(proc.stdout.strip().splitlines()[-1])
    layer_mb = s["layer_weights_mb"]
    assert model_mb > 6 * layer_mb
    growth = s["peak_rss_mb"] - s["start_rss_mb"]
    print(f"model {model_mb:.0f} MB, layer {layer_mb:.0f} MB, peak growth {growth:.0f} MB")
    assert growth < 0.75 * model_mb, s  # measured 156-219 MB (3-4.5 layers: copies + allocator slack)
    assert len(list((tmp_path / "q").glob("model-*.safetensors"))) == 9

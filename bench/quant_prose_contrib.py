"""Where an int4 SmolLM2's prose perplexity goes: float weights except one part quantized.

    QUANT_PROSE_SAVE=/tmp/q.pt python bench/quant_prose_ppl.py TAG gptq+act+static 128 64 256
    python bench/quant_prose_contrib.py /tmp/q.pt

Takes the weights bench/quant_prose_ppl.py saved (its projections quantized and dequantized) and scores,
on that script's texts and windows, the float model with only one part's projections taken from them:
each kind of projection over all layers, and each third of the layers with all its projections. Prints
one JSON line per part.
"""
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_prose_ppl import TEXTS, score  # noqa: E402

from engc.compiler.build import read_source  # noqa: E402

PARTS = {
    "q,k,v": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "o": ("self_attn.o_proj",),
    "gate,up": ("mlp.gate_proj", "mlp.up_proj"),
    "down": ("mlp.down_proj",),
}


def main():
    torch.set_grad_enabled(False)
    quantized = torch.load(sys.argv[1])
    ckpt = read_source("default")
    base = {n: ckpt.get(n).float() for n in ckpt.names()}
    layers = ckpt.hf_config["num_hidden_layers"]
    thirds = {f"layers {a}-{b - 1}": range(a, b) for a, b in
              ((0, layers // 3), (layers // 3, 2 * layers // 3), (2 * layers // 3, layers))}
    projections = [p for ps in PARTS.values() for p in ps]
    choices = {f"only {k}": [f"model.layers.{i}.{p}.weight" for i in range(layers) for p in ps]
               for k, ps in PARTS.items()}
    choices.update({f"only {k}": [f"model.layers.{i}.{p}.weight" for i in r for p in projections]
                    for k, r in thirds.items()})
    choices["all"] = [n for n in quantized if n in base and n.startswith("model.layers.")]
    for part, names in choices.items():
        sd = dict(base, **{n: quantized[n] for n in names})
        print(json.dumps({"part": part, **score(ckpt, sd)}), flush=True)


if __name__ == "__main__":
    main()

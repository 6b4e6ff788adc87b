"""AWQ's two searches judged on text they did not see: does what they pick on the calibration tokens
also lower a SmolLM2 layer's output error on prose?

    python bench/awq_objectives.py [--layers 1,15,28] [--groups 128,32] [--samples 64]

For each layer (its inputs: the float model's hidden states of the default corpus's calibration windows,
and of the first 4096 tokens of bench/quant_prose_ppl.py's two texts), the layer's output error
(mean square, over the float layer's output) with every projection fake-quantized after:
rtn (nothing searched), scale (AWQ's scale search alone), scale+clip (engc's AWQ: the clip search on
CLIP_TOKENS sampled calibration tokens), scale+clip_all (the clip search on every calibration token).
A search that fits its sample rather than the text's statistics wins on "calib" and loses on the others.
One JSON line per layer and group size.
"""
import argparse
import json
import sys

import torch

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from quant_prose_ppl import TEXTS  # noqa: E402

from engc.compiler.build import read_source  # noqa: E402
from engc.compiler.frontend.decoder import resolve_config  # noqa: E402
from engc.compiler.frontend.rope import inv_freq  # noqa: E402
from engc.compiler.quantize import awq  # noqa: E402
from engc.compiler.quantize.calibration import calibration_samples  # noqa: E402
from engc.compiler.quantize.layer import LINEARS, DecoderLayer, batched  # noqa: E402
from engc.compiler.quantize.rtn import fake_quantize  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402


def layer_weights(ckpt, i):
    p = f"model.layers.{i}."
    return {n[len(p):]: ckpt.get(n).float() for n in ckpt.names() if n.startswith(p)}


def error(cfg, rope, weights, group, x, reference):
    w = dict(weights)
    for n in LINEARS:
        w[n + ".weight"] = fake_quantize(w[n + ".weight"], group)
    out = batched(DecoderLayer(cfg, w, rope).forward, x)
    return round(((out - reference).pow(2).mean() / reference.pow(2).mean()).item(), 8)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", default="1,15,28")
    ap.add_argument("--groups", default="128,32")
    ap.add_argument("--samples", type=int, default=64)
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    ckpt = read_source("default")
    cfg = resolve_config(ckpt.hf_config)
    rope = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    tok_json = ckpt.tokenizer_files["tokenizer.json"]
    tok = Tokenizer.from_str(tok_json.decode())
    embed = ckpt.get("model.embed_tokens.weight").float()
    xs = {"calib": embed[calibration_samples(tok_json, None, args.samples, 256)]}
    for name, files in TEXTS.items():
        text = "\n".join(open(f).read() for f in files)
        xs[name] = embed[torch.tensor(tok.encode(text, add_special_tokens=False).ids[:4096]).view(16, 256)]
    wanted = set(map(int, args.layers.split(",")))
    for i in range(max(wanted) + 1):
        weights = layer_weights(ckpt, i)
        float_layer = DecoderLayer(cfg, weights, rope)
        outs = {k: batched(float_layer.forward, x) for k, x in xs.items()}
        if i in wanted:
            for g in map(int, args.groups.split(",")):
                row = {"layer": i, "group_size": g}
                row["rtn"] = {k: error(cfg, rope, weights, g, xs[k], outs[k]) for k in xs}
                seen = {}
                original_clip = awq.clip_weight
                awq.clip_weight = lambda w, inp, *_a, _seen=seen, **_k: _seen.setdefault(id(w), (w, inp))[0]
                layer = DecoderLayer(cfg, dict(weights), rope)
                awq.awq_layer(layer, xs["calib"], g)   # the scale search; the clip search recorded, not run
                awq.clip_weight = original_clip
                scaled = dict(layer.w)
                row["scale"] = {k: error(cfg, rope, scaled, g, xs[k], outs[k]) for k in xs}
                names = {id(scaled[n + ".weight"]): n for n in LINEARS}
                for label, tokens in (("scale+clip", awq.CLIP_TOKENS), ("scale+clip_all", 1 << 30)):
                    clipped = dict(scaled)
                    keep, awq.CLIP_TOKENS = awq.CLIP_TOKENS, tokens
                    for w, inp in seen.values():
                        clipped[names[id(w)] + ".weight"] = awq.clip_weight(w, inp, g, 20)
                    awq.CLIP_TOKENS = keep
                    row[label] = {k: error(cfg, rope, clipped, g, xs[k], outs[k]) for k in xs}
                print(json.dumps(row), flush=True)
        xs = outs  # the next layer's inputs: this float layer's outputs
    return 0


if __name__ == "__main__":
    main()

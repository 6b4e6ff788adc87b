"""Perplexity of int4 SmolLM2 on English prose unrelated to the calibration text, fast enough for 2 cores.

    python bench/quant_prose_ppl.py TAG METHOD GROUP SAMPLES SEQLEN [DAMP] [CALIB_FILE]
        METHOD: float, rtn, awq, gptq, gptq+act (GPTQ with act-order, groups in that order) or
        gptq+act+static (act-order, groups left in channel order)

Quantizes layer by layer with engc's own quantizer (stream.quantize_layer, the code `engc quantize`
runs), keeps each projection's dequantized weight instead of packing it, loads the weights into an HF
Llama in float32 and scores 8 windows of 512 tokens (stride 512, as `engc eval --window 512 --stride
512 --max-tokens 4096`; the float model's figures equal engc eval's) of two texts every Debian-based
system ships: the GPL-3 licence and the first chapters of Vim's user manual. One JSON line per run is
appended to /tmp/quant_prose_ppl.jsonl. With QUANT_PROSE_SAVE=FILE the model's weights (the quantized
projections dequantized) are saved there for bench/quant_prose_contrib.py.
"""
import glob
import json
import math
import os
import sys
import time

import torch
from tokenizers import Tokenizer
from transformers import LlamaConfig, LlamaForCausalLM

from engc.compiler.build import read_source
from engc.compiler.frontend.decoder import resolve_config
from engc.compiler.frontend.rope import inv_freq
from engc.compiler.quantize import stream
from engc.compiler.quantize.calibration import calibration_samples, corpus_name
from engc.compiler.quantize.options import QuantOptions

TEXTS = {"gpl3": ["/usr/share/common-licenses/GPL-3"],
         "vim_usr": sorted(glob.glob("/usr/share/vim/vim90/doc/usr_0*.txt"))}


def quantized_state(ckpt, cfg, opts: QuantOptions) -> dict:
    sd = {n: ckpt.get(n).float() for n in ckpt.names()}
    stream.pack_of = lambda _opts: (lambda qw: {"deq": qw.dequantize()})
    rope = inv_freq(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
    x = None
    if opts.method != "rtn":
        ids = calibration_samples(ckpt.tokenizer_files["tokenizer.json"], opts.calib, opts.calib_samples,
                                  opts.calib_seqlen)
        x = sd["model.embed_tokens.weight"][ids]
    for i in range(cfg.num_layers):
        tensors, x, _ = stream.quantize_layer(ckpt, cfg, rope, i, x, opts)
        sd.update({(k[:-4] + ".weight" if k.endswith(".deq") else k): v.float() for k, v in tensors.items()})
    return sd


def score(ckpt, sd: dict) -> dict:
    """{text: perplexity} of an HF Llama holding sd."""
    hf = LlamaConfig(**ckpt.hf_config)
    model = LlamaForCausalLM(hf).float().eval()
    model.load_state_dict(sd, strict=False)
    model.tie_weights()
    tok = Tokenizer.from_str(ckpt.tokenizer_files["tokenizer.json"].decode())
    out = {}
    for name, files in TEXTS.items():
        text = "\n".join(open(f).read() for f in files)
        ids = torch.tensor(tok.encode(text, add_special_tokens=False).ids[:4096]).view(8, 512)
        logits = model(ids).logits[:, :-1].reshape(-1, hf.vocab_size)
        out[name] = round(math.exp(torch.nn.functional.cross_entropy(logits, ids[:, 1:].reshape(-1)).item()), 3)
    return out


def main():
    tag, method, g, samples, seqlen = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:6])
    damp = float(sys.argv[6]) if len(sys.argv) > 6 else 0.01
    calib = sys.argv[7] if len(sys.argv) > 7 else None
    torch.set_grad_enabled(False)
    ckpt = read_source("default")
    cfg = resolve_config(ckpt.hf_config)
    started = time.monotonic()
    static = method.endswith("+static")
    method = method.removesuffix("+static")
    method, act_order = method.removesuffix("+act"), method.endswith("+act")
    opts = QuantOptions(method=method, group_size=g, calib_samples=samples, calib_seqlen=seqlen, damp=damp,
                        calib=calib, act_order=act_order, static_groups=static)
    sd = {n: ckpt.get(n).float() for n in ckpt.names()} if method == "float" else quantized_state(ckpt, cfg, opts)
    if os.environ.get("QUANT_PROSE_SAVE"):  # the weights for bench/quant_prose_contrib.py
        torch.save(sd, os.environ["QUANT_PROSE_SAVE"])
    result = {"tag": tag, "method": method, "group_size": g, "calib": corpus_name(calib),
              "calib_samples": samples, "calib_seqlen": seqlen, "damp": damp, "act_order": act_order,
              "static_groups": static,
              "quantize_seconds": round(time.monotonic() - started, 1)}
    result.update(score(ckpt, sd))
    print(json.dumps(result), flush=True)
    with open("/tmp/quant_prose_ppl.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()

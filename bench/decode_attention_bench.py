"""The split-KV decode attention kernel (paged_attention 'decode', or with --kernel decode_rotary the one fused with
the rotary that decode-only steps of up to rotary_max_rows run) of one model shape, tile config against tile config
and KV-cache format against format: compiled here for each tune override as a bundle's are ('prepare'), loaded and
timed on the GPU ('run'). Each: us a launch, the rate its KV bytes (codes and scales) are read at against the copy
rate, and the output's error against the torch reference (kernels/paged_attention).

    here:   python bench/decode_attention_bench.py prepare --shape 8b --kv fp8,auto --out .kc/attn \\
                --variants 'n32:;n64:BLOCK_N=64,num_stages=2' [--label NAME] [--kernel decode_rotary]
    there:  python bench/decode_attention_bench.py run --dir .kc/attn --batches 1024x192,32x1024 [--out r.json]

A variant is NAME:KEY=VALUE,... over the shape's tune entry for 'decode' (empty: the entry as it is). --label
names the source the kernels were compiled from, so two checkouts' kernels can be timed side by side.
"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch

from shapes import model_config
from timing import COPY_BW, median_event_us

BLOCK_SIZE = 16          # the KV page (engc build's default)
# copy rates (TB/s) of_copy divides by: the H200's measured one (timing.COPY_BW); the H100's is its 3.35 TB/s peak at
# the same fraction of peak (0.885), an estimate
COPY_TBS = {"H200": COPY_BW / 1e12, "H100": 3.0}


def parse_variants(text: str) -> dict[str, dict]:
    out = {}
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, _, body = item.partition(":")
        entry = {}
        for kv in filter(None, body.split(",")):
            key, _, value = kv.partition("=")
            entry[key.strip()] = json.loads(value)
        out[name.strip()] = entry
    return out


def prepare(args) -> None:
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    cfg = model_config(args.shape)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for kv in args.kv.split(","):
        for name, entry in parse_variants(args.variants).items():
            overrides = {"paged_attention": {"decode": entry}} if entry else None
            spec = next(s for s in model_specs(cfg, torch.bfloat16, "sm90", BLOCK_SIZE, overrides, kv_cache=kv)
                        if (s.op, s.variant) == ("paged_attention", args.kernel))
            result = compile_specs([spec], jobs=1)
            record = result.records[0]
            stem = f"{args.label}__{args.kernel}__{kv}__{name}"
            (out / f"{stem}.cubin").write_bytes(result.files[record["cubin"]])
            json.dump({"shape": args.shape, "kv": kv, "label": args.label, "variant": name, "override": entry,
                       "kernel": args.kernel, "record": record}, open(out / f"{stem}.json", "w"))
            print(f"{stem}: {spec.constexprs['BLOCK_N']=} {spec.num_warps=} {spec.num_stages=}")


def _inputs(cfg, kv: str, batch: int, ctx: int, gen: torch.Generator):
    """q, codes (or a bf16 cache), scales (None for bf16), block tables (pages scattered), context lengths,
    query offsets: one decode step of `batch` sequences at `ctx` tokens each."""
    from engc.kernels import kv_quant
    pages = math.ceil(ctx / BLOCK_SIZE)
    num_blocks = batch * pages
    shape = (2, num_blocks, BLOCK_SIZE, cfg.num_kv_heads, cfg.head_dim)
    if kv == "auto":
        cache, scales = torch.randn(shape, generator=gen, device="cuda").to(torch.bfloat16), None
    else:
        cache = torch.empty(shape, dtype=kv_quant.KV_CACHE_DTYPES[kv], device="cuda")
        scales = torch.empty(shape[:-1], dtype=torch.float32, device="cuda")
        for i in range(0, num_blocks, 4096):   # a slice at a time: the float32 source of a whole cache is large
            part = torch.randn((2, min(4096, num_blocks - i), *shape[2:]), generator=gen, device="cuda")
            part = part * torch.rand(part.shape[:-1], generator=gen, device="cuda")[..., None] * 4
            cache[:, i:i + part.shape[1]], scales[:, i:i + part.shape[1]] = kv_quant.quantize(
                part, kv_quant.KV_CACHE_DTYPES[kv])
    block_tables = torch.randperm(num_blocks, generator=gen, device="cuda").view(batch, pages).to(torch.int32)
    context_lens = torch.full((batch,), ctx, dtype=torch.int32, device="cuda")
    qsl = torch.arange(batch + 1, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, cfg.num_heads * cfg.head_dim, generator=gen, device="cuda").to(torch.bfloat16)
    return q, cache, scales, block_tables, context_lens, qsl


def _rotary_inputs(cfg, block_tables, context_lens, gen: torch.Generator) -> dict:
    """decode_rotary's own inputs for the step: the fused qkv rows, each row's position (its context's last) and the
    cache slot that position's k/v go to, and the rotary's inverse frequencies."""
    batch = block_tables.shape[0]
    pos = (context_lens - 1).long()
    rows = torch.arange(batch, device=pos.device)
    slots = block_tables[rows, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE
    width = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    qkv = torch.randn(batch, width, generator=gen, device=pos.device).to(torch.bfloat16)
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2, device=pos.device).float() / cfg.head_dim))
    return {"qkv": qkv, "pos": pos, "slots": slots, "inv_freq": inv_freq}


def _reference(op, cfg, kind: str, n: int, q, cache, scales, bt, ctx_lens, qsl, step):
    """The torch reference of the first n rows' outputs; decode_rotary's on copies of the cache it writes."""
    scale = cfg.head_dim ** -0.5
    if kind == "decode":
        return op.paged_attention(q[:n], cache, bt[:n], ctx_lens[:n], qsl[:n + 1], cfg.num_heads, cfg.num_kv_heads,
                                  cfg.head_dim, scale, 0, kv_scale=scales).float()
    return op.rotary_paged_attention(step["qkv"][:n], step["pos"][:n], step["inv_freq"], cache.clone(),
                                     step["slots"][:n], bt[:n], ctx_lens[:n], qsl[:n + 1], cfg.num_heads,
                                     cfg.num_kv_heads, cfg.head_dim, scale, 0,
                                     kv_scale=None if scales is None else scales.clone()).float()


def _kv_bytes(cfg, kv: str, batch: int, ctx: int) -> int:
    per_token = 2 * cfg.num_kv_heads * (cfg.head_dim * (2 if kv == "auto" else 1) + (0 if kv == "auto" else 4))
    return batch * ctx * per_token


def run(args) -> None:
    from engc.cuda import records
    from engc.kernels import paged_attention as op
    files = sorted(Path(args.dir).glob("*.json"))
    metas = [json.load(open(f)) for f in files]
    kernels = {f.stem: records.load_record(f.with_suffix(".cubin").read_bytes(), m["record"], records.pdl_enabled())
               for f, m in zip(files, metas)}
    gpu = torch.cuda.get_device_name()
    copy = next((v for k, v in COPY_TBS.items() if k in gpu), None)
    stream = torch.cuda.current_stream().cuda_stream
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    cfg = model_config(metas[0]["shape"])
    for batch, ctx in (tuple(int(x) for x in b.split("x")) for b in args.batches.split(",")):
        for kv in sorted({m["kv"] for m in metas}):
            q, cache, scales, bt, ctx_lens, qsl = _inputs(cfg, kv, batch, ctx, gen)
            step = _rotary_inputs(cfg, bt, ctx_lens, gen)
            refs = {}
            for f, m in zip(files, metas):
                if m["kv"] != kv:
                    continue
                kind = m.get("kernel", "decode")
                out = torch.full_like(q, float("nan"))
                common = dict(num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                              scale=cfg.head_dim ** -0.5, max_context_len=ctx, consts={kind: m["record"]["launch"]},
                              kv_scale=scales)
                if kind == "decode":
                    launches = op.launch(q, cache, bt, ctx_lens, qsl, out, max_query_len=1, **common)
                else:   # writes the step's k/v into its slot: the same values at every launch
                    launches = op.launch_rotary_decode(step["qkv"], step["pos"], step["inv_freq"], cache, step["slots"],
                                                       bt, ctx_lens, qsl, out, **common)
                kernel = kernels[f.stem]
                plan = [(grid, kernel.pointers(a)) for _, grid, a in launches]

                def go():
                    for grid, ptrs in plan:
                        kernel.launch(grid, ptrs, stream)
                go()
                torch.cuda.synchronize()
                if kind not in refs:   # the reference on the first rows only: it is a loop over sequences
                    refs[kind] = _reference(op, cfg, kind, min(batch, 16), q, cache, scales, bt, ctx_lens, qsl, step)
                ref = refs[kind]
                err = ((out[:ref.shape[0]].float() - ref).abs().max() / ref.abs().max()).item()
                us = median_event_us(lambda: [go() for _ in range(10)], reps=args.reps) / 10   # a launch
                tbs = _kv_bytes(cfg, kv, batch, ctx) / us / 1e6
                row = {"batch": batch, "ctx": ctx, "kv": kv, "kernel": kind, "label": m["label"],
                       "variant": m["variant"], "override": m["override"], "splits": launches[0][1][2],
                       "us": round(us, 1), "kv_TBs": round(tbs, 2), "of_copy": round(tbs / copy, 3) if copy else None,
                       "max_rel_err": float(f"{err:.2e}")}
                rows.append(row)
                print(f"b{batch:<5} ctx{ctx:<6} {kv:5} {kind:>13} {m['label']:>8} {m['variant']:>10}  {us:8.1f} us  "
                      f"{tbs:5.2f} TB/s  {row['of_copy']}  err {err:.1e}", flush=True)
            del cache, scales
    if args.out:
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": rows}, open(args.out, "w"), indent=1)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--shape", default="8b")
    p.add_argument("--kv", default="fp8,auto")
    p.add_argument("--variants", default="tuned:")
    p.add_argument("--label", default="here")
    p.add_argument("--kernel", default="decode", choices=("decode", "decode_rotary"))
    p.add_argument("--out", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--batches", default="1024x192,256x192,32x1024")
    r.add_argument("--reps", type=int, default=5)
    r.add_argument("--out", default="")
    args = ap.parse_args()
    prepare(args) if args.cmd == "prepare" else run(args)


if __name__ == "__main__":
    main()

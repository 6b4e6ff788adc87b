"""Quantized KV cache (--kv-cache int8|fp8) on an H200: correctness, then decode attention vs bf16.

Two steps, two machines (like kernels_device.py):
  python bench/kv_quant_device.py prepare .aot_kvq   # here, CPU only: sm90 cubins of rotary + paged
                                                      # attention for bf16, int8 and fp8 caches
  python bench/kv_quant_device.py run .aot_kvq        # on the GPU: launched through engc._native (the
                                                      # runtime's launcher), checked, timed; < 60 s
Checks: the rotary write (quantize on write) and a mixed prefill/extend/decode batch against the torch
references. Timing: split-KV decode (+ reduce) over long contexts at B 1/32/64, one CUDA graph per
point; bandwidth is the bytes the cache must give (codes + scales, or bf16) over the median time.
Writes results.json under $OUT (or --out) and prints the table last.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PAGE = 16
CONFIGS = {  # attention shapes of Llama-3-8B (d 128) and Llama-3.2-1B (d 64)
    "8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
               num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
               max_position_embeddings=131072, tie_word_embeddings=False),
    "1b": dict(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
               num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5,
               max_position_embeddings=131072, tie_word_embeddings=True),
}
KV_CACHES = ("auto", "int8", "fp8")
WANTED = {("rotary", "pos_i64"), ("paged_attention", "decode"), ("paged_attention", "decode_reduce"),
          ("paged_attention", "prefill")}
POINTS = [(1, 4096), (1, 16384), (1, 65536), (32, 4096), (32, 16384), (64, 4096), (64, 16384)]


def prepare(out_dir: Path):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    index = {}
    for name, cfg_dict in CONFIGS.items():
        cfg = ModelConfig(**cfg_dict)
        for kv in KV_CACHES:
            specs = [s for s in model_specs(cfg, torch.bfloat16, "sm90", PAGE, kv_cache=kv)
                     if (s.op, s.variant) in WANTED]
            t0 = time.time()
            res = compile_specs(specs, jobs=1)
            print(f"{name}/{kv}: {len(specs)} kernels in {time.time() - t0:.1f}s", flush=True)
            for path, data in res.files.items():
                dst = out_dir / name / kv / path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
            index.setdefault(name, {"cfg": cfg_dict, "sets": {}})["sets"][kv] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

class Kernels:
    """One set's cubins through engc.cuda.cubin (the runtime's launcher), on torch's current stream."""

    def __init__(self, base: Path, records: list[dict]):
        from engc.cuda.cubin import load_kernel, signature_from_triton
        self.kernels, self.consts = {}, {}
        for r in records:
            sig = signature_from_triton([a["type"] for a in r["args"][:-2]])
            self.kernels[(r["op"], r["variant"])] = load_kernel(
                (base / r["cubin"]).read_bytes(), r["entry"], sig, block_x=32 * r["num_warps"],
                shared_mem=r["shared_mem"], scratch_params=2)
            self.consts.setdefault(r["op"], {})[r["variant"]] = r["launch"]

    def run(self, op, launches):
        import torch
        from engc.cuda.cubin import current_stream
        stream = current_stream()
        for variant, grid, args in launches:
            self.kernels[(op, variant)].launch(grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a
                                                      for a in args[:-2]], stream)


def time_graph(fn, reps: int = 15) -> float:
    """Median microseconds of fn() replayed from a CUDA graph."""
    import torch
    fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return sorted(times)[len(times) // 2]


def rel_err(out, ref):
    out, ref = out.double().cpu(), ref.double().cpu()
    if not bool(out.isfinite().all()):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


class Cache:
    """One random float KV pool and its three stored forms (bf16, int8 + scales, fp8 + scales)."""

    def __init__(self, c: dict, num_blocks: int):
        import torch
        from engc.kernels import kv_quant
        KV, D = c["num_kv_heads"], c["head_dim"]
        g = torch.Generator(device="cuda").manual_seed(0)
        self.forms = {"auto": (torch.empty(2, num_blocks, PAGE, KV, D, dtype=torch.bfloat16, device="cuda"), None)}
        for kv, dtype in kv_quant.KV_CACHE_DTYPES.items():
            self.forms[kv] = (torch.empty(2, num_blocks, PAGE, KV, D, dtype=dtype, device="cuda"),
                              torch.empty(2, num_blocks, PAGE, KV, dtype=torch.float32, device="cuda"))
        step = 4096
        for lo in range(0, num_blocks, step):  # chunks: the float32 staging of a whole pool is large
            x = torch.randn(2, min(step, num_blocks - lo), PAGE, KV, D, device="cuda", generator=g)
            x *= torch.rand(x.shape[:-1], device="cuda", generator=g)[..., None] * 2  # rows of varied size
            self.forms["auto"][0][:, lo:lo + step] = x.to(torch.bfloat16)
            for kv, dtype in kv_quant.KV_CACHE_DTYPES.items():
                codes, scales = kv_quant.quantize(x, dtype)
                self.forms[kv][0][:, lo:lo + step] = codes
                self.forms[kv][1][:, lo:lo + step] = scales

    def bytes_per_token(self, kv: str) -> int:
        codes, scales = self.forms[kv]
        per = codes[0, 0, 0].numel() * codes.element_size()
        return 2 * (per + (0 if scales is None else scales[0, 0, 0].numel() * 4))


def batch(c, seqs, num_blocks, seed):
    import torch
    g = torch.Generator(device="cuda").manual_seed(seed)
    need = [math.ceil(ctx / PAGE) for ctx, _ in seqs]
    perm = torch.randperm(num_blocks, device="cuda", generator=g)[:sum(need)].to(torch.int32)
    bt = torch.zeros(len(seqs), max(need), dtype=torch.int32, device="cuda")
    off = 0
    for b, n in enumerate(need):
        bt[b, :n] = perm[off:off + n]
        off += n
    ctx = torch.tensor([s[0] for s in seqs], dtype=torch.int32, device="cuda")
    qsl = torch.tensor([0] + [s[1] for s in seqs], device="cuda").cumsum(0).to(torch.int32)
    q = torch.randn(int(qsl[-1]), c["num_heads"] * c["head_dim"], dtype=torch.bfloat16, device="cuda", generator=g)
    return q, bt, ctx, qsl


def reference(q, codes, scales, bt, ctx, qsl, c):
    """The op reference on the CPU over a compact copy of the blocks the batch uses."""
    import torch
    from engc.kernels import paged_attention as pa
    need = [math.ceil(int(n) / PAGE) for n in ctx.tolist()]
    bt_cpu = bt.cpu()
    ids = torch.unique(torch.cat([bt_cpu[b, :n] for b, n in enumerate(need)]).long())
    remap = torch.zeros(codes.shape[1], dtype=torch.int32)
    remap[ids] = torch.arange(len(ids), dtype=torch.int32)
    bt_new = torch.zeros_like(bt_cpu)
    for b, n in enumerate(need):
        bt_new[b, :n] = remap[bt_cpu[b, :n].long()]
    dev_ids = ids.to(codes.device)
    return pa.paged_attention(q.cpu(), codes[:, dev_ids].cpu(), bt_new, ctx.cpu(), qsl.cpu(), c["num_heads"],
                              c["num_kv_heads"], c["head_dim"], c["head_dim"] ** -0.5,
                              kv_scale=None if scales is None else scales[:, dev_ids].cpu())


def run(aot: Path, out: Path):
    import torch
    from engc.kernels import paged_attention as pa, rotary
    torch.zeros(1, device="cuda")
    index = json.loads((aot / "index.json").read_text())
    results = {"device": torch.cuda.get_device_name(), "checks": [], "decode": []}
    log = []

    def say(msg):
        print(msg, flush=True)
        log.append(msg)

    t_start = time.time()
    for name, entry in index.items():
        c = entry["cfg"]
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        sets = {kv: Kernels(aot / name / kv, entry["sets"][kv]) for kv in KV_CACHES}
        max_tokens = max(b * ctx for b, ctx in POINTS)
        num_blocks = max_tokens // PAGE + 64
        cache = Cache(c, num_blocks)
        scale = D ** -0.5
        ws = pa.decode_workspace(64, H, D, 64, "cuda")
        for kv in KV_CACHES:
            ks = sets[kv]
            codes, scales = cache.forms[kv]
            # quantize on write: the rotary kernel into a small cache vs the reference
            T = 77
            small = torch.zeros(2, 16, PAGE, KV, D, dtype=codes.dtype, device="cuda")
            small_s = None if scales is None else torch.zeros(2, 16, PAGE, KV, dtype=torch.float32, device="cuda")
            qkv = torch.randn(T, (H + 2 * KV) * D, dtype=torch.bfloat16, device="cuda") * 2
            pos = torch.randint(0, 100000, (T,), device="cuda")
            slots = torch.randperm(16 * PAGE, device="cuda")[:T]
            inv_freq = 1.0 / (5e5 ** (torch.arange(0, D, 2, device="cuda").float() / D))
            ref_c, ref_s = small.clone().cpu(), None if small_s is None else small_s.clone().cpu()
            ref_q = rotary.rotary_kv_write(qkv.cpu(), pos.cpu(), inv_freq.cpu(), ref_c, slots.cpu(), H, KV, D,
                                           kv_scale=ref_s)
            q_out = torch.empty(T, H * D, dtype=torch.bfloat16, device="cuda")
            ks.run("rotary", rotary.launch(qkv, pos, inv_freq, small, slots, q_out, kv_scale=small_s))
            deq = (lambda x, s: x.float() if s is None else x.float() * s[..., None])
            err = max(rel_err(q_out, ref_q), rel_err(deq(small.cpu(), None if small_s is None else small_s.cpu()),
                                                     deq(ref_c, ref_s)))
            results["checks"].append(dict(name=f"{name}/{kv}/rotary_write", err=err, ok=err < 2e-2))
            # attention: a mixed batch (prefill, extend over a cached prefix, decodes), and long decodes
            for label, seqs in (("mixed", [(1024, 1024), (2048, 512), (300, 1), (4096, 1), (777, 77)]),
                                ("decode_long", [(16384, 1), (5000, 1), (30000, 1)])):
                q, bt, ctx, qsl = batch(c, seqs, num_blocks, 1)
                o = torch.full_like(q, float("nan"))
                ks.run("paged_attention", pa.launch(
                    q, codes, bt, ctx, qsl, o, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                    max_query_len=max(n for _, n in seqs), workspace=ws, consts=ks.consts["paged_attention"],
                    kv_scale=scales))
                err = rel_err(o, reference(q, codes, scales, bt, ctx, qsl, c))
                results["checks"].append(dict(name=f"{name}/{kv}/attention_{label}", err=err, ok=err < 2e-2))
            say(f"{name}/{kv}: checks " + ", ".join(f"{r['name'].split('/')[-1]} {r['err']:.1e}"
                                                    for r in results["checks"][-3:]))
        for B, ctx_len in POINTS:
            q, bt, ctx, qsl = batch(c, [(ctx_len, 1)] * B, num_blocks, 7)
            o = torch.empty_like(q)
            row = {"cfg": name, "B": B, "ctx": ctx_len}
            for kv in KV_CACHES:
                ks = sets[kv]
                codes, scales = cache.forms[kv]
                launches = pa.launch(q, codes, bt, ctx, qsl, o, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                                     max_query_len=1, max_context_len=ctx_len, workspace=ws,
                                     consts=ks.consts["paged_attention"], kv_scale=scales)
                us = time_graph(lambda: ks.run("paged_attention", launches))
                row[kv] = {"us": us, "gbs": B * ctx_len * cache.bytes_per_token(kv) / us / 1e3,
                           "splits": launches[0][1][2]}
            results["decode"].append(row)
            say(f"decode {name} B={B} ctx={ctx_len}: " + ", ".join(
                f"{kv} {row[kv]['us']:.1f} us ({row[kv]['gbs']:.0f} GB/s)" for kv in KV_CACHES))
        del cache
        torch.cuda.empty_cache()
    results["seconds"] = round(time.time() - t_start, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "kv_quant_results.json").write_text(json.dumps(results, indent=1))
    bad = [r["name"] for r in results["checks"] if not r["ok"]]
    lines = ["", f"== quantized KV cache on {results['device']} ({results['seconds']} s) ==",
             f"checks: {len(results['checks']) - len(bad)}/{len(results['checks'])} ok"
             + (": FAILED " + ", ".join(bad) if bad else "") + "; worst err "
             + ", ".join(f"{kv} {max(r['err'] for r in results['checks'] if f'/{kv}/' in r['name']):.1e}"
                         for kv in KV_CACHES),
             "decode attention, us (speed-up vs bf16 cache):"]
    for row in results["decode"]:
        base = row["auto"]["us"]
        lines.append(f"  {row['cfg']} B={row['B']:<2} ctx={row['ctx']:<5} bf16 {base:8.1f} | "
                     + " | ".join(f"{kv} {row[kv]['us']:8.1f} (x{base / row[kv]['us']:.2f})" for kv in KV_CACHES[1:]))
    print("\n".join(lines), flush=True)
    (out / "kv_quant_log.txt").write_text("\n".join(log + lines) + "\n")


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})

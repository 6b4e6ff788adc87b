"""Small-batch decode attention (decode_rotary, RotaryPagedAttention on a decode step) variants on an H200.

At batch 1 and a few hundred tokens of context the fused decode kernel moves ~1 MB and takes ~7 us: it is a
chain of dependent memory round trips (query offsets -> context -> block table -> K/V, qkv -> rope -> the
new token's store, partial -> ticket -> combine), not bandwidth. This sweep times ways to shorten the
chain: EARLY_KV (the first KV tile loaded before the rotary, or before the PDL wait), BLOCK_N, num_stages,
num_warps, and the split rule's constants (launch-only: no new cubin).

Two steps, two machines (< 90 s on the GPU):
  python bench/attn_b1_device.py prepare .aot_attn_b1   # here: sm90 cubins of each variant (Triton 3.9)
  python bench/attn_b1_device.py run .aot_attn_b1       # on the GPU: engc.cuda.cubin launches, checked
                                                        # against the torch references, then timed
Timed as one CUDA graph over copies of the inputs spread over a 2.2 GB cache (cold L2 for K/V), without PDL
(as bench/decode_device.py run-fused), and with PDL: each attention launched with the attribute behind a
~3 us silu_mul (launched with it too) that stands in for the QKV projection; there the figure is the pair's
time less silu_mul's alone, i.e. what the attention adds to a step. Cases use the runtime's split sizing:
max_context_len is the graph's context bucket (255) or the block table's capacity (8192). Writes
results.json and log.txt under $OUT; prints the table last (us, and the ratio to 'base', today's config).
"""
from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_device import CONFIGS, PAGE, Bench, attention_reference, rel_err, time_graph  # noqa: E402

ARCH = "sm90"
# cubin variants: decode tune overrides (EARLY_KV, BLOCK_N, num_stages, num_warps); min_split_tokens follows
# BLOCK_N as in the tune table. 'base' is today's entry (d<=128: BLOCK_N 32, 3 stages, 4 warps, EARLY_KV 2).
# Earlier sweeps: bench/results/h200_cb40abc_attn_b1.txt (EARLY_KV, BLOCK_N 16-64, stages 1-3, warps),
# h200_4e0a94b_attn_sweep.txt (more splits, bigger tiles, 2/8 warps: all slower; 2 stages 1.3x slower at
# batch 32) and h200_4e0a94b_attn_busy.txt (one split for short contexts of a busy batch: slower). This one:
# deeper pipelines (the first tiles' loads all in flight at once).
# h200_4e0a94b_attn_sweep.txt / h200_*_attn_b1.txt (stages 4-6, BLOCK_N 16, 8 warps: none better than base).
# Sets named cl* are the CUDA cluster kernel (templates/paged_decode_cluster.cu.j2, variant
# decode_rotary_cluster) with decode_cluster tune overrides, launched at every batch size here; the table's
# entry has one stage since 41fa4b5 (cl8s2: the two it had before).
CUBINS = {
    "8b": {"base": {}, "cl8": {"cluster": 8}, "cl4": {"cluster": 4}, "cl2": {"cluster": 2},
           "cl8s2": {"cluster": 8, "stages": 2}},
    "1b": {"base": {}, "cl8": {"cluster": 8}, "cl4": {"cluster": 4}},
}
# launch-rule variants on a cubin: (name, cubin, decode launch-constant overrides)
LAUNCH = [(name, name, {}) for name in ("base", "cl8", "cl4", "cl2", "cl8s2")]
# (cfg, batch, context, max_context_len as the runtime sizes splits: 255 = b<=4 graph bucket, 8192 = capacity)
CASES = [("8b", 1, 128, 255), ("8b", 1, 192, 255), ("8b", 1, 256, 8192), ("8b", 1, 512, 8192),
         ("8b", 1, 1024, 8192), ("8b", 1, 4096, 8192), ("8b", 2, 192, 8192),
         ("8b", 4, 192, 8192), ("8b", 32, 192, 8192),
         ("8b", 32, 256, 8192), ("8b", 32, 512, 8192), ("8b", 32, 1024, 8192), ("8b", 64, 192, 8192),
         ("1b", 1, 256, 8192), ("1b", 64, 192, 8192)]
CHECKS = [("b3_graph_splits", [130, 1000, 17], 8192), ("b4_ctx1_and_257", [1, 257, 64, 65], 1024),
          ("b1_192", [192], 255), ("b2_long", [5000, 33], 8192)]
PDL_FILL_ROWS = 48          # silu_mul rows before each attention in the PDL timing (~5.5 MB, a few us)
# ATTN_SETS=base,s4 (prepare and run): only those cubin sets. ATTN_NCU=8b:32:192 (run): after the checks, two
# launches of each set at that case (no PDL, max_ctx 8192) inside the NVTX range 'ncu', and no timing:
#   ncu --clock-control none --nvtx --nvtx-include 'ncu/' --set full -o $OUT/attn -f \
#       python3 bench/attn_b1_device.py run .kc/aot_attn --out $OUT/attn
if os.environ.get("ATTN_SETS"):
    CUBINS = {cfg: {k: v for k, v in sets.items() if k in os.environ["ATTN_SETS"].split(",")}
              for cfg, sets in CUBINS.items()}
    LAUNCH = [entry for entry in LAUNCH if entry[1] in os.environ["ATTN_SETS"].split(",")]


def prepare(out_dir: Path):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    from engc.compiler.codegen.cuda import compile_cuda
    index = {}
    for name, variants in CUBINS.items():
        cfg = ModelConfig(**CONFIGS[name])
        index[name] = {"cfg": CONFIGS[name], "sets": {}}
        base = [s for s in model_specs(cfg, torch.bfloat16, ARCH, PAGE) if s.op == "silu_mul"]
        sets = {"silu_mul": base}
        for vname, tune in variants.items():
            if vname.startswith("cl"):
                sets[vname] = cluster_spec(cfg, tune)
                continue
            ov = dict(tune)
            if "BLOCK_N" in ov:
                ov["min_split_tokens"] = ov["BLOCK_N"]
            specs = model_specs(cfg, torch.bfloat16, ARCH, PAGE, {"paged_attention": {"decode": ov}} if ov else None)
            sets[vname] = [s for s in specs if (s.op, s.variant) == ("paged_attention", "decode_rotary")]
        for set_name, specs in sets.items():
            t0 = time.time()
            res = compile_cuda(specs) if set_name.startswith("cl") else compile_specs(specs, jobs=2)
            print(f"{name}/{set_name}: {', '.join(s.variant for s in specs)} in {time.time() - t0:.1f}s", flush=True)
            for path, data in res.files.items():
                dst = out_dir / name / set_name / path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
            index[name]["sets"][set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


def cluster_spec(cfg, tune_overrides: dict) -> list:
    """The cluster decode kernel's spec for this shape with decode_cluster overrides (enabled, and launched at
    any batch size here)."""
    from engc.compiler.codegen import cuda, tune
    key = f"{ARCH}/paged_attention/decode_cluster/{tune.head_dim_bucket(cfg.head_dim)}"
    with tune.overridden({key: {"enabled": True, "max_seqs": 1 << 20, **tune_overrides}}):
        spec, why = cuda.decode_cluster_spec(cfg, "bf16", ARCH, PAGE)
    assert spec is not None, why
    return [spec]


class Kernels:
    """One set's cubins loaded as the runtime loads them (gpu_ops.load_record), with or without PDL. Triton
    records take two scratch zeros at the end of a launch rule's args; CUDA ones none (scratch_params)."""

    def __init__(self, base: Path, records: list[dict], pdl: bool):
        from engc.cuda.records import SCRATCH, load_record
        self.kernels, self.consts, self.trailing = {}, {}, {}
        for r in records:
            self.kernels[(r["op"], r["variant"])] = load_record((base / r["cubin"]).read_bytes(), r, pdl)
            self.trailing[(r["op"], r["variant"])] = r.get("scratch_params", SCRATCH)
            self.consts.setdefault(r["op"], {})[r["variant"]] = r["launch"]

    def run(self, op, launches):
        import torch
        from engc.cuda.cubin import current_stream
        stream = current_stream()
        for variant, grid, args in launches:
            args = args[:len(args) - self.trailing[(op, variant)]]
            self.kernels[(op, variant)].launch(grid, [a.data_ptr() if isinstance(a, torch.Tensor) else a
                                                      for a in args], stream)


class AttnB1Bench(Bench):
    def step_inputs(self, c, contexts, num_blocks, seed):
        """A decode step: one token per sequence at position ctx - 1, its slot from the block table."""
        torch = self.torch
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        _, bt, ctx, qsl = self.attention_inputs(c, [(n, 1) for n in contexts], num_blocks, seed)
        g = torch.Generator(device="cuda").manual_seed(seed + 7)
        qkv = torch.randn(len(contexts), (H + 2 * KV) * D, dtype=torch.bfloat16, device="cuda", generator=g)
        pos = (ctx - 1).long()
        slots = bt[torch.arange(len(contexts), device="cuda"), pos // PAGE].long() * PAGE + pos % PAGE
        return dict(qkv=qkv, pos=pos, slots=slots, bt=bt, ctx=ctx, qsl=qsl,
                    out=torch.empty(len(contexts), H * D, dtype=torch.bfloat16, device="cuda"))

    def sweep(self, cfg_name):
        torch = self.torch
        from engc.kernels import paged_attention as pa
        from engc.kernels import rotary, silu_mul
        c = self.index[cfg_name]["cfg"]
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        sets = self.index[cfg_name]["sets"]
        ks = {pdl: {s: Kernels(self.aot / cfg_name / s, sets[s], pdl) for s in sets} for pdl in (False, True)}
        num_blocks = int(2.2e9 // (2 * PAGE * KV * D * 2))
        cache = torch.randn(2, num_blocks, PAGE, KV, D, dtype=torch.bfloat16, device="cuda")
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2, device="cuda").float() / D))
        counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
        ws = pa.decode_workspace(64, H, D, 64, "cuda")
        attn = dict(num_heads=H, num_kv_heads=KV, head_dim=D, scale=D ** -0.5)
        inter = c["intermediate_size"]
        fill_in = torch.randn(PDL_FILL_ROWS, 2 * inter, dtype=torch.bfloat16, device="cuda")
        fill_out = torch.empty(PDL_FILL_ROWS, inter, dtype=torch.bfloat16, device="cuda")
        variants = [(v, cub, ov) for v, cub, ov in LAUNCH if cub in sets]

        def attention(pdl, cub, ov, x, max_ctx):
            k = ks[pdl][cub]
            consts = {v: {**launch, **ov} for v, launch in k.consts["paged_attention"].items()}
            return lambda: k.run("paged_attention", pa.launch_rotary_decode(
                x["qkv"], x["pos"], inv_freq, cache, x["slots"], x["bt"], x["ctx"], x["qsl"], x["out"],
                max_context_len=max_ctx, consts=consts, workspace=ws, counters=counters, **attn))

        def fill(pdl):
            k = ks[pdl]["silu_mul"]
            return lambda: k.run("silu_mul", silu_mul.launch(fill_in, fill_out, k.consts["silu_mul"]))

        # correctness: every variant against rotary_kv_write then paged_attention (torch), new rows poisoned
        for name, contexts, max_ctx in CHECKS:
            x = self.step_inputs(c, contexts, num_blocks, 11)
            ref_q = rotary.rotary_kv_write(x["qkv"], x["pos"], inv_freq, cache, x["slots"], H, KV, D)
            ref = attention_reference(ref_q, cache, x["bt"], x["ctx"], x["qsl"], H, KV, D, attn["scale"]).float()
            rows = torch.stack([cache[i].view(-1, KV, D)[x["slots"]] for i in (0, 1)]).float().cpu()
            for v, cub, ov in variants:
                for i in (0, 1):
                    cache[i].view(-1, KV, D)[x["slots"]] = float("nan")
                x["out"].fill_(float("nan"))
                attention(False, cub, ov, x, max_ctx)()
                torch.cuda.synchronize()
                got = torch.stack([cache[i].view(-1, KV, D)[x["slots"]] for i in (0, 1)]).float().cpu()
                err = max(rel_err(x["out"].cpu(), ref), rel_err(got, rows))
                self.correct(f"{cfg_name}/{v}/{name}", err, 2e-2)
            self.correct(f"{cfg_name}/counters_zero/{name}", float(counters.abs().sum()), 0)

        if os.environ.get("ATTN_NCU"):
            cfg, B, ctx_len = os.environ["ATTN_NCU"].split(":")
            if cfg != cfg_name:
                return
            xs = [self.step_inputs(c, [int(ctx_len)] * int(B), num_blocks, 100 + i) for i in range(3)]
            for v, cub, ov in variants:
                runs = [attention(False, cub, ov, x, 8192) for x in xs]
                runs[0]()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_push("ncu")
                runs[1]()
                runs[2]()
                torch.cuda.synchronize()
                torch.cuda.nvtx.range_pop()
                self.log(f"ncu: {cfg} b{B} ctx {ctx_len}: {v} launched twice in range 'ncu'")
            return
        for cfg, B, ctx_len, max_ctx in CASES:
            if cfg != cfg_name:
                continue
            kv_bytes = B * ctx_len * KV * D * 2 * 2
            copies = max(1, min(48, math.ceil(600e6 / kv_bytes)))
            xs = [self.step_inputs(c, [ctx_len] * B, num_blocks, 100 + i) for i in range(copies)]
            fills = [fill(True)] * copies
            fill_us = time_graph(lambda i: fills[i](), copies)
            row = dict(cfg=cfg, B=B, ctx=ctx_len, max_ctx=max_ctx, fill_us=fill_us, sets={})
            for v, cub, ov in variants:
                plain = [attention(False, cub, ov, x, max_ctx) for x in xs]
                us = time_graph(lambda i: plain[i](), copies)
                pdl = [attention(True, cub, ov, x, max_ctx) for x in xs]

                def pair(i):
                    fills[i]()
                    pdl[i]()
                pdl_us = time_graph(pair, copies) - fill_us
                kc = ks[False][cub].consts["paged_attention"]
                splits = (kc["decode_rotary_cluster"]["cluster"] if "decode_rotary_cluster" in kc else
                          pa.decode_splits(B, KV, max_ctx, {**kc["decode_rotary"], **ov}))
                row["sets"][v] = dict(us=us, pdl_us=pdl_us, splits=splits)
            self.results["timing"].append(row)
            self.log(f"{cfg} B={B} ctx={ctx_len} max_ctx={max_ctx} (silu_mul alone {fill_us:.2f} us): " + ", ".join(
                f"{k} {s['us']:.2f}/{s['pdl_us']:.2f} us ({s['splits']})" for k, s in row["sets"].items()))

    def table(self):
        bad = [r for r in self.results["correctness"] if not r["ok"]]
        worst = max((r["err"] for r in self.results["correctness"]), default=float("nan"))
        lines = ["", f"== correctness: {len(self.results['correctness']) - len(bad)}/{len(self.results['correctness'])}"
                     f" ok, worst rel err {worst:.1e}" + (": FAILED " + ", ".join(r["name"] for r in bad) if bad else ""),
                 "== decode_rotary, sm90 cubins, us a launch: no PDL | with PDL behind silu_mul (added time);",
                 "   x = ratio to base; (splits) of the launch rule at that max_ctx =="]
        rows = self.results["timing"]
        names = []
        for r in rows:
            names += [n for n in r["sets"] if n not in names]
        head = "  {:<12}".format("variant") + "".join(
            f" | {r['cfg']} b{r['B']} {r['ctx']}/{r['max_ctx']}".ljust(31) for r in rows)
        lines.append(head)
        for n in names:
            cells = []
            for r in rows:
                s, b = r["sets"].get(n), r["sets"].get("base")
                if s is None or b is None:
                    cells.append(" | " + "-".ljust(28))
                    continue
                cells.append(f" | {s['us']:5.2f} {s['us'] / b['us']:4.2f}x {s['pdl_us']:5.2f} "
                             f"{s['pdl_us'] / b['pdl_us']:4.2f}x ({s['splits']})".ljust(31))
            lines.append(f"  {n:<12}" + "".join(cells))
        print("\n".join(lines), flush=True)
        self.log_lines.extend(lines)


def run(aot: Path, out: Path):
    import torch
    torch.cuda.init()
    started = time.time()
    bench = AttnB1Bench(aot, out)
    bench.log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        for cfg_name in bench.index:
            bench.attempt(cfg_name, lambda: bench.sweep(cfg_name))
    finally:
        bench.results["seconds"] = time.time() - started
        bench.table()
        bench.save()


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})

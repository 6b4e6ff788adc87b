"""Triton vs CUDA C++ (templates/paged_decode.cu.j2) split-KV decode attention on an H200, from cubins.

Two steps, two machines (the helpers of bench/kernels_device.py: same cubin launcher, references, timing):
  python bench/decode_device.py prepare .aot_decode   # here, CPU only: Triton 3.9 + nvcc, sm90 cubins
  python bench/decode_device.py run .aot_decode       # on the GPU box: check every kernel set against the
                                                      # torch reference, then time them on the same inputs
Sets: 'triton' (the tune table's decode, plus decode_reduce and prefill for mixed batches) and 'cuda_t4',
'cuda_t8' (the template with 4 or 8 tokens per thread and tile; its splits are finished by Triton's
decode_reduce). The run writes results.json and log.txt under $OUT and prints a short table last:
microseconds, TB/s of K/V bytes read, and CUDA/Triton time (below 1: the template is faster).

Fused decode (the in-kernel split reduce and RotaryPagedAttention), old against new, < 90 s on the H200:
  python bench/decode_device.py prepare-fused .aot_fused   # here: sm90 cubins of the rotary kernel, the
                                                           # decode + decode_reduce of OLD_COMMIT (before
                                                           # the in-kernel reduce) and today's decode and
                                                           # decode_rotary, for the 8B and 1B shapes
  python bench/decode_device.py run-fused .aot_fused       # on the GPU: launched through engc._native (the
                                                           # runtime's launcher; without PDL), checked
                                                           # against the torch references, then timed
Sets per (shape, batch, context): 'old' = rotary + OLD_COMMIT's decode (+ decode_reduce when split, its split
rule), 'split' = rotary + today's decode (in-kernel reduce), 'fused' = decode_rotary alone. Timed as one
CUDA graph over copies of the inputs spread over a 2.2 GB cache (cold L2 for the K/V, as the 'run' step).
Writes results.json and log.txt under $OUT and prints the table last.
"""
from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from kernels_device import (CONFIGS, PAGE, Bench, _check, _Consts, attention_reference,  # noqa: E402
                            rel_err, time_graph)

ARCH = "sm90"
CUDA_SETS = {"cuda_t4": 4, "cuda_t8": 8}   # TOKENS_PER_THREAD of the template
GRAPH_CAPACITY = 8192                       # a CUDA graph sizes splits by the block table, not the batch


def prepare(out_dir: Path):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen import cuda
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs

    if cuda.nvcc_path() is None:
        raise SystemExit("nvcc not found: the CUDA decode kernel cannot be built here")
    index = {}
    for name, cfg_dict in CONFIGS.items():
        cfg = ModelConfig(**cfg_dict)
        t0 = time.time()
        sets = {"triton": compile_specs([s for s in model_specs(cfg, torch.bfloat16, ARCH, PAGE)
                                         if s.op == "paged_attention"], jobs=1)}
        for set_name, tokens in CUDA_SETS.items():
            spec, why = cuda.decode_spec(cfg, "bf16", ARCH, PAGE, {"TOKENS_PER_THREAD": tokens})
            if spec is None:
                raise SystemExit(f"{name}: {why}")
            sets[set_name] = cuda.compile_cuda([spec])
        print(f"{name}: {len(sets)} kernel sets in {time.time() - t0:.1f}s", flush=True)
        index[name] = {"cfg": cfg_dict, "sets": {}}
        for set_name, res in sets.items():
            for path, data in res.files.items():
                dst = out_dir / name / set_name / path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
            index[name]["sets"][set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


class DecodeBench(Bench):
    def kernel_sets(self, cfg_name):
        """set name -> a KernelSet view whose paged_attention consts pick that set's decode kernel."""
        triton = self.kernels(cfg_name, "triton")
        views = {"triton": triton}
        for set_name in CUDA_SETS:
            merged = self.kernels_with(cfg_name, set_name, triton)
            consts = {k: dict(v) for k, v in merged.consts("paged_attention").items()}
            consts["decode"]["impl"] = "cuda"
            views[set_name] = _Consts(merged, consts)
            views[set_name].run = merged.run
        return views

    def decode(self, cfg_name):
        torch = self.torch
        from engc.kernels import paged_attention as pa
        c = self.index[cfg_name]["cfg"]
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        num_blocks = int(2.2e9 // (2 * PAGE * KV * D * 2))
        cache = torch.randn(2, num_blocks, PAGE, KV, D, dtype=torch.bfloat16, device="cuda")
        scale = D ** -0.5
        ws = pa.decode_workspace(64, H, D, 64, "cuda")
        views = self.kernel_sets(cfg_name)

        def launches(view, q, bt, ctx, qsl, out, max_q, max_ctx=None, window=0):
            ls = pa.launch(q, cache, bt, ctx, qsl, out, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                           sliding_window=window, max_query_len=max_q, max_context_len=max_ctx, workspace=ws,
                           consts=view.consts("paged_attention"))
            return ls

        # correctness first: every set against the reference on the same inputs
        cases = [("b1_4096", [(4096, 1)], 0, None), ("b32_mixed_ctx", [(128 + 127 * i, 1) for i in range(32)], 0, None),
                 ("b64_1000_one_split", [(1000 + i, 1) for i in range(64)], 0, None),
                 ("b1_130_graph_splits", [(130, 1)], 0, GRAPH_CAPACITY),
                 ("padded_rows_ctx1", [(300, 1), (1, 1), (1, 1)], 0, GRAPH_CAPACITY),
                 ("mixed_prefill_extend_decode", [(1024, 1024), (2048, 512), (300, 1), (4096, 1), (777, 77)], 0, None),
                 ("window_256", [(1024, 1024), (300, 1), (4096, 1), (5000, 1)], 256, None)]
        for name, seqs, window, max_ctx in cases:
            q, bt, ctx, qsl = self.attention_inputs(c, seqs, num_blocks, 1)
            ref = attention_reference(q, cache, bt, ctx, qsl, H, KV, D, scale, window)
            for set_name, view in views.items():
                out = torch.full_like(q, float("nan"))
                ls = launches(view, q, bt, ctx, qsl, out, max(s[1] for s in seqs), max_ctx, window)
                used = sorted({v for v, _, _ in ls})
                view.run("paged_attention", ls)
                self.correct(f"{cfg_name}/{set_name}/{name}", rel_err(out.cpu(), ref), 2e-2, kernels=used)

        shapes = [(B, n, None) for B in (1, 32, 64) for n in (128, 512, 4096)] + [(1, 130, GRAPH_CAPACITY)]
        for B, ctx_len, max_ctx in shapes:
            kv_bytes = B * ctx_len * KV * D * 2 * 2
            copies = max(1, min(48, math.ceil(600e6 / kv_bytes), num_blocks * PAGE // (B * ctx_len)))
            inputs = [self.attention_inputs(c, [(ctx_len, 1)] * B, num_blocks, 100 + i) for i in range(copies)]
            outs = [torch.empty_like(inp[0]) for inp in inputs]
            row = dict(cfg=cfg_name, B=B, ctx=ctx_len, max_ctx=max_ctx or ctx_len, kv_bytes=kv_bytes, sets={})
            for set_name, view in views.items():
                sets = [launches(view, *inputs[i], outs[i], 1, max_ctx or ctx_len) for i in range(copies)]
                us = time_graph(lambda i: view.run("paged_attention", sets[i]), copies)
                row["sets"][set_name] = dict(us=us, tbs=kv_bytes / us / 1e6, splits=sets[0][0][1][2])
            self.results["timing"].append(row)
            self.log(f"decode {cfg_name} B={B} ctx={ctx_len} max_ctx={row['max_ctx']}: " + ", ".join(
                f"{k} {v['us']:.1f} us ({v['splits']} splits)" for k, v in row["sets"].items()))
        del cache

    def table(self):
        bad = [r for r in self.results["correctness"] if not r["ok"]]
        worst = max((r["err"] for r in self.results["correctness"]), default=float("nan"))
        lines = ["", f"== correctness: {len(self.results['correctness']) - len(bad)}/{len(self.results['correctness'])}"
                     f" ok, worst rel err {worst:.1e}" + (": FAILED " + ", ".join(r["name"] for r in bad) if bad else ""),
                 "== decode attention, sm90 cubins: us (TB/s of K/V) and CUDA/Triton time ==",
                 f"  {'cfg':<3} {'B':>2} {'ctx':>5} | {'triton':>15} | " + " | ".join(f"{s:>15}" for s in CUDA_SETS)
                 + " | " + " ".join(f"{s[5:]:>5}" for s in CUDA_SETS)]
        for row in self.results["timing"]:
            s = row["sets"]
            cells = " | ".join(f"{s[k]['us']:7.1f} ({s[k]['tbs']:4.2f})" for k in ["triton", *CUDA_SETS])
            ratios = " ".join(f"{s[k]['us'] / s['triton']['us']:5.2f}" for k in CUDA_SETS)
            ctx = f"{row['ctx']}" + ("g" if row["max_ctx"] != row["ctx"] else "")
            lines.append(f"  {row['cfg']:<3} {row['B']:>2} {ctx:>5} | {cells} | {ratios}")
        lines.append("  (g: splits sized for a CUDA graph's 8192-token block table, as the runtime does)")
        print("\n".join(lines), flush=True)
        self.log_lines.extend(lines)


def run(aot: Path, out: Path):
    import torch
    from cuda.bindings import driver
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    _check(driver.cuInit(0))
    bench = DecodeBench(aot, out)
    bench.log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        for cfg_name in bench.index:
            bench.attempt(cfg_name, lambda: bench.decode(cfg_name))
    finally:
        bench.table()
        bench.save()


# ------------------------------------------------------------------ fused decode: old against new

OLD_COMMIT = "ce78d4e"   # the last decode with a separate decode_reduce launch and 128-token splits
FUSED_POINTS = [(B, n, None) for B in (1, 4, 32, 64) for n in (128, 256, 1024, 4096)] + [(1, 1024, GRAPH_CAPACITY)]
FUSED_SETS = ("old", "split", "fused")
NEW_KERNELS = {("rotary", "pos_i64"), ("paged_attention", "decode"), ("paged_attention", "decode_rotary")}


def _old_decode_specs(cfg, out_dir: Path) -> list:
    """OLD_COMMIT's decode (its source from git, as a module of its own) and the decode_reduce it needed."""
    import dataclasses
    import importlib
    import subprocess
    import torch
    from engc.compiler.codegen.specs import model_specs
    src = subprocess.run(["git", "show", f"{OLD_COMMIT}:engc/kernels/paged_attention/triton.py"], cwd=Path(__file__)
                         .resolve().parents[1], capture_output=True, text=True, check=True).stdout
    mod_dir = out_dir / "_old_src"
    mod_dir.mkdir(parents=True, exist_ok=True)
    (mod_dir / "old_paged_attention.py").write_text(src)
    sys.path.insert(0, str(mod_dir))
    old = importlib.import_module("old_paged_attention")
    # impl "cuda" makes model_specs add decode_reduce (today only the CUDA template's splits need it)
    specs = {s.variant: s for s in model_specs(cfg, torch.bfloat16, ARCH, PAGE,
                                               {"paged_attention": {"decode": {"impl": "cuda"}}})
             if s.op == "paged_attention"}
    def as_old(spec, **launch):
        """spec on the old module's function: only the parameters that function has (no counters, no PDL)."""
        params = getattr(old, spec.fn_name).arg_names
        return dataclasses.replace(
            spec, module="old_paged_attention", launch={**spec.launch, **launch},
            arg_types={k: v for k, v in spec.arg_types.items() if k in params},
            constexprs={k: v for k, v in spec.constexprs.items() if k in params})
    decode = as_old(specs["decode"], impl="triton", min_split_tokens=128, in_kernel_reduce=False)  # its split rule
    return [decode, as_old(specs["decode_reduce"])]


def prepare_fused(out_dir: Path):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs
    index = {}
    for name, cfg_dict in CONFIGS.items():
        cfg = ModelConfig(**cfg_dict)
        sets = {"new": [s for s in model_specs(cfg, torch.bfloat16, ARCH, PAGE) if (s.op, s.variant) in NEW_KERNELS],
                "old": _old_decode_specs(cfg, out_dir)}
        index[name] = {"cfg": cfg_dict, "sets": {}}
        for set_name, specs in sets.items():
            t0 = time.time()
            res = compile_specs(specs, jobs=1)
            print(f"{name}/{set_name}: {', '.join(s.variant for s in specs)} in {time.time() - t0:.1f}s", flush=True)
            for path, data in res.files.items():
                dst = out_dir / name / set_name / path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
            index[name]["sets"][set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


class FusedBench(Bench):
    """rotary + old decode (+ reduce) vs rotary + new decode vs decode_rotary, through engc._native."""

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
                    q=torch.empty(len(contexts), H * D, dtype=torch.bfloat16, device="cuda"),
                    out=torch.empty(len(contexts), H * D, dtype=torch.bfloat16, device="cuda"))

    def fused(self, cfg_name):
        torch = self.torch
        from engc.kernels import paged_attention as pa
        from engc.kernels import rotary
        from kv_quant_device import Kernels
        c = self.index[cfg_name]["cfg"]
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        new, old = (Kernels(self.aot / cfg_name / s, self.index[cfg_name]["sets"][s]) for s in ("new", "old"))
        num_blocks = int(2.2e9 // (2 * PAGE * KV * D * 2))
        cache = torch.randn(2, num_blocks, PAGE, KV, D, dtype=torch.bfloat16, device="cuda")
        inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, D, 2, device="cuda").float() / D))
        counters = torch.zeros(1 << 16, dtype=torch.int32, device="cuda")
        scale = D ** -0.5
        attn = dict(num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale)

        def launches(set_name, x, max_ctx):
            """[(kernels, op, launches)] of one step of a set."""
            rope = (new, "rotary", rotary.launch(x["qkv"], x["pos"], inv_freq, cache, x["slots"], x["q"]))
            if set_name == "fused":
                return [(new, "paged_attention", pa.launch_rotary_decode(
                    x["qkv"], x["pos"], inv_freq, cache, x["slots"], x["bt"], x["ctx"], x["qsl"], x["out"],
                    max_context_len=max_ctx, consts=new.consts["paged_attention"], counters=counters, **attn))]
            ks = old if set_name == "old" else new
            return [rope, (ks, "paged_attention", pa.launch(
                x["q"], cache, x["bt"], x["ctx"], x["qsl"], x["out"], max_query_len=1, max_context_len=max_ctx,
                consts=ks.consts["paged_attention"], counters=counters, **attn))]

        def run(steps):
            for ks, op, ls in steps:
                ks.run(op, ls)

        def kv_rows(x):
            return torch.stack([cache[i].view(-1, KV, D)[x["slots"]] for i in (0, 1)]).float()

        # correctness: every set against rotary_kv_write then paged_attention (torch), slots poisoned first
        cases = [("b1_4096", [4096], None), ("b3_graph_splits", [130, 1000, 17], GRAPH_CAPACITY),
                 ("b64_1000", [1000 + i for i in range(64)], None), ("b4_ctx1_and_257", [1, 257, 64, 65], 1024)]
        for name, contexts, max_ctx in cases:
            x = self.step_inputs(c, contexts, num_blocks, 11)
            ref_q = rotary.rotary_kv_write(x["qkv"], x["pos"], inv_freq, cache, x["slots"], H, KV, D)
            ref = attention_reference(ref_q, cache, x["bt"], x["ctx"], x["qsl"], H, KV, D, scale)
            ref_rows = kv_rows(x)
            for set_name in FUSED_SETS:
                for i in (0, 1):
                    cache[i].view(-1, KV, D)[x["slots"]] = float("nan")
                x["out"].fill_(float("nan"))
                steps = launches(set_name, x, max_ctx)
                run(steps)
                torch.cuda.synchronize()
                used = [v for _, _, ls in steps for v, _, _ in ls]
                err = max(rel_err(x["out"].cpu(), ref), rel_err(kv_rows(x).cpu(), ref_rows.cpu()))
                self.correct(f"{cfg_name}/{set_name}/{name}", err, 2e-2, kernels=used)
            self.correct(f"{cfg_name}/counters_zero/{name}", float(counters.abs().sum()), 0)

        for B, ctx_len, max_ctx in FUSED_POINTS:
            kv_bytes = B * ctx_len * KV * D * 2 * 2
            copies = max(1, min(48, math.ceil(600e6 / kv_bytes), num_blocks * PAGE // (B * ctx_len)))
            xs = [self.step_inputs(c, [ctx_len] * B, num_blocks, 100 + i) for i in range(copies)]
            row = dict(cfg=cfg_name, B=B, ctx=ctx_len, max_ctx=max_ctx or ctx_len, kv_bytes=kv_bytes, sets={})
            for set_name in FUSED_SETS:
                steps = [launches(set_name, x, max_ctx or ctx_len) for x in xs]
                us = time_graph(lambda i: run(steps[i]), copies)
                row["sets"][set_name] = dict(us=us, splits=steps[0][-1][2][0][1][2],
                                             launches=sum(len(ls) for _, _, ls in steps[0]))
            self.results["timing"].append(row)
            self.log(f"fused {cfg_name} B={B} ctx={ctx_len} max_ctx={row['max_ctx']}: " + ", ".join(
                f"{k} {v['us']:.2f} us ({v['launches']} launches, {v['splits']} splits)"
                for k, v in row["sets"].items()))

    def table(self):
        bad = [r for r in self.results["correctness"] if not r["ok"]]
        worst = max((r["err"] for r in self.results["correctness"]), default=float("nan"))
        lines = ["", f"== correctness: {len(self.results['correctness']) - len(bad)}/{len(self.results['correctness'])}"
                     f" ok, worst rel err {worst:.1e}" + (": FAILED " + ", ".join(r["name"] for r in bad) if bad else ""),
                 "== rotary + decode attention, sm90 cubins, us a layer (splits); old = rotary + decode (+ reduce)",
                 "   of " + OLD_COMMIT + ", split = rotary + in-kernel-reduce decode, fused = decode_rotary ==",
                 f"  {'cfg':<3} {'B':>2} {'ctx':>5} | {'old':>11} | {'split':>11} | {'fused':>11} | fused/old"]
        for row in self.results["timing"]:
            s = row["sets"]
            cells = " | ".join(f"{s[k]['us']:6.2f} ({s[k]['splits']:>2})" for k in FUSED_SETS)
            ctx = f"{row['ctx']}" + ("g" if row["max_ctx"] != row["ctx"] else "")
            lines.append(f"  {row['cfg']:<3} {row['B']:>2} {ctx:>5} | {cells} | {s['fused']['us'] / s['old']['us']:5.2f}")
        lines.append(f"  (g: splits sized for a CUDA graph's {GRAPH_CAPACITY}-token block table, as the runtime's)")
        print("\n".join(lines), flush=True)
        self.log_lines.extend(lines)


def run_fused(aot: Path, out: Path):
    import torch
    torch.cuda.init()
    started = time.time()
    bench = FusedBench(aot, out)
    bench.log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        for cfg_name in bench.index:
            bench.attempt(cfg_name, lambda: bench.fused(cfg_name))
    finally:
        bench.results["seconds"] = time.time() - started
        bench.table()
        bench.save()


if __name__ == "__main__":
    from kernels_device import step_main
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run,
               "prepare-fused": lambda aot, out: prepare_fused(aot), "run-fused": run_fused})

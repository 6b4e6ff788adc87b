"""Triton vs CUDA C++ (templates/paged_decode.cu.j2) split-KV decode attention on an H200, from cubins.

Two steps, two machines (the helpers of bench/kernels_device.py: same cubin launcher, references, timing):
  python bench/decode_device.py prepare .aot_decode   # here, CPU only: Triton 3.9 + nvcc, sm90 cubins
  python bench/decode_device.py run .aot_decode       # on the GPU box: check every kernel set against the
                                                      # torch reference, then time them on the same inputs
Sets: 'triton' (the tune table's decode, plus decode_reduce and prefill for mixed batches) and 'cuda_t4',
'cuda_t8' (the template with 4 or 8 tokens per thread and tile; its splits are finished by Triton's
decode_reduce). The run writes results.json and log.txt under $OUT and prints a short table last:
microseconds, TB/s of K/V bytes read, and CUDA/Triton time (below 1: the template is faster).
"""
from __future__ import annotations

import argparse
import json
import math
import os
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
            try:
                bench.decode(cfg_name)
            except Exception as exc:
                import traceback
                bench.log(f"STEP FAILED in {cfg_name}: {exc!r}\n{traceback.format_exc()}")
                bench.results["notes"].append(repr(exc))
            bench.save()
    finally:
        bench.table()
        bench.save()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=["prepare", "run"])
    ap.add_argument("aot", type=Path)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = ap.parse_args()
    if args.step == "prepare":
        prepare(args.aot)
    else:
        run(args.aot, args.out)


if __name__ == "__main__":
    main()

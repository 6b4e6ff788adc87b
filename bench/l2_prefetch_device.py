#!/usr/bin/env python3
"""The L2 prefetch of decode steps (runtime/l2_prefetch.py) on the H200: does it pay, and with what budgets?

Here (CPU):    python bench/l2_prefetch_device.py prepare --cache .kcache --aot .l2aot
On the device: python bench/l2_prefetch_device.py run --cache .kcache --aot .l2aot --shapes 1b,8b --out $OUT/l2

Per shape (random-weight checkpoints and bundles as bench/gpu_bench.py makes them):
  1. the bundle's prefetch kernel, and the asm variant (MODE 1, prepared here), read what they promise
     (MODE 0: XOR checksum of a whole o_proj against the CPU);
  2. one o_proj after a 256 MB L2 flush, in CUDA graphs: cold, after a prefetch of its weight on the same
     stream, the prefetch alone (its bandwidth), i.e. what a GEMM that hits L2 costs;
  3. the engine with each budget setting (graphs re-captured): batch-1 decode tok/s, batch-1 graph replay,
     and batch-32 128/128 output tok/s, against prefetch off in the same process.
Prints a short table last; JSON under --out.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

MB = 1 << 20
# name -> (attention-window bytes, norm-window bytes, max rows, MODE)
SETTINGS = {"off": (0, 0, 16, 0), "attn32": (32 * MB, 0, 16, 0), "attn32+norm8": (32 * MB, 8 * MB, 16, 0),
            "attn32+norm16": (32 * MB, 16 * MB, 16, 0), "attn48+norm8": (48 * MB, 8 * MB, 16, 0),
            "attn32+norm8/asm": (32 * MB, 8 * MB, 16, 1), "attn32+norm8/rows64": (32 * MB, 8 * MB, 64, 0)}


def prepare(args):
    import gpu_bench
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import l2_prefetch_specs
    gpu_bench.prepare(args)
    res = compile_specs(l2_prefetch_specs("sm90", {"MODE": 1}), progress=None, jobs=1)
    aot = Path(args.aot)
    aot.mkdir(parents=True, exist_ok=True)
    for path, data in res.files.items():
        (aot / path).parent.mkdir(parents=True, exist_ok=True)
        (aot / path).write_bytes(data)
    (aot / "records.json").write_text(json.dumps(res.records, indent=1))


def asm_kernel(aot: Path):
    from engc.runtime.cubin import load_kernel, signature_from_triton
    r = json.loads((aot / "records.json").read_text())[0]
    scratch = r.get("scratch_params", 2)
    sig = signature_from_triton([a["type"] for a in r["args"][:len(r["args"]) - scratch]])
    return load_kernel((aot / r["cubin"]).read_bytes(), r["entry"], sig, block_x=32 * r["num_warps"],
                       shared_mem=r["shared_mem"], scratch_params=scratch)


def bench_shape(shape: str, args) -> dict:
    import torch
    import torch.nn.functional as F
    import gpu_bench
    from kernels_device import time_graph
    from engc.compiler.build import BuildOptions, build
    from engc.kernels import l2_prefetch
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    work = Path(args.work)
    ckpt, bundle = work / f"ckpt-{shape}", work / f"bundle-{shape}"
    if not (ckpt / "config.json").exists():
        gpu_bench.make_checkpoint(shape, ckpt)
    if not (bundle / "manifest.json").exists():
        build(str(ckpt), bundle, BuildOptions(archs=("sm90",), dtype="bfloat16", kernel_cache=args.cache))
    model = load(bundle, device="cuda")
    p = model.l2_prefetch
    res = {"shape": shape, "gpu": torch.cuda.get_device_name(), "commit": args.commit,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "windows": len(p.forks)}
    bundle_kernel = p.kernels.kernels[("l2_prefetch", "default")]
    kernels = {0: bundle_kernel, 1: asm_kernel(Path(args.aot))}

    def use(mode):
        p.kernels.kernels[("l2_prefetch", "default")] = kernels[mode]

    # 1. correctness of the bundle's kernel on a whole o_proj
    o_name = next(w.weight for w in p.forks.values() if w.attention)
    w_o = model.executor.weights[o_name]
    nbytes = w_o.numel() * w_o.element_size()
    c = p.consts["default"]
    use(0)
    p.kernels.run("l2_prefetch", l2_prefetch.launch(w_o, nbytes, p.out, p.consts))
    want = l2_prefetch.checksums(w_o, nbytes, c["BLOCK"], c["programs"])
    res["check_mode0"] = bool(torch.equal(p.out[:len(want)].cpu(), want))

    # 2. one o_proj: cold, after a prefetch, and the prefetch alone (each after a 256 MB flush)
    flush = torch.empty(256 * MB // 4, dtype=torch.float32, device="cuda")
    x = torch.randn(1, w_o.shape[1], dtype=w_o.dtype, device="cuda")

    def prefetch(nb, mode):
        use(mode)
        p.kernels.run("l2_prefetch", l2_prefetch.launch(w_o, nb, p.out, p.consts))

    cases = {"flush": lambda i: flush.zero_(),
             "flush+o_proj": lambda i: (flush.zero_(), F.linear(x, w_o)),
             "flush+prefetch": lambda i: (flush.zero_(), prefetch(nbytes, 0)),
             "flush+prefetch+o_proj": lambda i: (flush.zero_(), prefetch(nbytes, 0), F.linear(x, w_o)),
             "flush+prefetch_asm": lambda i: (flush.zero_(), prefetch(nbytes, 1)),
             "flush+prefetch_asm+o_proj": lambda i: (flush.zero_(), prefetch(nbytes, 1), F.linear(x, w_o)),
             "o_proj_hot": lambda i: F.linear(x, w_o)}
    us = {k: time_graph(fn, 4, reps=30) for k, fn in cases.items()}
    base = us["flush"]
    res["o_proj_us"] = {"bytes": nbytes, **{k: round(v - (base if k.startswith("flush+") else 0), 2)
                                            for k, v in us.items() if k != "flush"}}
    use(0)

    # 3. the engine with each setting
    ids1 = gpu_bench.prompts(1, 128, model.config.vocab_size, 1)
    ids32 = gpu_bench.prompts(32, 128, model.config.vocab_size, 32)
    res["engine"] = {}
    for name, (attn, norm, rows, mode) in SETTINGS.items():
        p.budget = {True: attn, False: norm}
        p.max_rows = rows
        use(mode)
        engine = Engine(model, EngineConfig(max_num_seqs=64, num_blocks=2048, max_batched_tokens=8192))
        gpu_bench.run_batch(engine, ids1, 8)
        _, total, first = gpu_bench.run_batch(engine, ids1, 128)
        graph, _ = engine.executor.graphs[engine.executor.graph_key(1, 192)]
        _, t = gpu_bench.timed(lambda: [graph.replay() for _ in range(100)])
        _, total32, _ = gpu_bench.run_batch(engine, ids32, 128)
        res["engine"][name] = {"b1_decode_tok_s": round(127 / (total - first), 1), "b1_graph_ms": round(t * 10, 4),
                               "b32_out_tok_s": round(32 * 128 / total32, 1)}
        print(name, res["engine"][name], flush=True)
        del engine, graph
        torch.cuda.empty_cache()
    if args.serve:
        res.update(gpu_bench.serve_first_token(bundle))
    return res


def run(args):
    import subprocess
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results = []
    for shape in args.shapes.split(","):
        if args.child:
            r = bench_shape(shape, args)
            (out / f"l2_{shape}.json").write_text(json.dumps(r, indent=1))
            return
        subprocess.run([sys.executable, __file__, "run", "--child", "--shapes", shape, "--cache", args.cache,
                        "--aot", args.aot, "--out", str(out), "--work", args.work, "--commit", args.commit]
                       + (["--serve"] if args.serve and shape == "8b" else []), timeout=400)
        f = out / f"l2_{shape}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"shape": shape, "error": "no result"})
    for r in results:
        print(f"\n== {r['shape']}: {r.get('windows')} windows, kernel check {r.get('check_mode0')}, "
              f"first token {r.get('engc_run_to_first_token_s', '-')} s {r.get('error', '')}")
        print("   o_proj us:", json.dumps(r.get("o_proj_us")))
        off = r.get("engine", {}).get("off", {})
        for name, e in r.get("engine", {}).items():
            ratio = {k: round(v / off[k], 3) for k, v in e.items() if off.get(k)}
            print(f"   {name:22} {e}  vs off {ratio}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("--shapes", default="1b,8b")
    ap.add_argument("--cache", default=str(ROOT / ".kcache"))
    ap.add_argument("--aot", default=str(ROOT / ".l2aot"))
    ap.add_argument("--out", default="/tmp/engc_l2")
    ap.add_argument("--work", default="/tmp/engc_work")
    ap.add_argument("--commit", default="")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--serve", action="store_true", help="also time `engc run` of the 8b bundle to its first token")
    args = ap.parse_args()
    prepare(args) if args.verb == "prepare" else run(args)


if __name__ == "__main__":
    main()

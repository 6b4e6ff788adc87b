#!/usr/bin/env python3
"""engc on the H200: random-weight Llama-3.2-1B and Llama-3-8B shapes, built, checked and timed.

Here (CPU):    python bench/gpu_bench.py prepare --cache .kcache     # compile the sm90 kernels into a cache
On the device: python bench/gpu_bench.py run --cache .kcache --shapes 1b,8b --out $OUT

Shapes and their build variants ("8b-fp8", "8b-kv8", "8b-int4-qhead", ...) are described in bench/shapes.py;
an int4 shape's kernels need `prepare --shapes 8b-int4`. With the base shape in the same invocation, the
table ends with the variant's KV blocks and throughputs (b1 decode, b32/b64/b256) against it.

`run` makes each checkpoint (HF folder, bf16, seed 0), builds its bundle with `engc build --arch sm90
--kernel-cache` (the cubins compiled here, no compiler there), checks GPU logits against the reference
ops (bench/reference_check.py), and times decode, throughput, prefill and start-up. Figures are printed
as ratios against the copy-bandwidth roofline and LMDeploy's figures measured on the same card; JSON goes
to --out. --profile-only writes per-kernel tables and step timelines instead (bench/step_profile.py).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from reference_check import check_against_reference  # noqa: E402
from shapes import (INT4_GROUP, base_shape, checkpoint_dir, dtype_of, is_int4, is_int4_head, is_moe,  # noqa: E402
                    is_variant, kv_cache_of, long_context_of, make_checkpoint, model_config, prompts, quant_of,
                    step_weight_bytes, tp_of)
from step_profile import decode_breakdown, kernel_profile, step_timeline  # noqa: E402
from timing import COPY_BW, GpuClocks, frac_of_gemm_peak, synced  # noqa: E402

# LMDeploy 0.18's PyTorch engine on the same H200, same shapes and 128/128 requests: b1 decode and the
# throughput of batch N, output tok/s
LMDEPLOY = {"1b": {"b1": 517.0, "bN": 14356.0, "N": 64}, "8b": {"b1": 214.7, "bN": 5347.0, "N": 32}}
BATCHES = {"1b": [64, 256], "8b": [32, 64, 256], "tiny": [4],   # throughput batches of each base shape
           "olmoe": [32, 64, 256], "olmoe4": [32, 64, 256], "qwen3moe": [32, 64, 256], "qwen3moe48": [32, 64, 256],
           "qwen3moe4": [32, 64, 256], "v2lite": [32, 64, 256]}


def tune_overrides(args) -> dict | None:
    """--tune: the tune entries to build with (engc build --tune's form and checks)."""
    from engc.compiler.tune import check_overrides
    return check_overrides(json.loads(args.tune)) if args.tune else None


def skip_pass(name: str) -> None:
    """--skip-pass: build without the graph pass `name` (an A/B of a fusion on one machine; bench only). The
    build's pass list and its module's names both point at an identity named skipped_<name>."""
    from engc.compiler import build as build_module, passes
    known = [p.__name__ for p in passes.PASSES] + [n for n in vars(build_module) if n.startswith(("fuse_", "quantize_"))]
    if name not in known:
        raise SystemExit(f"--skip-pass {name}: not a pass of engc build ({', '.join(sorted(set(known)))})")

    def skipped(g):
        return g
    skipped.__name__ = "skipped_" + name
    passes.PASSES[:] = [skipped if p.__name__ == name else p for p in passes.PASSES]
    if hasattr(build_module, name):
        setattr(build_module, name, skipped)


def prepare(args):
    from engc.bundle.tp import rank_config
    from engc.compiler import tune
    from engc.compiler.kernel_cache import compile_cached
    with tune.overridden(tune_overrides(args)):
        for shape in args.shapes.split(","):
            t = time.time()
            r = compile_cached(rank_config(model_config(shape), tp_of(shape)), dtype_of(shape), ["sm90"], 16,
                               Path(args.cache),
                               kv_cache=kv_cache_of(shape), quant="fp8" if quant_of(shape) == "fp8" else "none",
                               int4_group_sizes=(INT4_GROUP,) if is_int4(shape) else (),
                               int4_lm_head=is_int4_head(shape),
                               int4_experts=INT4_GROUP if is_int4(shape) and is_moe(shape) else 0)
            print(f"{shape}: {len(r.records)} kernels in {time.time() - t:.1f}s")


# ------------------------------------------------------------------------------------------ device

def bench_shape(shape: str, args) -> dict:
    import torch
    from engc.bundle.reader import open_bundle
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    from engc.runtime.tp import load_rank
    res = {"shape": shape, "gpu": torch.cuda.get_device_name(), "commit": args.commit, "tune": args.tune,
           "skip_pass": args.skip_pass,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d")}
    ckpt, bundle = _checkpoint_and_bundle(shape, args, res)
    if args.fp8_slow_accum:   # the A/B of fp8_linear's FAST_ACCUM (bench/fp8_gemm_bench.py times the GEMMs alone)
        from engc.kernels.fp8_linear import bind
        bind.FAST_ACCUM = False
        res["fp8_slow_accum"] = True
    if args.ablate:   # bench/ablate.py: timings only, the outputs are garbage
        import ablate
        ablate.install(set(args.ablate.split(",")))
        res["ablate"] = args.ablate
    if not args.profile_only and not args.quick:
        res.update(_start_up(shape, ckpt, bundle, args))
    _, res["verify_hashes_s"] = synced(lambda: open_bundle(bundle))
    # a -tp<N> bundle: rank 0 here, the others in processes of their own on the next GPUs (runtime/tp.py)
    model, res["load_s"] = synced(lambda: load(bundle, device="cuda") if tp_of(shape) == 1
                                  else load_rank(str(bundle), "cuda", tp_of(shape)))
    cfg = model.config
    # A MoE shape's reference check (its torch op gathers each pair's expert weights: GBs at 40 tokens) needs
    # room the default KV fraction leaves none of; 0.7 still holds millions of tokens on these shapes
    kv_fraction = 0.7 if cfg.num_experts else EngineConfig.kv_memory_fraction
    engine, res["engine_init_and_graph_capture_s"] = synced(
        lambda: Engine(model, EngineConfig(max_num_seqs=max([256, *batches_of(args, base_shape(shape))]),
                                           max_batched_tokens=args.max_batched_tokens,
                                           kv_memory_fraction=kv_fraction)))
    res["kv_blocks"] = engine.kv.allocator.num_blocks
    # the most rows a decode step replays from a CUDA graph (larger steps run eagerly, with the host on their path)
    graphed = getattr(engine.runner.executor, "buckets", None)
    res["decode_graph_rows"] = graphed[-1] if graphed and engine.runner.graphs else 0
    # the largest 128-in / 128-out batch the KV cache holds at once (each sequence's 256 tokens in whole blocks)
    res["kv_holds_128_128_seqs"] = engine.kv.allocator.num_blocks // -(-256 // engine.kv.allocator.block_size)
    if args.profile_only:
        # batch 1 and the shape's first throughput batch (--batch-sizes), 32 without one
        profiled = (1, ([n for n in batches_of(args, base_shape(shape)) if n > 1] or [32])[0])
        res.update(kernel_profile(engine, cfg, Path(args.out), shape, profiled))
        for n in profiled:
            res.update(step_timeline(engine, cfg, Path(args.out), shape, n))
        return res
    # correctness: GPU kernels vs the reference ops on the same weights (prefill + 16 greedy tokens)
    try:
        if args.quick:
            raise RuntimeError("skipped (--quick)")
        res["check"] = check_against_reference(model, engine, cfg)
    except Exception as e:  # report and go on to the timings
        res["check"] = {"error": repr(e)[:500]}
    if args.check_only:
        return res
    if long_context_of(shape):   # its short-prompt figures are the base shape's
        return {**res, **_long_context(shape, engine, cfg)}
    res.update(_decode(shape, engine, cfg, args))
    res.update(_throughput(shape, engine, cfg, args))
    if not args.quick:
        res.update(_sampled_long_prefill(shape, engine, cfg, args))
    else:   # --quick times only what is asked for beyond the throughput batches
        res.update(_sampled(shape, engine, cfg) if args.sampled else {})
        res.update(_long(engine, cfg) if args.long else {})
    return res


def _checkpoint_and_bundle(shape: str, args, res: dict) -> tuple[Path, Path]:
    """The shape's checkpoint and bundle under --work (the checkpoint under --ckpt-work where given), made where
    missing (--quick reuses a built bundle); a --tune table or a --skip-pass gets a bundle of its own."""
    from engc.compiler.build import BuildOptions, build
    work = Path(args.work)
    ckpt, bundle = checkpoint_dir(Path(args.ckpt_work or work), shape), work / f"bundle-{shape}"
    if args.tune:
        import hashlib
        bundle = bundle.with_name(bundle.name + "-tuned-" + hashlib.sha256(args.tune.encode()).hexdigest()[:8])
    if args.skip_pass:
        skip_pass(args.skip_pass)
        bundle = bundle.with_name(bundle.name + "-skip-" + args.skip_pass)
    if not (ckpt / "config.json").exists():
        _, res["make_checkpoint_s"] = synced(lambda: make_checkpoint(shape, ckpt))
    t = time.perf_counter()
    if not (args.quick and (bundle / "manifest.json").exists()):
        build(str(ckpt), bundle, BuildOptions(archs=("sm90",), dtype="float32" if base_shape(shape) == "tiny"
                                              else "bfloat16", kernel_cache=args.cache, kv_cache=kv_cache_of(shape),
                                              quant=quant_of(shape), tune=tune_overrides(args), tp=tp_of(shape)))
        res["build_s"] = round(time.perf_counter() - t, 1)
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith("ENGC_")}
    manifest = json.loads((bundle / "manifest.json").read_text())
    # which Triton compiled the cubins: the device's own version would mean the kernel cache missed
    res["kernels_compiled_by_triton"] = sorted({k["triton_version"] for k in manifest["kernels"]
                                                if "triton_version" in k})
    res["kernels_compiled_by_nvcc"] = sorted({k["nvcc_version"] for k in manifest["kernels"] if "nvcc_version" in k})
    return ckpt, bundle


def _start_up(shape: str, ckpt: Path, bundle: Path, args) -> dict:
    """A fresh `engc generate` process to its one token, as a user would see it; `engc run` to its first
    completion (--serve); HF transformers' batch-1 decode on the same checkpoint, once per checkpoint."""
    res = {}
    t = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "engc.cli", "generate", str(bundle), "--raw", "--prompt",
                        "t5 t6 t7", "--max-tokens", "1"], capture_output=True, text=True, timeout=300)
    res["process_to_first_token_s"] = round(time.perf_counter() - t, 2)
    if r.returncode:
        res["generate_error"] = r.stderr[-2000:]
    if args.serve:
        res.update(serve_first_token(bundle))
    if base_shape(shape) != "tiny" and shape == base_shape(shape) and not args.no_hf:
        try:
            res.update(hf_floor(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"]))
        except Exception as e:  # the floor is context, not a gate
            res["hf_transformers_error"] = repr(e)[:300]
    return res


def run_batch(engine, ids_list, out_len, **sampling):
    """ids_list through the engine to out_len tokens each: (sequences, seconds, seconds to every first token)."""
    import torch
    from engc.runtime.sampling import SamplingParams
    p = SamplingParams(max_tokens=out_len, ignore_eos=True, **({"temperature": 0} | sampling))
    seqs = [engine.add_request(ids, p) for ids in ids_list]
    first = None
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
        if first is None and all(len(s.output_ids) >= 1 for s in seqs):
            first = time.perf_counter()
    return seqs, time.perf_counter() - t0, first - t0


def _decode(shape: str, engine, cfg, args) -> dict:
    """Batch-1 decode, 128 in / 128 out, against the copy roofline and LMDeploy; where its step's time goes,
    and that of LMDeploy's throughput batch."""
    base = base_shape(shape)
    wbytes, _ = step_weight_bytes(shape, cfg)
    ids = prompts(1, 128, cfg.vocab_size, 1)
    run_batch(engine, ids, 8)  # warm-up
    _, total, first = run_batch(engine, ids, 128)
    decode_tps = 127 / (total - first)
    kv_bytes = 2 * cfg.num_layers * cfg.kv_size * 2 * 192  # average context ~192 tokens
    res = {"b1_decode_tok_s": round(decode_tps, 1),
           # N ranks read their shares of the weights side by side: N GPUs' copy bandwidth
           "b1_frac_of_copy_roofline": round(decode_tps * (wbytes + kv_bytes) / (COPY_BW * tp_of(shape)), 3),
           "b1_vs_lmdeploy": round(decode_tps / LMDEPLOY.get(base, {}).get("b1", float("nan")), 3)}
    res.update(decode_breakdown(engine, ids, Path(args.out) / f"profile_{shape}.txt"))
    n = LMDEPLOY.get(base, {}).get("N")
    if n and n in batches_of(args, base):
        res.update(decode_breakdown(engine, prompts(n, 128, cfg.vocab_size, 300 + n),
                                    Path(args.out) / f"profile_{shape}_b{n}.txt"))
    return res


def batches_of(args, base: str) -> list[int]:
    """The throughput batches of a base shape ("v2lite24" has v2lite's)."""
    return args.batches.get(base, args.batches.get("v2lite", []) if base.startswith("v2lite") else [])


def _throughput(shape: str, engine, cfg, args) -> dict:
    """128 in / 128 out at each batch size, end to end. Each batch runs twice, other prompts the second time:
    the first run also pays one-time costs (its first prefill of n x 128 tokens, the allocator's first pools
    for it), so the figure is the second run's, as batch 1's follows a warm-up."""
    base, res = base_shape(shape), {}
    for n in batches_of(args, base)[:2 if args.quick else None]:
        _, total, first = run_batch(engine, prompts(n, 128, cfg.vocab_size, n + 1000), 128)
        res[f"b{n}_128_128_first_run_out_tok_s"] = round(n * 128 / total, 1)
        with GpuClocks() as clocks:
            _, total, first = run_batch(engine, prompts(n, 128, cfg.vocab_size, n), 128)
        res[f"b{n}_128_128_out_tok_s"] = round(n * 128 / total, 1)
        res[f"b{n}_128_128_gpu_clocks"] = clocks.summary
        # until every sequence has its first token (the prefill, in max_batched_tokens chunks), then decode
        res[f"b{n}_128_128_first_tokens_s"] = round(first, 4)
        res[f"b{n}_128_128_after_first_ms_per_token"] = round(1000 * (total - first) / 127, 3)
        if LMDEPLOY.get(base, {}).get("N") == n:
            res[f"b{n}_vs_lmdeploy"] = round(n * 128 / total / LMDEPLOY[base]["bN"], 3)
    return res


def _sampled(shape: str, engine, cfg, pairs: int = 3) -> dict:
    """Sampled decoding (temperature 0.8, top-k 50, top-p 0.95 on the GPU) at LMDeploy's throughput batch against
    greedy decoding of the same batch: greedy and sampled runs alternate, fresh prompts each (no prefix-cache
    hits), and the ratio is the median of the pairs', so a drift of the machine's speed over the sitting (a few
    percent, as large as the sampler's cost) does not decide it."""
    import statistics
    n = LMDEPLOY.get(base_shape(shape), {}).get("N", 4)
    greedy, sampled = [], []
    with GpuClocks() as clocks:
        for i in range(pairs):
            _, total, _ = run_batch(engine, prompts(n, 128, cfg.vocab_size, 5000 + 2 * i), 128)
            greedy.append(n * 128 / total)
            _, total, _ = run_batch(engine, prompts(n, 128, cfg.vocab_size, 5001 + 2 * i), 128,
                                    temperature=0.8, top_k=50, top_p=0.95, seed=0)
            sampled.append(n * 128 / total)
    return {f"b{n}_sampled_gpu_clocks": clocks.summary,
            f"b{n}_128_128_sampled_out_tok_s": round(statistics.median(sampled), 1),
            f"b{n}_128_128_greedy_paired_out_tok_s": round(statistics.median(greedy), 1),
            f"b{n}_sampled_over_greedy": round(statistics.median(s / g for s, g in zip(sampled, greedy)), 3)}


def _sampled_long_prefill(shape: str, engine, cfg, args) -> dict:
    """_sampled; 1000 in / 1000 out at batch 64 (--long); one 4k-token prefill against the GEMM peak."""
    from engc.runtime.sampling import SamplingParams
    base, res = base_shape(shape), _sampled(shape, engine, cfg)
    if base == "tiny":
        return res
    if args.long:
        res.update(_long(engine, cfg))
    # 4,096 tokens, or all the context holds with the one output token (OLMoE's is 4,096 in all)
    n = min(4096, engine.max_context - 1)
    for seed in (3, 4):  # distinct prompts: the prefix cache must not serve the second one
        engine.add_request(prompts(1, n, cfg.vocab_size, seed)[0],
                           SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
        _, dt = synced(engine.step)
    res["prefill_4k_tokens"] = n
    res["prefill_4k_s"] = round(dt, 4)
    res.update(_prefill_rate("prefill_4k", prefill_flops(shape, cfg, n), dt))
    return res


def _long(engine, cfg) -> dict:
    """1000 in / 1000 out at batch 64."""
    _, total, _ = run_batch(engine, prompts(64, 1000, cfg.vocab_size, 7), 1000)
    return {"b64_1000_1000_out_tok_s": round(64 * 1000 / total, 1)}


def prefill_flops(shape: str, cfg, n: int) -> int:
    """FLOPs of one n-token prompt's prefill: every weight once a token, and causal attention."""
    _, params = step_weight_bytes(shape, cfg)
    return 2 * params * n + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * n * n


def _prefill_rate(key: str, flops: int, seconds: float) -> dict:
    return {f"{key}_tflops": round(flops / seconds / 1e12, 1),
            f"{key}_frac_of_gemm_peak": frac_of_gemm_peak(flops / seconds)}


def _long_context(shape: str, engine, cfg) -> dict:
    """One prompt of the variant's length (32,768 tokens for "-32k"), prefilled in the engine's chunks, against the
    GEMM peak; then the decode step at that context, for 1 and 8 sequences. Each timed run follows an untimed one
    of the same size with other prompts (the long steps' first allocations), and no two prompts share a prefix."""
    n, vocab = long_context_of(shape), cfg.vocab_size
    res = {"long_prompt_tokens": n, "prefill_chunk_tokens": engine.config.max_batched_tokens}
    for b, seed in ((1, 11), (8, 21)):
        run_batch(engine, prompts(b, n, vocab, seed), 2)
        _, total, first = run_batch(engine, prompts(b, n, vocab, seed + 1), 65)
        if b == 1:
            res["prefill_long_s"] = round(first, 3)
            res.update(_prefill_rate("prefill_long", prefill_flops(shape, cfg, n), first))
        res[f"decode_at_long_b{b}_ms_per_step"] = round(1000 * (total - first) / 64, 3)
        res[f"decode_at_long_b{b}_out_tok_s"] = round(b * 64 / (total - first), 1)
    return res


def hf_floor(ckpt: Path, cfg_vocab: int) -> dict:
    """HF transformers on the same checkpoint, bf16, batch 1, greedy: the floor any engine must clear."""
    import torch
    import transformers
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16).cuda().eval()
    ids = torch.tensor(prompts(1, 128, cfg_vocab, 1), device="cuda")
    kw = dict(do_sample=False, min_new_tokens=64, max_new_tokens=64, pad_token_id=0)
    with torch.inference_mode():
        model.generate(ids, **kw)  # warm-up
        _, dt = synced(lambda: model.generate(ids, **kw))
    del model
    torch.cuda.empty_cache()
    return {"hf_transformers_b1_tok_s": round(64 / dt, 1)}


def serve_first_token(bundle: Path, port: int = 23391) -> dict:
    """`engc run` in a fresh process: seconds from its start to the first completion token."""
    import urllib.request
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "engc.cli", "run", str(bundle), "--port", str(port),
                             "--served-model-name", "m"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    body = json.dumps({"model": "m", "prompt": "t5 t6 t7", "max_tokens": 1}).encode()
    out = {}
    try:
        while time.perf_counter() - t0 < 120 and proc.poll() is None:
            try:
                req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                             {"Content-Type": "application/json"})
                with urllib.request.urlopen(req, timeout=60) as r:
                    out["engc_run_to_first_token_s"] = round(time.perf_counter() - t0, 2)
                    out["engc_run_reply"] = json.loads(r.read())["usage"]
                    break
            except OSError:
                time.sleep(0.05)
    finally:
        proc.terminate()
        log = proc.communicate(timeout=30)[0].decode(errors="replace")
    if "engc_run_to_first_token_s" not in out:
        out["engc_run_error"] = log[-1500:]
    return out


def run(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.batches = dict(BATCHES)
    if args.batch_sizes:   # the throughput batches of every shape
        args.batches = {shape: [int(b) for b in args.batch_sizes.split(",")] for shape in BATCHES}
    if args.child:
        shape = args.shapes
        res = bench_shape(shape, args)
        (out / f"engc_{shape}.json").write_text(json.dumps(res, indent=1))
        print(json.dumps(res), flush=True)
        return
    results = []
    for shape in args.shapes.split(","):   # one process per shape, so each starts with an empty GPU
        subprocess.run(_child_command(shape, args), timeout=args.timeout)
        f = out / f"engc_{shape}.json"
        results.append(json.loads(f.read_text()) if f.exists() else {"shape": shape, "error": "no result"})
    print("\n===== engc on", results[0].get("gpu", "?"), "=====")
    keys = sorted({k for r in results for k in r if k not in ("gpu", "commit", "check", "shape")})
    for r in results:
        print(f"-- {r['shape']}: check {json.dumps(r.get('check'))}")
        for k in keys:
            if k in r:
                print(f"   {k:36} {r[k]}")
    _compare_variants(results, out)


def _child_command(shape: str, args) -> list[str]:
    cmd = [sys.executable, __file__, "run", "--child", "--shapes", shape, "--cache", args.cache,
           "--out", args.out, "--work", args.work, "--ckpt-work", args.ckpt_work, "--commit", args.commit,
           "--timeout", str(args.timeout)]
    for flag in ("long", "serve", "profile_only", "no_hf", "quick", "check_only", "sampled", "fp8_slow_accum"):
        if getattr(args, flag):
            cmd.append("--" + flag.replace("_", "-"))
    for opt in ("tune", "batch_sizes", "ablate", "skip_pass", "max_batched_tokens"):
        if getattr(args, opt):
            cmd += ["--" + opt.replace("_", "-"), str(getattr(args, opt))]
    return cmd


def _compare_variants(results: list[dict], out: Path) -> None:
    """A --kv-cache, --quant or int4 variant's KV blocks and throughputs against its base shape's, when both ran."""
    by_shape = {r["shape"]: r for r in results}
    for r in results:
        base = by_shape.get(base_shape(r["shape"]))
        if base is None or base is r or not is_variant(r["shape"]):
            continue
        keys = [k for k in sorted(r) if k in ("kv_blocks", "b1_decode_tok_s")
                or (k.endswith("_out_tok_s") and k.startswith("b"))]
        ratios = {k: round(r[k] / base[k], 3) for k in keys if isinstance(base.get(k), (int, float)) and base[k]}
        (out / f"engc_{r['shape']}_vs_{base['shape']}.json").write_text(
            json.dumps({"variant": r["shape"], "base": base["shape"], "ratios": ratios}, indent=1))
        print(f"-- {r['shape']} / {base['shape']}: " + ", ".join(f"{k} x{v}" for k, v in ratios.items()))


def main():
    ap = argparse.ArgumentParser(description="engc's H200 benchmark: prepare kernels here, run them there")
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("--shapes", default="tiny,1b,8b")
    ap.add_argument("--cache", default=str(ROOT / ".kcache"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/engc_bench"))
    ap.add_argument("--work", default="/tmp/engc_work")
    ap.add_argument("--ckpt-work", default="",
                    help="where the checkpoints go (default: --work); /dev/shm where checkpoint and bundle together "
                         "outgrow the disk (DeepSeek-V2-Lite: 31 GB each against the H200 machine's 64 GB)")
    ap.add_argument("--commit", default="", help="recorded in each JSON")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--long", action="store_true", help="also 1000 in / 1000 out at batch 64")
    ap.add_argument("--serve", action="store_true", help="also time `engc run` to its first token")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers floor")
    ap.add_argument("--profile-only", action="store_true", help="per-kernel decode profile, no timings")
    ap.add_argument("--check-only", action="store_true",
                    help="build, load and check against the reference ops (and the float32 oracle, up to the 1B "
                         "shape), no timings")
    ap.add_argument("--sampled", action="store_true",
                    help="with --quick: also the sampled figure (temperature 0.8, top-k 50, top-p 0.95)")
    ap.add_argument("--quick", action="store_true",
                    help="batch-1 decode and the two first batch sizes only, reusing a built bundle (A/B runs)")
    ap.add_argument("--tune", default="", help='tune-table entries (JSON {"sm90/op/variant/bucket": {field: '
                    'value}}, as engc build --tune takes) to prepare and build with; the bundle gets a '
                    '-tuned-<hash of the JSON> suffix (an 8B one is 16 GB: remove it after its run on a small disk)')
    ap.add_argument("--batch-sizes", default="",
                    help="comma-separated batch sizes of the 128 in / 128 out throughput runs, for every shape "
                         "(default: 1b 64,256; 8b 32,64,256; --quick keeps the first two)")
    ap.add_argument("--skip-pass", default="",
                    help="build without this graph pass (e.g. fuse_fp8_input_quant): an A/B of a fusion; "
                         "the bundle gets a -skip-<pass> suffix")
    ap.add_argument("--ablate", default="",
                    help="comma-separated kernel families (norm, attn, silu, gemm) removed from decode steps: an "
                         "upper bound on what fusing them away can give; outputs are garbage (bench/ablate.py)")
    ap.add_argument("--timeout", type=int, default=400, help="seconds a shape's process may take")
    ap.add_argument("--fp8-slow-accum", action="store_true",
                    help="the large FP8 GEMMs promoting to float32 every 128 products (the A/B of the default)")
    ap.add_argument("--max-batched-tokens", type=int, default=8192,
                    help="the engine's token budget a step (a prefill chunk's size)")
    args = ap.parse_args()
    prepare(args) if args.verb == "prepare" else run(args)


if __name__ == "__main__":
    main()

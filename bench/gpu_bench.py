#!/usr/bin/env python3
"""engc on the H200: random-weight Llama-3.2-1B and Llama-3-8B shapes, built, checked and timed.

Here (CPU):    python bench/gpu_bench.py prepare --cache .kcache     # compile the sm90 kernels into a cache
On the device: python bench/gpu_bench.py run --cache .kcache --shapes 1b,8b --out $OUT

A shape name may carry a build variant: "8b-kv8" is the 8b checkpoint built with --kv-cache int8,
"8b-kvfp8" with --kv-cache fp8, "8b-fp8" with --quant fp8 (W8A8 projections) (same weights: one checkpoint
per base shape). "8b-int4" / "1b-int4" are a random AutoAWQ-GEMM int4 g128 checkpoint of that shape (its own
folder), which `engc build` repacks as it would a real one; its kernels need `prepare --shapes 8b-int4`;
"8b-int4-qhead" has its lm_head in int4 too (as `engc quantize --lm-head` writes it). With the base shape in
the same invocation, the table ends with the variant's KV blocks
and throughputs (b1 decode, b32/b64/b256) against it.

`run` makes each checkpoint (HF folder, bf16, seed 0), builds its bundle with `engc build --arch sm90
--kernel-cache` (the cubins compiled here, no compiler there), checks GPU logits against the reference
ops, and times decode, throughput, prefill and start-up. Figures are printed as ratios against the
copy-bandwidth roofline and LMDeploy's figures measured on the same card; JSON goes to --out.
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

COPY_BW = 4.25e12        # bytes/s, measured on the H200 2026-11-30
GEMM_PEAK = 793e12       # bf16 FLOP/s, same day
LMDEPLOY = {"1b": {"b1": 517.0, "bN": 14356.0, "N": 64}, "8b": {"b1": 214.7, "bN": 5347.0, "N": 32}}
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, tie_word_embeddings=True),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, tie_word_embeddings=False),
    "tiny": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, head_dim=32, tie_word_embeddings=True, vocab_size=512),
}


KV_VARIANTS = {"kv8": "int8", "kvfp8": "fp8"}   # shape suffix -> --kv-cache


def base_shape(shape: str) -> str:
    return shape.split("-")[0]


def kv_cache_of(shape: str) -> str:
    return next((KV_VARIANTS[v] for v in shape.split("-")[1:] if v in KV_VARIANTS), "auto")


INT4_GROUP = 128


def is_int4(shape: str) -> bool:
    """An "-int4" variant: its checkpoint is AutoAWQ GEMM int4, group size INT4_GROUP."""
    return "int4" in shape.split("-")[1:]


def is_int4_head(shape: str) -> bool:
    """An "-int4-qhead" variant: the int4 checkpoint's lm_head is int4 too (GPTQModel's lm_head quantization)."""
    return is_int4(shape) and "qhead" in shape.split("-")[1:]


def quant_of(shape: str) -> str:
    """--quant of a shape: "fp8" for an "-fp8" variant (W8A8 projections), else "auto"."""
    return "fp8" if "fp8" in shape.split("-")[1:] else "auto"


def hf_config(shape: str) -> dict:
    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
               rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
               bos_token_id=128000, eos_token_id=128001, torch_dtype="bfloat16",
               rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    cfg.update(SHAPES[base_shape(shape)])
    return cfg


def model_config(shape: str):
    from engc.compiler.frontend.decoder import resolve_config
    return resolve_config(hf_config(shape))


def dtype_of(shape: str):
    import torch
    return torch.float32 if base_shape(shape) == "tiny" else torch.bfloat16


def tune_overrides(args) -> dict | None:
    """--tune: the tune entries to build with (engc build --tune's form and checks)."""
    from engc.compiler.codegen.tune import check_overrides
    return check_overrides(json.loads(args.tune)) if args.tune else None


def skip_pass(name: str) -> None:
    """--skip-pass: build without the graph pass `name` (an A/B of a fusion in one lease; bench only). The
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
    from engc.compiler.codegen import tune
    with tune.overridden(tune_overrides(args)):
        _prepare(args)


def _prepare(args):
    from engc.compiler.kernel_cache import compile_cached
    for shape in args.shapes.split(","):
        t = time.time()
        r = compile_cached(model_config(shape), dtype_of(shape), ["sm90"], 16, Path(args.cache),
                           kv_cache=kv_cache_of(shape), quant="fp8" if quant_of(shape) == "fp8" else "none",
                           int4_group_sizes=(INT4_GROUP,) if is_int4(shape) else (),
                           int4_lm_head=is_int4_head(shape))
        print(f"{shape}: {len(r.records)} kernels in {time.time() - t:.1f}s")


# ------------------------------------------------------------------------------------------ device

def plain_bundle(shape: str, work: str, cache: str) -> Path:
    """work/bundle-<shape>: the shape's random checkpoint (an int4 one for '-int4' shapes) built for sm90 with
    the kernel cache, each made only where missing, so a device script reuses what this lease made (the
    names bench_shape uses for the stock table)."""
    from engc.compiler.build import BuildOptions, build
    base, int4 = base_shape(shape), is_int4(shape)
    ckpt, bundle = Path(work) / f"ckpt-{base}{'-int4' if int4 else ''}", Path(work) / f"bundle-{shape}"
    if not (ckpt / "config.json").exists():
        make_checkpoint(base, ckpt, int4=int4)
    if not (bundle / "manifest.json").exists():
        build(str(ckpt), bundle, BuildOptions(archs=("sm90",), dtype="bfloat16", kernel_cache=cache))
    return bundle


def make_checkpoint(shape: str, folder: Path, int4: bool = False, int4_head: bool = False) -> None:
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, models, pre_tokenizers
    folder.mkdir(parents=True, exist_ok=True)
    cfg = hf_config(shape)
    if int4:
        cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": INT4_GROUP,
                                      "version": "gemm", "zero_point": True}
    (folder / "config.json").write_text(json.dumps(cfg))
    vocab = {f"t{i}": i for i in range(cfg["vocab_size"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "t128001"}))
    g = torch.Generator(device="cuda").manual_seed(0)
    dt = dtype_of(shape)
    h, i, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]

    def rand(*shape_, std=0.02):
        return (torch.randn(*shape_, generator=g, device="cuda", dtype=torch.float32) * std).to(dt).cpu()

    def proj(name, out_f, in_f):
        """A projection's tensors: bf16 weight, or AutoAWQ GEMM int4 (random codes and zeros; scales
        that give weights of about the float checkpoint's spread)."""
        if not int4:
            return {name + ".weight": rand(out_f, in_f)}
        words = lambda rows: torch.randint(-2**31, 2**31 - 1, (rows, out_f // 8), generator=g, device="cuda",  # noqa: E731
                                           dtype=torch.int32).cpu()
        scales = torch.rand(in_f // INT4_GROUP, out_f, generator=g, device="cuda") * 0.002 + 0.002
        return {name + ".qweight": words(in_f), name + ".qzeros": words(in_f // INT4_GROUP),
                name + ".scales": scales.to(torch.float16).cpu()}

    tensors = {"model.embed_tokens.weight": rand(cfg["vocab_size"], h), "model.norm.weight": torch.ones(h, dtype=dt)}
    if int4_head:   # an int4 head is its own tensor, tied or not (as engc quantize --lm-head writes it)
        cfg["tie_word_embeddings"] = False
        cfg["quantization_config"]["lm_head"] = True   # GPTQModel's key, which engc quantize --lm-head writes
        (folder / "config.json").write_text(json.dumps(cfg))
        tensors.update(proj("lm_head", cfg["vocab_size"], h))
    elif not cfg["tie_word_embeddings"]:
        tensors["lm_head.weight"] = rand(cfg["vocab_size"], h)
    save_file(tensors, str(folder / "model-embed.safetensors"))
    for layer in range(L):
        p = f"model.layers.{layer}."
        t = {p + "input_layernorm.weight": torch.ones(h, dtype=dt),
             p + "post_attention_layernorm.weight": torch.ones(h, dtype=dt),
             **proj(p + "self_attn.q_proj", q, h), **proj(p + "self_attn.k_proj", kv, h),
             **proj(p + "self_attn.v_proj", kv, h), **proj(p + "self_attn.o_proj", h, q),
             **proj(p + "mlp.gate_proj", i, h), **proj(p + "mlp.up_proj", i, h), **proj(p + "mlp.down_proj", h, i)}
        save_file(t, str(folder / f"model-layer{layer:03d}.safetensors"))
    # the index HF transformers needs to read a sharded folder (engc reads any *.safetensors)
    weight_map = {}
    for shard in sorted(folder.glob("model-*.safetensors")):
        from safetensors import safe_open
        with safe_open(str(shard), framework="pt") as f:
            weight_map.update({name: shard.name for name in f.keys()})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))


def timed(fn):
    import torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t


def prompts(n: int, length: int, vocab: int, seed: int):
    import torch
    g = torch.Generator().manual_seed(seed)
    return torch.randint(200, vocab - 200, (n, length), generator=g).tolist()


def run_batch(engine, ids_list, out_len, **sampling):
    from engc.runtime.sampling import SamplingParams
    p = SamplingParams(max_tokens=out_len, ignore_eos=True, **({"temperature": 0} | sampling))
    seqs = [engine.add_request(ids, p) for ids in ids_list]
    first = None
    import torch
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while engine.has_work:
        engine.step()
        if first is None and all(len(s.output_ids) >= 1 for s in seqs):
            first = time.perf_counter()
    t1 = time.perf_counter()
    return seqs, t1 - t0, first - t0


def weight_bytes(cfg, projection_bytes: float = 2, head_bytes: float = 2) -> tuple[int, int]:
    """(bytes a decode step reads, non-embedding parameter count): bf16 weights, or 1-byte projections (fp8),
    or int4 ones (and an int4 lm_head: head_bytes)."""
    h, i, L, V = cfg.hidden_size, cfg.intermediate_size, cfg.num_layers, cfg.vocab_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    params = L * per_layer + V * h  # lm_head counts: it is read every step (tied or not)
    return int(projection_bytes * L * per_layer + head_bytes * V * h), params


def bench_shape(shape: str, args) -> dict:
    import torch
    from engc.compiler.build import BuildOptions, build
    from engc.runtime.engine import Engine, EngineConfig
    from engc.runtime.loader import load
    work = Path(args.work)
    base = base_shape(shape)
    ckpt = work / f"ckpt-{base}{'-int4' if is_int4(shape) else ''}{'-qhead' if is_int4_head(shape) else ''}"
    bundle = work / f"bundle-{shape}"
    if args.tune:   # a tune-table variant: its own bundle, one per table (--quick reuses a bundle by name)
        import hashlib
        bundle = bundle.with_name(bundle.name + "-tuned-" + hashlib.sha256(args.tune.encode()).hexdigest()[:8])
    if args.skip_pass:   # likewise a bundle of its own
        skip_pass(args.skip_pass)
        bundle = bundle.with_name(bundle.name + "-skip-" + args.skip_pass)
    res = {"shape": shape, "gpu": torch.cuda.get_device_name(), "commit": args.commit, "tune": args.tune,
           "skip_pass": args.skip_pass,
           "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d")}
    if not (ckpt / "config.json").exists():
        _, res["make_checkpoint_s"] = timed(lambda: make_checkpoint(base, ckpt, int4=is_int4(shape),
                                                                    int4_head=is_int4_head(shape)))
    t = time.perf_counter()
    if not (args.quick and (bundle / "manifest.json").exists()):   # --quick reuses this lease's bundle
        build(str(ckpt), bundle, BuildOptions(archs=("sm90",), dtype="float32" if base == "tiny" else "bfloat16",
                                              kernel_cache=args.cache, kv_cache=kv_cache_of(shape),
                                              quant=quant_of(shape), tune=tune_overrides(args)))
        res["build_s"] = round(time.perf_counter() - t, 1)
    res["env"] = {k: v for k, v in os.environ.items() if k.startswith("ENGC_")}
    if args.ablate:   # bench/ablate.py: timings only, the outputs are garbage
        import ablate
        ablate.install(set(args.ablate.split(",")))
        res["ablate"] = args.ablate
    manifest = json.loads((bundle / "manifest.json").read_text())
    # which Triton compiled the cubins: this machine's 3.6 would mean the kernel cache missed
    res["kernels_compiled_by_triton"] = sorted({k["triton_version"] for k in manifest["kernels"]
                                                if "triton_version" in k})
    res["kernels_compiled_by_nvcc"] = sorted({k["nvcc_version"] for k in manifest["kernels"] if "nvcc_version" in k})

    # start-up: a fresh process from `engc generate` to its one token, as a user would see it
    if not args.profile_only and not args.quick:
        t = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "engc.cli", "generate", str(bundle), "--raw", "--prompt",
                            "t5 t6 t7", "--max-tokens", "1"], capture_output=True, text=True, timeout=300)
        res["process_to_first_token_s"] = round(time.perf_counter() - t, 2)
        if r.returncode:
            res["generate_error"] = r.stderr[-2000:]
    if args.serve and not args.profile_only and not args.quick:
        res.update(serve_first_token(bundle))
    # once per checkpoint
    if base != "tiny" and shape == base and not args.profile_only and not args.no_hf and not args.quick:
        try:
            res.update(hf_floor(ckpt, json.loads((ckpt / "config.json").read_text())["vocab_size"]))
        except Exception as e:  # the floor is context, not a gate
            res["hf_transformers_error"] = repr(e)[:300]
    from engc.bundle.reader import open_bundle
    _, res["verify_hashes_s"] = timed(lambda: open_bundle(bundle))
    model, res["load_s"] = timed(lambda: load(bundle, device="cuda"))
    cfg = model.config
    engine, res["engine_init_and_graph_capture_s"] = timed(
        lambda: Engine(model, EngineConfig(max_num_seqs=256, max_batched_tokens=8192)))
    res["kv_blocks"] = engine.kv.allocator.num_blocks
    if args.profile_only:
        res.update(kernel_profile(engine, cfg, Path(args.out), shape))
        for n in (1, 32):
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

    int4_bytes = 0.5 + 3 / INT4_GROUP   # int4: codes, bf16 scale, u8 zero
    wbytes, params = weight_bytes(cfg, 1 if quant_of(shape) == "fp8" else int4_bytes if is_int4(shape) else 2,
                                  int4_bytes if is_int4_head(shape) else 2)
    # batch 1 decode, 128 in / 128 out
    ids = prompts(1, 128, cfg.vocab_size, 1)
    run_batch(engine, ids, 8)  # warm-up
    seqs, total, first = run_batch(engine, ids, 128)
    decode_tps = 127 / (total - first)
    kv_bytes = 2 * cfg.num_layers * cfg.kv_size * 2 * 192  # average context ~192 tokens
    res["b1_decode_tok_s"] = round(decode_tps, 1)
    res["b1_frac_of_copy_roofline"] = round(decode_tps * (wbytes + kv_bytes) / COPY_BW, 3)
    res["b1_vs_lmdeploy"] = round(decode_tps / LMDEPLOY.get(base, {}).get("b1", float("nan")), 3)
    res.update(decode_breakdown(engine, ids, Path(args.out) / f"profile_{shape}.txt"))
    n = LMDEPLOY.get(base, {}).get("N")
    if n and n in args.batches.get(base, []):   # the batch of the throughput target: is its step the graph's?
        res.update(decode_breakdown(engine, prompts(n, 128, cfg.vocab_size, 300 + n),
                                    Path(args.out) / f"profile_{shape}_b{n}.txt"))
    # throughput, 128 in / 128 out, end to end
    for n in args.batches.get(base, [])[:2 if args.quick else None]:
        # twice, other prompts the second time: the first run at a batch also pays one-time costs (its first
        # prefill of n x 128 tokens, the allocator's first pools for it), so the figure is the second run's, as
        # batch 1's follows a warm-up. At faeac11 the int4-head bundle's b32 figure, then its first run, trailed
        # the bf16-head bundle's by 12% while its graphed decode step is no slower (bench/results/README.md)
        seqs, total, first = run_batch(engine, prompts(n, 128, cfg.vocab_size, n + 1000), 128)
        res[f"b{n}_128_128_first_run_out_tok_s"] = round(n * 128 / total, 1)
        seqs, total, first = run_batch(engine, prompts(n, 128, cfg.vocab_size, n), 128)
        res[f"b{n}_128_128_out_tok_s"] = round(n * 128 / total, 1)
        # where the time goes: until every sequence has its first token (the prefill of n x 128 tokens, in
        # max_batched_tokens chunks), then the decode steps (the 8B b32 target is 6,500 tok/s end to end)
        res[f"b{n}_128_128_first_tokens_s"] = round(first, 4)
        res[f"b{n}_128_128_after_first_ms_per_token"] = round(1000 * (total - first) / 127, 3)
        if LMDEPLOY.get(base, {}).get("N") == n:
            res[f"b{n}_vs_lmdeploy"] = round(n * 128 / total / LMDEPLOY[base]["bN"], 3)
    if args.quick:
        return res
    # sampled decoding (temperature, top-k, top-p on the GPU), same shape of work as the greedy run
    n = LMDEPLOY.get(base, {}).get("N", 4)
    seqs, total, first = run_batch(engine, prompts(n, 128, cfg.vocab_size, n + 1), 128,
                                   temperature=0.8, top_k=50, top_p=0.95, seed=0)
    res[f"b{n}_128_128_sampled_out_tok_s"] = round(n * 128 / total, 1)
    if base != "tiny" and args.long:
        n = 64
        seqs, total, first = run_batch(engine, prompts(n, 1000, cfg.vocab_size, 7), 1000)
        res[f"b{n}_1000_1000_out_tok_s"] = round(n * 1000 / total, 1)
    # prefill at 4k tokens: one request, one step
    if base != "tiny":
        from engc.runtime.sampling import SamplingParams
        for seed in (3, 4):  # distinct prompts: the prefix cache must not serve the second one
            ids = prompts(1, 4096, cfg.vocab_size, seed)[0]
            engine.add_request(ids, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
            _, dt = timed(engine.step)
        flops = 2 * params * 4096 + 2 * cfg.num_layers * cfg.num_heads * cfg.head_dim * 4096 * 4096  # causal
        res["prefill_4k_s"] = round(dt, 4)
        res["prefill_4k_tflops"] = round(flops / dt / 1e12, 1)
        res["prefill_4k_frac_of_gemm_peak"] = round(flops / dt / GEMM_PEAK, 3)
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
        _, dt = timed(lambda: model.generate(ids, **kw))
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


def kernel_profile(engine, cfg, out_dir: Path, shape: str, batches=(1, 32)) -> dict:
    """Per-kernel GPU time of one eager decode step (torch.profiler), at a few batch sizes."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from engc.runtime.sampling import SamplingParams
    res = {}
    for n in batches:
        seqs = [engine.add_request(ids, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True))
                for ids in prompts(n, 128, cfg.vocab_size, 100 + n)]
        while any(s.num_computed < len(s.prompt_ids) for s in seqs):
            engine.step()  # prefill
        for _ in range(3):
            engine.step()
        engine.executor.enabled = False  # eager, so the profiler sees each kernel
        engine.step()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for _ in range(5):
                engine.step()
            torch.cuda.synchronize()
        engine.executor.enabled = True
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        (out_dir / f"kernels_{shape}_b{n}.txt").write_text(table)
        total = sum(e.device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA") / 5
        res[f"b{n}_eager_kernel_time_per_step_ms"] = round(total / 1000, 3)
        # graph replay alone and the whole engine step, at this batch
        graph, _ = engine.executor.graphs[engine.executor.graph_key(n, 128 + 64)][0]
        _, t = timed(lambda: [graph.replay() for _ in range(50)])
        res[f"b{n}_graph_replay_ms"] = round(t * 20, 3)
        # the same step's kernels inside the graph (with PDL a kernel's time includes its wait)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                graph.replay()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
        (out_dir / f"kernels_graph_{shape}_b{n}.txt").write_text(table)
        _, t = timed(lambda: [engine.step() for _ in range(20)])
        res[f"b{n}_engine_step_ms"] = round(t * 50, 3)
        engine.run_to_completion()
    return res


def step_timeline(engine, cfg, out_dir: Path, shape: str, n: int = 1, steps: int = 30) -> dict:
    """Where the GPU idles during overlapped engine decode steps at batch n: the GPU's busy and idle time
    a step (union of kernel and copy intervals) and the idle gaps summed by the ops on either side."""
    import collections
    import torch
    from torch.profiler import ProfilerActivity, profile
    from engc.runtime.sampling import SamplingParams
    for ids in prompts(n, 128, cfg.vocab_size, 200 + n):
        engine.add_request(ids, SamplingParams(max_tokens=steps + 20, temperature=0, ignore_eos=True))
    for _ in range(5):
        engine.step()   # prefill, then warm decode steps
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            engine.step()
        torch.cuda.synchronize()
    engine.run_to_completion()
    trace = out_dir / f"trace_{shape}_b{n}.json"
    prof.export_chrome_trace(str(trace))
    events = [e for e in json.loads(trace.read_text())["traceEvents"]
              if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    trace.unlink()  # large; the summary below is what is kept
    events.sort(key=lambda e: e["ts"])
    busy, idle, end, prev = 0.0, 0.0, None, None
    gaps = collections.Counter()
    # in-chain cost: how far each kernel pushes the end of the busy time (with PDL kernels overlap, and a
    # kernel's own duration includes its wait for the one before; this is what it adds to the step)
    # Rows are kernel and grid: one kernel serving several shapes (the int4 GEMV's down and its lm_head) splits.
    pushed, launches = collections.Counter(), collections.Counter()
    for e in events:
        ts, te = e["ts"], e["ts"] + e["dur"]
        grid = e.get("args", {}).get("grid")
        row = e["name"][:60] + (f" grid {tuple(grid)}" if grid else "")
        launches[row] += 1
        if end is not None and ts > end:
            idle += ts - end
            gaps[(prev[:40], e["name"][:40])] += ts - end
        if end is None or te > end:
            step = te - max(ts, end) if end is not None else te - ts
            busy += step
            pushed[row] += step
            end, prev = te, e["name"]
    lines = [f"{shape} b{n}: {steps} overlapped engine steps, GPU busy {busy / steps:.1f} us a step, "
             f"idle {idle / steps:.1f} us a step", "idle us a step  after -> before"]
    lines += [f"{v / steps:10.2f}  {a} -> {b}" for (a, b), v in gaps.most_common(15)]
    lines += ["", "busy us a step each kernel adds (in-chain), launches a step, us a launch"]
    lines += [f"{v / steps:10.2f}  {launches[k] / steps:6.1f}  {v / launches[k]:8.2f}  {k}"
              for k, v in pushed.most_common(20)]
    (out_dir / f"timeline_{shape}_b{n}.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)
    return {f"b{n}_timeline_busy_us": round(busy / steps, 1), f"b{n}_timeline_idle_us": round(idle / steps, 1)}


def _timed_steps(engine, ids_list, prof=None) -> float:
    """ms an engine step over 100 decode steps of a fresh batch (its prefill first), under prof when given."""
    import torch
    from engc.runtime.sampling import SamplingParams
    for ids in ids_list:
        engine.add_request(ids, SamplingParams(max_tokens=101, temperature=0, ignore_eos=True))
    engine.step()  # prefill
    torch.cuda.synchronize()
    if prof is not None:
        prof.enable()
    t0 = time.perf_counter()
    for _ in range(100):
        engine.step()
    torch.cuda.synchronize()
    t = time.perf_counter() - t0
    if prof is not None:
        prof.disable()
    engine.run_to_completion()
    return round(t * 10, 3)


def decode_breakdown(engine, ids_list, profile_path: Path) -> dict:
    """Where a decode step's time goes at batch n = len(ids_list): graph replay alone (GPU) against the
    whole engine step, synchronous and overlapped (a gap is host work the overlap does not hide). The steps
    are timed without the profiler (cProfile alone slowed the host 2-3x: at 1B b64 it made the overlapped
    step 1.95-2.75 ms where the 128/128 run took 1.42, so the batch looked host-bound); a third, profiled run
    writes profile_path."""
    import cProfile
    import pstats
    import torch
    n = len(ids_list)
    out = {}
    from dataclasses import replace
    overlap = engine.config.overlap
    # synchronous steps (host work in series with the GPU) and overlapped ones (the default)
    for key, on in ((f"b{n}_engine_step_sync_ms", False), (f"b{n}_engine_step_ms", True)):
        engine.config = replace(engine.config, overlap=on)
        out[key] = _timed_steps(engine, ids_list)
    engine.config = replace(engine.config, overlap=overlap)
    prof = cProfile.Profile()
    _timed_steps(engine, ids_list, prof)
    # The graph replayed alone, after the runs above: its staged inputs are then their last step's (n real
    # rows, contexts ~228). Before any step of this batch, rows past the last batch's held context 1 (no
    # attention): at 8B b32 that replay took 4.51 ms against an engine step of 4.75.
    graph, _ = engine.executor.graphs[engine.executor.graph_key(n, len(ids_list[0]) + 101)][0]
    for _ in range(5):
        graph.replay()
    _, t = timed(lambda: [graph.replay() for _ in range(100)])
    out[f"b{n}_graph_replay_ms"] = round(t * 10, 3)
    with open(profile_path, "w") as f:  # the overlapped run's profile
        pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(25)
    return out


def check_against_reference(model, engine, cfg) -> dict:
    import torch
    from engc.runtime.executor import Executor
    from engc.runtime.ops_reference import REFERENCE_OPS
    from engc.runtime.sampling import SamplingParams
    ref_exec = Executor(model.executor.program, model.executor.weights, REFERENCE_OPS)
    ids_list = prompts(2, 40, cfg.vocab_size, 11)
    p = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    seqs = [engine.add_request(ids, p) for ids in ids_list]
    engine.run_to_completion()
    # the reference engine: same weights, plain-torch ops on the GPU, no graphs
    ref_engine = type(engine)(model.__class__(**{**model.__dict__, "executor": ref_exec, "step_facts": None}),
                              engine.config.__class__(num_blocks=64, cuda_graphs=False))
    ref_engine.executor = _Eager(ref_exec, model.device)
    ref_seqs = [ref_engine.add_request(ids, p) for ids in ids_list]
    ref_engine.run_to_completion()
    agree = [sum(a == b for a, b in zip(s.output_ids, r.output_ids)) / 16 for s, r in zip(seqs, ref_seqs)]
    firsts = [(s.output_ids[:6], r.output_ids[:6]) for s, r in zip(seqs, ref_seqs)]
    # logits of one prefill through both executors
    ids = torch.tensor(ids_list[0])
    n = len(ids)
    inputs = {"input_ids": ids, "positions": torch.arange(n), "slot_mapping": torch.arange(n),
              "block_tables": torch.arange((n + 15) // 16, dtype=torch.int32)[None],
              "context_lens": torch.tensor([n], dtype=torch.int32),
              "query_start_loc": torch.tensor([0, n], dtype=torch.int32),
              "logits_indices": torch.arange(n)}
    kv_a = [_small_cache(t) for t in engine.kv.layers]
    kv_b = [_small_cache(t) for t in engine.kv.layers]
    with torch.inference_mode():
        a = engine.executor.forward(inputs, kv_a)
        b = _Eager(ref_exec, model.device).forward(inputs, kv_b)
    rel = float((a - b).abs().max() / b.abs().max())
    top1 = float((a.argmax(-1) == b.argmax(-1)).float().mean())
    res = {"greedy_token_agreement_vs_bf16_reference": agree, "first_tokens_engine_vs_reference": firsts,
           "prefill_logits_max_rel_err_vs_bf16_reference": rel,
           "prefill_top1_agreement_vs_bf16_reference": top1}
    if weight_bytes(cfg)[1] > 3e9:
        return res  # an 8B float32 copy does not fit beside the KV cache: the oracle runs on the 1B shape
    # the float32 oracle: the same weights upcast, reference ops; how far is each bf16 path from it?
    fp32 = {k: v.float() if v.is_floating_point() else v for k, v in model.executor.weights.items()}
    kv_c = [_small_cache(t, torch.float32) for t in engine.kv.layers]
    with torch.inference_mode():
        c = _Eager(Executor(model.executor.program, fp32, REFERENCE_OPS), model.device).forward(inputs, kv_c)
    del fp32
    err = lambda x: float((x - c).abs().max() / c.abs().max())
    return {**res, "gpu_bf16_vs_fp32_oracle_max_rel_err": err(a), "reference_bf16_vs_fp32_oracle_max_rel_err": err(b),
            "gpu_bf16_top1_vs_fp32_oracle": float((a.argmax(-1) == c.argmax(-1)).float().mean()),
            "reference_bf16_top1_vs_fp32_oracle": float((b.argmax(-1) == c.argmax(-1)).float().mean())}


def _small_cache(layer, dtype=None):
    """A zeroed 8-block cache like `layer`: a tensor, or the (codes, scales) of a quantized KV cache
    (whose codes keep their dtype: the float32 oracle then runs the same quantized-cache program)."""
    import torch
    if isinstance(layer, tuple):
        return tuple(torch.zeros_like(t[:, :8]) for t in layer)
    return torch.zeros_like(layer[:, :8], dtype=dtype)


class _Eager:
    def __init__(self, executor, device):
        self.executor, self.device = executor, device

    def forward(self, inputs, kv, fill=None):
        inputs = {k: v.to(self.device) for k, v in inputs.items()}
        if fill is not None:  # the engine's overlapped step: rows whose input id is still on the device
            fill.apply(inputs["input_ids"], fill.rows.to(self.device), fill.src.to(self.device))
        return self.executor.forward(inputs, kv)


def run(args):
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    args.batches = {"1b": [64, 256], "8b": [32, 64, 256], "tiny": [4]}
    if args.batch_sizes:   # the throughput batches of every shape, e.g. 16,32 for an A/B of 9-16-row kernels
        sizes = [int(b) for b in args.batch_sizes.split(",")]
        args.batches = {shape: sizes for shape in args.batches}
    results = []
    for shape in args.shapes.split(","):
        if args.child:
            res = bench_shape(shape, args)
            (out / f"engc_{shape}.json").write_text(json.dumps(res, indent=1))
            print(json.dumps(res), flush=True)
            return
        # one process per shape, so each starts with an empty GPU
        cmd = [sys.executable, __file__, "run", "--child", "--shapes", shape, "--cache", args.cache,
               "--out", str(out), "--work", args.work, "--commit", args.commit] + (["--long"] if args.long else []) \
            + (["--serve"] if args.serve else []) + (["--profile-only"] if args.profile_only else []) \
            + (["--no-hf"] if args.no_hf else []) + (["--quick"] if args.quick else []) \
            + (["--tune", args.tune] if args.tune else []) + (["--check-only"] if args.check_only else []) \
            + (["--batch-sizes", args.batch_sizes] if args.batch_sizes else []) \
            + (["--ablate", args.ablate] if args.ablate else []) \
            + (["--skip-pass", args.skip_pass] if args.skip_pass else [])
        subprocess.run(cmd, timeout=args.timeout)
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


def _compare_variants(results: list[dict], out: Path) -> None:
    """A --kv-cache or --quant variant's KV blocks and throughputs against its base shape's, when both ran."""
    by_shape = {r["shape"]: r for r in results}
    for r in results:
        base = by_shape.get(base_shape(r["shape"]))
        if base is None or base is r or (kv_cache_of(r["shape"]) == "auto" and quant_of(r["shape"]) == "auto"
                                         and not is_int4(r["shape"])):
            continue
        keys = [k for k in sorted(r) if k in ("kv_blocks", "b1_decode_tok_s")
                or (k.endswith("_out_tok_s") and k.startswith("b"))]
        ratios = {k: round(r[k] / base[k], 3) for k in keys if isinstance(base.get(k), (int, float)) and base[k]}
        (out / f"engc_{r['shape']}_vs_{base['shape']}.json").write_text(
            json.dumps({"variant": r["shape"], "base": base["shape"], "ratios": ratios}, indent=1))
        print(f"-- {r['shape']} / {base['shape']}: " + ", ".join(f"{k} x{v}" for k, v in ratios.items()))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("verb", choices=["prepare", "run"])
    ap.add_argument("--shapes", default="tiny,1b,8b")
    ap.add_argument("--cache", default=str(ROOT / ".kcache"))
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/engc_bench"))
    ap.add_argument("--work", default="/tmp/engc_work")
    ap.add_argument("--commit", default="")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--long", action="store_true")
    ap.add_argument("--serve", action="store_true", help="also time `engc run` to its first token")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers floor")
    ap.add_argument("--profile-only", action="store_true", help="per-kernel decode profile, no timings")
    ap.add_argument("--check-only", action="store_true",
                    help="build, load and check against the reference ops (and the float32 oracle, up to the 1B "
                         "shape), no timings")
    ap.add_argument("--quick", action="store_true",
                    help="batch-1 decode and the two first batch sizes only, reusing a built bundle (A/B runs: "
                         "e.g. ENGC_PDL=0 ... --quick after a full run)")
    ap.add_argument("--tune", default="", help='tune-table entries (JSON {"sm90/op/variant/bucket": {field: '
                    'value}}, as engc build --tune takes) to prepare and build with; the bundle gets a '
                    '-tuned-<hash of the JSON> suffix (an 8B one is 16 GB: remove it after its run on a small disk)')
    ap.add_argument("--batch-sizes", default="",
                    help="comma-separated batch sizes of the 128 in / 128 out throughput runs, for every shape "
                         "(default: 1b 64,256; 8b 32,64,256; --quick keeps the first two)")
    ap.add_argument("--skip-pass", default="",
                    help="build without this graph pass (e.g. fuse_fp8_input_quant): a same-lease A/B of a fusion; "
                         "the bundle gets a -skip-<pass> suffix")
    ap.add_argument("--ablate", default="",
                    help="comma-separated kernel families (norm, attn, silu, gemm) removed from decode steps: an "
                         "upper bound on what fusing them away can give; outputs are garbage (bench/ablate.py)")
    ap.add_argument("--timeout", type=int, default=400)
    args = ap.parse_args()
    prepare(args) if args.verb == "prepare" else run(args)


if __name__ == "__main__":
    main()

"""Check and time engc's AOT Triton kernels on an H200, launched from cubins the way the runtime does.

Two steps, two machines:
  python bench/kernels_device.py prepare .aot     # here, CPU only, Triton 3.9: compile sm90 cubins + PTX
  python bench/kernels_device.py run .aot         # on the GPU box (no Triton import): load with the CUDA
                                                  # driver API, check against the torch references, time
The run writes results.json and log.txt under $OUT (or the given --out) and prints a short table last.
Bandwidth is bytes that must move (each input read once, each output written once) over median time,
against the 4.25 TB/s device-to-device copy roofline (also measured in the run).
"""
from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ROOFLINE_GBS = 4250.0
PAGE = 16
CONFIGS = {  # attention/norm shapes of Llama-3-8B and Llama-3.2-1B; qk_norm on so it is checked too
    "8b": dict(family="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_layers=32,
               num_heads=32, num_kv_heads=8, head_dim=128, rms_norm_eps=1e-5, rope_theta=5e5,
               max_position_embeddings=8192, tie_word_embeddings=False, qk_norm=True),
    "1b": dict(family="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_layers=16,
               num_heads=32, num_kv_heads=8, head_dim=64, rms_norm_eps=1e-5, rope_theta=5e5,
               max_position_embeddings=8192, tie_word_embeddings=True, qk_norm=True),
}
DECODE_SWEEP = {"n32w4s2": dict(BLOCK_N=32, num_warps=4, num_stages=2),
                "n64w4s2": dict(BLOCK_N=64, num_warps=4, num_stages=2),
                "n64w4s3": dict(BLOCK_N=64, num_warps=4, num_stages=3),
                "n128w4s2": dict(BLOCK_N=128, num_warps=4, num_stages=2)}
PREFILL_SWEEP = {"m128n64w8s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=8, num_stages=3),
                 "m128n128w8s2": dict(BLOCK_M=128, BLOCK_N=128, num_warps=8, num_stages=2),
                 "m64n64w4s3": dict(BLOCK_M=64, BLOCK_N=64, num_warps=4, num_stages=3),
                 "m128n64w4s3": dict(BLOCK_M=128, BLOCK_N=64, num_warps=4, num_stages=3),
                 "m256n64w8s2": dict(BLOCK_M=256, BLOCK_N=64, num_warps=8, num_stages=2)}


# ------------------------------------------------------------------------------------------ prepare (CPU)

def prepare(out_dir: Path):
    import torch
    from engc.bundle.model_config import ModelConfig
    from engc.compiler.codegen.record import compile_specs
    from engc.compiler.codegen.specs import model_specs

    index = {}
    for name, cfg_dict in CONFIGS.items():
        cfg = ModelConfig(**cfg_dict)
        sets = {"default": None}
        sets.update({k: {"paged_attention": {"decode": v}} for k, v in DECODE_SWEEP.items()})
        sets.update({k: {"paged_attention": {"prefill": v}} for k, v in PREFILL_SWEEP.items()})
        index[name] = {"cfg": cfg_dict, "sets": {}}
        for set_name, overrides in sets.items():
            specs = model_specs(cfg, torch.bfloat16, "sm90", PAGE, overrides)
            if overrides:
                wanted = next(iter(overrides["paged_attention"]))
                specs = [s for s in specs if s.variant == wanted]
            t0 = time.time()
            res = compile_specs(specs, progress=None, jobs=1)
            print(f"{name}/{set_name}: {len(specs)} kernels in {time.time() - t0:.1f}s", flush=True)
            for path, data in res.files.items():
                dst = out_dir / name / set_name / path
                dst.parent.mkdir(parents=True, exist_ok=True)
                dst.write_bytes(data)
            index[name]["sets"][set_name] = res.records
    (out_dir / "index.json").write_text(json.dumps(index, indent=1, sort_keys=True))


# ------------------------------------------------------------------------------------------ run (GPU)

_CTYPE = {"i32": ctypes.c_int32, "i64": ctypes.c_int64, "fp32": ctypes.c_float, "u32": ctypes.c_uint32}


def _check(result):
    err = result[0] if isinstance(result, tuple) else result
    if int(getattr(err, "value", err)) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return result[1] if isinstance(result, tuple) and len(result) == 2 else result


class CubinKernel:
    """One kernel from a cubin (or PTX) image, launched with cuLaunchKernel on torch's current stream."""

    def __init__(self, image: bytes, record: dict):
        from cuda.bindings import driver
        self.driver = driver
        self.record = record
        self.module = _check(driver.cuModuleLoadData(image))
        self.fn = _check(driver.cuModuleGetFunction(self.module, record["entry"].encode()))
        self.shared = record["shared_mem"]
        self.threads = 32 * record["num_warps"]
        # The default limit is 48 KiB minus the kernel's static shared memory (CUDA C++ kernels have both
        # kinds): raise it whenever the dynamic bytes exceed it, not only above 48 KiB.
        attr = driver.CUfunction_attribute.CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
        if self.shared > _check(driver.cuFuncGetAttribute(attr, self.fn)):
            _check(driver.cuFuncSetAttribute(self.fn, attr, self.shared))

    def __call__(self, grid, args):
        import torch
        specs = self.record["args"]
        assert len(args) == len(specs), (self.record["entry"], len(args), len(specs))
        holders = []
        for value, spec in zip(args, specs):
            if spec["type"].startswith("*"):
                ptr = value.data_ptr() if isinstance(value, torch.Tensor) else int(value)
                holders.append(ctypes.c_uint64(ptr))
            else:
                holders.append(_CTYPE[spec["type"]](value))
        params = (ctypes.c_void_p * len(holders))(*[ctypes.addressof(h) for h in holders])
        stream = self.driver.CUstream(torch.cuda.current_stream().cuda_stream)
        _check(self.driver.cuLaunchKernel(self.fn, grid[0], grid[1], grid[2], self.threads, 1, 1, self.shared,
                                          stream, ctypes.addressof(params), 0))


def load_sets(aot: Path, kernel_set=None) -> dict:
    """The kernel sets a `prepare` step wrote under aot (index.json: set name -> records), by name, each a
    kernel_set(folder, records) (default KernelSet); the primary CUDA context is made first, before any
    driver call loads a module."""
    import torch
    torch.zeros(1, device="cuda")
    index = json.loads((aot / "index.json").read_text())
    return {name: (kernel_set or KernelSet)(aot / name, recs) for name, recs in index.items()}


class RunLog:
    """What a device script's run prints: say() prints a line and keeps it; finish() says the total time
    and writes the lines to out/log.txt."""

    def __init__(self):
        self.started, self.lines = time.time(), []

    def say(self, msg: str) -> None:
        print(msg, flush=True)
        self.lines.append(msg)

    def elapsed(self) -> float:
        return time.time() - self.started

    def finish(self, out: Path) -> None:
        self.say(f"total {self.elapsed():.0f}s")
        (out / "log.txt").write_text("\n".join(self.lines) + "\n")


class KernelSet:
    def __init__(self, base: Path, records: list[dict], use_ptx=False):
        self.kernels = {}
        for r in records:
            image = (base / (r["ptx"] if use_ptx else r["cubin"])).read_bytes()
            if use_ptx:
                image += b"\0"
            self.kernels[(r["op"], r["variant"])] = CubinKernel(image, r)
        self.records = {(r["op"], r["variant"]): r for r in records}

    def consts(self, op):
        return {v: r["launch"] for (o, v), r in self.records.items() if o == op}

    def run(self, op, launches):
        for variant, grid, args in launches:
            self.kernels[(op, variant)](grid, args)


def rel_err(out, ref):
    out, ref = out.double(), ref.double()
    if not torch_isfinite(out):
        return float("inf")
    return float((out - ref).norm() / ref.norm().clamp_min(1e-30))


def torch_isfinite(t):
    import torch
    return bool(torch.isfinite(t).all())


def attention_reference(q, cache, bt, ctx, qsl, H, KV, D, scale, window=0):
    """The torch reference on the CPU, over a compact copy of just the blocks the batch uses (the reference
    builds its masks on the CPU, and the full cache is gigabytes)."""
    import torch
    from engc.kernels import paged_attention as pa
    need = [math.ceil(int(c) / PAGE) for c in ctx.tolist()]
    bt_cpu = bt.cpu()
    ids = torch.unique(torch.cat([bt_cpu[b, :n] for b, n in enumerate(need)]).long())
    remap = torch.zeros(cache.shape[1], dtype=torch.int32)
    remap[ids] = torch.arange(len(ids), dtype=torch.int32)
    compact = cache[:, ids.to(cache.device)].cpu()
    bt_new = torch.zeros_like(bt_cpu)
    for b, n in enumerate(need):
        bt_new[b, :n] = remap[bt_cpu[b, :n].long()]
    return pa.paged_attention(q.cpu(), compact, bt_new, ctx.cpu(), qsl.cpu(), H, KV, D, scale, window)


def time_graph(fn, copies: int, reps: int = 20):
    """Median per-call microseconds of fn(i) for i in range(copies), captured once in a CUDA graph."""
    import torch
    for i in range(copies):   # warm-up outside the graph (module load, first-touch)
        fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(copies):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0 / copies)
    times.sort()
    return times[len(times) // 2]


class Bench:
    def __init__(self, aot: Path, out: Path):
        import torch
        self.torch = torch
        self.aot, self.out = aot, out
        self.index = json.loads((aot / "index.json").read_text())
        self.results = {"correctness": [], "timing": [], "sweep": [], "notes": []}
        self.log_lines = []

    def log(self, msg):
        print(msg, flush=True)
        self.log_lines.append(msg)

    def attempt(self, where, step):
        """Run one step of a run; a failure is logged and noted, not raised, so the steps after it still run.
        Saves the results either way."""
        try:
            step()
        except Exception as exc:
            import traceback
            self.log(f"STEP FAILED in {where}: {exc!r}\n{traceback.format_exc()}")
            self.results["notes"].append(repr(exc))
        self.save()

    def kernels(self, cfg_name, set_name="default", use_ptx=False):
        return KernelSet(self.aot / cfg_name / set_name, self.index[cfg_name]["sets"][set_name], use_ptx)

    def correct(self, name, err, limit, **info):
        ok = err <= limit
        self.results["correctness"].append(dict(name=name, err=err, limit=limit, ok=ok, **info))
        self.log(f"check {name}: rel err {err:.3e} (limit {limit:g}) {'OK' if ok else 'FAIL'}")

    # ------------------------------------------------------------------ ceilings
    def copy_bandwidth(self):
        torch = self.torch
        x = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
        y = torch.empty_like(x)
        for _ in range(20):
            y.copy_(x)
        us = time_graph(lambda i: y.copy_(x), 1, reps=20)
        gbs = 2 * x.numel() / us / 1e3
        self.results["copy_gbs"] = gbs
        self.log(f"device-to-device copy: {gbs:.0f} GB/s (2 GiB, read + write)")

    # ------------------------------------------------------------------ elementwise ops
    def elementwise(self, cfg_name, ks):
        torch = self.torch
        from engc.kernels import qk_norm, rms_norm, rotary, silu_mul
        c = self.index[cfg_name]["cfg"]
        hid, inter, H, KV, D = c["hidden_size"], c["intermediate_size"], c["num_heads"], c["num_kv_heads"], c["head_dim"]
        bf = torch.bfloat16
        dev = "cuda"
        # correctness
        x, r = torch.randn(77, hid, dtype=bf, device=dev), torch.randn(77, hid, dtype=bf, device=dev)
        w = torch.randn(hid, dtype=bf, device=dev)
        out = torch.full_like(x, float("nan"))
        ks.run("rms_norm", rms_norm.launch(x, w, 1e-5, out))
        self.correct(f"{cfg_name}/rms_norm", rel_err(out, rms_norm.rms_norm(x, w, 1e-5)), 1e-2)
        y_ref, s_ref = rms_norm.add_rms_norm(x, r, w, 1e-5)
        out, res = torch.full_like(x, float("nan")), r.clone()
        ks.run("rms_norm", rms_norm.launch(x, w, 1e-5, out, residual=res))
        self.correct(f"{cfg_name}/add_rms_norm", max(rel_err(out, y_ref), rel_err(res, s_ref)), 1e-2)
        gu = torch.randn(77, 2 * inter, dtype=bf, device=dev)
        out = torch.full((77, inter), float("nan"), dtype=bf, device=dev)
        ks.run("silu_mul", silu_mul.launch(gu, out, consts=ks.consts("silu_mul")))
        self.correct(f"{cfg_name}/silu_mul", rel_err(out, silu_mul.silu_mul(gu)), 1e-2)
        qkv = torch.randn(77, (H + 2 * KV) * D, dtype=bf, device=dev)
        qw, kw = torch.randn(D, dtype=bf, device=dev), torch.randn(D, dtype=bf, device=dev)
        out = torch.full_like(qkv, float("nan"))
        ks.run("qk_norm", qk_norm.launch(qkv, qw, kw, 1e-6, out))
        self.correct(f"{cfg_name}/qk_norm", rel_err(out, qk_norm.qk_norm(qkv, qw, kw, H, KV, D, 1e-6)), 1e-2)
        inv_freq = 1.0 / (5e5 ** (torch.arange(0, D, 2, device=dev).float() / D))
        cache = torch.randn(2, 64, PAGE, KV, D, dtype=bf, device=dev)
        ref_cache = cache.clone()
        pos = torch.randint(0, 100000, (77,), device=dev)
        slots = torch.randperm(64 * PAGE, device=dev)[:77]
        ref_q = rotary.rotary_kv_write(qkv, pos, inv_freq, ref_cache, slots, H, KV, D)
        q_out = torch.full((77, H * D), float("nan"), dtype=bf, device=dev)
        ks.run("rotary", rotary.launch(qkv, pos, inv_freq, cache, slots, q_out))
        self.correct(f"{cfg_name}/rotary", max(rel_err(q_out, ref_q), rel_err(cache, ref_cache)), 1e-2)

        # timing
        for T in (1, 64, 4096, 16384):
            nbytes = T * hid * 2
            copies = max(1, min(32, math.ceil(512e6 / (4 * nbytes))))
            xs = [torch.randn(T, hid, dtype=bf, device=dev) for _ in range(copies)]
            rs = [torch.randn(T, hid, dtype=bf, device=dev) for _ in range(copies)]
            outs = [torch.empty_like(xs[0]) for _ in range(copies)]
            launches = [rms_norm.launch(xs[i], w, 1e-5, outs[i]) for i in range(copies)]
            us = time_graph(lambda i: ks.run("rms_norm", launches[i]), copies)
            self.timed(cfg_name, "rms_norm", f"T={T}", us, 2 * nbytes)
            launches = [rms_norm.launch(xs[i], w, 1e-5, outs[i], residual=rs[i]) for i in range(copies)]
            us = time_graph(lambda i: ks.run("rms_norm", launches[i]), copies)
            self.timed(cfg_name, "add_rms_norm", f"T={T}", us, 4 * nbytes)
            del xs, rs, outs
        for T in (1, 64, 4096):
            nbytes = T * inter * 3 * 2
            copies = max(1, min(32, math.ceil(512e6 / nbytes)))
            gus = [torch.randn(T, 2 * inter, dtype=bf, device=dev) for _ in range(copies)]
            outs = [torch.empty(T, inter, dtype=bf, device=dev) for _ in range(copies)]
            launches = [silu_mul.launch(gus[i], outs[i], consts=ks.consts("silu_mul")) for i in range(copies)]
            us = time_graph(lambda i: ks.run("silu_mul", launches[i]), copies)
            self.timed(cfg_name, "silu_mul", f"T={T}", us, nbytes)
            del gus, outs
        for T in (1, 4096):
            row = (H + 2 * KV) * D
            copies = max(1, min(32, math.ceil(512e6 / (T * row * 4))))
            blocks = T * copies // PAGE + 1
            cache = torch.zeros(2, blocks, PAGE, KV, D, dtype=bf, device=dev)
            qkvs = [torch.randn(T, row, dtype=bf, device=dev) for _ in range(copies)]
            qouts = [torch.empty(T, H * D, dtype=bf, device=dev) for _ in range(copies)]
            pos = torch.arange(T, device=dev)
            slot_list = [torch.arange(i * T, (i + 1) * T, device=dev) for i in range(copies)]
            launches = [rotary.launch(qkvs[i], pos, inv_freq, cache, slot_list[i], qouts[i]) for i in range(copies)]
            us = time_graph(lambda i: ks.run("rotary", launches[i]), copies)
            self.timed(cfg_name, "rotary_kv", f"T={T}", us, T * row * 2 * 2)
            del cache, qkvs, qouts

    def timed(self, cfg_name, op, shape, us, nbytes, **extra):
        gbs = nbytes / us / 1e3
        entry = dict(cfg=cfg_name, op=op, shape=shape, us=us, gbs=gbs, roofline_pct=100 * gbs / ROOFLINE_GBS, **extra)
        self.results["timing"].append(entry)
        self.log(f"time {cfg_name} {op} {shape}: {us:.2f} us, {gbs:.0f} GB/s ({entry['roofline_pct']:.0f}% of copy)")
        return entry

    # ------------------------------------------------------------------ attention
    def attention_inputs(self, c, seqs, num_blocks, gen_seed, cache=None):
        torch = self.torch
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        g = torch.Generator(device="cuda").manual_seed(gen_seed)
        need = [math.ceil(ctx / PAGE) for ctx, _ in seqs]
        perm = torch.randperm(num_blocks, device="cuda", generator=g)[:sum(need)].to(torch.int32)
        bt = torch.zeros(len(seqs), max(need), dtype=torch.int32, device="cuda")
        off = 0
        for b, n in enumerate(need):
            bt[b, :n] = perm[off:off + n]
            off += n
        ctx = torch.tensor([s[0] for s in seqs], dtype=torch.int32, device="cuda")
        qsl = torch.tensor([0] + [s[1] for s in seqs], device="cuda").cumsum(0).to(torch.int32)
        q = torch.randn(int(qsl[-1]), H * D, dtype=torch.bfloat16, device="cuda", generator=g)
        return q, bt, ctx, qsl

    def attention(self, cfg_name, ks):
        torch = self.torch
        from engc.kernels import paged_attention as pa
        c = self.index[cfg_name]["cfg"]
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        block_bytes = 2 * PAGE * KV * D * 2
        num_blocks = int(2.2e9 // block_bytes)
        cache = torch.randn(2, num_blocks, PAGE, KV, D, dtype=torch.bfloat16, device="cuda")
        scale = D ** -0.5
        ws = pa.decode_workspace(64, H, D, 64, "cuda")

        def launches(q, bt, ctx, qsl, out, max_q, ks_=ks, max_ctx=None, window=0, decode_rows=True):
            return pa.launch(q, cache, bt, ctx, qsl, out, num_heads=H, num_kv_heads=KV, head_dim=D, scale=scale,
                             sliding_window=window, max_query_len=max_q, max_context_len=max_ctx, workspace=ws,
                             decode_rows=decode_rows, consts=ks_.consts("paged_attention"))

        # correctness: decode batches, a mixed prefill/extend/decode batch, a sliding window
        cases = [("decode_b1_4096", [(4096, 1)], 0), ("decode_b32_mixed_ctx", [(128 + 127 * i, 1) for i in range(32)], 0),
                 ("decode_b64_1000", [(1000 + i, 1) for i in range(64)], 0),
                 ("mixed_prefill_extend_decode", [(1024, 1024), (2048, 512), (300, 1), (4096, 1), (777, 77)], 0),
                 ("mixed_window_256", [(1024, 1024), (2048, 512), (300, 1), (4096, 1)], 256)]
        for name, seqs, window in cases:
            q, bt, ctx, qsl = self.attention_inputs(c, seqs, num_blocks, 1)
            out = torch.full_like(q, float("nan"))
            ks.run("paged_attention", launches(q, bt, ctx, qsl, out, max(s[1] for s in seqs), window=window))
            ref = attention_reference(q, cache, bt, ctx, qsl, H, KV, D, scale, window)
            self.correct(f"{cfg_name}/attention/{name}", rel_err(out.cpu(), ref), 2e-2)

        # timing: decode over the grid, every tile config on a subset; prefill
        for set_name in ["default"] + list(DECODE_SWEEP):
            kset = ks if set_name == "default" else self.kernels_with(cfg_name, set_name, ks)
            for B in (1, 32, 64):
                for ctx_len in ((128, 512, 1024, 2048, 4096) if set_name == "default" else (512, 4096)):
                    for mult in ((1, 2, 4) if B < 64 else (2,)):
                        self.time_decode(cfg_name, set_name, kset, c, B, ctx_len, mult, num_blocks, launches)
        for seqs, label in (([(4096, 4096)], "1x4096"), ([(1024, 1024)] * 8, "8x1024"),
                            ([(4096, 512)] * 4, "4x512_on_3584_cached")):
            q, bt, ctx, qsl = self.attention_inputs(c, seqs, num_blocks, 3)
            out = torch.empty_like(q)
            flops = sum(4 * H * D * (n * (ctxl - n) + n * (n + 1) / 2) for ctxl, n in seqs)
            for set_name in ["default"] + list(PREFILL_SWEEP):
                kset = ks if set_name == "default" else self.kernels_with(cfg_name, set_name, ks)
                ls = launches(q, bt, ctx, qsl, out, max(s[1] for s in seqs), ks_=kset, decode_rows=False)
                us = time_graph(lambda i: kset.run("paged_attention", ls), 1)
                self.results["sweep"].append(dict(cfg=cfg_name, set=set_name, prefill=label, us=us,
                                                  tflops=flops / us / 1e6))
                self.log(f"prefill {cfg_name} {set_name} {label}: {us:.1f} us {flops / us / 1e6:.0f} TFLOP/s")
                if set_name != "default":
                    ref = torch.empty_like(out)
                    ks.run("paged_attention", launches(q, bt, ctx, qsl, ref, max(s[1] for s in seqs),
                                                       decode_rows=False))
                    kset.run("paged_attention", ls)
                    self.correct(f"{cfg_name}/attention/prefill_{set_name}_vs_default_{label}", rel_err(out, ref), 1e-2)
            ls = launches(q, bt, ctx, qsl, out, max(s[1] for s in seqs), decode_rows=False)
            us = time_graph(lambda i: ks.run("paged_attention", ls), 1)
            entry = self.timed(cfg_name, "prefill", label, us, sum(2 * ctxl * KV * D * 2 for ctxl, _ in seqs))
            entry["tflops"] = flops / us / 1e6
            if len(seqs) and seqs[0][0] == seqs[0][1]:
                import torch.nn.functional as F
                n = seqs[0][1]
                qq = torch.randn(len(seqs), H, n, D, dtype=torch.bfloat16, device="cuda")
                kk = torch.randn(len(seqs), KV, n, D, dtype=torch.bfloat16, device="cuda")
                vv = torch.randn_like(kk)
                us_t = time_graph(lambda i: F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True), 1)
                self.log(f"      torch sdpa (contiguous, no paging) {label}: {us_t:.1f} us, {flops / us_t / 1e6:.0f} TFLOP/s")
                entry["torch_sdpa_us"] = us_t
        del cache

    def kernels_with(self, cfg_name, set_name, base: KernelSet) -> KernelSet:
        sweep = self.kernels(cfg_name, set_name)
        ks = KernelSet.__new__(KernelSet)
        ks.kernels = dict(base.kernels)
        ks.records = dict(base.records)
        ks.kernels.update(sweep.kernels)
        ks.records.update(sweep.records)
        return ks

    def time_decode(self, cfg_name, set_name, ks, c, B, ctx_len, mult, num_blocks, launches):
        torch = self.torch
        KV, D = c["num_kv_heads"], c["head_dim"]
        kv_bytes = B * ctx_len * KV * D * 2 * 2
        copies = max(1, min(48, math.ceil(600e6 / kv_bytes), num_blocks * PAGE // (B * ctx_len)))
        consts = {k: dict(v) for k, v in ks.consts("paged_attention").items()}
        consts["decode"]["target_programs"] = 132 * mult
        ks_local = _Consts(ks, consts)
        sets = []
        for i in range(copies):
            q, bt, ctx, qsl = self.attention_inputs(c, [(ctx_len, 1)] * B, num_blocks, 100 + i)
            out = torch.empty_like(q)
            sets.append(launches(q, bt, ctx, qsl, out, 1, ks_=ks_local, max_ctx=ctx_len))
        splits = sets[0][0][1][2]
        us = time_graph(lambda i: ks.run("paged_attention", sets[i]), copies)
        gbs = kv_bytes / us / 1e3
        entry = dict(cfg=cfg_name, set=set_name, B=B, ctx=ctx_len, target=132 * mult, splits=splits, us=us, gbs=gbs,
                     roofline_pct=100 * gbs / ROOFLINE_GBS)
        self.results["sweep"].append(entry)
        self.log(f"decode {cfg_name} {set_name} B={B} ctx={ctx_len} target={132 * mult} splits={splits}: "
                 f"{us:.1f} us {gbs:.0f} GB/s ({entry['roofline_pct']:.0f}%)")

    # ------------------------------------------------------------------ sampling
    def sampling(self, cfg_name, ks):
        torch = self.torch
        from engc.kernels import sampling as sp
        V = self.index[cfg_name]["cfg"]["vocab_size"]
        B = 32
        g = torch.Generator(device="cuda").manual_seed(5)
        logits = torch.randn(B, V, device="cuda", generator=g) * 4
        t = torch.tensor([0.0, 0.7, 1.0, 1.3] * 8, device="cuda")
        k = torch.tensor([0, 0, 50, 1000] * 8, dtype=torch.int32, device="cuda")
        p = torch.tensor([1.0, 0.9, 1.0, 0.8] * 8, device="cuda")
        u = torch.rand(B, device="cuda", generator=g)
        for dt in (torch.float32, torch.bfloat16):
            lg = logits.to(dt)
            out = torch.full((B,), -1, dtype=torch.int64, device="cuda")
            ks.run("sampling", sp.launch(lg, t, k, p, u, out))
            ref = sp.sample(lg, t, k, p, u)
            mism = int((out != ref).sum())
            self.correct(f"{cfg_name}/sampling/{str(dt)[6:]}", mism, 0)
            for label, tt, kk, pp in (("greedy", t * 0, k, p), ("temp_only", t * 0 + 1, k * 0, p * 0 + 1),
                                      ("topk50_topp0.9", t * 0 + 1, k * 0 + 50, p * 0 + 0.9)):
                us = time_graph(lambda i: ks.run("sampling", sp.launch(lg, tt, kk, pp, u, out)), 1)
                self.timed(cfg_name, f"sampling_{str(dt)[6:]}", f"B={B} {label}", us, B * V * lg.element_size())

    def ptx_check(self, cfg_name):
        """The pinned-ISA PTX must JIT on this driver and compute the same as the cubin."""
        torch = self.torch
        from engc.kernels import paged_attention as pa, rms_norm
        try:  # noqa: SIM105
            ks = self.kernels(cfg_name, use_ptx=True)
        except Exception as exc:
            self.correct(f"{cfg_name}/ptx_jit_load", float("inf"), 0, error=repr(exc))
            return
        c = self.index[cfg_name]["cfg"]
        x = torch.randn(5, c["hidden_size"], dtype=torch.bfloat16, device="cuda")
        w = torch.randn(c["hidden_size"], dtype=torch.bfloat16, device="cuda")
        out = torch.full_like(x, float("nan"))
        ks.run("rms_norm", rms_norm.launch(x, w, 1e-5, out))
        self.correct(f"{cfg_name}/ptx_jit/rms_norm", rel_err(out, rms_norm.rms_norm(x, w, 1e-5)), 1e-2)
        H, KV, D = c["num_heads"], c["num_kv_heads"], c["head_dim"]
        cache = torch.randn(2, 300, PAGE, KV, D, dtype=torch.bfloat16, device="cuda")
        q, bt, ctx, qsl = self.attention_inputs(c, [(1500, 1), (700, 300)], 300, 9)
        out = torch.full_like(q, float("nan"))
        ks.run("paged_attention", pa.launch(q, cache, bt, ctx, qsl, out, num_heads=H, num_kv_heads=KV, head_dim=D,
                                            scale=D ** -0.5, max_query_len=300,
                                            consts=ks.consts("paged_attention")))
        ref = attention_reference(q, cache, bt, ctx, qsl, H, KV, D, D ** -0.5)
        self.correct(f"{cfg_name}/ptx_jit/paged_attention", rel_err(out.cpu(), ref), 2e-2)

    def graph_check(self, cfg_name, ks):
        """Launches captured in a torch CUDA graph replay correctly on new data."""
        torch = self.torch
        from engc.kernels import rms_norm
        c = self.index[cfg_name]["cfg"]
        x = torch.randn(8, c["hidden_size"], dtype=torch.bfloat16, device="cuda")
        w = torch.randn(c["hidden_size"], dtype=torch.bfloat16, device="cuda")
        out = torch.empty_like(x)
        ls = rms_norm.launch(x, w, 1e-5, out)
        ks.run("rms_norm", ls)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            ks.run("rms_norm", ls)
        x.copy_(torch.randn_like(x))
        out.fill_(float("nan"))
        g.replay()
        torch.cuda.synchronize()
        self.correct(f"{cfg_name}/cuda_graph_replay", rel_err(out, rms_norm.rms_norm(x, w, 1e-5)), 1e-2)

    def save(self):
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "results.json").write_text(json.dumps(self.results, indent=1))
        (self.out / "log.txt").write_text("\n".join(self.log_lines) + "\n")

    def table(self):
        lines = ["", "== correctness (rel err; sampling: mismatching tokens) =="]
        bad = [r for r in self.results["correctness"] if not r["ok"]]
        worst = {}
        for r in self.results["correctness"]:
            key = r["name"].split("/", 1)[1].split("/")[0]
            worst[key] = max(worst.get(key, 0.0), r["err"])
        lines.append("  " + ", ".join(f"{k} {v:.1e}" for k, v in sorted(worst.items())))
        lines.append(f"  {len(self.results['correctness']) - len(bad)}/{len(self.results['correctness'])} ok"
                     + (": FAILED " + ", ".join(r["name"] for r in bad) if bad else ""))
        lines.append(f"== decode attention (GB/s of KV read; copy roofline {ROOFLINE_GBS:.0f}, "
                     f"measured copy {self.results.get('copy_gbs', 0):.0f}) ==")
        best = {}
        for e in self.results["sweep"]:
            if "B" not in e:
                continue
            key = (e["cfg"], e["B"], e["ctx"])
            if e["set"] == "default" and e["target"] == 264:
                best.setdefault(key, {})["default"] = e
            if key not in best or e["us"] < best[key].get("best", {"us": 1e30})["us"]:
                best.setdefault(key, {})["best"] = e
        for (cfg, B, ctx), d in sorted(best.items()):
            de, be = d.get("default"), d["best"]
            if de:
                lines.append(f"  {cfg} B={B:<2} ctx={ctx:<4} default {de['us']:7.1f} us {de['gbs']:5.0f} GB/s "
                             f"({de['roofline_pct']:3.0f}%) | best {be['set']}/t{be['target']} {be['us']:7.1f} us "
                             f"({be['roofline_pct']:3.0f}%)")
        lines.append("== prefill (TFLOP/s per tile config) ==")
        pre = {}
        for e in self.results["sweep"]:
            if "prefill" in e:
                pre.setdefault((e["cfg"], e["prefill"]), []).append(f"{e['set']} {e['tflops']:.0f}")
        for (cfg, label), items in sorted(pre.items()):
            lines.append(f"  {cfg} {label}: " + ", ".join(items))
        lines.append("== other kernels ==")
        for e in self.results["timing"]:
            extra = f" {e['tflops']:.0f} TFLOP/s" if "tflops" in e else ""
            if "torch_sdpa_us" in e:
                extra += f" (torch sdpa, unpaged: {e['tflops'] * e['us'] / e['torch_sdpa_us']:.0f})"
            lines.append(f"  {e['cfg']} {e['op']:<16} {e['shape']:<22} {e['us']:8.2f} us {e['gbs']:6.0f} GB/s "
                         f"({e['roofline_pct']:3.0f}%){extra}")
        print("\n".join(lines), flush=True)
        self.log_lines.extend(lines)


class _Consts:
    """A KernelSet view with different launch constants (for the target_programs sweep)."""

    def __init__(self, ks, consts):
        self.ks, self._consts = ks, consts

    def consts(self, op):
        return self._consts if op == "paged_attention" else self.ks.consts(op)


def run(aot: Path, out: Path):
    import torch
    from cuda.bindings import driver
    torch.cuda.init()
    torch.zeros(1, device="cuda")
    _check(driver.cuInit(0))
    bench = Bench(aot, out)
    bench.log(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}")
    try:
        bench.copy_bandwidth()
        for cfg_name in CONFIGS:
            ks = bench.kernels(cfg_name)
            for step in (lambda: bench.graph_check(cfg_name, ks), lambda: bench.ptx_check(cfg_name),
                         lambda: bench.elementwise(cfg_name, ks), lambda: bench.sampling(cfg_name, ks),
                         lambda: bench.attention(cfg_name, ks)):
                bench.attempt(cfg_name, step)
    finally:
        bench.save()
        bench.table()
        bench.save()


def step_main(steps: dict) -> None:
    """The command line of the device bench scripts: `SCRIPT STEP AOT [--out DIR]`, each step a function of
    (aot folder, out folder): a `prepare` here (CPU: compile into AOT) and a `run` on the GPU box."""
    ap = argparse.ArgumentParser()
    ap.add_argument("step", choices=list(steps))
    ap.add_argument("aot", type=Path)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "bench/results")))
    args = ap.parse_args()
    steps[args.step](args.aot, args.out)


if __name__ == "__main__":
    step_main({"prepare": lambda aot, out: prepare(aot), "run": run})

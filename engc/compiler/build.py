"""engc build: read -> lower -> passes -> codegen -> write bundle."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engc.bundle import manifest as mf
from engc.bundle.hashing import sha256_file
from engc.bundle.safetensors_stream import write_streaming
from engc.bundle.tp import rank_config, weight_file
from engc.bundle.writer import write_bundle
from engc.compiler.frontend.bos import with_bos
from engc.compiler.frontend.checkpoint import Checkpoint
from engc.compiler.frontend.decoder import lower
from engc.compiler.frontend.fp8_checkpoint import is_block_fp8
from engc.compiler.ir import to_onnx
from engc.compiler.passes import PASSES
from engc.compiler.passes.decode_form import add_decode_form
from engc.compiler.passes.fuse_fp8_input_quant import fuse_fp8_input_quant
from engc.compiler.passes.quantize_kv_cache import KV_CACHE_PASSES
from engc.compiler.passes.shard_tp import tp_pass
from engc.compiler.passes.quantize_fp8 import (check_fp8_shapes, check_fp8_targets, fp8_manifest, fp8_target_problem,
                                               quantize_fp8)
from engc.errors import UserError
from engc.progress import Progress

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
KV_BLOCK_SIZE = 16


@dataclass(frozen=True)
class BuildOptions:
    archs: tuple[str, ...] = ("cpu",)
    dtype: str = "auto"          # auto: float32 for a CPU-only bundle, bfloat16 when GPUs are targeted
    kv_block_size: int = KV_BLOCK_SIZE
    kernel_cache: str | None = None   # folder of compiled kernels to reuse (see kernel_cache.py)
    kv_cache: str = "auto"       # auto: the model dtype; int8 / fp8 (e4m3): codes + per-token scales
    quant: str = "auto"          # auto: as the checkpoint is (float, AWQ/GPTQ int4 repacked, block-scaled float8
                                 # as fp8 where the targets run it); fp8: W8A8;
                                 # keep: a GGUF's 4-bit projections stay 4-bit (frontend/gguf_quant.py)
    tune: dict | None = None     # tune-table entries merged over the table for this build (--tune FILE)
    tp: int = 1                  # tensor-parallel ranks: one weight file a rank (passes/shard_tp.py)

    def resolved_dtype(self) -> str:
        if self.dtype != "auto":
            if self.dtype not in DTYPES:
                raise UserError(f"unknown --dtype '{self.dtype}'; known: auto, {', '.join(DTYPES)}")
            return self.dtype
        return "float32" if self.archs == ("cpu",) else "bfloat16"


def read_source(src: str, keep_quant: bool = False) -> Checkpoint:
    if src == "default":
        from engc.compiler.frontend.default_model import default_gguf_path
        path = default_gguf_path()
    else:
        path = Path(src)
    if not path.exists():
        raise UserError(f"{src}: no such file or folder")
    if path.is_dir():
        from engc.compiler.frontend.fp8_checkpoint import read_fp8_folder
        from engc.compiler.frontend.hf import read_hf_folder
        from engc.compiler.frontend.quantized import is_quantized, read_quantized_folder
        config = path / "config.json"
        hf = json.loads(config.read_text() or "{}") if config.is_file() else {}
        if is_block_fp8(hf):
            return read_fp8_folder(path)
        if is_quantized(hf):
            return read_quantized_folder(path)
        return read_hf_folder(path)
    if path.suffix.lower() == ".gguf":
        from engc.compiler.frontend.gguf import read_gguf
        return read_gguf(path, keep_quant)
    raise UserError(f"{src}: expected a Hugging Face model folder, a .gguf file or 'default'")


def build(src: str, out: Path, opts: BuildOptions, progress: Progress | None = None) -> dict:
    progress = progress or Progress(enabled=False)
    started = time.monotonic()
    dtype_name = opts.resolved_dtype()
    if opts.quant not in ("auto", "fp8", "keep"):
        raise UserError(f"unknown --quant '{opts.quant}'; known: auto, fp8, keep (int4 comes from AWQ/GPTQ "
                        "checkpoints, see engc quantize, or from a GGUF's 4-bit weights with keep)")
    if opts.kv_cache != "auto" and opts.kv_cache not in KV_CACHE_PASSES:
        raise UserError(f"unknown --kv-cache '{opts.kv_cache}'; known: auto, {', '.join(KV_CACHE_PASSES)}")
    if opts.quant == "fp8":
        check_fp8_targets(opts.archs, dtype_name)
    with progress.step("read checkpoint"):
        ckpt = read_source(src, keep_quant=opts.quant == "keep")
    # a block-scaled float8 checkpoint stays float8 where the targets have FP8 tensor cores (else it is read
    # dequantized, as a float one)
    fp8_source = is_block_fp8(ckpt.hf_config)
    fp8 = opts.quant == "fp8" or (opts.quant == "auto" and fp8_source
                                  and fp8_target_problem(opts.archs, dtype_name) is None)
    if fp8 and _quantization(ckpt):
        raise UserError(f"{ckpt.name} is already quantized ({_quantization(ckpt)['method']} int4); "
                        "--quant fp8 needs a float checkpoint")
    passes = list(PASSES)
    if fp8:  # right after the qkv/gate_up fusion, before any pass that claims a plain Gemm (silu_mul+down)
        at = [p.__name__ for p in passes].index("fuse_parallel_gemms") + 1
        passes[at:at] = [quantize_fp8, fuse_fp8_input_quant]
    if opts.kv_cache != "auto":
        passes = [*passes, KV_CACHE_PASSES[opts.kv_cache]]
    passes.append(add_decode_form)   # last: it copies the finished head (the format's second output)
    with progress.step("lower to engine program"):
        cfg, graph = lower(ckpt, DTYPES[dtype_name])
        if fp8 and opts.archs != ("cpu",):
            check_fp8_shapes(cfg)
        if opts.tp != 1:   # first: every later pass works on the shard shapes
            passes.insert(0, tp_pass(cfg, opts.tp))
        for p in passes:
            graph = p(graph)
        graph.validate()
    files = with_bos(tokenizer_files(ckpt), cfg)
    kernels = []
    gpu_archs = [a for a in opts.archs if a != "cpu"]
    if gpu_archs:
        with progress.step(f"compile kernels for {','.join(gpu_archs)}"):
            from engc.compiler import tune
            from engc.compiler.kernel_cache import compile_cached
            with tune.overridden(opts.tune):
                result = compile_cached(rank_config(cfg, opts.tp), DTYPES[dtype_name], gpu_archs, opts.kv_block_size,
                                        Path(opts.kernel_cache) if opts.kernel_cache else None,
                                        quant="fp8" if fp8 else "none", kv_cache=opts.kv_cache,
                                        int4_group_sizes=int4_group_sizes(graph),
                                        int4_lm_head=has_int4_lm_head(graph), int4_experts=int4_experts(graph))
            files.update(result.files)
            kernels = result.records

    def write_large(tmp: Path):
        (tmp / "weights").mkdir()
        bar = progress.bar("write weights", total=len(graph.weights) * opts.tp)
        for rank in reversed(range(opts.tp)):   # rank 0 last: the program points into its file
            graph.rank = rank
            layout = write_streaming(tmp / weight_file(rank), graph.weights, on_tensor=lambda _: bar.advance())
        bar.close()
        (tmp / mf.PROGRAM).write_bytes(to_onnx(graph, layout, mf.WEIGHTS, dtype_name))

    manifest = {
        "source": {"name": ckpt.name, "sha256": ckpt.source_sha256()},
        "model": cfg.to_dict(), "dtype": dtype_name, "tp": opts.tp,
        "quantization": ({**fp8_manifest(graph), **({"source_format": "fp8 block-scaled"} if fp8_source else {})}
                         if fp8 else _quantization(ckpt)),
        "archs": list(opts.archs), "kv_block_size": opts.kv_block_size, "kv_cache": opts.kv_cache,
        "program": mf.PROGRAM, "weights": [weight_file(r) for r in range(opts.tp)], "kernels": kernels,
        "passes": [p.__name__ for p in passes],
        **({"tune_overrides": opts.tune} if opts.tune else {}),   # each kernel record has its entry too
    }
    with progress.step("write bundle"):
        manifest = write_bundle(out, manifest, files, write_large)
    sizes = {rel: (out / rel).stat().st_size for rel in manifest["files"]}
    parts = {"weights": "weights/", "kernels": "kernels/", "program": mf.PROGRAM}
    by_part = {name: sum(n for rel, n in sizes.items() if rel.startswith(prefix)) for name, prefix in parts.items()}
    by_part["other"] = sum(sizes.values()) - sum(by_part.values())
    # digest: the manifest's sha256, which names every byte of the bundle (it lists each file's sha256);
    # two builds of the same inputs give the same digest
    return {"bundle": str(out), "model": ckpt.name, "family": cfg.family, "dtype": dtype_name,
            "archs": list(opts.archs), "tp": opts.tp, "kernels": len(kernels),
            "kernels_by_arch": {a: sum(r["arch"] == a for r in kernels) for a in gpu_archs},
            "files": len(sizes), "bytes": sum(sizes.values()), "bytes_by_part": by_part,
            "digest": sha256_file(out / mf.MANIFEST), "timings_s": dict(progress.timings),
            "seconds": round(time.monotonic() - started, 2)}


def int4_group_sizes(graph) -> tuple[int, ...]:
    """The group sizes of the program's int4 projections: each gets its own GEMV/GEMM kernels."""
    return tuple(sorted({int(n.attrs["group_size"]) for n in graph.nodes if n.op == "QLinear"}))


def int4_experts(graph) -> int:
    """The MoE experts' int4 group size (one for every MoE node of a checkpoint), 0 where they are not int4."""
    return max((int(n.attrs.get("group_size") or 0) for n in graph.nodes if n.op == "MoE"), default=0)


def has_int4_lm_head(graph) -> bool:
    """The logits come from an int4 QLinear (a checkpoint quantized with its lm_head): no dense Gemm left."""
    return any(n.op == "QLinear" and n.inputs[1] == "lm_head.qweight" for n in graph.nodes)


def tokenizer_files(ckpt: Checkpoint) -> dict[str, bytes]:
    files = {f"tokenizer/{name}": data for name, data in sorted(ckpt.tokenizer_files.items())}
    # One place for the chat template, whichever file the checkpoint kept it in.
    if "tokenizer/chat_template.jinja" not in files:
        cfg = json.loads(files.get("tokenizer/tokenizer_config.json", b"{}"))
        template = cfg.get("chat_template")
        if isinstance(template, list):  # named templates: keep the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            files["tokenizer/chat_template.jinja"] = template.encode()
    return files


def _quantization(ckpt: Checkpoint) -> dict | None:
    """The manifest's quantization entry of a checkpoint that stays quantized as it was (int4, a GGUF's kept
    4-bit); None for float ones and block-scaled float8 ones, which read as float."""
    qc = ckpt.hf_config.get("quantization_config")
    if not qc or is_block_fp8(ckpt.hf_config):
        return None
    if qc.get("quant_method") == "gguf":
        from engc.compiler.frontend.gguf_quant import describe as describe_gguf
        return describe_gguf(qc, lm_head=ckpt.has("lm_head.qweight"))
    from engc.compiler.frontend.quantized import describe
    return describe(qc, lm_head=ckpt.has("lm_head.qweight"))

"""A build cache for compiled kernels, keyed by everything that decides their bytes.

Kernels depend on the model's shapes, the dtype, the arch list, the KV block size and the kernel and
codegen sources, not on the weights. So a cache filled on one machine (a CPU-only CI runner, say)
lets a build elsewhere reuse the same cubins without a compiler: `engc build --kernel-cache DIR`.
"""
from __future__ import annotations

import hashlib
import io
import json
import tokenize
from pathlib import Path

import torch

import engc
from engc.bundle.model_config import ModelConfig


def source_files() -> list[Path]:
    """Every file a compiled kernel's bytes can depend on: the kernel folders (the Triton code with
    kernels/pdl.py and any helper module a triton.py imports, the contracts' constants, the spec builders;
    not bind.py, the runtime's), codegen and the CUDA templates."""
    root = Path(engc.__file__).parent
    kernels = [f for f in root.glob("kernels/**/*.py") if f.name != "bind.py"]
    return sorted([*kernels, *root.glob("compiler/codegen/**/*.py"), *root.glob("templates/*.j2")])


def digested_form(f: Path) -> bytes:
    """What of a source file the key covers. Triton code and templates: their bytes (the bundle records the
    kernels' sources as they read, and Triton's line info follows their lines). Other Python (codegen, the
    spec builders, the contracts): its code without comments, blank lines or trailing blanks, so editing a
    note there leaves prepared caches valid (a changed key means every kernel compiles again). Not its
    syntax tree: ast.dump differs between Python versions (3.12 adds type_params), and a cache filled under
    one version must serve another (this machine's 3.11, the GPU machine's 3.12)."""
    text = f.read_bytes()
    if f.suffix == ".py" and b"triton" not in text:
        return code_without_comments(text.decode()).encode()
    return text


def code_without_comments(source: str) -> str:
    """Python source with its comments, blank lines and trailing whitespace removed (tokenize finds the
    comments, so a '#' inside a string stays)."""
    lines = source.splitlines()
    cut = {tok.start[0] - 1: tok.start[1] for tok in tokenize.generate_tokens(io.StringIO(source).readline)
           if tok.type == tokenize.COMMENT}
    kept = (line[:cut[i]] if i in cut else line for i, line in enumerate(lines))
    return "\n".join(line.rstrip() for line in kept if line.strip())


def sources_digest() -> str:
    root = Path(engc.__file__).parent
    h = hashlib.sha256()
    for f in source_files():
        h.update(f.relative_to(root).as_posix().encode() + b"\0" + digested_form(f))
    return h.hexdigest()


def compile_cached(cfg: ModelConfig, dtype: torch.dtype, archs: list[str], block_size: int,
                   cache_dir: Path | None, quant: str = "none", kv_cache: str = "auto", int4_group_sizes=(),
                   int4_lm_head: bool = False, int4_experts: int = 0):
    """compile_kernels, answered from cache_dir when it already holds this exact compilation."""
    from engc.compiler import tune
    from engc.compiler.codegen import CodegenResult, compile_kernels
    if cache_dir is None:
        return compile_kernels(cfg, dtype, archs, block_size, quant=quant, kv_cache=kv_cache,
                               int4_group_sizes=int4_group_sizes, int4_lm_head=int4_lm_head,
                               int4_experts=int4_experts)
    key = hashlib.sha256(json.dumps({"model": cfg.to_dict(), "dtype": str(dtype), "archs": sorted(archs),
                                     "block_size": block_size, "sources": sources_digest(), "quant": quant,
                                     "kv_cache": kv_cache,
                                     # the table as loaded: a sweep or bench may have changed entries in memory
                                     "tune": hashlib.sha256(json.dumps(tune.TUNE, sort_keys=True, default=str)
                                                            .encode()).hexdigest(),
                                     **({"int4_group_sizes": sorted(set(int4_group_sizes))} if int4_group_sizes else {}),
                                     **({"int4_lm_head": True} if int4_lm_head else {}),
                                     **({"int4_experts": int4_experts} if int4_experts else {})},
                                    sort_keys=True).encode()).hexdigest()[:32]
    entry = Path(cache_dir) / key
    if (entry / "records.json").is_file():
        records = json.loads((entry / "records.json").read_text())
        files = {rel: (entry / "files" / rel).read_bytes() for rel in json.loads((entry / "files.json").read_text())}
        return CodegenResult(files=files, records=records)
    result = compile_kernels(cfg, dtype, archs, block_size, quant=quant, kv_cache=kv_cache,
                               int4_group_sizes=int4_group_sizes, int4_lm_head=int4_lm_head,
                               int4_experts=int4_experts)
    for rel, data in result.files.items():
        (entry / "files" / rel).parent.mkdir(parents=True, exist_ok=True)
        (entry / "files" / rel).write_bytes(data)
    (entry / "files.json").write_text(json.dumps(sorted(result.files)))
    (entry / "records.json").write_text(json.dumps(result.records, sort_keys=True))
    return result


if __name__ == "__main__":
    # `python -m engc.compiler.kernel_cache`: the digest of engc's kernel sources, the key a CI keeps its
    # kernel cache folder under (examples/ci); the entries inside are keyed per model and build as well
    print(sources_digest()[:16])

"""compile_kernels and the kernel-table record written for each compiled kernel.

Record schema (all JSON types; one per (op, variant, arch)):
  op, variant, arch            e.g. "paged_attention", "decode", "sm90"
  entry                        kernel symbol in the cubin (cuModuleGetFunction name)
  cubin, ptx, source           bundle-relative paths of the cubin, its PTX and the Triton source file
  imports                      Triton only: bundle-relative paths of the engc modules whose @triton.jit
                               helpers the source calls (kernels/pdl.py, a sibling like paged_attention/tiles.py)
  ptx_version, ptx_target      PTX ISA pinned for the driver's JIT (87 = ISA 8.7), .target of the PTX
  num_warps, num_ctas          block = (32 * num_warps, 1, 1); num_ctas is always 1
  shared_mem                   dynamic shared memory bytes to pass to cuLaunchKernel; above the function's
                               CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES (by default 49152 minus its
                               static shared memory) the loader must first raise that attribute
  static_shared                CUDA C++ kernels only: the cubin's static shared memory (bytes)
  args                         [{"name", "type"}] in launch order: the kernel's runtime params (types
                               "*bf16" pointer, "i32", "fp32", ...) then two "*i8" scratch params
                               (global_scratch, profile_scratch) that take null
  align                        pointer params are assumed 16-byte aligned (Triton divisibility hint)
  constexprs                   the values the kernel was specialized on
  launch                       constants the op's launch rule reads (pass as consts[variant])
  tune_key, tune               tune-table key and entry chosen
  scratch_params               trailing scratch pointers the kernel takes (Triton: 2; CUDA C++: 0)
  triton_version               compiler that produced the cubin (CUDA C++ kernels: nvcc_version)
"""
from __future__ import annotations

import inspect
import os
import sys
import types
from dataclasses import dataclass, field
from typing import Callable

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen.aot import PTX_VERSION, compile_in_children, compile_spec
from engc.compiler.codegen.cuda import add_selected as add_selected_cuda
from engc.compiler.codegen.kernel_spec import KernelSpec
from engc.compiler.codegen.specs import model_specs

SCRATCH_ARGS = [{"name": "global_scratch", "type": "*i8"}, {"name": "profile_scratch", "type": "*i8"}]


@dataclass
class CodegenResult:
    files: dict[str, bytes] = field(default_factory=dict)
    records: list[dict] = field(default_factory=list)


def kernel_record(spec: KernelSpec, meta: dict, cubin_path: str, ptx_path: str, source_path: str,
                  imports: list[str] | None = None) -> dict:
    """imports: None leaves the field out (a record for a folder that carries no sources)."""
    args = [{"name": name, "type": ty} for name, ty in spec.signature().items() if ty != "constexpr"]
    return {
        "op": spec.op, "variant": spec.variant, "arch": spec.arch, "entry": meta["name"],
        "cubin": cubin_path, "ptx": ptx_path, "source": source_path,
        **({"imports": imports} if imports is not None else {}),
        "ptx_version": PTX_VERSION, "ptx_target": meta["ptx_target"],
        "num_warps": meta["num_warps"], "num_ctas": meta["num_ctas"], "shared_mem": meta["shared"],
        "args": args + SCRATCH_ARGS, "scratch_params": len(SCRATCH_ARGS), "align": 16,
        "constexprs": {k: spec.constexprs[k] for k in sorted(spec.constexprs)},
        "launch": tune.record_launch(spec.launch, spec.tune),
        "tune_key": spec.tune_key, "tune": dict(sorted(spec.tune.items())),
        "triton_version": meta["triton_version"],
    }


def jit_imports(module: types.ModuleType) -> list[types.ModuleType]:
    """The engc.kernels modules other than `module` whose @triton.jit functions its kernels can call, found
    through its globals (a module, or a function imported from one), transitively; sorted by name. A
    kernel's cubin is compiled from these as much as from its own file."""
    from triton.runtime.jit import JITFunction

    def reached(m):
        for v in vars(m).values():
            if isinstance(v, JITFunction):
                v = sys.modules[v.fn.__module__]
            if isinstance(v, types.ModuleType) and v.__name__.startswith("engc.kernels.") and \
                    any(isinstance(f, JITFunction) for f in vars(v).values()):
                yield v

    found, todo = {}, [module]
    while todo:
        for dep in reached(todo.pop()):
            if dep is not module and dep.__name__ not in found:
                found[dep.__name__] = dep
                todo.append(dep)
    return [found[name] for name in sorted(found)]


def import_path(module: types.ModuleType) -> str:
    """Bundle path of a helper module's source: kernels/src/ + its path under engc/kernels."""
    return "kernels/src/" + module.__name__.removeprefix("engc.kernels.").replace(".", "/") + ".py"


def default_jobs() -> int:
    """Half the CPUs, at most 8: each child pays a few seconds to import Triton, so two CPUs gain nothing."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _compile_all(specs: list[KernelSpec], progress, jobs: int) -> list:
    """compile_spec over specs, in order; jobs > 1 spreads them over child processes."""
    if jobs <= 1 or len(specs) <= 1:
        out = []
        for spec in specs:
            if progress:
                progress(f"compiling {spec.arch} {spec.op}.{spec.variant}")
            out.append(compile_spec(spec))
        return out
    if progress:
        progress(f"compiling {len(specs)} kernels in {min(jobs, len(specs))} processes")
    return compile_in_children(specs, jobs)


def compile_specs(specs: list[KernelSpec], progress: Callable[[str], None] | None = None,
                  jobs: int | None = None) -> CodegenResult:
    result = CodegenResult()
    specs = sorted(specs, key=lambda s: (s.arch, s.op, s.variant))
    compiled = _compile_all(specs, progress, default_jobs() if jobs is None else jobs)
    for spec, (cubin, ptx, meta) in zip(specs, compiled):
        stem = f"kernels/{spec.arch}/{spec.op}.{spec.variant}"
        source_path = f"kernels/src/{spec.op}.py"
        result.files[f"{stem}.cubin"] = cubin
        result.files[f"{stem}.ptx"] = ptx.encode()
        module = inspect.getmodule(spec.fn().fn)
        imports = jit_imports(module)
        for path, mod in ((source_path, module), *((import_path(m), m) for m in imports)):
            if path not in result.files:
                result.files[path] = inspect.getsource(mod).encode()
        result.records.append(kernel_record(spec, meta, f"{stem}.cubin", f"{stem}.ptx", source_path,
                                            [import_path(m) for m in imports]))
    return result


def compile_kernels(cfg: ModelConfig, dtype: torch.dtype, archs: list[str], block_size: int,
                    progress: Callable[[str], None] | None = None, jobs: int | None = None,
                    quant: str = "none", kv_cache: str = "auto", int4_group_sizes=(),
                    int4_lm_head: bool = False, int4_experts: int = 0) -> CodegenResult:
    """Compile every kernel cfg needs for each arch ("sm80", "sm90"), for a KV cache of block_size tokens.

    jobs: compiler processes (default: default_jobs(); 1 compiles in this process).
    quant: the build's --quant ('fp8' adds the activation quantization kernels).
    kv_cache: the build's --kv-cache ('int8'/'fp8': rotary and attention on a quantized KV cache).
    int4_group_sizes: group sizes of the program's int4 QLinears (adds the W4A16 GEMV/GEMM per size).
    int4_lm_head: the lm_head is an int4 QLinear (no dense GEMV / skinny GEMM is built).
    int4_experts: the MoE experts' int4 group size (0: not int4).
    """
    specs = [s for arch in sorted(set(archs))
             for s in model_specs(cfg, dtype, arch, block_size, quant=quant, kv_cache=kv_cache,
                                       int4_group_sizes=int4_group_sizes, int4_lm_head=int4_lm_head,
                                       int4_experts=int4_experts)]
    # CUDA C++ kernels (nvcc) join where the tune table prefers them to a Triton kernel of the same op.
    return add_selected_cuda(compile_specs(specs, progress, jobs), specs, cfg, progress)

"""CUDA C++ kernels from jinja2 templates: render per model shape, compile per arch with nvcc through a
generated build.ninja, and record them in the same kernel-table schema as the Triton kernels.

    specs, notes = cuda_specs.cuda_specs(triton_specs, cfg)   # an op folder's cuda_specs.py: what it selects
    result = compile_cuda(specs)                              # a CodegenResult, like compile_specs

nvcc is optional: without it (a CI runner, most CPU boxes) `nvcc_path()` is None and the build keeps the
Triton kernels. Flags: -O3 and no --use_fast_math, so division and rounding stay IEEE; the templates call
the approximate exp2 instruction themselves where Triton does too (the softmax). Line info is off so no
machine path reaches the cubin; the PTX's ISA version is pinned to PTX_VERSION like Triton's.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from engc.bundle.model_config import ModelConfig
from engc.compiler import tune
from engc.compiler.codegen.aot import ARCH_CAPABILITY, PTX_VERSION

TEMPLATES = Path(__file__).resolve().parents[2] / "templates"
NVCC_FLAGS = ["-O3", "-std=c++17", "--restrict"]
C_TYPE = {"bf16": "__nv_bfloat16", "fp16": "__half", "fp32": "float"}
MMA_TYPE = {"bf16": "bf16", "fp16": "f16"}   # the mma instruction's name for an operand type
ELEM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
_PTX_VERSION_LINE = re.compile(r"^\.version\s+\d+\.\d+\s*$", re.MULTILINE)
_PTX_TARGET = re.compile(r"^\.target\s+(\S+)", re.MULTILINE)
SHARED_LIMIT = 48 * 1024   # static shared memory; a template that needs more asks for the dynamic kind
DYNAMIC_SHARED_LIMIT = {"sm80": 163 * 1024, "sm90": 227 * 1024}   # the most shared memory one CTA may take


@dataclass(frozen=True)
class CudaKernelSpec:
    op: str
    variant: str
    arch: str
    template: str               # file in engc/templates
    entry: str                  # extern "C" symbol
    render: dict                # template variables (the shape the kernel is specialized on)
    arg_types: dict             # runtime params in kernel order -> Triton-style type names ("*bf16", "i32")
    num_warps: int
    tune_key: str
    tune: dict
    launch: dict = field(default_factory=dict)
    shared_mem: int = 0         # dynamic shared memory bytes per CTA (the loader raises the function's
                                # limit, 48 KiB minus the static shared memory by default, when it exceeds it)

    @property
    def stem(self) -> str:
        return f"{self.op}.{self.variant}"


def nvcc_path() -> str | None:
    """nvcc from $CUDA_HOME/bin, else PATH; None when there is none."""
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.access(Path(home) / "bin" / "nvcc", os.X_OK):
        return str(Path(home) / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_version(nvcc: str) -> str:
    out = subprocess.run([nvcc, "--version"], capture_output=True, text=True, check=True).stdout
    found = re.search(r"release \S+, V(\S+)", out)
    return found.group(1) if found else out.strip().splitlines()[-1]


def render(template: str, **values) -> str:
    import jinja2
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    return env.get_template(template).render(**values)


def write_build_ninja(build_dir: Path, nvcc: str, specs: list[CudaKernelSpec]) -> Path:
    """One cubin and one PTX rule per arch; one build edge per (kernel, arch). Sources are in src/."""
    lines = ["ninja_required_version = 1.3", f"nvcc = {nvcc}", f"flags = {' '.join(NVCC_FLAGS)}", ""]
    for arch in sorted({s.arch for s in specs}):
        cap = ARCH_CAPABILITY[arch]
        lines += [f"rule cubin_{arch}", f"  command = $nvcc $flags -cubin -arch=sm_{cap} -o $out $in",
                  f"  description = nvcc {arch} cubin $out",
                  f"rule ptx_{arch}", f"  command = $nvcc $flags -ptx -arch=compute_{cap} -o $out $in",
                  f"  description = nvcc {arch} ptx $out", ""]
    for s in sorted(specs, key=lambda s: (s.arch, s.stem)):
        src = f"src/{s.stem}.cu"
        lines.append(f"build {s.arch}/{s.stem}.cubin: cubin_{s.arch} {src}")
        lines.append(f"build {s.arch}/{s.stem}.ptx: ptx_{s.arch} {src}")
    path = build_dir / "build.ninja"
    path.write_text("\n".join(lines) + "\n")
    return path


def _ninja() -> list[str]:
    exe = shutil.which("ninja")
    if exe:
        return [exe]
    import ninja  # the PyPI package ships the binary
    return [str(Path(ninja.BIN_DIR) / "ninja")]


def pin_ptx_version(ptx: str) -> str:
    """nvcc writes its own PTX ISA (9.0 for CUDA 13); the bundle promises PTX_VERSION to older drivers."""
    major, minor = divmod(PTX_VERSION, 10)
    return _PTX_VERSION_LINE.sub(f".version {major}.{minor}", ptx, count=1)


def static_shared_bytes(cubin: bytes, entry: str) -> int:
    """The static shared memory of kernel `entry` in a cubin: the size of its .nv.shared.<entry> section
    (NOBITS; on sm90 it includes the 1 KB the system reserves a CTA), 0 when it has none."""
    import struct
    if cubin[:5] != b"\x7fELF\x02":
        raise ValueError("not a 64-bit ELF cubin")
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3a)
    sections = [struct.unpack_from("<IIQQQQ", cubin, shoff + i * shentsize) for i in range(shnum)]
    names_at = sections[shstrndx][4]                      # sh_offset of the section-name table
    wanted = f".nv.shared.{entry}".encode()
    for name, _type, _flags, _addr, _offset, size in sections:
        start = names_at + name
        if cubin[start:cubin.index(b"\0", start)] == wanted:
            return size
    return 0


# A PTX entry parameter: `.param .u64 name`, or an aggregate nvcc declares as bytes (a __nv_bfloat16 or
# __half by value: `.param .align 2 .b8 name[2]`).
_PTX_PARAM = re.compile(r"\.param\s+(?:\.align\s+\d+\s+)?\.[a-z]+(\d+)\s+[\w$]+(?:\[(\d+)\])?")


def check_params(spec: CudaKernelSpec, ptx: str) -> None:
    """The entry's parameters in the PTX must be the spec's arg_types, one for one and of the same size in
    bytes as the launcher packs them: a template parameter it does not know of would read what lies past
    the arguments (a kernel whose flag read garbage did exactly that)."""
    from engc.cuda.cubin import PARAM_BYTES, signature_from_triton
    found = re.search(rf"\.entry\s+{re.escape(spec.entry)}\s*\((.*?)\)", ptx, re.DOTALL)
    params = ([int(bits) // 8 * int(count or 1) for bits, count in _PTX_PARAM.findall(found.group(1))]
              if found else None)
    want = [PARAM_BYTES[code] for code in signature_from_triton(list(spec.arg_types.values()))]
    if params is None or params != want:
        raise ValueError(f"{spec.entry}: the kernel takes parameters of {params} bytes, its spec passes "
                         f"{list(spec.arg_types.values())} ({want} bytes)")


def check_shared_fits(spec: CudaKernelSpec, static: int) -> None:
    """Static + dynamic shared memory must fit one CTA of the arch; launches that pass 48 KiB in total
    need the loader to raise the function's dynamic limit (engc.cuda.cubin.load_kernel does)."""
    if static + spec.shared_mem > DYNAMIC_SHARED_LIMIT[spec.arch]:
        raise ValueError(f"{spec.entry}: {static} bytes of static + {spec.shared_mem} of dynamic shared memory "
                         f"exceed the {DYNAMIC_SHARED_LIMIT[spec.arch]} a {spec.arch} CTA may take")


def kernel_record(spec: CudaKernelSpec, ptx: str, cubin_path: str, ptx_path: str, source_path: str,
                  version: str, static_shared: int = 0) -> dict:
    """The Triton record schema (record.py), with no scratch params and nvcc_version for triton_version;
    static_shared: the cubin's static shared memory (the launch passes shared_mem more, dynamic)."""
    return {
        "op": spec.op, "variant": spec.variant, "arch": spec.arch, "entry": spec.entry,
        "cubin": cubin_path, "ptx": ptx_path, "source": source_path,
        "ptx_version": PTX_VERSION, "ptx_target": _PTX_TARGET.search(ptx).group(1),
        "num_warps": spec.num_warps, "num_ctas": 1, "shared_mem": spec.shared_mem, "static_shared": static_shared,
        "args": [{"name": name, "type": ty} for name, ty in spec.arg_types.items()], "scratch_params": 0,
        "align": 16, "constexprs": dict(sorted(spec.render.items())),
        "launch": tune.record_launch(spec.launch, spec.tune),
        "tune_key": spec.tune_key, "tune": dict(sorted(spec.tune.items())), "nvcc_version": version,
    }


def compile_cuda(specs: list[CudaKernelSpec], build_dir: str | Path | None = None, nvcc: str | None = None):
    """Render, write build.ninja, run ninja; a CodegenResult of cubins, pinned PTX, sources and records.

    build_dir: keep the build tree there (inspection, incremental rebuilds); default a temporary folder."""
    from engc.compiler.codegen.record import CodegenResult
    nvcc = nvcc or nvcc_path()
    if nvcc is None:
        raise RuntimeError("nvcc not found (set CUDA_HOME or put nvcc on PATH)")
    result = CodegenResult()
    if not specs:
        return result
    version = nvcc_version(nvcc)
    with tempfile.TemporaryDirectory(prefix="engc-nvcc-") as tmp:
        root = Path(build_dir) if build_dir else Path(tmp)
        (root / "src").mkdir(parents=True, exist_ok=True)
        sources = {}
        for s in specs:
            text = render(s.template, **s.render)
            prev = sources.setdefault(s.stem, text)
            if prev != text:
                raise ValueError(f"{s.stem}: the template renders differently per arch; name the variants apart")
        for stem, text in sources.items():
            path = root / "src" / f"{stem}.cu"
            if not path.is_file() or path.read_text() != text:   # unchanged sources keep ninja's work
                path.write_text(text)
        write_build_ninja(root, nvcc, specs)
        proc = subprocess.run(_ninja() + ["-C", str(root)], capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"nvcc build failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
        for s in sorted(specs, key=lambda s: (s.arch, s.op, s.variant)):
            stem = f"kernels/{s.arch}/{s.stem}"
            source_path = f"kernels/src/{s.stem}.cu"
            ptx = pin_ptx_version((root / s.arch / f"{s.stem}.ptx").read_text())
            cubin = (root / s.arch / f"{s.stem}.cubin").read_bytes()
            static = static_shared_bytes(cubin, s.entry)
            check_shared_fits(s, static)
            check_params(s, ptx)
            result.files[f"{stem}.cubin"] = cubin
            result.files[f"{stem}.ptx"] = ptx.encode()
            result.files[source_path] = sources[s.stem].encode()
            result.records.append(kernel_record(s, ptx, f"{stem}.cubin", f"{stem}.ptx", source_path, version,
                                                static))
    return result


def add_selected(result, triton_specs: list, cfg: ModelConfig, progress=None, overrides=None):
    """Compile into result (a CodegenResult) the CUDA kernels every op folder's cuda_specs.py selects for
    this build. Without nvcc they are skipped with one line each: the Triton kernels they stand beside are in
    the bundle anyway, and the launch rules fall back to them (or cuBLAS). overrides: op -> that op's CUDA
    tune overrides (tests, bench sweeps)."""
    from engc.kernels import parts
    specs, notes = [], []
    missing = nvcc_path() is None
    for op in parts("cuda_specs"):
        name = op.__name__.split(".")[-2]
        more, why = op.cuda_specs(triton_specs, cfg, (overrides or {}).get(name))
        notes += why
        if more and missing:
            notes.append(f"nvcc not found: {op.WITHOUT_NVCC}")
        elif more:
            specs += more
    for note in notes:
        print(f"engc: note: {note}", file=sys.stderr)
    if specs:
        if progress:
            progress(f"compiling {len(specs)} CUDA kernels with nvcc")
        extra = compile_cuda(specs)
        result.files.update(extra.files)
        result.records = sorted(result.records + extra.records, key=lambda r: (r["arch"], r["op"], r["variant"]))
    return result

"""The GPU binding of an engine program: each node launches the bundle's cubins for this arch.

BundleKernels loads the kernels a GPU of this arch runs; gpu_ops builds the op table from every kernel
folder's bind.py (gpu_ops(ctx)), over the CPU table for what has no kernel (gathers, casts, wide GEMMs stay
with torch and cuBLAS). An op's launch rule (kernels/<op>/__init__.py) turns tensors into (variant, grid,
args); BundleKernels.run launches the cubin recorded for (op, variant) on torch's current stream, which makes
every step capturable in a CUDA graph.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from engc.bundle.program import ENGC_DOMAIN
from engc.bundle.reader import Bundle
from engc.cuda.cubin import Kernel, current_stream, require_cuda
from engc.cuda.records import cuda_templates_enabled, load_record, pdl_enabled
from engc.errors import BundleError
from engc.kernels import gemv, int4_linear, parts
from engc.runtime.ops_reference import REFERENCE_OPS

def warm_cublas(dtype: torch.dtype, device: torch.device) -> None:
    """Initialize cuBLAS now, at start: it sets itself up at its first call (handle, workspace, its kernel
    modules). Most programs call it while their decode graphs are captured; an int4 program with an int4
    lm_head does not (its projections and head run engc's kernels up to 256 rows), so its first prefill of
    more rows (a user's first long prompt) would pay the setup, tens of milliseconds (bench/results/HISTORY.md)."""
    a = torch.zeros(64, 64, dtype=dtype, device=device)
    F.linear(a, a)
    torch.cuda.synchronize(device)


def device_arch(device: torch.device) -> str:
    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


@dataclass
class StepFacts:
    """Host-side facts about the current batch that kernels' grids depend on (no device reads)."""
    max_query_len: int = 1
    max_context_len: int | None = None  # None: the block table's capacity (fixed under CUDA graphs)
    has_decode_rows: bool = True
    fresh: bool = False                 # set for the next forward (describe, for_graph), taken by it (take)

    def describe(self, query_lens: torch.Tensor, context_lens: torch.Tensor) -> None:
        """Set them for an eager step from its host-side query and context lengths. Every eager forward on
        a GPU model needs this first: left at the defaults (a decode step), a prefill's rows get no output."""
        self.max_query_len = int(query_lens.max())
        self.has_decode_rows = bool((query_lens == 1).any())
        self.max_context_len = int(context_lens.max())
        self.fresh = True

    def for_graph(self, max_context_len: int | None) -> None:
        """Set them for the capture of a decode graph: one token a row, contexts up to max_context_len
        (None: the block table's capacity), so the decode kernels size their split-KV grid for it."""
        self.max_query_len, self.max_context_len, self.has_decode_rows, self.fresh = 1, max_context_len, True, True

    def take(self) -> None:
        """The GPU executor's first act in each forward (Executor.before_forward): the facts were set for
        this forward. Without them the kernels would size their grids for the last batch described and
        leave rows of this one unwritten, silently; this stops it."""
        if not self.fresh:
            raise RuntimeError("engc: internal error: a GPU forward ran without its step facts "
                               "(StepFacts.describe or for_graph first)")
        self.fresh = False


def _capability(arch: str) -> int:
    return int(arch[2:])


def select_kernels(records: list[dict], arch: str) -> tuple[list[dict], str]:
    """Which of a bundle's kernels a GPU of `arch` runs, and from which image ('cubin' or 'ptx').

    Its own arch's cubins; else cubins of an older arch of the same major (sm80 code runs on sm86 and
    sm89 as it is); else, on a GPU newer than every built arch, the newest portable PTX (an 'sm_90a'
    target is tied to its arch), which the driver JIT-compiles at load."""
    by_arch: dict[str, list[dict]] = {}
    for r in records:
        by_arch.setdefault(r["arch"], []).append(r)
    cap = _capability(arch)
    if arch in by_arch:
        return by_arch[arch], "cubin"
    older = sorted((a for a in by_arch if _capability(a) < cap), key=_capability)
    same_major = [a for a in older if _capability(a) // 10 == cap // 10]
    if same_major:
        return by_arch[same_major[-1]], "cubin"
    portable = [a for a in older if not any(r.get("ptx_target", "").endswith("a") for r in by_arch[a])]
    if portable:
        return by_arch[portable[-1]], "ptx"
    have = ", ".join(sorted(by_arch, key=_capability)) or "none"
    raise BundleError(f"the bundle has GPU kernels for {have}; this GPU is {arch}: rebuild with --arch {arch}")


class BundleKernels:
    """The kernels this GPU runs, loaded once: (op, variant) -> Kernel, op -> launch constants."""

    def __init__(self, bundle: Bundle, arch: str):
        require_cuda()
        records, image = select_kernels(bundle.manifest["kernels"], arch)
        if image == "ptx":
            print(f"engc: warning: this GPU ({arch}) is newer than the bundle's archs; the driver compiles "
                  f"{records[0]['arch']} PTX at load (slower start, older code): rebuild with --arch {arch}",
                  file=sys.stderr)
        pdl = pdl_enabled()
        if not cuda_templates_enabled():
            records = [r for r in records if "nvcc_version" not in r]
        self.kernels: dict[tuple[str, str], Kernel] = {}
        self.consts: dict[str, dict] = {}
        self.records: dict[tuple[str, str], dict] = {}
        self.align_mask: dict[tuple[str, str], int] = {}
        for r in records:  # one image file per (op, variant): each loads as its own module
            self.kernels[(r["op"], r["variant"])] = load_record(bundle.read(r[image]), r, pdl)
            self.consts.setdefault(r["op"], {})[r["variant"]] = r.get("launch", {})
            self.records[(r["op"], r["variant"])] = r
            # the pointer alignment the kernel was compiled to assume (Triton's divisibility hint; vector
            # loads in the CUDA C++ kernels)
            self.align_mask[(r["op"], r["variant"])] = r["align"] - 1

    def run(self, op: str, launches) -> None:
        stream = current_stream()
        for variant, grid, args in launches:
            kernel = self.kernels[(op, variant)]
            # A launch rule lists every parameter of the record, scratch zeros included; the kernel
            # appends its own null scratch pointers, so pass only its own parameters. Tensors pass as their
            # addresses, which the kernel assumes aligned: a view at an odd offset would be misread
            # silently, not fault, so it is refused (one OR a tensor, a few hundred ns a launch; a
            # captured CUDA graph replays without it).
            values, addresses = [], 0
            for a in args[:len(kernel.signature)]:
                if isinstance(a, torch.Tensor):
                    a = a.data_ptr()
                    addresses |= a
                values.append(a)
            if addresses & self.align_mask[(op, variant)]:
                self._misaligned(op, variant, args)
            kernel.launch(grid, values, stream)

    def _misaligned(self, op: str, variant: str, args):
        r, mask = self.records[(op, variant)], self.align_mask[(op, variant)]
        i, address = next((i, a.data_ptr()) for i, a in enumerate(args)
                          if isinstance(a, torch.Tensor) and a.data_ptr() & mask)
        raise ValueError(f"{op}.{variant}: argument {r['args'][i]['name']} is at {address:#x}, not "
                         f"{mask + 1}-byte aligned as the kernel assumes (a view at an offset? pass a fresh "
                         f"tensor, e.g. .clone())")


@dataclass
class GpuContext:
    """What a kernel folder's GPU binding (bind.py: gpu_ops(ctx)) is given: the bundle's kernels, the batch's
    host-side facts, the shared split-K counters, the model's packed int4 scale words, and the finished op
    table, through which a binding falls back on another node's (an unfused path). A binding returns no
    ops where the bundle has none of its kernels; the node's CPU reference then runs on the GPU's tensors."""
    kernels: BundleKernels
    facts: StepFacts
    counters: torch.Tensor
    packed: int4_linear.PackedScales
    table: dict

    def run(self, op: str, launches) -> None:
        self.kernels.run(op, launches)

    def has(self, op: str) -> bool:
        """The bundle has kernels of this op (quantized ops only exist in bundles built for them)."""
        return op in self.kernels.consts

    def consts(self, op: str) -> dict:
        """variant -> launch constants of the bundle's kernels of this op ({} where it has none)."""
        return self.kernels.consts.get(op, {})

    def op(self, name: str):
        """The table's binding of the ai.engc node `name` (looked up when called, so any folder's)."""
        return self.table[(ENGC_DOMAIN, name)]

    def cpu_op(self, domain: str, name: str):
        return REFERENCE_OPS[(domain, name)]


def gpu_ops(k: BundleKernels, facts: StepFacts, packed: int4_linear.PackedScales | None = None) -> dict:
    """The op table for the executor; `facts` is updated by the caller before each step. packed: the
    model's packed int4 scale / zero words (int4_linear/bind.py's prepack_int4 fills them at load; a fresh
    set by default)."""
    # Split-K arrival counters of the GEMV, FP8 GEMM, CUDA int4 GEMV and split-KV decode: each launch's
    # last program leaves its counters zero again and launches follow one another on the stream, so one
    # array serves them all. Made here, before any capture: graphs replay on these zeros (the CPU serves
    # tests).
    counters = torch.zeros(gemv.NUM_COUNTERS, dtype=torch.int32,
                           device="cuda" if torch.cuda.is_available() else "cpu")
    ops = dict(REFERENCE_OPS)
    ops[("", "Gather")] = _gather
    ctx = GpuContext(k, facts, counters, packed if packed is not None else int4_linear.PackedScales(), ops)
    for bind in parts("bind"):
        if hasattr(bind, "gpu_ops"):
            ops.update(bind.gpu_ops(ctx))
    return ops


def _gather(data, indices, axis=0):
    return (F.embedding(indices, data) if axis == 0 else torch.index_select(data, axis, indices),)

"""A kernel record (the bundle manifest's, or a tune candidate's) loaded as the record says, and the
environment switches that change how: the runtime's BundleKernels and `engc tune` load through here, so
the kernels a tune times are loaded exactly as a bundle's are."""
from __future__ import annotations

import os

from engc.cuda.cubin import Kernel, load_kernel, signature_from_triton
from engc.errors import UserError

SCRATCH = 2  # Triton's trailing global/profile scratch pointers (records older than 'scratch_params' mean 2)


def pdl_enabled() -> bool:
    """Kernels compiled for programmatic dependent launch get it unless ENGC_PDL=0 (an escape hatch, and a
    debugging switch for bench/gpu_bench.py): their waits are no-ops when launched plainly."""
    return os.environ.get("ENGC_PDL", "1") != "0"


def cuda_templates_enabled() -> bool:
    """The bundle's nvcc-built kernels (templates/*.cu.j2: records with an nvcc_version) load unless
    ENGC_CUDA_TEMPLATES=0, an escape hatch that needs no rebuild: each is optional, and its
    launch rule takes the Triton kernel (or cuBLAS) the bundle always has where the variant is missing."""
    return os.environ.get("ENGC_CUDA_TEMPLATES", "1") != "0"


def shared_carveout() -> int | None:
    """ENGC_SMEM_CARVEOUT=P (0..100, or -1) sets every bundle kernel's preferred L1/shared-memory split to P
    percent of the most shared memory, over the records' own (their launch constant smem_carveout, from the
    tune table); unset, each record's or the driver's choice. A debugging switch: a kernel's CTAs an SM are bounded by the
    shared memory of its split (the rest is L1), so no one value suits every kernel (bench/results/HISTORY.md)."""
    value = os.environ.get("ENGC_SMEM_CARVEOUT", "")
    if not value:
        return None
    if not value.lstrip("-").isdigit() or not -1 <= int(value) <= 100:
        raise UserError(f"ENGC_SMEM_CARVEOUT={value!r}: expected a percent 0..100 or -1 (no preference)")
    return int(value)


def load_record(image: bytes, r: dict, pdl: bool) -> Kernel:
    """One kernel record's image (cubin or PTX), loaded as its record says: its runtime params (less the
    trailing scratch pointers, which the kernel appends itself), 32 * num_warps threads, its dynamic shared
    memory, and programmatic dependent launch where its launch constant PDL asks for it and pdl allows.
    Shared with engc tune's loader (compiler/tune/gpu.py), so the candidates it times load as bundles do."""
    scratch = r.get("scratch_params", SCRATCH)   # CUDA C++ kernels take none
    sig = signature_from_triton([a["type"] for a in r["args"][:len(r["args"]) - scratch]])
    return load_kernel(image, r["entry"], sig, block_x=32 * r["num_warps"], shared_mem=r["shared_mem"],
                       scratch_params=scratch, pdl=pdl and bool(r.get("launch", {}).get("PDL")),
                       carveout=_first_set(shared_carveout(), r.get("launch", {}).get("smem_carveout")))


def _first_set(*values):
    return next((v for v in values if v is not None), None)

"""A kernel record (the bundle manifest's, or a tune candidate's) loaded as the record says, and the debugging
switches that change how: the runtime's BundleKernels and `engc tune` load through here, so the kernels a
tune times are loaded exactly as a bundle's are.

ENGC_DEBUG, a comma list, holds the switches (none needs a rebuild; all are for debugging and measuring,
the defaults are what the tune table decided):
    no-pdl              launch kernels compiled for programmatic dependent launch plainly (their waits are
                        then no-ops)
    no-cuda-templates   leave the bundle's nvcc-built kernels (templates/*.cu.j2) unloaded: each is optional,
                        and its launch rule takes the Triton kernel (or cuBLAS) the bundle always has
    smem-carveout=P     every kernel's preferred L1/shared-memory split, P percent of the most shared memory
                        (0..100, -1 no preference), over the records' own (the tune table's smem_carveout)
"""
from __future__ import annotations

import os

from engc.cuda.cubin import Kernel, load_kernel, signature_from_triton
from engc.errors import UserError

SWITCHES = ("no-pdl", "no-cuda-templates", "smem-carveout")


def debug_switches() -> dict[str, str]:
    """ENGC_DEBUG parsed: switch -> value ('' for a flag); an unknown switch is one clear line."""
    found = {}
    for item in filter(None, (i.strip() for i in os.environ.get("ENGC_DEBUG", "").split(","))):
        name, _, value = item.partition("=")
        if name not in SWITCHES:
            raise UserError(f"ENGC_DEBUG: unknown switch '{name}'; known: {', '.join(SWITCHES)}")
        found[name] = value
    return found


def pdl_enabled() -> bool:
    """Kernels compiled for programmatic dependent launch get it, unless ENGC_DEBUG has no-pdl."""
    return "no-pdl" not in debug_switches()


def cuda_templates_enabled() -> bool:
    """The bundle's nvcc-built kernels (records with an nvcc_version) load, unless ENGC_DEBUG has
    no-cuda-templates."""
    return "no-cuda-templates" not in debug_switches()


def shared_carveout() -> int | None:
    """ENGC_DEBUG's smem-carveout=P, else None (each record's or the driver's choice). A kernel's CTAs an SM are
    bounded by the shared memory of its split (the rest is L1), so no one value suits every kernel: the tune
    table sets it per kernel (bench/results/HISTORY.md)."""
    value = debug_switches().get("smem-carveout")
    if value is None:
        return None
    if not value.lstrip("-").isdigit() or not -1 <= int(value) <= 100:
        raise UserError(f"ENGC_DEBUG smem-carveout={value!r}: expected a percent 0..100 or -1 (no preference)")
    return int(value)


def load_record(image: bytes, r: dict, pdl: bool) -> Kernel:
    """One kernel record's image (cubin or PTX), loaded as its record says: its runtime params (less the
    trailing scratch pointers, which the kernel appends itself), 32 * num_warps threads, its dynamic shared
    memory, and programmatic dependent launch where its launch constant PDL asks for it and pdl allows.
    Shared with engc tune's loader (compiler/tune/gpu.py), so the candidates it times load as bundles do."""
    scratch = r["scratch_params"]   # Triton kernels take 2 trailing scratch pointers, CUDA C++ ones none
    sig = signature_from_triton([a["type"] for a in r["args"][:len(r["args"]) - scratch]])
    return load_kernel(image, r["entry"], sig, block_x=32 * r["num_warps"], shared_mem=r["shared_mem"],
                       scratch_params=scratch, pdl=pdl and bool(r.get("launch", {}).get("PDL")),
                       carveout=_first_set(shared_carveout(), r.get("launch", {}).get("smem_carveout")))


def _first_set(*values):
    return next((v for v in values if v is not None), None)

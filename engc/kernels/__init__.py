"""Op contracts: one folder per op, holding everything about it.

    __init__.py   the plain-torch reference (the CPU path and the test oracle) and the launch rule, which
                  turns tensors into [(variant, grid, args)] for the bundle's kernels; free of Triton
                  (where an op's GPU path outgrows that, its launch rules sit beside it: moe/launch.py)
    triton.py     the Triton kernels (the compiler's)
    specs.py      specs(b): the kernels a model's build needs, as KernelSpecs (the compiler's)
    bind.py       the program nodes the op serves: CPU_OPS (and HALF_OPS), gpu_ops(ctx) (the runtime's)

Codegen, the CPU op table and the GPU op table each walk every folder (parts), so adding an op adds a
folder, not lines in central tables.
"""
from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path


def folders() -> list[str]:
    """Every op folder, by name (sorted: the order codegen and the op tables see them in)."""
    return sorted(p.name for p in Path(__file__).parent.iterdir() if (p / "__init__.py").is_file())


def parts(name: str) -> list:
    """The `name` module (e.g. 'specs', 'bind') of every op folder that has one."""
    found = []
    for folder in folders():
        module = f"{__name__}.{folder}.{name}"
        if importlib.util.find_spec(module) is not None:
            found.append(importlib.import_module(module))
    return found

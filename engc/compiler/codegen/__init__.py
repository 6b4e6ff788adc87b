"""Codegen: pick, specialize and AOT-compile every kernel a model needs, per arch, with launch records.

    result = compile_kernels(cfg, torch.bfloat16, ["sm80", "sm90"], block_size=16)
    result.files    {bundle-relative path: bytes}: kernels/<arch>/<op>.<variant>.cubin and .ptx, and
                    kernels/src/<op>.py (the Triton source, once per op, for the record) and the helper
                    modules it imports (kernels/src/pdl.py, kernels/src/paged_attention/tiles.py)
    result.records  one JSON-ready dict per kernel for the manifest's kernel table (schema in record.py)

Deterministic: the same inputs give the same bytes (records sorted by arch, op, variant).
"""
from __future__ import annotations

from engc.compiler.codegen.record import CodegenResult, compile_kernels  # noqa: F401
from engc.compiler.codegen.kernel_spec import KernelSpec  # noqa: F401
from engc.compiler.codegen.specs import model_specs  # noqa: F401

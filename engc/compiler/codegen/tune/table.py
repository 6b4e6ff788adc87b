"""The tune table itself: TUNE, keyed "arch/op/variant/bucket", and put(), which the per-op-family modules
of this package fill it with."""
from __future__ import annotations

ARCHS = ("sm80", "sm90")
# Programmatic dependent launch of the kernels that support it (kernels/pdl.py): griddepcontrol is sm90+.
PDL = {"sm80": 0, "sm90": 1}
# Multiprocessors of the GPU each arch's entries assume (split rules aim at a multiple of them)
SM_COUNT = {"sm80": 108, "sm90": 132}

TUNE: dict[str, dict] = {}


def put(arch: str, op: str, variant: str, bucket: str, **entry):
    TUNE[f"{arch}/{op}/{variant}/{bucket}"] = entry

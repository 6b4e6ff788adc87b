"""What `engc quantize` was asked to do, validated before any weight is read."""
from __future__ import annotations

from dataclasses import dataclass

from engc.errors import UserError

METHODS = ("awq", "gptq", "rtn")
GROUP_SIZES = (32, 64, 128)
FORMATS = {"awq": "awq", "gptq": "gptq", "rtn": "gptq"}  # checkpoint layout each method writes


@dataclass(frozen=True)
class QuantOptions:
    method: str = "awq"
    bits: int = 4
    group_size: int = 128
    calib: str | None = None          # text or JSONL file; None: the default corpus (calibration.py)
    calib_samples: int = 64
    calib_seqlen: int = 256
    # GPTQ only: quantize columns in decreasing Hessian diagonal order; None: on for gptq (it beats plain GPTQ
    # on held-out and on unrelated text: docs/quantization.md), off for the others
    act_order: bool | None = None
    static_groups: bool = True        # with act_order: groups stay in channel order (gptq.py), no runtime gather
    damp: float = 0.01                # GPTQ only: dampening, a fraction of the mean Hessian diagonal
    awq_grid: int = 20                # AWQ only: grid points of the scale and the clip search
    lm_head: bool = False             # also quantize the lm_head (GPTQModel's `lm_head: true`; head.py)
    seed: int = 0

    def __post_init__(self):
        if self.act_order is None:
            object.__setattr__(self, "act_order", self.method == "gptq")

    @property
    def format(self) -> str:
        return FORMATS[self.method]

    def validate(self) -> "QuantOptions":
        if self.method not in METHODS:
            raise UserError(f"unknown quantization method '{self.method}'; known: {', '.join(METHODS)}")
        if self.bits != 4:
            raise UserError(f"--bits {self.bits} is not supported; engc quantizes to 4 bits")
        if self.group_size not in GROUP_SIZES:
            raise UserError(f"--group-size {self.group_size} is not supported; use one of "
                            f"{', '.join(map(str, GROUP_SIZES))}")
        if self.act_order and self.method != "gptq":
            raise UserError("--act-order applies to --method gptq only")
        if not 0 < self.damp < 1:
            raise UserError(f"--damp {self.damp} must be in (0, 1)")
        if self.calib_samples < 1 or self.calib_seqlen < 8:
            raise UserError("--calib-samples must be >= 1 and --calib-seqlen >= 8")
        return self

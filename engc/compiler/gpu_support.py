"""What the GPU kernels do not compute yet: a GPU build of a model that needs it is refused with one line.

The GPU op table runs an op without a kernel through its torch reference on the device (the embedding's
Mul, the final logit soft-cap), which computes the same; but the attention kernels take no soft-cap, so a
GPU bundle of a model that caps its attention scores would compute another network. Each entry: (what the
model needs, the test on its ModelConfig).
"""
from __future__ import annotations

from engc.bundle.model_config import ModelConfig
from engc.errors import UserError

_LACKS = (
    ("attention logit soft-capping (attn_logit_softcapping)", lambda c: c.attn_logit_softcap != 0),
)


def check_gpu_support(cfg: ModelConfig, archs: list[str]) -> None:
    for need, lacks in _LACKS:
        if lacks(cfg):
            raise UserError(f"{cfg.family}: the GPU kernels lack {need}; "
                            f"build it with --arch cpu, not {','.join(archs)}")

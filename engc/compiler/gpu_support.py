"""What the GPU kernels do not compute yet: a GPU build of a model that needs it is refused with one line.

The CPU binds every op the frontend emits; the GPU op table falls back to those torch references only for
ops without a kernel, and the attention kernels take no soft-cap, so a GPU bundle of such a model would
fail or compute another model. Each entry: (what the model needs, the test on its ModelConfig).
"""
from __future__ import annotations

from engc.bundle.model_config import ModelConfig
from engc.errors import UserError

_LACKS = (
    ("attention logit soft-capping (attn_logit_softcapping)", lambda c: c.attn_logit_softcap != 0),
    ("final logit soft-capping (final_logit_softcapping)", lambda c: c.final_logit_softcap != 0),
    ("the GELU-tanh GLU (hidden_activation gelu_pytorch_tanh)", lambda c: c.hidden_act != "silu"),
    ("the (1 + weight) RMSNorm and the four norms of a Gemma block", lambda c: c.norm_unit_offset or c.sandwich_norms),
    ("the scaled embedding", lambda c: c.embed_scale != 0),
)


def check_gpu_support(cfg: ModelConfig, archs: list[str]) -> None:
    for need, lacks in _LACKS:
        if lacks(cfg):
            raise UserError(f"{cfg.family}: the GPU kernels lack {need}; "
                            f"build it with --arch cpu, not {','.join(archs)}")

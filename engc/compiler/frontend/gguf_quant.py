"""GGUF 4-bit weights kept 4-bit (engc build --quant keep): llama.cpp's blocks as the engc int4 layout.

Every kept type is groups of 32 inputs with one float scale per group, exactly as engc's int4 layout
(kernels/int4_linear/layout.py) holds them:
  Q4_0  W = d * (q - 8)            -> scales d, zeros 8
  Q4_1  W = d * q + m              -> scales d, zeros 0, offsets m (a float minimum: no integer zero point
                                      holds it, so the layout's optional offsets carry it)
  Q4_K  W = d * sc * q - dmin * mn -> per 32-input sub-block: scales d * sc, zeros 0, offsets -dmin * mn
                                      (fp16 times a 6-bit integer: exact in float32)
so a float32 bundle computes the same W as llama.cpp's reference dequantization, bit for bit. Other types
are dequantized to float by the reader: Q8_0 because engc has no int8 weight kernels, Q5_x / Q6_K and
the rest because they are not 4-bit; embeddings and norms always, since they are read as float tables.
"""
from __future__ import annotations

import numpy as np
import torch

from engc.kernels import int4_linear

GROUP_SIZE = 32
KEPT_TYPES = ("Q4_0", "Q4_1", "Q4_K")


def keeps(tensor, hf_name: str) -> bool:
    """Whether --quant keep keeps this GGUF tensor 4-bit: a projection's weight of a kept type."""
    is_projection = hf_name.endswith("_proj.weight") or hf_name == "lm_head.weight"
    return is_projection and tensor.tensor_type.name in KEPT_TYPES and len(tensor.shape) == 2


def _blocks(tensor) -> tuple[np.ndarray, int]:
    """The tensor's bytes as [N, blocks a row, block bytes] and its input count K."""
    from gguf import GGML_QUANT_SIZES
    block_size, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    n, k = int(tensor.shape[1]), int(tensor.shape[0])   # GGUF lists dims fastest-first
    return np.asarray(tensor.data).view(np.uint8).reshape(n, k // block_size, block_bytes), k


def _half(raw: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(raw).view(np.float16).astype(np.float32)[..., 0]


def codes(tensor) -> np.ndarray:
    """uint8 [N, K] in 0..15, in input order."""
    blocks, k = _blocks(tensor)
    n = blocks.shape[0]
    if tensor.tensor_type.name == "Q4_K":
        qs = blocks[..., 16:].reshape(n, -1, 4, 1, 32)   # 4 chunks of 64 inputs: low nibbles, then high
    else:
        qs = blocks[..., -16:].reshape(n, -1, 1, 16)     # 32 inputs: low nibbles, then high
    q = (qs >> np.array([0, 4], dtype=np.uint8).reshape(2, 1)) & np.uint8(0x0F)
    return q.reshape(n, k)


def group_params(tensor) -> dict[str, np.ndarray]:
    """scales float32, zeros uint8 and (Q4_1, Q4_K) offsets float32, each [N, K / 32]."""
    blocks, k = _blocks(tensor)
    n, kind = blocks.shape[0], tensor.tensor_type.name
    if kind == "Q4_0":
        scales = _half(blocks[..., 0:2])
        return {"scales": scales, "zeros": np.full(scales.shape, 8, dtype=np.uint8)}
    if kind == "Q4_1":
        scales = _half(blocks[..., 0:2])
        return {"scales": scales, "zeros": np.zeros(scales.shape, dtype=np.uint8), "offsets": _half(blocks[..., 2:4])}
    from gguf.quants import Q4_K
    d, dmin = _half(blocks[..., 0:2]), _half(blocks[..., 2:4])
    sc, mn = Q4_K.get_scale_min(np.ascontiguousarray(blocks[..., 4:16]).reshape(-1, 12))
    scales = d[..., None] * sc.reshape(n, -1, 8).astype(np.float32)
    offsets = -(dmin[..., None] * mn.reshape(n, -1, 8).astype(np.float32))
    return {"scales": scales.reshape(n, -1), "zeros": np.zeros((n, k // GROUP_SIZE), dtype=np.uint8),
            "offsets": offsets.reshape(n, -1)}


def has_offsets(tensor) -> bool:
    return tensor.tensor_type.name != "Q4_0"


def to_engc(part: str, array: np.ndarray) -> torch.Tensor:
    """A part as the engc int4 layout stores it: codes become the packed qweight."""
    tensor = torch.from_numpy(np.array(array))   # copy: the source may be a read-only mmap
    return int4_linear.pack_int4(tensor) if part == "qweight" else tensor


def quantization_config(kept: dict[str, str], dequantized: dict[str, str]) -> dict:
    """The checkpoint's quantization_config: the decoder reads group_size, build.py the manifest entry.
    kept / dequantized: GGUF tensor name -> its GGUF type."""
    types = sorted({t.lower() for t in kept.values()})
    return {"quant_method": "gguf", "group_size": GROUP_SIZE, "method": "gguf-" + "+".join(types),
            "kept": dict(sorted(kept.items())), "dequantized": dict(sorted(dequantized.items()))}


def describe(qc: dict, lm_head: bool) -> dict:
    """The manifest's `quantization` field for a GGUF built with --quant keep."""
    by_type: dict[str, int] = {}
    for t in qc["kept"].values():
        by_type[t] = by_type.get(t, 0) + 1
    layout = int4_linear.LAYOUT if set(by_type) == {"Q4_0"} else int4_linear.LAYOUT_WITH_OFFSETS
    return {"method": qc["method"], "bits": 4, "group_size": GROUP_SIZE, "source_format": "gguf",
            "act_order": False, "layout": layout, "lm_head": lm_head, "kept": by_type,
            "dequantized": qc["dequantized"]}


def kept_loaders(tensor, prefix: str, reorder_rows) -> dict:
    """Loaders of one kept projection's engc int4 tensors, prefix.{qweight,scales,zeros[,offsets]}, each
    read when the build asks for it. reorder_rows: [N, ...] -> [N, ...] (llama's q/k rows), or None."""
    def part(name: str):
        def load() -> torch.Tensor:
            array = codes(tensor) if name == "qweight" else group_params(tensor)[name]
            return to_engc(name, reorder_rows(array) if reorder_rows else array)
        return load
    names = ("qweight", "scales", "zeros", "offsets") if has_offsets(tensor) else ("qweight", "scales", "zeros")
    return {f"{prefix}.{name}": part(name) for name in names}

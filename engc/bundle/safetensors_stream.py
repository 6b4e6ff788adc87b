"""Writes a safetensors file one tensor at a time, so building a model needs one tensor's memory.

Standard safetensors layout (8-byte little-endian header length, JSON header, raw data), tensors in
sorted-name order: the same tensors always give the same bytes. Returns each tensor's byte range,
which program.onnx records as ONNX external data.
"""
from __future__ import annotations

import json
import shutil
import struct
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int32: "I32",
             torch.int64: "I64", torch.uint8: "U8", torch.int8: "I8", torch.float8_e4m3fn: "F8_E4M3"}
DTYPE_NAMES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16",
               torch.int32: "int32", torch.int64: "int64", torch.uint8: "uint8", torch.int8: "int8",
               torch.float8_e4m3fn: "float8_e4m3fn"}


def write_streaming(path: Path, tensors: dict[str, Callable[[], torch.Tensor]],
                    on_tensor: Callable[[str], None] | None = None) -> dict[str, dict]:
    header, layout, offset = {}, {}, 0
    with tempfile.TemporaryFile(dir=path.parent) as data:
        for name in sorted(tensors):
            t = tensors[name]().contiguous().cpu()
            # flat first: torch calls a [N, 1] transpose contiguous while its last stride is N, and a dtype view
            # wants a last stride of 1
            raw = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
            data.write(raw)
            header[name] = {"dtype": ST_DTYPES[t.dtype], "shape": list(t.shape),
                            "data_offsets": [offset, offset + len(raw)]}
            layout[name] = {"dtype": DTYPE_NAMES[t.dtype], "shape": list(t.shape),
                            "length": len(raw), "rel_offset": offset}
            offset += len(raw)
            del t, raw
            if on_tensor:
                on_tensor(name)
        blob = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # data starts 8-byte aligned, as the reference writer does
        with open(path, "wb") as out:
            out.write(struct.pack("<Q", len(blob)))
            out.write(blob)
            data.seek(0)
            shutil.copyfileobj(data, out, 1 << 24)
    base = 8 + len(blob)
    for entry in layout.values():
        entry["offset"] = base + entry.pop("rel_offset")
    return layout


def iter_names(path: Path) -> Iterable[str]:
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return [k for k in json.loads(f.read(n)) if k != "__metadata__"]

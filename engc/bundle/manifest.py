"""Manifest schema and format version. Bump MAJOR when an older runtime could misread a bundle."""
from __future__ import annotations

FORMAT = "engc-bundle"
FORMAT_VERSION = (2, 0)
# Version 2 marks what an engc 1.x runtime would misread: int4 weights in the N-major layout (1.x read
# them as K-major, silently wrong) and a quantized KV cache (1.x crashed on its scale inputs). A bundle
# using neither is still written as 1.0, so older runtimes keep reading it; this runtime reads both.
READABLE_MAJORS = (1, 2)
MANIFEST = "manifest.json"
PROGRAM = "program.onnx"
WEIGHTS = "weights/rank0.safetensors"

# Fields every manifest has; the reader refuses a manifest missing one.
REQUIRED = ("format", "format_version", "model", "dtype", "archs", "kv_block_size", "program",
            "weights", "kernels", "files", "source", "tp", "quantization")

ARCHS = ("cpu", "sm80", "sm86", "sm89", "sm90")


def format_version(manifest: dict) -> tuple[int, int]:
    """The version a bundle is written with: the oldest whose readers all understand it."""
    layout = (manifest.get("quantization") or {}).get("layout", "")
    needs_v2 = layout.startswith("engc-int4") or manifest.get("kv_cache", "auto") != "auto"
    return FORMAT_VERSION if needs_v2 else (1, 0)


def parse_archs(text: str) -> list[str]:
    """'sm80,sm90' -> ['sm80', 'sm90']; unknown names are a UserError naming the known ones."""
    from engc.errors import UserError
    archs = [a.strip().lower() for a in text.split(",") if a.strip()]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown or not archs:
        raise UserError(f"unknown --arch '{','.join(unknown) or text}'; known: {', '.join(ARCHS)}")
    return sorted(set(archs), key=ARCHS.index)

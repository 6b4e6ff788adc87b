"""Manifest schema and format version. Bump MAJOR when an older runtime could misread a bundle."""
from __future__ import annotations

FORMAT = "engc-bundle"
FORMAT_VERSION = (8, 0)
# The majors this runtime reads. 8.0: an MoE layer's shared expert is a dense MLP of the program, whose output
# the MoE node takes in place of the shared expert's weights (kernels/moe); the program has its decode form
# (passes/decode_form), sampling is the four launches of kernels/sampling, and an MoE model's GPU kernels
# include the router-logits and expert-sort kernels and take their inputs' row scales, as in 7.0. A bundle of
# an older format is refused with a line saying to rebuild it.
READABLE_MAJORS = (8,)
MANIFEST = "manifest.json"
PROGRAM = "program.onnx"
WEIGHTS = "weights/rank0.safetensors"

# Fields every manifest has; the reader refuses a manifest missing one.
REQUIRED = ("format", "format_version", "model", "dtype", "archs", "kv_block_size", "program",
            "weights", "kernels", "files", "source", "tp", "quantization")

ARCHS = ("cpu", "sm80", "sm86", "sm89", "sm90")


def parse_archs(text: str) -> list[str]:
    """'sm80,sm90' -> ['sm80', 'sm90']; unknown names are a UserError naming the known ones."""
    from engc.errors import UserError
    archs = [a.strip().lower() for a in text.split(",") if a.strip()]
    unknown = [a for a in archs if a not in ARCHS]
    if unknown or not archs:
        raise UserError(f"unknown --arch '{','.join(unknown) or text}'; known: {', '.join(ARCHS)}")
    return sorted(set(archs), key=ARCHS.index)

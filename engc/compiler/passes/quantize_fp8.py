"""--quant fp8: every decoder-layer projection Gemm becomes ai.engc::FP8Linear (W8A8, kernels/fp8_quant).

Runs after fuse_parallel_gemms, so the fused qkv and gate_up weights are quantized once, whole. The
scales are per output channel (row of the [N, K] weight), so quantizing the fused weight gives exactly
the scales the parts would have had. Only Gemms inside the decoder layers (values named 'layers.<i>.')
are rewritten: the lm_head stays in the bundle's dtype (its logits feed sampling directly, and it is
one of 4L+1 GEMMs), and embeddings are a Gather, not a Gemm.
"""
from __future__ import annotations

from engc.bundle.model_config import ModelConfig
from engc.compiler.ir import Graph, Node
from engc.errors import UserError
from engc.kernels.fp8_quant import FP8_ARCHS, FP8_MAX, quantize_rows

FP8_MANIFEST = {"method": "fp8", "bits": 8, "format": "float8_e4m3fn",
                "weights": f"per output channel, absmax/{FP8_MAX:g}, static",
                "activations": f"per token, absmax/{FP8_MAX:g}, dynamic",
                "scope": "decoder-layer projections (qkv, o, gate_up, down); embeddings and lm_head unquantized"}


def check_fp8_targets(archs: tuple[str, ...], dtype_name: str) -> None:
    """FP8 GEMMs need FP8 tensor cores; a CPU target runs the op's reference (exact emulation)."""
    old = [a for a in archs if a != "cpu" and a not in FP8_ARCHS]
    if old:
        raise UserError(f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {', '.join(old)} has none: "
                        "drop it from --arch or build without --quant")
    if any(a != "cpu" for a in archs) and dtype_name != "bfloat16":
        raise UserError(f"--quant fp8 on a GPU builds bfloat16 bundles (row-wise scaled FP8 GEMMs write "
                        f"bf16), not {dtype_name}")


def check_fp8_shapes(cfg: ModelConfig) -> None:
    """torch._scaled_mm takes K and N in multiples of 16: every projection's in and out widths."""
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_heads * head_dim": cfg.q_size, "num_kv_heads * head_dim": cfg.kv_size}
    bad = [f"{name} {w}" for name, w in widths.items() if w % 16]
    if bad:
        raise UserError(f"--quant fp8 on a GPU needs projection widths in multiples of 16; {', '.join(bad)}")


def quantize_fp8(g: Graph) -> Graph:
    for i, node in enumerate(g.nodes):
        if not _is_layer_projection(node):
            continue
        x, weight, *bias = node.inputs
        scale = weight + "_scale"
        g.weights[weight], g.weights[scale] = _quantized_loaders(g.weights[weight])
        g.nodes[i] = Node("FP8Linear", [x, weight, scale, *bias], list(node.outputs),
                          {"has_bias": bool(bias)})
    return g


def _is_layer_projection(node: Node) -> bool:
    return (node.op == "Gemm" and node.domain == "" and node.attrs.get("transB") == 1
            and node.outputs[0].startswith("layers."))


def _quantized_loaders(load):
    """Two lazy tensors (the float8 weight, its float32 scales) from one quantization of the weight.

    The bundle writer asks for each once, in name order: the first call quantizes and keeps the other
    half until it is asked for, so a weight is read and quantized once, and no more than one layer's
    half waits in memory."""
    pending = {}

    def part(index: int):
        def get():
            if index not in pending:
                pending.update(enumerate(quantize_rows(load())))
            return pending.pop(index)
        return get
    return part(0), part(1)

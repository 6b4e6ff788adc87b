"""--quant fp8: every decoder-layer projection Gemm becomes ai.engc::FP8Linear (W8A8, kernels/fp8_quant), and
every MoE node's experts become float8 with per-channel scales (W8A8 too: the expert kernels quantize their
inputs per row; kernels/moe fp8_experts).

Runs after fuse_parallel_gemms, so the fused qkv and gate_up weights are quantized once, whole. The
scales are per output channel (row of the [N, K] weight), so quantizing the fused weight gives exactly
the scales the parts would have had. Only Gemms inside the decoder layers (values named 'layers.<i>.')
are rewritten: the lm_head stays in the bundle's dtype (its logits feed sampling directly, and it is
one of 4L+1 GEMMs), and embeddings are a Gather, not a Gemm. DeepSeek's latent-attention projections (q_a,
q_b, kv_a, o) are such Gemms; the absorbed decode's per-head w_uk / w_uv are MLAAttention's inputs, not
Gemms, and stay in the bundle's dtype.

An MoE node's stacked experts, gate_up [E, 2I, H] and down [E, H, I], are quantized a row at a time the same
way (one scale per output channel per expert), their scales the node's inputs after the shared expert's;
the router, the shared expert's gate and the shared expert itself (a dense MLP of the layer, frontend/moe.py)
stay in the bundle's dtype: _is_layer_projection says why.
"""
from __future__ import annotations

import torch

from engc.bundle.model_config import ModelConfig
from engc.compiler.ir import Graph, Node
from engc.errors import UserError
from engc.kernels.fp8_quant import FP8, FP8_ARCHS, FP8_MAX, quantize_rows

FP8_MANIFEST = {"method": "fp8", "bits": 8, "format": "float8_e4m3fn",
                "weights": f"per output channel, absmax/{FP8_MAX:g}, static",
                "activations": f"per token, absmax/{FP8_MAX:g}, dynamic",
                "scope": "decoder-layer projections (qkv, o, gate_up, down); embeddings, lm_head and an MoE "
                         "layer's shared expert unquantized"}
FP8_EXPERTS = {"experts": f"MoE experts' gate_up and down: per output channel per expert, absmax/{FP8_MAX:g}, "
                          "static; activations per token (gate_up) and per pair (down), absmax/448, dynamic; "
                          "router and shared expert unquantized"}


def fp8_manifest(g: Graph) -> dict:
    """The manifest's quantization entry of an fp8 graph: the dense scope, and the experts' where it has any."""
    return {**FP8_MANIFEST, **(FP8_EXPERTS if any(n.op == "MoE" and n.attrs.get("fp8_experts")
                                                  for n in g.nodes) else {})}


def check_fp8_targets(archs: tuple[str, ...], dtype_name: str) -> None:
    """FP8 GEMMs need FP8 tensor cores; a CPU target runs the op's reference (exact emulation)."""
    problem = fp8_target_problem(archs, dtype_name)
    if problem:
        raise UserError(problem)


def fp8_target_problem(archs: tuple[str, ...], dtype_name: str) -> str | None:
    """Why --quant fp8 cannot build for these targets (one line), or None."""
    old = [a for a in archs if a != "cpu" and a not in FP8_ARCHS]
    if old:
        return (f"--quant fp8 needs FP8 tensor cores (sm89 or newer); {', '.join(old)} has none: "
                "drop it from --arch or build without --quant")
    if any(a != "cpu" for a in archs) and dtype_name != "bfloat16":
        return (f"--quant fp8 on a GPU builds bfloat16 bundles (row-wise scaled FP8 GEMMs write "
                f"bf16), not {dtype_name}")
    return None


def check_fp8_shapes(cfg: ModelConfig) -> None:
    """torch._scaled_mm takes K and N in multiples of 16: every projection's in and out widths."""
    # q_lora_rank 0 (q straight from x) passes: 0 % 16 == 0
    widths = {"hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
              "num_heads * head_dim": cfg.q_size, "num_kv_heads * head_dim": cfg.kv_size}
    if cfg.kv_lora_rank:   # latent attention's q_a / q_b, kv_a and o (the experts are Triton's: any width)
        widths.update({"q_lora_rank": cfg.q_lora_rank,
                       "kv_lora_rank + qk_rope_head_dim": cfg.kv_lora_rank + cfg.qk_rope_head_dim,
                       "num_heads * v_head_dim": cfg.num_heads * cfg.v_head_dim})
    bad = [f"{name} {w}" for name, w in widths.items() if w % 16]
    if bad:
        raise UserError(f"--quant fp8 on a GPU needs projection widths in multiples of 16; {', '.join(bad)}")


def quantize_fp8(g: Graph) -> Graph:
    for i, node in enumerate(g.nodes):
        if node.op == "MoE" and node.domain != "" and not node.attrs.get("group_size"):
            _quantize_experts(g, node)
        if not _is_layer_projection(node):
            continue
        x, weight, *bias = node.inputs
        scale = weight + "_scale"
        g.weights[weight], g.weights[scale] = _quantized_loaders(g.weights[weight])
        g.nodes[i] = Node("FP8Linear", [x, weight, scale, *bias], list(node.outputs),
                          {"has_bias": bool(bias)})
    return g


def _quantize_experts(g: Graph, node: Node) -> None:
    """gate_up and down float8, their scales [E, N] inserted where the node's quantization inputs go (after
    the shared expert's, before the correction bias: kernels/moe)."""
    gate_up, down = node.inputs[2], node.inputs[3]
    scales = []
    for name in (gate_up, down):
        scales.append(name + "_scale")
        g.weights[name], g.weights[name + "_scale"] = _quantized_loaders(g.weights[name], _quantize_experts_rows)
    shared = (1 if node.attrs.get("shared_ungated") else 2) if node.attrs.get("has_shared_expert") else 0
    at = 4 + shared
    node.inputs[at:at] = scales
    node.attrs["fp8_experts"] = True


def _quantize_experts_rows(w):
    """quantize_rows one expert at a time: a float32 copy of one expert, not of the layer's whole stack."""
    q = torch.empty(w.shape, dtype=FP8)
    scale = torch.empty(w.shape[:-1], dtype=torch.float32)
    for e in range(w.shape[0]):
        q[e], scale[e] = quantize_rows(w[e])
    return q, scale


def _is_layer_projection(node: Node) -> bool:
    """A decoder layer's projection Gemm, but not a shared expert's: at the batch sizes where fp8 pays (every
    expert read) its W8A8 GEMMs and their input quantization took longer than the bf16 ones they replace
    (bench/results/HISTORY.md), and it is a small share of the weights."""
    return (node.op == "Gemm" and node.domain == "" and node.attrs.get("transB") == 1
            and node.outputs[0].startswith("layers.") and ".shared_expert." not in node.outputs[0])


def _quantized_loaders(load, quantize=quantize_rows):
    """Two lazy tensors (the float8 weight, its float32 scales) from one quantization of the weight.

    The bundle writer asks for each once, in name order: the first call quantizes and keeps the other
    half until it is asked for, so a weight is read and quantized once, and no more than one layer's
    half waits in memory."""
    pending = {}

    def part(index: int):
        def get():
            if index not in pending:
                pending.update(enumerate(quantize(load())))
            return pending.pop(index)
        return get
    return part(0), part(1)

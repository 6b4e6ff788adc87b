"""--quant fp8: the producer of an FP8Linear's input writes that input quantized (ai.engc::FP8LinearQ).

FP8Linear quantizes its input per token at run time (kernels/fp8_quant) before its GEMM: one launch more a
projection, a visible share of a decode step (bench/results/HISTORY.md). Where the input is a norm's output (qkv's and gate_up's) the norm's kernel
holds the row already and quantizes it as it stores it (kernels/rms_norm FP8_OUT); where it is SiluMul's
(down's) the quant kernel computes silu(gate) * up from gate_up itself (kernels/fp8_quant SILU), one launch
in place of two. o's input, the attention's output, keeps FP8Linear. Both round the row to the model
dtype before quantizing it, as the two separate ops do, so the codes and scales are the same bits.

    RMSNorm(x, w)          -> RMSNormFP8(x, w)          -> (x_fp8, x_scale)
    AddRMSNorm(x, r, w)    -> AddRMSNormFP8(x, r, w)    -> (x_fp8, x_scale, x + r)
    SiluMul(gate_up)       -> SiluMulFP8(gate_up)       -> (x_fp8, x_scale)
    FP8Linear(x, W, s[, b]) -> FP8LinearQ(x_fp8, x_scale, W, s[, b]), attribute dtype (ONNX code of the output)

Only where the FP8Linear is the value's one reader (the norm's and SiluMul's outputs have no other).
"""
from __future__ import annotations

from engc.bundle.program import ONNX_DTYPES
from engc.compiler.ir import Graph, Node

QUANTIZING = {"RMSNorm": "RMSNormFP8", "AddRMSNorm": "AddRMSNormFP8", "SiluMul": "SiluMulFP8"}


def fuse_fp8_input_quant(g: Graph) -> Graph:
    for linear in [n for n in g.nodes if n.op == "FP8Linear" and n.domain != ""]:
        x = linear.inputs[0]
        producer = g.producer(x)
        if (producer is None or producer.op not in QUANTIZING or producer.domain != linear.domain
                or producer.outputs[0] != x or len(g.consumers(x)) != 1 or x in g.outputs):
            continue
        xq, scale = x + ".fp8", x + ".fp8_scale"
        g.nodes[g.nodes.index(producer)] = Node(QUANTIZING[producer.op], list(producer.inputs),
                                                [xq, scale, *producer.outputs[1:]], dict(producer.attrs))
        g.nodes[g.nodes.index(linear)] = Node("FP8LinearQ", [xq, scale, *linear.inputs[1:]], list(linear.outputs),
                                              dict(linear.attrs, dtype=ONNX_DTYPES[g.dtype]))
    return g

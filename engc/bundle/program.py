"""The engine program as the runtime reads it: program.onnx parsed into plain node records.

Shared by the compiler (names, dtypes) and the runtime (parsing); the runtime never needs onnx's
checker or any execution provider, only the protobuf structure.
"""
from __future__ import annotations

from dataclasses import dataclass

import onnx
from onnx import TensorProto, helper

ENGC_DOMAIN = "ai.engc"

# The program's outputs: the sampled rows' float32 logits, and every row's in the model dtype (its decode form,
# for steps whose every row is sampled)
LOGITS, DECODE_OUTPUT = "logits", "logits.decode"

# Per-step inputs that the runtime fills; kv_cache.{i} per layer follow them.
GRAPH_INPUTS = ("input_ids", "positions", "slot_mapping", "block_tables", "context_lens",
                "query_start_loc", "logits_indices")

ONNX_DTYPES = {"float32": TensorProto.FLOAT, "bfloat16": TensorProto.BFLOAT16,
               "float16": TensorProto.FLOAT16, "int32": TensorProto.INT32, "int64": TensorProto.INT64,
               "uint8": TensorProto.UINT8, "int8": TensorProto.INT8,
               "float8_e4m3fn": TensorProto.FLOAT8E4M3FN}


def torch_dtype(onnx_type: int):
    """The torch dtype of an ONNX element type (Cast's `to`, FP8LinearQ's `dtype` attribute)."""
    import torch
    return getattr(torch, next(name for name, t in ONNX_DTYPES.items() if t == onnx_type))


@dataclass(frozen=True)
class ProgramNode:
    op: str
    domain: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict


@dataclass(frozen=True)
class Program:
    nodes: tuple[ProgramNode, ...]
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    initializers: tuple[str, ...]   # weight names, found in the bundle's safetensors

    @property
    def num_layers(self) -> int:
        return sum(1 for name in self.inputs if name.startswith("kv_cache."))


def parse_program(data: bytes) -> Program:
    model = onnx.ModelProto()
    model.ParseFromString(data)
    g = model.graph
    nodes = tuple(ProgramNode(n.op_type, n.domain, tuple(n.input), tuple(n.output),
                              {a.name: helper.get_attribute_value(a) for a in n.attribute})
                  for n in g.node)
    return Program(nodes=nodes, inputs=tuple(i.name for i in g.input),
                   outputs=tuple(o.name for o in g.output),
                   initializers=tuple(t.name for t in g.initializer))

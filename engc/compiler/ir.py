"""The engine program while the compiler works on it, and its serialization to ONNX.

A Graph is an ordered node list over named values plus lazy weights; passes rewrite it in place.
Serialization writes initializers as ONNX external data pointing into the bundle's safetensors file
(offset and length of each tensor's bytes), so program.onnx holds structure only and still opens in
Netron or onnx tooling with the real weights.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch
from onnx import TensorProto, helper

from engc.bundle.program import ENGC_DOMAIN, ONNX_DTYPES, GRAPH_INPUTS

Lazy = Callable[[], torch.Tensor]


@dataclass
class Node:
    op: str
    inputs: list[str]
    outputs: list[str]
    attrs: dict = field(default_factory=dict)
    domain: str = ENGC_DOMAIN


@dataclass
class Graph:
    nodes: list[Node] = field(default_factory=list)
    weights: dict[str, Lazy] = field(default_factory=dict)
    outputs: list[str] = field(default_factory=lambda: ["logits"])
    num_layers: int = 0
    kv_cache: str = "auto"      # int8/fp8: a quantized cache, kv_scale.{i} inputs (passes/quantize_kv_cache)
    dtype: str = "float32"      # the activations' (torch name): what a pass that changes a value's type restores
    tp: int = 1                 # tensor-parallel ranks (build --tp); passes/shard_tp makes weights per rank
    rank: int = 0               # the rank whose shard the lazy weights load (the writer sets it per file)

    def add(self, op: str, inputs: list[str], outputs: list[str] | str, domain: str = ENGC_DOMAIN,
            **attrs) -> str | list[str]:
        outs = [outputs] if isinstance(outputs, str) else outputs
        self.nodes.append(Node(op, list(inputs), outs, attrs, domain))
        return outputs

    def onnx_op(self, op: str, inputs: list[str], outputs: str, **attrs) -> str:
        return self.add(op, inputs, outputs, domain="", **attrs)

    def consumers(self, value: str) -> list[Node]:
        return [n for n in self.nodes if value in n.inputs]

    def producer(self, value: str) -> Node | None:
        return next((n for n in self.nodes if value in n.outputs), None)

    def input_names(self) -> list[str]:
        scales = [f"kv_scale.{i}" for i in range(self.num_layers)] if self.kv_cache != "auto" else []
        return list(GRAPH_INPUTS) + [f"kv_cache.{i}" for i in range(self.num_layers)] + scales

    def validate(self) -> None:
        """Every value is defined before use, exactly once; every weight used exists and vice versa."""
        defined = set(self.input_names()) | set(self.weights)
        used_weights = set()
        for n in self.nodes:
            for v in n.inputs:
                if v == "":
                    continue
                if v not in defined:
                    raise ValueError(f"{n.op} reads undefined value '{v}'")
                if v in self.weights:
                    used_weights.add(v)
            for v in n.outputs:
                if v in defined:
                    raise ValueError(f"value '{v}' defined twice")
                defined.add(v)
        missing = [o for o in self.outputs if o not in defined]
        if missing:
            raise ValueError(f"graph outputs never produced: {missing}")
        unused = set(self.weights) - used_weights
        if unused:
            raise ValueError(f"weights never used: {sorted(unused)[:5]}")


def to_onnx(graph: Graph, tensor_layout: dict[str, dict], weights_file: str, dtype_name: str) -> bytes:
    """tensor_layout: name -> {dtype, shape, offset, length} of each weight inside weights_file."""
    graph.validate()
    nodes = [helper.make_node(n.op, n.inputs, n.outputs, name=f"{n.op}_{i}", domain=n.domain,
                              **_attrs(n.attrs))
             for i, n in enumerate(graph.nodes)]
    inits = [_external(name, tensor_layout[name], weights_file) for name in sorted(graph.weights)]
    kv_dtype = {"int8": "int8", "fp8": "float8_e4m3fn"}.get(graph.kv_cache, dtype_name)
    inputs = [_input_info(name, kv_dtype) for name in graph.input_names()]
    # logits: float32, the sampled rows; logits.decode (passes/decode_form): every row, in the model dtype
    shapes = {"logits": (TensorProto.FLOAT, ["num_sampled", "vocab"]),
              "logits.decode": (ONNX_DTYPES[dtype_name], ["num_tokens", "vocab"])}
    outputs = [helper.make_tensor_value_info(name, *shapes[name]) for name in graph.outputs]
    g = helper.make_graph(nodes, "engc_step", inputs, outputs, initializer=inits)
    model = helper.make_model(g, producer_name="engc", opset_imports=[
        helper.make_opsetid("", 21), helper.make_opsetid(ENGC_DOMAIN, 1)])
    return model.SerializeToString(deterministic=True)


def _attrs(attrs: dict) -> dict:
    # ONNX attributes have no bool type: store flags as ints.
    return {k: int(v) if isinstance(v, bool) else v for k, v in sorted(attrs.items())}


def _external(name: str, layout: dict, weights_file: str) -> TensorProto:
    t = TensorProto()
    t.name = name
    t.data_type = ONNX_DTYPES[layout["dtype"]]
    t.dims.extend(layout["shape"])
    t.data_location = TensorProto.EXTERNAL
    for key, value in (("location", weights_file), ("offset", str(layout["offset"])),
                       ("length", str(layout["length"]))):
        entry = t.external_data.add()
        entry.key, entry.value = key, value
    return t


def _input_info(name: str, kv_dtype_name: str):
    int_inputs = {"input_ids": ["num_tokens"], "positions": ["num_tokens"],
                  "slot_mapping": ["num_tokens"], "block_tables": ["num_seqs", "max_blocks"],
                  "context_lens": ["num_seqs"], "query_start_loc": ["num_seqs_plus_1"],
                  "logits_indices": ["num_sampled"]}
    if name in int_inputs:
        elem = TensorProto.INT64 if name in ("input_ids", "positions", "slot_mapping",
                                             "logits_indices") else TensorProto.INT32
        return helper.make_tensor_value_info(name, elem, int_inputs[name])
    if name.startswith("kv_scale."):  # a quantized cache's scales: one per (k/v, token, KV head)
        return helper.make_tensor_value_info(name, TensorProto.FLOAT,
                                             [2, "num_blocks", "block_size", "num_kv_heads"])
    # kv_cache.{i}: [2, num_blocks, block_size, num_kv_heads, head_dim], updated in place
    return helper.make_tensor_value_info(name, ONNX_DTYPES[kv_dtype_name],
                                         [2, "num_blocks", "block_size", "num_kv_heads", "head_dim"])

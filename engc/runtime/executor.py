"""Runs the engine program one step at a time: each node bound to an op implementation.

Binding happens once at load (names resolved to slots, attributes decoded), so a step is a flat loop
of calls. Values are dropped after their last use to keep activation memory at a layer's worth.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from engc.bundle.program import DECODE_OUTPUT, Program
from engc.errors import BundleError


@dataclass
class TokenFill:
    """Input ids that are still on the device: the previous step's sampled tokens (overlapped steps).

    input_ids[rows] = tokens[src], done where the inputs already are, so the host never waits for them.
    """
    rows: torch.Tensor      # int64 positions in the flat input_ids (host)
    src: torch.Tensor       # int64 rows of `tokens` (host)
    tokens: torch.Tensor    # the previous step's sampled ids, on the executor's device

    def apply(self, input_ids: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
        """rows and src given on input_ids' device (a GPU executor stages them with its other inputs)."""
        input_ids.index_copy_(0, rows, self.tokens.index_select(0, src))


class Executor:
    """The eager executor. Its interface is the GraphedExecutor's (runtime/cuda_graphs.py) too: an eager step
    takes no tokens itself (step_tokens stays None) and fills read tokens where they are (keep_tokens)."""

    step_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    draws_in_graph = False      # nothing samples inside an eager step: its rows are sampled after it

    def __init__(self, program: Program, weights: dict[str, torch.Tensor],
                 ops: dict[tuple[str, str], Callable], before_forward: Callable[[], None] | None = None):
        """before_forward: called first in every forward (a GPU model's StepFacts.take: the batch's facts
        must have been set for it)."""
        self.program = program
        self.weights = weights
        self.before_forward = before_forward
        for i, node in enumerate(program.nodes):
            if (node.domain, node.op) not in ops:
                raise BundleError(f"program uses op {node.domain or 'onnx'}::{node.op}, "
                                  "which this runtime does not implement")
            missing = [n for n in node.inputs if n and n not in weights and n not in program.inputs
                       and not any(n in p.outputs for p in program.nodes[:i])]
            if missing:
                raise BundleError(f"program node {node.op} reads unknown value '{missing[0]}'")
        if DECODE_OUTPUT not in program.outputs:
            raise BundleError(f"the program has no {DECODE_OUTPUT} output (a bundle from another engc: rebuild it)")
        self.steps = self._steps_for(program.outputs[0], ops)
        self.decode_steps = self._steps_for(DECODE_OUTPUT, ops)

    def _steps_for(self, output: str, ops: dict) -> list:
        """The bound steps that compute `output`: the nodes it depends on, in program order, each with the
        values to drop after it (their last use among those nodes)."""
        needed, nodes = {output}, []
        for node in reversed(self.program.nodes):
            if needed.intersection(node.outputs):
                nodes.append(node)
                needed.update(node.inputs)
        nodes.reverse()
        last_use = {name: i for i, node in enumerate(nodes) for name in node.inputs}
        keep = set(self.weights) | set(self.program.inputs)
        return [(ops[(node.domain, node.op)], node.inputs, node.outputs, dict(node.attrs),
                 tuple(n for n in node.inputs if last_use[n] == i and n not in keep))
                for i, node in enumerate(nodes)]

    def forward(self, inputs: dict[str, torch.Tensor], kv_caches: list[torch.Tensor],
                fill: TokenFill | None = None, decode: bool = False, draws=None) -> torch.Tensor:
        """The program's logits for the batch. decode: a step whose every row is sampled (logits_indices is
        arange over the rows): the program's decode form, its logits in the head's dtype (passes/decode_form).
        draws: what a graphed executor's draw reads (GraphedExecutor.forward); unused by an eager step."""
        if self.before_forward is not None:
            self.before_forward()
        if fill is not None:
            fill.apply(inputs["input_ids"], fill.rows, fill.src)
        env = dict(self.weights)
        env.update(inputs)
        for i, cache in enumerate(kv_caches):  # KVCache.layers: (codes, scales) when quantized
            if isinstance(cache, tuple):
                env[f"kv_cache.{i}"], env[f"kv_scale.{i}"] = cache
            else:
                env[f"kv_cache.{i}"] = cache
        for impl, ins, outs, attrs, drop in (self.decode_steps if decode else self.steps):
            results = impl(*[env[n] for n in ins], **attrs)
            for name, value in zip(outs, results):
                env[name] = value
            for name in drop:
                del env[name]
        return env[DECODE_OUTPUT if decode else self.program.outputs[0]]

    def keep_tokens(self, tokens: torch.Tensor | None) -> None:
        """Nothing to keep: a TokenFill reads the previous step's tokens where they are."""


"""The MoE op's candidates on the GPU (gpu.GpuBench delegates moe shapes here): one class's gate_up and down
cubins launched by the op's own launch rule (kernels/moe/launch.py launch_experts) over a seeded random
routing, checked against the op's torch reference (kernels/moe moe()), timed as gpu.py times a launch.

The weights: one layer's experts, random, in as many copies as overflow L2 three times (a Qwen3-30B-A3B layer,
1.2 GB, is one copy), cycled through so every launch pair reads its experts from memory as a decode step does.
The routing: route() of a seeded random router on seeded random tokens (the Qwen3 routing: softmax, top-k,
renormalized), near uniform over the experts as a trained router's load balancing makes it. The schedule
(sort_by_expert) is made once per BLOCK_M outside the timed graph: it does not depend on the tile otherwise.
A model whose decode pair is fused (no shared expert) times it as forward() launches it: the gate_up routing
from the router's logits (made once, outside the graph) and the down writing each token's sum.
"""
from __future__ import annotations

import math

import torch

from engc.compiler.tune import moe as tm
from engc.kernels import moe as op
from engc.kernels.moe import launch as gpu


class MoeBench:
    def __init__(self, plan, kernels: dict, ring_bytes: int, device: str = "cuda"):
        cfg = plan.cfg
        self.device = device
        self.plan, self.kernels, self.dtype = plan, kernels, plan.dtype
        self.e, self.k = cfg.num_experts, cfg.num_experts_per_tok
        self.h, self.i = cfg.hidden_size, cfg.moe_intermediate_size
        layer = self.e * 3 * self.h * self.i * torch.finfo(self.dtype).bits // 8
        self.copies = max(1, min(16, math.ceil(ring_bytes / layer)))
        self._weights = None
        self._inputs = {}     # tokens -> x, weights, ids, reference, pairs
        self._schedules = {}  # (tokens, BLOCK_M) -> rows, block_expert, act

    def weights(self):
        if self._weights is None:
            gen = torch.Generator(device=self.device).manual_seed(0)
            h, i, dt = self.h, self.i, self.dtype
            self._weights = dict(
                router=(torch.randn(self.e, h, device=self.device, generator=gen) / h ** 0.5).to(dt),
                gate_up=[(torch.randn(self.e, 2 * i, h, device=self.device, generator=gen) / h ** 0.5).to(dt)
                         for _ in range(self.copies)],
                down=[(torch.randn(self.e, h, i, device=self.device, generator=gen) / i ** 0.5).to(dt)
                      for _ in range(self.copies)])
        return self._weights

    def inputs(self, tokens: int) -> dict:
        """The batch of `tokens`: its routing (seeded) and the reference's output on the first weight copy."""
        if tokens not in self._inputs:
            w = self.weights()
            gen = torch.Generator(device=self.device).manual_seed(tokens)
            x = torch.randn(tokens, self.h, device=self.device, generator=gen).to(self.dtype)
            weights, ids = op.route(x, w["router"], self.k, softmax_first=1, renormalize=1)
            ref = op.moe(x, w["router"], w["gate_up"][0], w["down"][0], top_k=self.k, softmax_first=1,
                         renormalize=1)
            pairs = torch.empty(tokens * self.k, self.h, dtype=self.dtype, device=self.device)
            # the fused decode variants' own: the router's logits they route from, the routing they write,
            # the output they sum each token's pairs into
            fused = dict(logits=torch.nn.functional.linear(x, w["router"]),
                         routed_weights=torch.empty_like(weights),
                         routed_ids=torch.empty_like(ids, dtype=torch.int32),
                         out=torch.empty(tokens, self.h, dtype=self.dtype, device=self.device))
            self._inputs[tokens] = dict(x=x, weights=weights.to(self.dtype).float().contiguous(),
                                        ids=ids.to(torch.int32).contiguous(), ref=ref.float(), pairs=pairs, **fused)
        return self._inputs[tokens]

    def fused(self, shape, cand) -> tuple[bool, bool]:
        """Which of the candidate's decode pair are fused kernels (kernels/moe/launch.py fused_decode): (gate_up
        routing from the logits, down summing each token's pairs into out)."""
        if shape.name != "decode":
            return False, False
        return gpu.fused_decode({r["variant"]: r["launch"] for _, r in self.kernels[(shape, cand)]})

    def schedule(self, tokens: int, block_m: int | None):
        """(rows, block_expert, act) for the batch: sort_by_expert's at block_m, or the decode variants' one
        pair a program in pair order (block_m None: no rows, block_expert the ids)."""
        key = (tokens, block_m)
        if key not in self._schedules:
            ids = self.inputs(tokens)["ids"]
            if block_m is None:
                rows, block_expert = None, ids.reshape(-1)
            else:
                rows, block_expert = gpu.sort_by_expert(ids, self.e, block_m)
            act = torch.empty(ids.numel(), self.i, dtype=self.dtype, device=self.device)   # a row a pair
            self._schedules[key] = (rows, block_expert, act)
        return self._schedules[key]

    def launches(self, shape, cand) -> list:
        """One function per weight copy, launching the candidate's gate_up then down as forward() would."""
        from engc.cuda import cubin
        parts = self.kernels[(shape, cand)]
        by_variant = {r["variant"]: (kernel, r) for kernel, r in parts}
        consts = {r["variant"]: r["launch"] for _, r in parts}
        cls = shape.name
        decode = cls == "decode"
        gate_up = tm.CLASSES[cls][0]
        b = self.inputs(shape.tokens)
        rows, block_expert, act = self.schedule(shape.tokens, None if decode else consts[gate_up]["BLOCK_M"])
        weights = b["weights"]
        route, combine = self.fused(shape, cand)
        fused = dict(logits=b["logits"], out=b["out"], routing=dict(softmax_first=1, renormalize=1)) \
            if route or combine else {}
        if route:   # the bench's routing (Qwen3's), computed by the gate_up kernel itself
            weights, block_expert = b["routed_weights"], b["routed_ids"]
        w = self.weights()
        fns = []
        for c in range(self.copies):
            plan = []
            for variant, grid, args in gpu.launch_experts(b["x"], w["gate_up"][c], w["down"][c], rows, block_expert,
                                                          weights, act, b["pairs"], consts,
                                                          None if decode else tm.CLASSES[cls], **fused):
                kernel, _ = by_variant[variant]
                plan.append((kernel, grid, kernel.pointers(args)))

            def run(plan=plan):
                for kernel, grid, ptrs in plan:
                    kernel.launch(grid, ptrs, cubin.current_stream())
            fns.append(run)
        return fns

    def check(self, shape, cand) -> float:
        """Relative error of the candidate's MoE output (its pairs summed per token, as the combine kernel
        sums them, or the fused decode down's output) against moe()'s."""
        b = self.inputs(shape.tokens)
        fused = self.fused(shape, cand)[1]
        b["out" if fused else "pairs"].fill_(float("nan"))
        self.launches(shape, cand)[0]()
        if self.device != "cpu":
            torch.cuda.synchronize()
        out = b["out"].float() if fused else b["pairs"].float().view(shape.tokens, self.k, self.h).sum(1)
        return float((out - b["ref"]).norm() / b["ref"].norm())

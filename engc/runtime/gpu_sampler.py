"""Sampling on the GPU with the bundle's sampling kernel: temperature, top-k and top-p per row.

Only the row parameters and one uniform draw per row cross to the device, and one token id per row
comes back, instead of a [batch, vocab] float32 block (32 MB a step at batch 64 for a 128k vocab).
The draw comes from each sequence's own generator, so a seeded request stays reproducible. Penalties,
JSON masks and logprobs are applied around this draw on the device (runtime/step_sampling.py).
"""
from __future__ import annotations

import torch

from engc.kernels import argmax, sampling
from engc.runtime.gpu_ops import BundleKernels
from engc.runtime.sequence import Sequence


class GpuSampler:
    def __init__(self, kernels: BundleKernels, device: torch.device):
        self.kernels = kernels
        self.device = device

    def greedy(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Argmax per row, [rows] int64 on the device (the split kernel: torch's takes 27 us a step), into
        out where given (a decode graph's last_tokens)."""
        if out is None:
            out = torch.empty(logits.shape[0], dtype=torch.int64, device=self.device)
        if "argmax" not in self.kernels.consts:  # a bundle built before the kernel existed
            return torch.argmax(logits, -1, out=out)
        self.kernels.run("argmax", argmax.launch(logits.contiguous(), out, self.kernels.consts["argmax"]))
        return out

    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        """The sampled ids, [len(seqs)] int64 on the device; nothing here waits for the GPU."""
        rows = [(s.params.temperature, s.params.top_k, s.params.top_p,
                 0.0 if s.params.greedy else float(torch.rand((), generator=s.generator)))
                for s in seqs]
        # Padded to 4 rows so each parameter's row below starts 16 bytes aligned, as the kernel assumes
        # (BundleKernels.run refuses a misaligned argument; one sequence put top_p 8 bytes off).
        rows += [(1.0, 0, 1.0, 0.0)] * (-len(rows) % 4)
        # pinned, so the upload does not wait for the step still running on the GPU
        params = torch.tensor(rows, dtype=torch.float32).pin_memory().to(self.device, non_blocking=True)
        params = params.T.contiguous()
        temperature, top_p, uniform = params[0], params[2], params[3]
        top_k = params[1].to(torch.int32)
        out = torch.empty(len(seqs), dtype=torch.int64, device=self.device)
        self.kernels.run("sampling", sampling.launch(logits.contiguous(), temperature, top_k, top_p,
                                                     uniform, out))
        return out

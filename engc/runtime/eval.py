"""Perplexity of a bundle on a text: what a quantization costs, measured the same way for every bundle.

The text is tokenized once (no special tokens) and cut into windows of `window` tokens every `stride`
tokens; each window scores only the tokens the previous one did not (the Hugging Face sliding-window
recipe), so every token after the first is scored exactly once with up to window - 1 tokens of context;
with stride == window, a window's first token has no context in it and is not scored.
A window is one prefill from position 0 whose program computes logits only at the positions it scores.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engc.errors import UserError
from engc.progress import Progress
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import LoadedModel


@dataclass(frozen=True)
class EvalOptions:
    window: int = 512
    stride: int = 256
    max_tokens: int = 0        # 0: the whole text


@dataclass(frozen=True)
class Window:
    """Runs ids[begin:end] and scores the targets ids[first:end]."""
    begin: int
    first: int
    end: int


def perplexity(model: LoadedModel, text: str, opts: EvalOptions = EvalOptions(),
               progress: Progress | None = None) -> dict:
    """progress: a bar on stderr counting windows (each costs one forward of up to `window` tokens)."""
    if not 0 < opts.stride <= opts.window:
        raise UserError(f"--stride {opts.stride} must be in [1, window {opts.window}]")
    if opts.window > model.config.max_position_embeddings:
        raise UserError(f"--window {opts.window} exceeds the model's context "
                        f"{model.config.max_position_embeddings}")
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    if opts.max_tokens:
        ids = ids[:opts.max_tokens]
    if len(ids) < 2:
        raise UserError("the evaluation text has fewer than 2 tokens")
    plan = windows(len(ids), opts.window, opts.stride)
    blocks = -(-opts.window // model.block_size)
    kv = KVCache(model.config, blocks, model.block_size, model.kv_dtype or model.dtype, model.device)
    bar = (progress or Progress(enabled=False)).bar("perplexity", total=len(plan), unit=" windows", eta=True)
    nll, scored = 0.0, 0
    for w in plan:
        # the logits at position p predict token p + 1: those of first - 1 .. end - 2 score first .. end - 1
        logits = _forward(model, kv, ids[w.begin:w.end], range(w.first - w.begin - 1, w.end - w.begin - 1))
        nll += window_nll(logits, ids[w.first:w.end])
        scored += w.end - w.first
        bar.advance(note=f"{scored}/{len(ids) - 1} tokens scored")
    bar.close()
    return {"ppl": math.exp(nll / scored), "nll_per_token": nll / scored, "tokens": len(ids),
            "scored": scored, "windows": len(plan), "window": opts.window, "stride": opts.stride}


def windows(num_tokens: int, window: int, stride: int) -> list[Window]:
    """The windows of a text of num_tokens tokens: one every stride tokens until one reaches the end."""
    plan, prev_end = [], 0
    for begin in range(0, num_tokens, stride):
        end = min(begin + window, num_tokens)
        plan.append(Window(begin, max(prev_end, begin + 1), end))
        prev_end = end
        if end == num_tokens:
            break
    return plan


def window_nll(logits: torch.Tensor, targets: list[int]) -> float:
    """The summed negative log-likelihood of targets, row i of logits predicting targets[i]."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    return -float(logp.gather(1, torch.tensor(targets, dtype=torch.int64, device=logp.device)[:, None]).sum())


def _forward(model: LoadedModel, kv: KVCache, ids: list[int], positions: range | None = None) -> torch.Tensor:
    """Logits of one sequence run as a single prefill from position 0, at `positions` (default: all).
    The program's lm_head runs only on the rows of logits_indices, so leaving out the positions nobody
    scores saves their share of the largest GEMM."""
    n, dev = len(ids), model.device
    positions = range(n) if positions is None else positions
    blocks = -(-n // model.block_size)
    if model.step_facts is not None:   # a GPU model: its kernels size their grids from these
        model.step_facts.describe(torch.tensor([n]), torch.tensor([n]))
    inputs = {
        "input_ids": torch.tensor(ids, dtype=torch.int64, device=dev),
        "positions": torch.arange(n, dtype=torch.int64, device=dev),
        "slot_mapping": torch.arange(n, dtype=torch.int64, device=dev),
        "block_tables": torch.arange(blocks, dtype=torch.int32, device=dev)[None, :],
        "context_lens": torch.tensor([n], dtype=torch.int32, device=dev),
        "query_start_loc": torch.tensor([0, n], dtype=torch.int32, device=dev),
        "logits_indices": torch.tensor(positions, dtype=torch.int64, device=dev),
    }
    with torch.inference_mode():
        return model.executor.forward(inputs, kv.layers)

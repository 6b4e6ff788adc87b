"""Perplexity of a bundle on a text: what a quantization costs, measured the same way for every bundle.

The text is tokenized once (no special tokens) and cut into windows of `window` tokens every `stride`
tokens; each window scores only the tokens the previous one did not (the Hugging Face sliding-window
recipe), so every token after the first is scored exactly once with up to window - 1 tokens of context.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from engc.errors import UserError
from engc.runtime.kv_cache import KVCache
from engc.runtime.loader import LoadedModel


@dataclass(frozen=True)
class EvalOptions:
    window: int = 512
    stride: int = 256
    max_tokens: int = 0        # 0: the whole text


def perplexity(model: LoadedModel, text: str, opts: EvalOptions = EvalOptions()) -> dict:
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
    blocks = -(-opts.window // model.block_size)
    kv = KVCache(model.config, blocks, model.block_size, model.kv_dtype or model.dtype, model.device)
    nll, scored, windows, prev_end = 0.0, 0, 0, 0
    for begin in range(0, len(ids), opts.stride):
        end = min(begin + opts.window, len(ids))
        first = max(prev_end, begin + 1)   # first target position this window scores
        logits = _forward(model, kv, ids[begin:end])
        logp = torch.log_softmax(logits[first - begin - 1:end - begin - 1].float(), dim=-1)
        targets = torch.tensor(ids[first:end], dtype=torch.int64)
        nll -= float(logp.gather(1, targets[:, None]).sum())
        scored += end - first
        windows += 1
        prev_end = end
        if end == len(ids):
            break
    return {"ppl": math.exp(nll / scored), "nll_per_token": nll / scored, "tokens": len(ids),
            "scored": scored, "windows": windows, "window": opts.window, "stride": opts.stride}


def _forward(model: LoadedModel, kv: KVCache, ids: list[int]) -> torch.Tensor:
    """Logits at every position of one sequence, run as a single prefill from position 0."""
    n, dev = len(ids), model.device
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
        "logits_indices": torch.arange(n, dtype=torch.int64, device=dev),
    }
    with torch.inference_mode():
        return model.executor.forward(inputs, kv.layers)

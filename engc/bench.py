"""engc bench: what a bundle does on this machine's GPU (or CPU), measured through the engine users run.

For each batch size, that many requests of `input_len` random prompt tokens (seeded, so every run sends the
same ones) decode `output_len` greedy tokens each, EOS ignored, all added at once: the figures are the
batch's time to its first tokens (the prefill), its decode rate after them and its output rate over the
whole run. A warm-up request first takes the one-time costs (CUDA graph capture, cuBLAS set-up, the first
launches) out of the figures. The engine reads each step's tokens back to the host, so wall-clock time is
GPU time plus the host's share of a step, which is what a server sees.
"""
from __future__ import annotations

import platform
import time

import torch

from engc.errors import UserError
from engc.progress import Progress
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu"


def prompts(vocab: int, batch: int, length: int, seed: int = 0) -> list[list[int]]:
    """Random prompt token ids, the same for the same arguments (ids 0..9 left out: special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, vocab, (batch, length), generator=g).tolist()


def run_batch(engine: Engine, ids: list[list[int]], output_len: int) -> dict:
    """One batch to completion: prefill_s (until every request has its first token), decode_tok_s (the
    tokens after the first, over the time after the prefill), output_tok_s (all tokens, the whole run)."""
    params = SamplingParams(temperature=0, max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    seqs = [engine.add_request(p, params) for p in ids]
    first = None
    while engine.has_work:
        engine.step()
        if first is None and all(len(s.output_ids) for s in seqs):
            first = time.perf_counter()
    done = time.perf_counter()
    produced = sum(len(s.output_ids) for s in seqs)
    first = first or done
    after_first = produced - len(seqs)
    return {"batch": len(ids), "input_len": len(ids[0]), "output_len": output_len,
            "prefill_s": round(first - started, 4),
            "decode_tok_s": round(after_first / (done - first), 1) if after_first and done > first else None,
            "output_tok_s": round(produced / (done - started), 1), "seconds": round(done - started, 3)}


def bench(bundle: str, device: str = "auto", batch_sizes=(1, 8), input_len: int = 128, output_len: int = 128,
          progress: Progress | None = None) -> dict:
    """The figures of a bundle at each batch size; progress shows what runs."""
    progress = progress or Progress(enabled=False)
    with progress.step(f"load {bundle}"):
        model = load(bundle, device=device)
    vocab = model.config.vocab_size
    longest = input_len + output_len
    if longest >= model.config.max_position_embeddings:
        raise UserError(f"input_len + output_len = {longest} is past the model's context "
                         f"({model.config.max_position_embeddings})")
    engine = Engine(model, EngineConfig(max_num_seqs=max(batch_sizes)))
    with progress.step("warm-up"):
        run_batch(engine, prompts(vocab, 1, min(input_len, 16), seed=1), min(output_len, 4))
    results = []
    for b in batch_sizes:
        with progress.step(f"batch {b}: {b} x {input_len} prompt tokens, {output_len} out"):
            results.append(run_batch(engine, prompts(vocab, b, input_len), output_len))
    return {"bundle": bundle, "model": model.bundle.manifest["source"]["name"], "device": model.device.type,
            "device_name": device_name(model.device), "dtype": str(model.dtype).removeprefix("torch."),
            "results": results}


def table(report: dict) -> str:
    """The report as a few aligned lines for a terminal."""
    lines = [f"{report['model']} on {report['device_name']} ({report['device']}, {report['dtype']})",
             f"{'batch':>6} {'in':>6} {'out':>6} {'prefill s':>10} {'decode tok/s':>13} {'output tok/s':>13}"]
    for r in report["results"]:
        decode = "-" if r["decode_tok_s"] is None else f"{r['decode_tok_s']:,.1f}"
        lines.append(f"{r['batch']:>6} {r['input_len']:>6} {r['output_len']:>6} {r['prefill_s']:>10.3f} "
                     f"{decode:>13} {r['output_tok_s']:>13,.1f}")
    return "\n".join(lines)

"""Host cost of Engine.step on the CPU: the model replaced by a fake that returns fixed logits.

On the H200 a decode step's GPU work is one CUDA graph replay, so everything else Engine.step does
(schedule, build inputs, stage them, sample, detokenize, stop checks) is lost throughput. This times
exactly that: a real bundle's tokenizer and config, the real GraphedExecutor decode path (staging into
the host buffer) with the graph replay a no-op, and a logits tensor that looks like a GPU one, so
the device sampler takes its greedy path (argmax(-1)) on eager steps. The fake's argmax, and
the tokens a graphed step leaves, are precomputed tokens of real text, so detokenizing does
representative work.

    python bench/host_overhead.py [--bundle /tmp/b_default] [--batch 1 32 128] [--steps 100] [--profile]
                                  [--no-overlap]

With overlap (the default) a GPU hides this time behind its own as long as it is shorter than a step;
the figure here is then the host's total work a step, not time added to it.
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import re
import statistics
import time
from pathlib import Path

import torch

from engc.runtime import cuda_graphs
from engc.runtime.cuda_graphs import GraphedExecutor
from engc.runtime.engine import Engine, EngineConfig
from engc.runtime.gpu_ops import StepFacts
from engc.runtime.loader import load
from engc.runtime.sampling import SamplingParams

STOPS = ("###", "\nUser:")   # never in the generated text: stop checks run, nothing stops


class GpuLogits(torch.Tensor):
    """[n, vocab] logits that report a CUDA device; argmax returns the next precomputed tokens."""
    __torch_function__ = torch._C._disabled_torch_function_impl

    @property
    def device(self):
        return torch.device("cuda")

    def argmax(self, dim=None):
        return self.source.next_tokens(self.shape[0])


class FakeModel:
    """Stands in for the executor (prefill, eager) and for every captured graph (decode)."""

    def __init__(self, vocab: int, text_ids: list[int], max_batch: int, steps: int = 257):
        self.step = 0
        base = torch.zeros(max_batch, vocab)
        self.views = {}
        for n in range(max_batch + 1):
            v = torch.Tensor._make_subclass(GpuLogits, base[:n])
            v.source = self
            self.views[n] = v
        # Row i at step k continues text i*7 + k: each sequence reads as ordinary text.
        L = len(text_ids)
        ids = torch.tensor(text_ids)
        self.tokens = torch.stack([ids[(torch.arange(max_batch) * 7 + k) % L] for k in range(steps)])

    def next_tokens(self, n: int) -> torch.Tensor:
        t = self.tokens[self.step % len(self.tokens), :n]
        self.step += 1
        return t

    def forward(self, inputs, kv_caches):           # the eager executor: prefill chunks
        return self.views[inputs["logits_indices"].shape[0]]

    def replay(self):                                # a captured graph
        pass

    def __getitem__(self, s: slice):                 # a graph's output buffer, sliced to n rows
        return self.views[s.stop]


def make_engine(model, batch: int, prompt_len: int, steps: int, stops: tuple[str, ...], overlap: bool = True):
    bs = model.block_size
    blocks = batch * (-(-(prompt_len + steps + 8) // bs)) + 16
    engine = Engine(model, EngineConfig(num_blocks=blocks, max_num_seqs=max(batch, 1), overlap=overlap))
    text = re.sub(r"#+", "", Path(__file__).parents[1].joinpath("docs/architecture.md").read_text())
    text_ids = model.tokenizer.encode(text, add_special_tokens=False)
    fake = FakeModel(model.config.vocab_size, text_ids, max(cuda_graphs.BUCKETS[-1], batch))   # larger: eager steps
    ex = GraphedExecutor(fake, StepFacts(), -(-engine.max_context // bs), batch, "cpu", True, block_size=bs)
    ex.graphs = {(b, c): [(fake, fake)] * 2 for b in ex.buckets for c in ex._ctx_buckets(b)}
    graphed_forward = ex.forward

    def forward(inputs, kv_caches, fill=None, draws=None):   # a graphed step's tokens, as its argmax leaves them
        out = graphed_forward(inputs, kv_caches, fill, draws=draws)
        if ex.step_tokens is not None:
            tokens = fake.next_tokens(inputs["input_ids"].shape[0])
            ex.step_tokens = (tokens, tokens)
        return out
    ex.forward = forward
    engine.runner.executor = ex
    params = SamplingParams(max_tokens=10_000, temperature=0, ignore_eos=True, stop=stops)
    for i in range(batch):
        engine.add_request(text_ids[i * 5:i * 5 + prompt_len], params)
    while any(s.num_computed == 0 or s.num_pending > 1 for s in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()                                # prefill until every sequence decodes
    for _ in range(3):
        engine.step()
    return engine


def time_steps(engine: Engine, steps: int, profile: bool = False) -> float:
    prof = cProfile.Profile() if profile else None
    if prof:
        prof.enable()
    t0 = time.thread_time()
    for _ in range(steps):
        engine.step()
    dt = time.thread_time() - t0
    if prof:
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)
    return dt / steps * 1e3


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", default="/tmp/b_default")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 32, 128])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=5, help="timed runs, a fresh engine each (best and median printed)")
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--no-overlap", action="store_true", help="synchronous steps (EngineConfig.overlap off)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.Tensor.pin_memory = lambda self: self      # no CUDA here: the staging buffer is plain memory
    model = load(args.bundle)
    print(f"{'batch':>5} {'stops':>5} {'best ms':>8} {'median':>8}")
    for batch in args.batch:
        for stops in ((), STOPS):
            runs = [time_steps(make_engine(model, batch, args.prompt_len, args.steps, stops, not args.no_overlap),
                               args.steps) for _ in range(args.repeat)]
            print(f"{batch:>5} {'yes' if stops else 'no':>5} {min(runs):8.3f} {statistics.median(runs):8.3f}",
                  flush=True)
            if args.profile:
                time_steps(make_engine(model, batch, args.prompt_len, args.steps, stops, not args.no_overlap),
                           args.steps, True)


if __name__ == "__main__":
    main()

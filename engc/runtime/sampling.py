"""Sampling parameters, a sampled token (Sampled) and a sequence's generator; the samplers are in sampler.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from engc.runtime.constrained.grammars import Grammar


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: off
    min_p: float = 0.0                # keep tokens at least min_p times as likely as the likeliest; 0: off
    seed: int | None = None
    repetition_penalty: float = 1.0   # HF style, over prompt and output
    presence_penalty: float = 0.0     # OpenAI style, over output
    frequency_penalty: float = 0.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None       # None: none; k: the chosen token's logprob and the top k
    prompt_logprobs: int | None = None  # None: none; k: each prompt token's logprob given the tokens before
                                        # it (the first has none), its rank and the top k (runtime/scoring.py)
    # what the output follows (runtime/constrained: constrained.json_object(), json_schema(schema), regex(...),
    # choice([...]), grammar(lark), tool_calls(...)); None: free text
    grammar: Grammar | None = None
    extra: dict = field(default_factory=dict, compare=False)

    def validate(self) -> None:
        checks = [(self.max_tokens >= 1, "max_tokens must be at least 1"),
                  (self.temperature >= 0, "temperature must be >= 0"),
                  (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
                  (self.top_k >= 0, "top_k must be >= 0"),
                  (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
                  (self.repetition_penalty > 0, "repetition_penalty must be > 0"),
                  (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
                  (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
                  (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
                  (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= 20,
                   "prompt_logprobs must be in [0, 20]"),
                  # an empty stop string matches before the first token: the answer would always be empty
                  (all(self.stop), "stop strings must not be empty"),
                  (self.grammar is None or isinstance(self.grammar, Grammar),
                   "grammar must be an engc.runtime.constrained Grammar")]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1

    @cached_property
    def plain_greedy(self) -> bool:
        """Greedy with nothing that needs the logits on the host (cached: the engine asks every step)."""
        return self.greedy and self.device_sampleable

    @cached_property
    def device_sampleable(self) -> bool:
        """Only temperature, top-k, top-p and min-p: what the plain draw (the GPU sampling kernel) does, with no
        penalties, mask or logprobs to add (runtime/sampler.py adds those)."""
        return self.logprobs is None and not self.penalized and self.grammar is None

    @cached_property
    def penalized(self) -> bool:
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0 or self.frequency_penalty != 0


@dataclass
class Sampled:
    token: int
    logprob: float | None = None
    top: list[tuple[int, float]] | None = None
    rank: int | None = None           # of a prompt token: 1 + how many tokens the model found likelier


def make_generator(seed: int | None) -> torch.Generator:
    """The sequence's own generator. Any integer seeds it: torch takes [-2^63, 2^64) and wraps negatives to
    64 bits, so the seed is reduced modulo 2^64, which leaves every seed torch took as it was (an API seed of
    1e23 made torch raise, a 500 from the server)."""
    g = torch.Generator()
    g.manual_seed(seed % 2**64 if seed is not None else int(torch.randint(0, 2**62, ()).item()))
    return g

"""Sampling parameters, a sampled token (Sampled), a sequence's generator (the host sampler's) and its
counter-based uniform draws (the device sampler's); the samplers are in sampler.py."""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from functools import cached_property

import numpy as np
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

    @cached_property
    def greedy(self) -> bool:
        """Cached: the device sampler asks for every row every step."""
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
    def kernel_row(self) -> tuple[float, int, float, float]:
        """(temperature, top_k, top_p, min_p) as the sampling kernel reads them (cached: gathered every step).
        top_k is capped at int32's largest: the kernel reads it as int32, and any k at or over the vocabulary
        is off."""
        return self.temperature, min(self.top_k, 2**31 - 1), self.top_p, self.min_p

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


# splitmix64 (Steele, Lea and Flood): a Weyl sequence (state += _WEYL) through a 64-bit finalizer; numpy
# uint64 scalars, so that the arithmetic stays in uint64 and wraps modulo 2^64
_WEYL = np.uint64(0x9E3779B97F4A7C15)          # 2^64 over the golden ratio, odd
_MIX1, _MIX2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_ONE, _S27, _S30, _S31, _S40 = (np.uint64(n) for n in (1, 27, 30, 31, 40))


def _mix64(z: np.ndarray) -> np.ndarray:
    """splitmix64's finalizer, elementwise on a uint64 array (numpy wraps an array's overflow silently; a
    numpy scalar's with a warning)."""
    z = (z ^ z >> _S30) * _MIX1
    z = (z ^ z >> _S27) * _MIX2
    return z ^ z >> _S31


def make_draw_key(seed: int | None) -> int:
    """The key of a sequence's device draws (uniforms): the seed reduced modulo 2^64 as make_generator reduces
    it, then mixed (unmixed, two seeds k Weyl steps apart would draw one stream k draws apart; mixed, no simple
    relation between seeds does); a random key without a seed."""
    if seed is None:
        return secrets.randbits(64)
    return int(_mix64(np.array([seed % 2**64], dtype=np.uint64))[0])


def uniforms(keys: np.ndarray, counters: np.ndarray) -> np.ndarray:
    """Draw number `counters[i]` of the sequence keyed `keys[i]`, for every row at once: float32 in [0, 1).

    The device sampler's uniforms are counter-based: a draw is splitmix64's output number counter + 1 from the
    state key, a function of the sequence's key and of how many it drew before, and of nothing else. So a
    seeded request draws the same uniforms whatever shares its batch and whichever row it has, and a step's
    draws are one vectorized call instead of a torch generator call a row. The top 24 bits times 2^-24 are
    exact in float32: 1.0 never comes up. keys, counters: uint64 arrays of one shape (0-d ones make numpy
    scalars, whose wrapping numpy would warn of, hence the errstate)."""
    with np.errstate(over="ignore"):
        z = _mix64(keys + (counters + _ONE) * _WEYL)
    return (z >> _S40).astype(np.float32) * np.float32(2.0**-24)

"""A request's state as the engine sees it: tokens, how many are in the KV cache, its blocks."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engc.runtime.sampling import Sampled, SamplingParams, make_draw_key, make_generator

_ids = itertools.count()
IN_FLIGHT = -1  # stands in for a token id still on the device; the executor overwrites it before use
                # (negative, so on the CPU a missed one fails loudly in the embedding lookup)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_FINISHED = Status.FINISHED   # a module global reads faster than an enum member, and `finished` is read often


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0                         # lower runs first
    session_id: str | None = None             # a chat whose KV blocks outlive this request
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    num_in_flight: int = 0                    # sampled on the device, not read back yet (overlapped steps)
    num_computed: int = 0                     # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain over full computed blocks
    num_cached_tokens: int | None = None      # prompt tokens found in the prefix cache at first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None          # "stop" | "length" | "abort"
    stop_string: str | None = None            # the stop string that ended it, if one did
    output_text: str = ""
    logprobs: list[Sampled] = field(default_factory=list)
    prompt_logprobs: list[Sampled | None] = field(default_factory=list)   # runtime/scoring.py fills them
    generator: torch.Generator | None = None  # the host sampler's draws (sample_row)
    draw_key: int = field(default=0, repr=False)   # the device sampler's draws: sampling.uniforms of the key
    draws: int = 0                            # and of how many uniforms the device sampler drew before
    arrival: int = field(default_factory=lambda: next(_ids))
    constraint: object | None = None          # a constrained.Constraint (the request's grammar)
    _seen: tuple[set[int], int] | None = field(default=None, repr=False)   # seen_ids and the outputs in it

    def __post_init__(self):
        self.generator = make_generator(self.params.seed)
        self.draw_key = make_draw_key(self.params.seed)

    def seen_ids(self) -> set[int]:
        """The distinct ids of the prompt and the output (a repetition penalty's), kept as outputs arrive:
        a 4k-token prompt's set is not rebuilt every step."""
        seen, n = self._seen or (set(self.prompt_ids), 0)
        seen.update(self.output_ids[n:])
        self._seen = (seen, len(self.output_ids))
        return seen

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step needs one token).

        A token still in flight reads as IN_FLIGHT; the executor takes its id from the device.
        """
        p = len(self.prompt_ids)
        if start >= p + len(self.output_ids):   # all in flight: an overlapped decode step's row
            return [IN_FLIGHT] * (end - start)
        if start >= p:
            ids = self.output_ids[start - p:end - p]
        else:
            ids = self.prompt_ids[start:end] + self.output_ids[:max(0, end - p)]
        missing = end - start - len(ids)
        return ids + [IN_FLIGHT] * missing if missing else ids

    @property
    def token_ids(self) -> list[int]:
        """The known tokens: never an in-flight one, so prefix-cache hashes see real ids only."""
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        """Known and in-flight: what the scheduler plans with."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_in_flight

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache: the prompt (or its rest) at first, then the last sample."""
        return len(self.prompt_ids) + len(self.output_ids) + self.num_in_flight - self.num_computed   # num_tokens

    @property
    def ends_in_flight(self) -> bool:
        """Its token in flight is its last (max_tokens): reading it finishes the sequence, so no step needs
        to run that token through the model (the step would compute a token only to drop it)."""
        return self.num_in_flight > 0 and len(self.output_ids) + self.num_in_flight >= self.params.max_tokens

    @property
    def finished(self) -> bool:
        return self.status is _FINISHED

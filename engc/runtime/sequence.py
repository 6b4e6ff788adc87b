"""A request's state as the engine sees it: tokens, how many are in the KV cache, its blocks."""
from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field

import torch

from engc.runtime.sampling import Sampled, SamplingParams, make_generator

_ids = itertools.count()


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    prompt_ids: list[int]
    params: SamplingParams
    priority: int = 0                         # lower runs first
    session_id: str | None = None             # a chat whose KV blocks outlive this request
    request_id: str = field(default_factory=lambda: f"seq-{next(_ids)}")
    output_ids: list[int] = field(default_factory=list)
    num_computed: int = 0                     # tokens whose K/V are in the cache
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache chain over full computed blocks
    num_cached_tokens: int | None = None      # prompt tokens found in the prefix cache at first admission
    status: Status = Status.WAITING
    finish_reason: str | None = None          # "stop" | "length" | "abort"
    stop_string: str | None = None            # the stop string that ended it, if one did
    output_text: str = ""
    emitted: int = 0                          # chars of output_text already streamed
    logprobs: list[Sampled] = field(default_factory=list)
    generator: torch.Generator | None = None
    arrival: int = field(default_factory=lambda: next(_ids))

    def __post_init__(self):
        self.generator = make_generator(self.params.seed)

    def tokens(self, start: int, end: int) -> list[int]:
        """token_ids[start:end] without building the whole list (a decode step needs one token)."""
        p = len(self.prompt_ids)
        if start >= p:
            return self.output_ids[start - p:end - p]
        return self.prompt_ids[start:end] + self.output_ids[:max(0, end - p)]

    @property
    def token_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def num_pending(self) -> int:
        """Tokens not yet in the KV cache: the prompt (or its rest) at first, then the last sample."""
        return self.num_tokens - self.num_computed

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

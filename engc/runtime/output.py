"""OutputProcessor: a sampled token becomes a sequence's output. It appends the token, advances the
sequence's constraint, detokenizes (IncrementalDecoder), ends the sequence at an end token, a stop token,
a stop string, its constraint's end, max_tokens or the context, and returns what a stream may show now
(StepOutput).

The streaming state (each live sequence's decoder and how much of its text was streamed) lives here;
the text itself (Sequence.output_text, stop_string, logprobs) stays on the Sequence, the request's result
that callers read."""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Callable

from engc.runtime.sampling import Sampled
from engc.runtime.sequence import Sequence
from engc.runtime.tokenizer import IncrementalDecoder, Tokenizer


@dataclass(slots=True)
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    logprobs: list = field(default_factory=list)   # the new tokens' Sampled, when logprobs were asked
    prompt_logprobs: list | None = None            # with the first token, when prompt_logprobs were asked


@dataclass(slots=True)
class Stream:
    """A live sequence's streaming state, and what its parameters fix, worked out once at add()."""
    decoder: IncrementalDecoder
    ends: frozenset[int]         # tokens that end the text: the end tokens (unless ignore_eos) and stop tokens
    room: int                    # tokens the context holds after the prompt
    stops: re.Pattern | None     # the stop strings, None without
    finals: frozenset[str]       # their last characters: new text without one completes none
    hold: int = 0                # chars a stream holds back: a stop string may start in them (its length - 1)
    emitted: int = 0             # chars of output_text already streamed


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_context: int, finish: Callable[[Sequence, str], None]):
        """finish(seq, reason): the engine ends a sequence (its blocks freed, its request forgotten)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        self.max_context = max_context
        self.finish = finish
        self.streams: dict[Sequence, Stream] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        ends = frozenset(p.stop_token_ids) | (frozenset() if p.ignore_eos else self.eos_token_ids)
        self.streams[seq] = Stream(IncrementalDecoder(self.tokenizer, seq.prompt_ids), ends,
                                   self.max_context - len(seq.prompt_ids), _stop_pattern(tuple(p.stop)),
                                   frozenset(s[-1] for s in p.stop), max(map(len, p.stop), default=1) - 1)

    def drop(self, seq: Sequence) -> None:
        self.streams.pop(seq, None)

    def process(self, seq: Sequence, token: int, sampled: Sampled | None = None) -> StepOutput:
        """sampled: the token's Sampled, where the sequence asked for logprobs."""
        p, out, stream = seq.params, seq.output_ids, self.streams[seq]
        out.append(token)
        if p.logprobs is not None:
            seq.logprobs.append(sampled)
        reason = None
        # a grammar: the token that completes it ends the output with its text; one that cannot continue
        # it (only where the mask was ignored) ends it without, as an end-of-sequence token does
        json = seq.constraint.take(token) if seq.constraint is not None else None
        text_ends = token in stream.ends or json == "broken"   # the token is not part of the answer
        if text_ends or json == "done":
            reason = "stop"
        elif len(out) >= p.max_tokens or len(out) + seq.num_in_flight >= stream.room:   # the context is full
            reason = "length"
        text = ""
        if not text_ends:
            text = stream.decoder.add(token)
            if reason:
                text += stream.decoder.flush()
            if text:
                seq.output_text += text
        if stream.stops is None:   # all new text is streamed at once
            delta = text
            stream.emitted += len(text)
        else:
            # only text added now can complete a stop string (the text before was searched as it came), and
            # only if it holds the string's last character
            if text and not stream.finals.isdisjoint(text) and _hit_stop_string(seq, stream):
                reason = "stop"
            # all but the chars a stop string may start in; at the end, all
            end = len(seq.output_text) - (stream.hold if reason is None else 0)
            delta = ""
            if end > stream.emitted:
                delta = seq.output_text[stream.emitted:end]
                stream.emitted = end
        if reason is not None:
            self.streams.pop(seq, None)
            self.finish(seq, reason)
        first = p.prompt_logprobs is not None and len(out) == 1
        return StepOutput(seq, [token], delta, reason is not None, [sampled] if p.logprobs is not None else [],
                          list(seq.prompt_logprobs) if first else None)


@lru_cache(maxsize=1024)
def _stop_pattern(stops: tuple[str, ...]) -> re.Pattern | None:
    """One search for all the stop strings. It finds the leftmost, and at one place the alternative that comes
    first, so sorted they give the least (place, string), the stop string that ends the text."""
    return re.compile("|".join(map(re.escape, sorted(stops)))) if stops else None


def _hit_stop_string(seq: Sequence, stream: Stream) -> bool:
    """Truncates output_text at the first stop string, if one has appeared (in the text not streamed yet
    or in the stop string's length before it)."""
    hit = stream.stops.search(seq.output_text, max(0, stream.emitted - stream.hold - 1))
    if hit is not None:
        seq.stop_string = hit.group()
        seq.output_text = seq.output_text[:hit.start()]
    return hit is not None


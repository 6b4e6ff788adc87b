"""OutputProcessor: a sampled token becomes a sequence's output. It appends the token, advances the
sequence's constraint, detokenizes (IncrementalDecoder), ends the sequence at an end token, a stop token,
a stop string, its constraint's end, max_tokens or the context, and returns what a stream may show now
(StepOutput).

The streaming state (each live sequence's decoder and how much of its text was streamed) lives here;
the text itself (Sequence.output_text, stop_string, logprobs) stays on the Sequence, the request's result
that callers read."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from engc.runtime.sampling import Sampled
from engc.runtime.sequence import Sequence
from engc.runtime.tokenizer import IncrementalDecoder, Tokenizer


@dataclass
class StepOutput:
    seq: Sequence
    new_token_ids: list[int]
    text_delta: str
    finished: bool
    logprobs: list = field(default_factory=list)   # the new tokens' Sampled, when logprobs were asked
    prompt_logprobs: list | None = None            # with the first token, when prompt_logprobs were asked


@dataclass
class Stream:
    decoder: IncrementalDecoder
    emitted: int = 0   # chars of output_text already streamed


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer, max_context: int, finish: Callable[[Sequence, str], None]):
        """finish(seq, reason): the engine ends a sequence (its blocks freed, its request forgotten)."""
        self.tokenizer = tokenizer
        self.eos_token_ids = tokenizer.eos_token_ids
        self.max_context = max_context
        self.finish = finish
        self.streams: dict[Sequence, Stream] = {}

    def add(self, seq: Sequence) -> None:
        self.streams[seq] = Stream(IncrementalDecoder(self.tokenizer, seq.prompt_ids))

    def drop(self, seq: Sequence) -> None:
        self.streams.pop(seq, None)

    def process(self, seq: Sequence, s: Sampled) -> StepOutput:
        p, token = seq.params, s.token
        seq.output_ids.append(token)
        if p.logprobs is not None:
            seq.logprobs.append(s)
        reason = None
        # a grammar: the token that completes it ends the output with its text; one that cannot continue
        # it (only where the mask was ignored) ends it without, as an end-of-sequence token does
        json = seq.constraint.take(token) if seq.constraint is not None else None
        text_ends = ((not p.ignore_eos and token in self.eos_token_ids) or token in p.stop_token_ids
                     or json == "broken")   # the token is not part of the answer
        if text_ends or json == "done":
            reason = "stop"
        elif len(seq.output_ids) >= p.max_tokens or seq.num_tokens >= self.max_context:
            reason = "length"
        stream = self.streams[seq]
        if not text_ends:
            seq.output_text += stream.decoder.step([token]) + (stream.decoder.flush() if reason else "")
        if p.stop and _hit_stop_string(seq, stream.emitted):
            reason = "stop"
        delta = _release_text(seq, stream, reason is not None)
        if reason is not None:
            self.streams.pop(seq, None)
            self.finish(seq, reason)
        first = p.prompt_logprobs is not None and len(seq.output_ids) == 1
        return StepOutput(seq, [s.token], delta, reason is not None, [s] if p.logprobs is not None else [],
                          list(seq.prompt_logprobs) if first else None)


def _hit_stop_string(seq: Sequence, emitted: int) -> bool:
    """Truncates output_text at the first stop string, if one has appeared (in the text not streamed yet
    or in the stop string's length before it)."""
    stops = seq.params.stop
    start = max(0, emitted - _longest(stops))
    hits = [(i, s) for s in stops if (i := seq.output_text.find(s, start)) >= 0]
    if hits:
        i, seq.stop_string = min(hits)
        seq.output_text = seq.output_text[:i]
    return bool(hits)


def _release_text(seq: Sequence, stream: Stream, finished: bool) -> str:
    """The text a stream may show now: all of it at the end, else all but a possible stop-string start."""
    end = len(seq.output_text)
    if not finished and seq.params.stop:
        end = max(stream.emitted, end - _longest(seq.params.stop) + 1)
    delta = seq.output_text[stream.emitted:end]
    stream.emitted = end
    return delta


def _longest(stops) -> int:
    return max(map(len, stops))

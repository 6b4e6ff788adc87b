"""A JSON constraint that starts where the output calls for it: strict function calls under tool_choice "auto".

With "auto" the model may answer in prose or call a function; a strict function's arguments must still follow
its schema. So the output stays free until it starts a call, and from there until the call's value closes it
is constrained like a json_schema answer (json_mode's masks, the same grammar), then free again. A call starts
- where the text reaches a trigger (`<tool_call>`, Hermes/Qwen): blanks may follow, then the value; or
- at the start of the answer (at_start: Llama 3.x and engc's own instructions, whose calls are the whole
  answer): a first visible character `{` or `[` opens the value, any other leaves the answer free. A call
  of this kind is the answer, so its end ends the output.
Masks: free steps have none (the row still samples on the host, as every constrained row does); the first
step of an at_start answer allows every token except those whose first visible character opens a value that
the grammar refuses (cached per grammar); after a trigger, blank tokens (a few) or those that start the value.
"""
from __future__ import annotations

import torch

from engc.runtime.constrained.json_mode import BLANKS, DONE, JsonConstraint, JsonVocab, walk

LEAD_BLANKS = 8   # blank characters allowed between a trigger and its value


class TriggeredConstraint:
    def __init__(self, vocab: JsonVocab, grammar, triggers: tuple[str, ...] = (), at_start: bool = False):
        self.vocab, self.grammar, self.triggers = vocab, grammar, tuple(t for t in triggers if t)
        self.phase = "start" if at_start else "free"   # start | free | lead (after a trigger) | value
        self.whole = False                               # the value is the whole answer (at_start)
        self.inner: JsonConstraint | None = None
        self.tail = ""                                   # free text a trigger may still end in
        self.keep = max((len(t) for t in self.triggers), default=1) - 1   # how much of it: one short of a trigger
        self.blanks = 0

    def allowed(self) -> torch.Tensor | None:
        if self.phase == "value":
            return self.inner.allowed()
        if self.phase == "lead":
            start = self.vocab.mask(self.grammar.start, self.grammar)
            return start | self.vocab.blank_only if self.blanks < LEAD_BLANKS else start
        if self.phase == "start":
            return self._start_mask()
        return None

    def take(self, token: int) -> str | None:
        """As JsonConstraint.take: "done" ends the answer, "broken" drops the token and ends it, None goes on."""
        text = self.vocab.texts[token] if 0 <= token < self.vocab.size else ""
        if self.phase == "value":
            result = self.inner.take(token)
            return self._closed() if result == "done" else result
        if self.phase == "start":
            solid = text.lstrip(BLANKS)
            if not solid:
                return None
            if solid[0] in "{[":
                self.whole = True
                return self._open(solid)
            self.phase = "free"
        if self.phase == "lead":
            return self._lead(text)
        return self._free(text)

    def _free(self, text: str) -> str | None:
        seen = self.tail + text
        hits = [(seen.find(t), t) for t in self.triggers if t in seen]
        if not hits:
            self.tail = seen[-self.keep:] if self.keep else ""
            return None
        at, trigger = min(hits)
        self.phase, self.blanks, self.tail = "lead", 0, ""
        return self._lead(seen[at + len(trigger):])

    def _lead(self, text: str) -> str | None:
        rest = text.lstrip(BLANKS)
        self.blanks += len(text) - len(rest)
        return self._open(rest) if rest else None

    def _open(self, text: str) -> str | None:
        """Start the value with `text` (its first characters): constrained from here. Text the mask did not
        vouch for (a token that was sampled free and ran on past the trigger) is walked; if the grammar
        refuses it, the call stays free (the answer is still read for calls afterwards)."""
        self.inner = JsonConstraint(self.vocab, self.grammar)
        state = walk(self.grammar.start, text, self.grammar)
        if state is None:
            self.phase, self.inner = "free", None
            return None
        self.inner.state = state
        if state[0] == DONE:
            return self._closed()
        self.phase = "value"
        return None

    def _closed(self) -> str | None:
        """The value just closed: the answer ends if it was the whole answer, else the text is free again."""
        if self.whole:
            return "done"
        self.phase, self.inner, self.tail = "free", None, ""
        return None

    def _start_mask(self) -> torch.Tensor:
        """Every token but those whose first visible character opens a value the grammar cannot start with."""
        def compute():
            m = torch.ones(self.vocab.size, dtype=torch.bool)
            m[[i for ch in "{[" for i in self.vocab.by_first_solid.get(ch, [])
               if walk(self.grammar.start, self.vocab.texts[i].lstrip(BLANKS), self.grammar) is None]] = False
            return m
        return self.vocab.cached((self.grammar, "triggered-start"), compute)

"""JSON mode (`response_format: {"type": "json_object"}`): the sampler may only pick tokens that keep the
output a prefix of one JSON object (RFC 8259), and the sequence ends when that object closes.

A character automaton reads the output; its state is a hashable tuple (mode, aux, stack), so the mask of
allowed tokens is computed once per state and reused (a document revisits few states: "in a string value
at depth 2" is one state however long the string). A token is allowed if the automaton accepts every one
of its characters. Walking the whole vocabulary for each new state would be slow in Python, so:
- in a string, tokens without '"', '\\' or control characters are always allowed (one precomputed mask),
  and only the others are walked;
- between values, whitespace changes nothing, so tokens are bucketed by their first non-blank character
  and only the buckets the state accepts are walked (blank-only tokens are allowed, up to blank_limit
  characters in a row, so a model cannot spend its tokens on newlines).
Token texts come from decoding each token after an anchor token (a lone token's leading space can
vanish in decoding); bytes of a character split across tokens read as U+FFFD, which a string accepts.
"""
from __future__ import annotations

import bisect
from collections import OrderedDict, defaultdict

import torch

BLANKS = " \t\n\r"
CACHE_STATES = 256               # masks kept (a vocabulary-sized bool tensor each)
LITERALS = {"t": "rue", "f": "alse", "n": "ull"}
NUMBER_NEXT = {                  # number sub-state -> {character class: next sub-state}
    "minus": {"0": "zero", "1": "int"}, "zero": {".": "dot", "e": "e"}, "int": {"d": "int", ".": "dot", "e": "e"},
    "dot": {"d": "frac"}, "frac": {"d": "frac", "e": "e"}, "e": {"+": "sign", "d": "exp"}, "sign": {"d": "exp"},
    "exp": {"d": "exp"}}
NUMBER_ENDS = {"zero", "int", "frac", "exp"}
# modes where blanks are allowed and change nothing (between tokens of the grammar); not before the object:
# the answer starts with its '{' (JSON allows blanks there, but they would only cost tokens)
BETWEEN = {"value", "value_or_close", "key", "key_or_close", "colon", "comma_or_close"}
START = ("start", None, ())
DONE = "done"


def blank_limit(depth: int) -> int:
    """Blank characters allowed in a row outside strings at a nesting depth: a pretty-printed document's
    newline and indent (4 spaces a level) fit; more would only spend tokens (a random model's greedy
    answer spent 64 of them at each gap under a fixed cap of 64)."""
    return 8 + 4 * depth


def plain(text: str) -> bool:
    """Whether a string's characters stand for themselves inside a JSON string (no quote, backslash or
    control character)."""
    return not any(c in '"\\' or ord(c) < 0x20 for c in text)


def _number_class(ch: str) -> str:
    if ch == "0":
        return "0"
    if ch.isascii() and ch.isdigit():
        return "1"
    return {"e": "e", "E": "e", "+": "+", "-": "+", ".": "."}.get(ch, "?")


def number_start(ch: str) -> str | None:
    """A number's first sub-state, or None where ch cannot start one."""
    if ch == "-":
        return "minus"
    cls = _number_class(ch)
    return "zero" if cls == "0" else "int" if cls == "1" else None


def number_next(sub: str, ch: str, integer: bool = False) -> str | None:
    """A number's sub-state after one more character, or None where the number cannot take it (an integer
    has no fraction or exponent)."""
    cls = _number_class(ch)
    cls = "d" if cls in "01" and sub != "minus" else cls
    return None if integer and cls in ".e" else NUMBER_NEXT[sub].get(cls)


def _after_value(stack: tuple) -> tuple:
    return (DONE, None, ()) if not stack else ("comma_or_close", None, stack)


def _after_first_special(text: str) -> str | None:
    """The text after its first quote, backslash or control character where that character is a quote
    (inside a string it closes it), else None."""
    at = next(i for i, c in enumerate(text) if c in '"\\' or ord(c) < 0x20)
    return text[at + 1:] if text[at] == '"' else None


def step(state: tuple, ch: str) -> tuple | None:
    """The state after one more character, or None if no JSON object text continues that way."""
    mode, aux, stack = state
    if mode == "string":
        if ch == '"':
            return ("colon", None, stack) if aux else _after_value(stack)
        if ch == "\\":
            return ("escape", aux, stack)
        return None if ord(ch) < 0x20 else state
    if mode == "escape":
        if ch in '"\\/bfnrt':
            return ("string", aux, stack)
        return ("unicode", (aux, 4), stack) if ch == "u" else None
    if mode == "unicode":
        if ch not in "0123456789abcdefABCDEF":
            return None
        is_key, left = aux
        return ("string", is_key, stack) if left == 1 else ("unicode", (is_key, left - 1), stack)
    if mode == "number":
        nxt = number_next(aux, ch)
        if nxt is not None:
            return ("number", nxt, stack)
        return step(_after_value(stack), ch) if aux in NUMBER_ENDS else None
    if mode == "literal":
        if ch != aux[0]:
            return None
        return ("literal", aux[1:], stack) if len(aux) > 1 else _after_value(stack)
    if mode == DONE:
        return None
    if mode == "start":
        return ("key_or_close", None, ("{",)) if ch == "{" else None
    if ch in BLANKS:
        return state
    if mode in ("key", "key_or_close"):
        if ch == '"':
            return ("string", True, stack)
        return _after_value(stack[:-1]) if ch == "}" and mode == "key_or_close" else None
    if mode == "colon":
        return ("value", None, stack) if ch == ":" else None
    if mode == "comma_or_close":
        if ch == ",":
            return ("key" if stack[-1] == "{" else "value", None, stack)
        return _after_value(stack[:-1]) if ch == "}]"[stack[-1] == "["] else None
    if mode == "value_or_close" and ch == "]":
        return _after_value(stack[:-1])
    return _start_value(ch, stack)


def _start_value(ch: str, stack: tuple) -> tuple | None:
    if ch == "{":
        return ("key_or_close", None, stack + ("{",))
    if ch == "[":
        return ("value_or_close", None, stack + ("[",))
    if ch == '"':
        return ("string", False, stack)
    if ch in LITERALS:
        return ("literal", LITERALS[ch], stack)
    sub = number_start(ch)
    return ("number", sub, stack) if sub else None


def walk(state: tuple | None, text: str, grammar=None) -> tuple | None:
    go = grammar.step if grammar is not None else step
    for ch in text:
        if state is None:
            return None
        state = go(state, ch)
    return state


class ObjectGrammar:
    """Any JSON object (json_object mode). A grammar is what JsonVocab and JsonConstraint drive: a start
    state, step, and kind(state): 'string' where characters other than '"', '\\' and controls keep the
    state, 'between' where blanks keep it, 'other' elsewhere (json_schema.SchemaGrammar is the other one)."""
    start = START

    @staticmethod
    def step(state: tuple, ch: str) -> tuple | None:
        return step(state, ch)

    @staticmethod
    def kind(state: tuple) -> str:
        return "string" if state[0] == "string" else "between" if state[0] in BETWEEN else "other"

    @staticmethod
    def depth(state: tuple) -> int:
        return len(state[2])

    @staticmethod
    def choices(state: tuple) -> tuple[str, ...] | None:
        """The texts one of which must come next, where only constant texts can (the rest of true/false/null)."""
        return (state[1],) if state[0] == "literal" else None


OBJECT = ObjectGrammar()


class JsonVocab:
    """A tokenizer's token texts, sorted for the mask computation; built once per engine."""

    def __init__(self, texts: list[str]):
        self.texts = texts
        self.size = len(texts)
        is_plain = [bool(t) and plain(t) for t in texts]
        self.plain = torch.tensor(is_plain, dtype=torch.bool)
        self.not_plain = [i for i, t in enumerate(texts) if t and not is_plain[i]]
        # what follows the first special character of each, where that character is a quote (it closes a
        # string): tokens sharing it share their validity in a string state
        self.after_quote = [_after_first_special(texts[i]) for i in self.not_plain]
        self.blank_only = torch.tensor([bool(t) and not t.strip(BLANKS) for t in texts], dtype=torch.bool)
        self.blank_led = torch.tensor([bool(t) and t[0] in BLANKS for t in texts], dtype=torch.bool)
        self.by_first: dict[str, list[int]] = defaultdict(list)       # first character
        self.by_first_solid: dict[str, list[int]] = defaultdict(list)  # first non-blank one
        self.by_text: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(texts):
            if t:
                self.by_first[t[0]].append(i)
                self.by_text[t].append(i)
                solid = t.lstrip(BLANKS)
                if solid:
                    self.by_first_solid[solid[0]].append(i)
        self.sorted_texts = sorted(self.by_text)   # for the tokens that start with one of a state's choices
        self._masks: OrderedDict[tuple, torch.Tensor] = OrderedDict()

    def mask(self, state: tuple, grammar=OBJECT) -> torch.Tensor:
        """The tokens allowed in `state` of `grammar` (a bool tensor over the vocabulary), cached per state."""
        return self.cached((grammar, state), lambda: self._compute(state, grammar))

    def cached(self, key, compute) -> torch.Tensor:
        """The mask cached under `key`, computed by compute() at its first use (the last CACHE_STATES kept)."""
        m = self._masks.get(key)
        if m is None:
            m = compute()
            self._masks[key] = m
            if len(self._masks) > CACHE_STATES:
                self._masks.popitem(last=False)
        else:
            self._masks.move_to_end(key)
        return m

    def _compute(self, state: tuple, grammar) -> torch.Tensor:
        choices = grammar.choices(state)
        if choices:
            return self._compute_choices(state, grammar, choices)
        kind, go = grammar.kind(state), grammar.step
        if kind == "string":
            return self._compute_string(state, grammar)
        if kind == "between":
            allowed = self.blank_only.clone()
            candidates = [i for ch, ids in self.by_first_solid.items() if go(state, ch) is not None for i in ids]
        else:
            allowed = torch.zeros(self.size, dtype=torch.bool)
            firsts = [ch for ch in self.by_first if go(state, ch) is not None]
            after_blank = go(state, " ")
            if after_blank is not None and grammar.kind(after_blank) == "between":
                # a blank ends a number: blank-led tokens read on as in the state after it (65% of
                # SmolLM2's tokens start with a blank; walking each took ~70 ms a number state)
                allowed |= self.mask(after_blank, grammar) & self.blank_led
                firsts = [ch for ch in firsts if ch not in BLANKS]
            candidates = [i for ch in firsts for i in self.by_first[ch]]
        for i in candidates:
            if walk(state, self.texts[i], grammar) is not None:
                allowed[i] = True
        return allowed

    def _compute_string(self, state: tuple, grammar) -> torch.Tensor:
        """Inside a string: plain tokens keep it; a token whose first special character is the closing quote
        is valid if what follows the quote is valid after it, decided once per distinct rest (most such
        tokens end in '",' or '":' and the like); the others (escapes, control characters) are walked."""
        allowed = self.plain.clone()
        closed = grammar.step(state, '"')
        seen: dict[str, bool] = {}
        ok = []
        for i, rest in zip(self.not_plain, self.after_quote):
            if rest is None:
                good = walk(state, self.texts[i], grammar) is not None
            else:
                good = seen.get(rest)
                if good is None:
                    good = seen[rest] = closed is not None and (not rest or walk(closed, rest, grammar) is not None)
            if good:
                ok.append(i)
        allowed[ok] = True
        return allowed

    def _compute_choices(self, state: tuple, grammar, choices: tuple[str, ...]) -> torch.Tensor:
        """A state whose next characters can only be one of `choices` (the rest of a key, a literal, a tag):
        the tokens that are a prefix of one, and those that start with one and read on (found by bisection,
        then walked). Walking every token with a possible first character took 10-40 ms a state at SmolLM2's
        vocabulary, 20-34 ms with two alternatives at a 128k one."""
        allowed = torch.zeros(self.size, dtype=torch.bool)
        for text in choices:
            for k in range(1, len(text)):
                allowed[self.by_text.get(text[:k], [])] = True
            at = bisect.bisect_left(self.sorted_texts, text)
            while at < len(self.sorted_texts) and self.sorted_texts[at].startswith(text):
                token = self.sorted_texts[at]
                if walk(state, token, grammar) is not None:
                    allowed[self.by_text[token]] = True
                at += 1
        return allowed


class JsonConstraint:
    """One sequence's JSON-mode state: the mask for its next token, advanced by each token it takes.
    grammar: OBJECT (any JSON object) or a json_schema.SchemaGrammar."""

    def __init__(self, vocab: JsonVocab, grammar=OBJECT):
        self.vocab, self.grammar, self.state, self.blanks = vocab, grammar, grammar.start, 0

    @property
    def done(self) -> bool:
        return self.state[0] == DONE

    def allowed(self) -> torch.Tensor:
        m = self.vocab.mask(self.state, self.grammar)
        if self.grammar.kind(self.state) == "between" and self.blanks >= blank_limit(self.grammar.depth(self.state)):
            m = m & ~self.vocab.blank_only
        return m

    def take(self, token: int) -> str | None:
        """Advance by the token the sequence took. "done": it closed the object; "broken": it does not
        continue it (the mask was empty, a vocabulary without the characters needed; or an end-of-sequence
        token), so the output ends before it; None: go on."""
        text = self.vocab.texts[token] if 0 <= token < self.vocab.size else ""
        state = walk(self.state, text, self.grammar) if text else None
        if state is None:
            return "broken"
        between = self.grammar.kind(state) == "between"
        if between and not text.strip(BLANKS):
            self.blanks += len(text)
        else:   # blanks that end a token in a between-values state are outside strings
            self.blanks = len(text) - len(text.rstrip(BLANKS)) if between else 0
        self.state = state
        return "done" if self.done else None

"""JSON mode (`response_format: {"type": "json_object"}`): the sampler may only pick tokens that keep the
output a prefix of one JSON object (RFC 8259), and the sequence ends when that object closes.

A character automaton reads the output; its state is a hashable tuple (mode, aux, stack), so the mask of
allowed tokens is computed once per state and reused (a document revisits few states: "in a string value
at depth 2" is one state however long the string). A token is allowed if the automaton accepts every one
of its characters. Walking the whole vocabulary for each new state would be slow in Python, so:
- in a string, tokens without '"', '\\' or control characters are always allowed (one precomputed mask),
  and only the others are walked;
- elsewhere the sorted token texts are walked as a trie: a prefix is stepped once for every token that
  starts with it, and a refused one rules them all out; between values, where whitespace changes nothing,
  only the runs of texts whose first non-blank character the state takes are walked (blank-only tokens are
  allowed, up to blank_limit characters in a row, so a model cannot spend its tokens on newlines).
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


def _run_end(texts: list[str], prefix: str, ch: str, lo: int, hi: int) -> int:
    """Where the run of sorted texts[lo:hi] that start with prefix + ch ends."""
    return hi if ch == "\U0010ffff" else bisect.bisect_left(texts, prefix + chr(ord(ch) + 1), lo, hi)


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
        self.by_first_solid: dict[str, list[int]] = defaultdict(list)  # by first non-blank character
        self.by_text: dict[str, list[int]] = defaultdict(list)
        for i, t in enumerate(texts):
            if t:
                self.by_text[t].append(i)
                solid = t.lstrip(BLANKS)
                if solid:
                    self.by_first_solid[solid[0]].append(i)
        self.sorted_texts = sorted(self.by_text)   # the distinct texts, walked as a trie (_compute_trie)
        # for states between values, where blanks change nothing: the blank-only texts (as sorted positions), and
        # for each first solid character c the runs of texts that are blanks P then c, as (P, start, end)
        self.blank_positions: list[int] = []
        self.solid_runs: dict[str, list[tuple[str, int, int]]] = defaultdict(list)
        for k, t in enumerate(self.sorted_texts):
            solid = t.lstrip(BLANKS)
            if not solid:
                self.blank_positions.append(k)
                continue
            blanks = t[:len(t) - len(solid)]
            runs = self.solid_runs[solid[0]]
            if runs and runs[-1][0] == blanks and runs[-1][2] == k:
                runs[-1] = (blanks, runs[-1][1], k + 1)
            else:
                runs.append((blanks, k, k + 1))
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
        if choices and all(choices):   # only these texts can come next: only their first characters' runs
            return self._compute_trie(state, grammar, {text[0] for text in choices})
        if grammar.kind(state) == "string":
            return self._compute_string(state, grammar)
        return self._compute_trie(state, grammar)

    def _compute_trie(self, state: tuple, grammar, firsts: set[str] | None = None) -> torch.Tensor:
        """Every token whose text the grammar accepts from `state` (only those starting with one of `firsts`,
        where given), by one walk over the sorted texts read as a trie: the texts that share a prefix are a run
        of the sorted list (its end found by bisection), so a prefix is stepped once for all of them, and one
        the grammar refuses rules them all out at once, where a token-by-token walk would step every token that
        shares it (bench/json_masks.py times the masks)."""
        texts, go, ok, n, valid = self.sorted_texts, grammar.step, [], len(self.sorted_texts), {}
        runs = ([(state, "", 0, n)] if firsts is None else
                [(state, "", bisect.bisect_left(texts, ch), _run_end(texts, "", ch, 0, n)) for ch in firsts])
        while runs:
            at, prefix, lo, hi = runs.pop()
            depth = len(prefix)
            if not prefix.strip(BLANKS) and grammar.kind(at) == "between":
                # blanks keep the state: every blank-only text here is allowed, and of the rest only the runs
                # of texts whose first solid character the state takes are walked on (~500 of those
                # characters, not every child of every blank prefix)
                blanks = self.blank_positions
                ok += blanks[bisect.bisect_left(blanks, lo):bisect.bisect_left(blanks, hi)]
                chars = valid.get(at)
                if chars is None:
                    chars = valid[at] = [(ch, nxt) for ch in self.solid_runs if (nxt := go(at, ch)) is not None]
                for ch, nxt in chars:
                    for blank, start, end in self.solid_runs[ch]:
                        if lo <= start and end <= hi:
                            runs.append((nxt, blank + ch, start, end))
                continue
            if lo < hi and len(texts[lo]) == depth:   # the prefix itself is a token (it sorts first)
                ok.append(lo)
                lo += 1
            while lo < hi:
                ch = texts[lo][depth]
                end = _run_end(texts, prefix, ch, lo, hi)
                nxt = go(at, ch)
                if nxt is not None:
                    runs.append((nxt, prefix + ch, lo, end))
                lo = end
        allowed = torch.zeros(self.size, dtype=torch.bool)
        allowed[[i for k in ok for i in self.by_text[texts[k]]]] = True
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

"""Echo and prompt logprobs on /v1/completions, how scoring clients (lm-eval's loglikelihood tasks) read a
model: `echo` puts the prompt's text before the answer, and with `logprobs` its tokens' logprobs before the
answer's (the first token's null: nothing predicts it), as OpenAI's legacy API did; `prompt_logprobs: k`
adds vLLM's list (per prompt token, null first, then {token id: {logprob, rank, decoded_token}} for the
token and the top k). The engine computes them in the prefill (runtime/scoring.py).

`max_tokens: 0` with echo only scores the prompt: the engine runs one token, which the answer leaves out
(text, logprobs and usage), as vLLM does.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace

from engc.runtime.async_engine import Delta
from engc.runtime.sampling import Sampled
from engc.runtime.server.app import APIError


def read_prompts(tokenizer, prompt, echo: bool) -> tuple[list[list[int]], list[str]]:
    """The prompts' token ids, and their texts when echoed (a prompt given as ids decoded); runs off the
    event loop (ServerState.off_loop)."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    id_lists = [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompt]
    if any(not ids for ids in id_lists):
        raise APIError(400, "prompt must not be empty", "prompt")
    texts = [p if isinstance(p, str) else tokenizer.decode(ids, skip_special_tokens=False)
             for p, ids in zip(prompt, id_lists)] if echo else []
    return id_lists, texts


@dataclass
class Echo:
    """What a completion request asked of its prompts, and each choice's prompt logprobs as they arrive."""
    id_lists: list[list[int]]
    texts: list[str]
    n: int
    echo: bool
    logprobs: int | None           # echo with logprobs: the prompt's tokens lead the logprobs, with top k
    vllm: int | None               # prompt_logprobs: k
    scoring_only: bool             # max_tokens 0 with echo
    prompt_logprobs: dict[int, list] = field(default_factory=dict)

    @classmethod
    def of(cls, req, id_lists: list[list[int]], texts: list[str]) -> Echo | None:
        vllm = req.prompt_logprobs
        if vllm is not None and req.stream:
            raise APIError(400, "prompt_logprobs cannot be streamed: send it with stream false", "prompt_logprobs")
        if req.max_tokens == 0 and not req.echo:
            raise APIError(400, "max_tokens 0 only scores the prompt, which needs echo", "max_tokens")
        if not req.echo and vllm is None:
            return None
        return cls(id_lists, texts, req.n, req.echo, req.logprobs if req.echo else None, vllm,
                   req.echo and req.max_tokens == 0)

    @property
    def k(self) -> int | None:
        """SamplingParams.prompt_logprobs: the top logprobs a prompt token needs, or None (none needed)."""
        asked = [k for k in (self.logprobs, self.vllm) if k is not None]
        return max(asked) if asked else None

    def track(self, d: Delta) -> tuple[Delta, tuple[str, list[Sampled]] | None]:
        """The delta as the answer shows it (a scoring-only request's token left out), and on a choice's
        first delta the prompt part an echo streams before it: (text, logprob entries)."""
        first = d.index not in self.prompt_logprobs
        if first or d.prompt_logprobs is not None:
            self.prompt_logprobs[d.index] = d.prompt_logprobs or []
        if self.scoring_only:
            d = replace(d, text="", token_ids=[], logprobs=[], completion_tokens=0,
                        finish_reason="length" if d.finished else None, stop_string=None)
        return d, (self.head(d.index) if first and self.echo else None)

    def head(self, index: int) -> tuple[str, list[Sampled]]:
        """The prompt part of a choice: its text, and its tokens as logprob entries (the first without)."""
        ids = self.id_lists[index // self.n]
        scored = self.prompt_logprobs.get(index) or []
        entries = [Sampled(ids[0])] + [s if s is not None else Sampled(t) for s, t in zip(scored[1:], ids[1:])]
        return self.texts[index // self.n], entries

    def vllm_list(self, index: int, decode, number) -> list | None:
        """vLLM's prompt_logprobs of a choice: per prompt token None (the first) or {id: {logprob, rank,
        decoded_token}} for the token and the top k (number: a logprob as JSON can carry it)."""
        if self.vllm is None:
            return None
        out = [None]
        for s in (self.prompt_logprobs.get(index) or [None])[1:]:
            entry = {str(i): {"logprob": number(lp), "rank": r + 1, "decoded_token": decode(i)}
                     for r, (i, lp) in enumerate(s.top[:self.vllm])}
            entry.setdefault(str(s.token), {"logprob": number(s.logprob), "rank": s.rank,
                                            "decoded_token": decode(s.token)})
            out.append(entry)
        return out

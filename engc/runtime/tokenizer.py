"""Tokenizer and chat template from a bundle: `tokenizers` for text, a sandboxed jinja2 for templates.

The chat template is data from the bundle, so it renders in jinja2's immutable sandbox: it can format
messages but cannot reach Python objects or the file system.
"""
from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders

from engc.errors import UserError


class Tokenizer:
    def __init__(self, folder: Path, model_eos_ids: tuple[int, ...] = ()):
        self.tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
        cfg_path = folder / "tokenizer_config.json"
        self.config = json.loads(cfg_path.read_text()) if cfg_path.is_file() else {}
        template_path = folder / "chat_template.jinja"
        self.chat_template = template_path.read_text() if template_path.is_file() else None
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        eos = set(model_eos_ids)
        if self.eos_token and self.tok.token_to_id(self.eos_token) is not None:
            eos.add(self.tok.token_to_id(self.eos_token))
        gen_path = folder / "generation_config.json"
        if gen_path.is_file():
            gen_eos = json.loads(gen_path.read_text()).get("eos_token_id")
            eos.update(gen_eos if isinstance(gen_eos, list) else [gen_eos] if gen_eos is not None else [])
        self.eos_token_ids = frozenset(eos)
        self._template = None
        # A byte-level BPE decoder (GPT-2, Llama 3, Qwen, SmolLM2) reads each token's bytes, joins them and
        # decodes UTF-8, so a token after text that ends in a whole character adds exactly its own text
        self.joins_bytes = isinstance(self.tok.decoder, decoders.ByteLevel)
        self._pieces: dict[int, str] = {}
        self._reads_tools: tuple[str | None, bool] = (None, False)   # (the template searched, whether it reads tools)
        # the batch calls let go of the GIL while they work (encode holds it throughout), so the server's event loop
        # and engine thread run while a worker thread tokenizes a prompt; the fast one (tokenizers >= 0.20) also
        # skips the offsets, which nothing here reads: ~10% less CPU than encode for a 300-token prompt
        self._encode_batch = getattr(self.tok, "encode_batch_fast", self.tok.encode_batch)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def piece(self, token: int) -> str:
        """decode([token]), cached: what the token adds after whole characters where joins_bytes."""
        text = self._pieces.get(token)
        if text is None:
            text = self._pieces[token] = self.tok.decode([token], skip_special_tokens=True)
        return text

    @property
    def reads_tools(self) -> bool:
        """Whether the chat template uses a `tools` variable (it then also writes tool calls and results). Found once
        a template (a search of a few-kB template is 6-50 us, and every chat request asks)."""
        template = self.chat_template
        if self._reads_tools[0] is not template:
            self._reads_tools = template, template is not None and re.search(r"\btools\b", template) is not None
        return self._reads_tools[1]

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None) -> str:
        if self.chat_template is None:
            raise UserError("this model has no chat template; send a plain prompt instead")
        if self._template is None:
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(self.chat_template)
        try:
            extra = {"tools": tools} if tools else {}   # templates test `tools is defined` or `if tools`
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         bos_token=self.bos_token or "", eos_token=self.eos_token or "", **extra)
        except TemplateError as e:
            raise UserError(f"chat template refused the messages: {e}") from None

    def encode_chat(self, messages: list[dict], continue_final: bool = False, tools: list | None = None) -> list[int]:
        # The template writes any BOS itself, as HF's apply_chat_template assumes.
        text = self.continue_chat(messages, tools) if continue_final else self.apply_chat_template(messages, tools=tools)
        return self.encode(text, add_special_tokens=False)

    def continue_chat(self, messages: list[dict], tools: list | None = None) -> str:
        """The conversation with its final message (an assistant's opening words) left open for the model
        to continue: rendered as a finished turn, then cut right after that message's text, so whatever
        the template closes a turn with (an end-of-turn token, a newline) is not in the prompt. Templates
        that trim messages (Llama 3's) drop its outer blanks: the text is found without them, and the
        trailing ones are kept where the template kept them."""
        content = messages[-1]["content"]
        core = content.strip()
        if not core:   # an empty start: the reply starts where a new turn would
            return self.apply_chat_template(messages[:-1], tools=tools)
        text = self.apply_chat_template(messages, add_generation_prompt=False, tools=tools)
        at = text.rfind(core)
        if at < 0:
            raise UserError("the chat template does not write the final message's text as sent, "
                            "so it cannot be continued")
        tail = content.lstrip()
        return text[:at + (len(tail) if text.startswith(tail, at) else len(core))]


def _token_text(value) -> str | None:
    return value.get("content") if isinstance(value, dict) else value


def _raise(message: str):
    raise TemplateError(message)


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas without splitting multi-byte characters.

    Decodes a small window before the new tokens so byte-level merges and leading spaces come out as
    they would in a full decode, and holds back text that ends in an incomplete UTF-8 sequence.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int]):
        self.decode = tokenizer.decode   # bound once: step calls it twice per token
        # Byte-level tokenizers: one cached lookup for a token that follows a whole character, in place of the
        # two decodes (a large share of a decode step's host work at big batches); the same text
        self.piece = tokenizer.piece if tokenizer.joins_bytes else None
        self.ids = list(prompt_ids[-6:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self.whole = False   # whether the text read so far ends in a whole character (known after a delta)

    def add(self, token: int) -> str:
        """step([token]), without the list (a decode step calls this for every sequence)."""
        if self.whole and self.piece is not None and self.read_offset == len(self.ids):
            text = self.piece(token)
            if text and "\ufffd" not in text:   # the token's bytes are whole characters themselves
                self.ids.append(token)
                self.prefix_offset = self.read_offset
                self.read_offset += 1
                return text
        return self._decoded([token])

    def step(self, new_ids: list[int]) -> str:
        return self.add(new_ids[0]) if len(new_ids) == 1 else self._decoded(new_ids)

    def _decoded(self, new_ids: list[int]) -> str:
        self.ids.extend(new_ids)
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        full = self.decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            delta = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self.whole = True
            return delta
        return ""

    def flush(self) -> str:
        """Whatever is still held back when the sequence ends (an incomplete character, as U+FFFD)."""
        full = self.decode(self.ids[self.prefix_offset:])
        prefix = self.decode(self.ids[self.prefix_offset:self.read_offset])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full[len(prefix):]

"""Request bodies of the OpenAI and Anthropic APIs, as pydantic models (the HTTP edge only).

Unknown fields are accepted and ignored, as the reference APIs' SDKs send fields that come and go;
fields engc would have to honour but cannot (images, logit_bias) are refused where used.
Known fields are typed strictly, as JSON Schema types them (the OpenAPI document declares them so):
`"stream": "yes"`, `"max_tokens": "5"` or `"n": 2.5` get a 400 naming the field instead of being coerced; an
integer is a valid number, and a number without a fractional part (`2.0`) a valid integer.
Fields marked "engc" are extensions.
"""
from __future__ import annotations

import functools
from typing import Annotated, Literal, Optional, Union, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Body(BaseModel):
    # allow_inf_nan: JSON has no NaN or Infinity (Python's parser reads them, and 1e400 as inf)
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _integral_numbers(cls, data):
        """JSON has one number type, and JSON Schema's "integer" is any number without a fractional part, so
        in an integer field (or a list of them) 2.0 is 2; 2.5 stays refused."""
        if isinstance(data, dict):
            ints = _integer_fields(cls)
            if any(isinstance(v, (float, list)) for k, v in data.items() if k in ints):
                data = {k: _integral(v) if k in ints else v for k, v in data.items()}
        return data


@functools.cache
def _integer_fields(model: type[BaseModel]) -> frozenset[str]:
    """The body names of a model's fields typed with int (not bool) and never float."""
    def leaves(t):
        args = get_args(t)
        return {x for a in args for x in leaves(a)} if args else {t}
    return frozenset(f.alias or name for name, f in model.model_fields.items()
                     if int in leaves(f.annotation) and float not in leaves(f.annotation))


def _integral(value):
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return [_integral(v) for v in value] if isinstance(value, list) else value


def _text_parts_only(content):
    """A message's content list may hold text parts only: an image (or any other part) gets one line that
    names it, not the union's "should be a valid string" for the string form it was not meant to be."""
    if isinstance(content, list):
        for part in content:
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text":
                raise ValueError(f"content parts of type {kind!r} are not supported: this server takes text only")
    return content


# --- OpenAI ----------------------------------------------------------------------------------------

class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: Union[str, list[TextPart], None] = None
    name: Optional[str] = None
    tool_calls: Optional[list[dict]] = None    # an assistant's earlier calls
    tool_call_id: Optional[str] = None         # a tool message's call

    _text_only = field_validator("content", mode="before")(_text_parts_only)


class StreamOptions(_Body):
    include_usage: bool = False


class ResponseFormat(_Body):
    type: Literal["text", "json_object", "json_schema", "regex", "regex_schema", "choice", "grammar"]
    json_schema: Optional[dict] = None   # {"name": ..., "schema": {...}, "strict": ...} with type json_schema
    regex: Optional[str] = None          # engc: with type regex (LMDeploy's regex_schema too)
    regex_schema: Optional[str] = None
    choice: Optional[list[str]] = None   # engc: with type choice
    grammar: Optional[str] = None        # engc: with type grammar, a Lark or GBNF grammar
    syntax: Optional[Literal["lark", "regex"]] = None   # OpenAI's grammar shape: type grammar, syntax, definition
    definition: Optional[str] = None


class StructuredOutputs(_Body):
    """vLLM's structured_outputs: one of these (runtime/server/formats.py)."""
    json_: Union[dict, str, None] = Field(None, alias="json")
    regex: Optional[str] = None
    choice: Optional[list[str]] = None
    grammar: Optional[str] = None
    json_object: Optional[bool] = None
    structural_tag: Union[dict, str, None] = None   # refused: engc reads tool calls through `tools`


class _OpenAISampling(_Body):
    model: str
    temperature: Optional[float] = Field(None, ge=0, le=2)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=-1, description="engc: 0 or -1 is off")
    min_p: Optional[float] = Field(None, ge=0, le=1, description="engc: 0 is off")
    n: int = Field(1, ge=1, le=16)
    stop: Union[str, list[str], None] = None
    seed: Optional[int] = None
    presence_penalty: float = Field(0.0, ge=-2, le=2)
    frequency_penalty: float = Field(0.0, ge=-2, le=2)
    repetition_penalty: float = Field(1.0, gt=0, description="engc: HF-style, over prompt and output")
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    user: Optional[str] = None
    ignore_eos: bool = Field(False, description="engc: keep generating past end-of-sequence")
    priority: int = Field(0, description="engc: lower runs first")
    session_id: Optional[str] = Field(None, description="engc: keep this chat's KV cache between requests")
    structured_outputs: Optional[StructuredOutputs] = Field(None, description="vLLM's: the answer's format")
    guided_json: Union[dict, str, None] = Field(None, description="vLLM's older spelling of structured_outputs")
    guided_regex: Optional[str] = None
    guided_choice: Optional[list[str]] = None
    guided_grammar: Optional[str] = None


class ChatCompletionRequest(_OpenAISampling):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = Field(None, ge=0, le=20)
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list] = None
    tool_choice: Union[Literal["none", "auto", "required"], dict, None] = None
    parallel_tool_calls: Optional[bool] = None   # accepted: a forced call is one call; "auto" reads all it finds
    continue_final_message: bool = Field(False, description="engc (as vLLM): the final message, an assistant's, "
                                                            "is the reply's start; the model continues it")


class CompletionRequest(_OpenAISampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = Field(None, ge=0, le=20)
    echo: bool = Field(False, description="the prompt before the answer; with logprobs, its tokens' logprobs too "
                                          "(the first null); with max_tokens 0, the prompt only (scoring)")
    suffix: Optional[str] = None
    prompt_logprobs: Optional[int] = Field(None, ge=0, le=20, description="vLLM: each prompt token's logprob, "
                                                                          "rank and top k (not streamed)")
    response_format: Optional[ResponseFormat] = None


# --- Anthropic -------------------------------------------------------------------------------------

class AnthropicText(_Body):
    type: Literal["text"]
    text: str


class AnthropicToolUse(_Body):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict


class AnthropicToolResult(_Body):
    type: Literal["tool_result"]
    tool_use_id: str
    content: Union[str, list[AnthropicText], None] = None
    is_error: bool = False

    _text_only = field_validator("content", mode="before")(_text_parts_only)


def _anthropic_blocks(content):
    """Text, tool_use and tool_result blocks; any other (an image) gets one line that names it."""
    if isinstance(content, list):
        for block in content:
            kind = block.get("type") if isinstance(block, dict) else None
            if kind not in ("text", "tool_use", "tool_result"):
                raise ValueError(f"content blocks of type {kind!r} are not supported: this server takes text "
                                 "and tool blocks only")
    return content


class AnthropicMessage(_Body):
    role: Literal["user", "assistant"]
    content: Union[str, list[Annotated[Union[AnthropicText, AnthropicToolUse, AnthropicToolResult],
                                       Field(discriminator="type")]]]

    _blocks = field_validator("content", mode="before")(_anthropic_blocks)


class _AnthropicPrompt(_Body):
    model: str
    messages: list[AnthropicMessage]
    system: Union[str, list[AnthropicText], None] = None
    tools: Optional[list] = None        # [{"name", "description", "input_schema"}]
    tool_choice: Optional[dict] = None  # {"type": "auto" | "any" | "tool" | "none", "name": ...}


class MessagesRequest(_AnthropicPrompt):
    max_tokens: int
    stop_sequences: Optional[list[str]] = None
    temperature: Optional[float] = Field(None, ge=0, le=1)
    top_p: Optional[float] = Field(None, gt=0, le=1)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    metadata: Optional[dict] = None
    output_config: Optional[dict] = None   # {"format": {"type": "json_schema", "schema": ...}}: structured output
    session_id: Optional[str] = Field(None, description="engc: keep this chat's KV cache between requests")


class CountTokensRequest(_AnthropicPrompt):
    pass

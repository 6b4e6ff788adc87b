"""The answer's format as a request gives it, read into a constrained.Grammar (runtime/constrained):

- OpenAI's `response_format`: `json_object`, `json_schema` (`strict: false` ignores the keywords llguidance
  cannot enforce instead of refusing the schema), and engc's `regex`, `choice` and `grammar` types, with
  OpenAI's grammar shape (`{"type": "grammar", "syntax": "lark" | "regex", "definition": ...}`) and
  LMDeploy's `regex_schema`;
- vLLM's `structured_outputs: {json | regex | choice | grammar | json_object}` and its older `guided_json`,
  `guided_regex`, `guided_choice`, `guided_grammar`;
- Anthropic's `output_config.format` (`{"type": "json_schema", "schema": ...}`).
A request gives at most one. What llguidance cannot compile is a 400 naming the field, with its reason.
"""
from __future__ import annotations

from engc.runtime import constrained
from engc.runtime.server.app import APIError

GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def openai_format(req) -> constrained.Grammar | None:
    """The format an OpenAI-route request asks for, or None (free text)."""
    given = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.type != "text":
        given.append(("response_format", lambda: _response_format(fmt)))
    structured = getattr(req, "structured_outputs", None)
    if structured is not None:
        given.append(("structured_outputs", lambda: _structured(structured)))
    for field, kind in GUIDED.items():
        value = getattr(req, field, None)
        if value is not None:
            given.append((field, lambda kind=kind, value=value: _vllm(kind, value)))
    if len(given) > 1:
        raise APIError(400, f"give one answer format, not {' and '.join(name for name, _ in given)}", given[1][0])
    if not given:
        return None
    field, make = given[0]
    try:
        return make()
    except constrained.GrammarError as e:
        raise APIError(400, f"{field}: {e}", field) from None


def anthropic_format(req) -> constrained.Grammar | None:
    """output_config.format (Anthropic's structured outputs) as a grammar, or None."""
    fmt = (req.output_config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise APIError(400, 'output_config.format must be {"type": "json_schema", "schema": {...}}')
    try:
        return constrained.json_schema(fmt["schema"])
    except constrained.GrammarError as e:
        raise APIError(400, f"output_config.format: {e}") from None


def _response_format(fmt) -> constrained.Grammar:
    kind = fmt.type
    if kind == "json_object":
        return constrained.json_object()
    if kind == "json_schema":
        spec = fmt.json_schema
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise APIError(400, "response_format json_schema needs json_schema.schema, a JSON Schema object",
                           "response_format")
        return constrained.json_schema(spec["schema"], strict=spec.get("strict") is not False)
    if kind == "grammar" and fmt.definition is not None:   # OpenAI's grammar shape
        if fmt.syntax not in ("lark", "regex"):
            raise APIError(400, 'response_format grammar: syntax must be "lark" or "regex"', "response_format")
        return (constrained.regex if fmt.syntax == "regex" else constrained.grammar)(fmt.definition)
    value = getattr(fmt, kind)
    if value is None:
        raise APIError(400, f"response_format {kind} needs its {kind} field", "response_format")
    return _vllm("regex" if kind == "regex_schema" else kind, value)


def _structured(structured) -> constrained.Grammar:
    if structured.structural_tag is not None:
        raise APIError(400, "structured_outputs.structural_tag is not supported by engc (use tools)",
                       "structured_outputs")
    values = {"json": structured.json_, "regex": structured.regex, "choice": structured.choice,
              "grammar": structured.grammar, "json_object": structured.json_object}
    kinds = [k for k, v in values.items() if v not in (None, False)]
    if len(kinds) != 1:
        raise APIError(400, f"structured_outputs needs exactly one of {', '.join(values)}", "structured_outputs")
    return _vllm(kinds[0], values[kinds[0]])


def _vllm(kind: str, value) -> constrained.Grammar:
    """vLLM's kinds: json is a schema (an object or its text), json_object any object."""
    if kind == "json_object":
        return constrained.json_object()
    if kind == "json":
        return constrained.json_schema(value)
    return {"regex": constrained.regex, "choice": constrained.choice, "grammar": constrained.grammar}[kind](value)

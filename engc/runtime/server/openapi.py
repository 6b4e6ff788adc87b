"""The OpenAPI document (/openapi.json): FastAPI's, with every response the server gives declared, so
generated clients and API fuzzers (schemathesis) agree with the server.

FastAPI declares a 422 for request validation; engc answers 400 (the APIs it serves do), in OpenAI's error
shape, or Anthropic's on /v1/messages and for clients that send anthropic-version (app.from_anthropic_client).
Request bodies and /v1/models/{model_id} name the one model the server serves. Each operation gets the
errors it can give: 400 (a body it refuses), 404 (a model it does not serve), 413 (a
body over the limit), 401 (with an API key), 429 (a full queue, with --max-waiting), 500 (a failure of the
server), and the x-request-id header every
response carries. A streamed answer is text/event-stream; /metrics is Prometheus' text format.
"""
from __future__ import annotations

from fastapi.openapi.utils import get_openapi

NULLABLE_STRING = {"anyOf": [{"type": "string"}, {"type": "null"}]}
ERROR_SCHEMAS = {
    "OpenAIError": {"type": "object", "required": ["error"], "properties": {"error": {
        "type": "object", "required": ["message", "type", "param", "code"],
        "properties": {"message": {"type": "string"}, "type": {"type": "string"},
                       "param": NULLABLE_STRING, "code": NULLABLE_STRING}}}},
    "AnthropicError": {"type": "object", "required": ["type", "error"], "properties": {
        "type": {"const": "error"},
        "error": {"type": "object", "required": ["type", "message"],
                  "properties": {"type": {"type": "string"}, "message": {"type": "string"}}}}},
}
SSE_EVENT = {"description": 'With "stream": true, server-sent events (the schema is one event\'s): each data a JSON '
                             "chunk, or [DONE] last on the OpenAI routes; Anthropic's named by their event",
             "type": "object", "required": ["data"],
             "properties": {"data": {"type": "string"}, "event": {"type": "string"}}}
STREAMED = {"/v1/chat/completions", "/v1/completions", "/v1/messages"}   # "stream": true answers as SSE
MODEL_ROUTES = {"/v1/models/{model_id}"}
REQUEST_ID = {"x-request-id": {"description": "The request's id: the client's x-request-id if it sent a short "
                                              "printable one, else one the server made (written in its log)",
                               "schema": {"type": "string"}}}
# What the routes refuse that the request models' types do not say, by schema and field, per JSON type (applied
# through anyOf branches and array items): declared so that clients and fuzzers send what the server takes.
VOCAB = object()   # stands for the model's largest token id
REFINED = {
    ("ChatCompletionRequest", "messages"): {"array": {"minItems": 1}},
    ("ChatCompletionRequest", "max_completion_tokens"): {"integer": {"minimum": 1}},
    ("CompletionRequest", "prompt"): {"string": {"minLength": 1}, "array": {"minItems": 1},
                                      "integer": {"minimum": 0, "maximum": VOCAB}},
    ("CompletionRequest", "max_tokens"): {"integer": {"minimum": 0}},
    ("MessagesRequest", "messages"): {"array": {"minItems": 1}},
    ("MessagesRequest", "max_tokens"): {"integer": {"minimum": 1}},
    ("CountTokensRequest", "messages"): {"array": {"minItems": 1}},
    **{(model, field): {"array": {"minItems": 1}} for model in ("ChatCompletionRequest", "CompletionRequest")
       for field in ("guided_choice",)},
}
ERRORS = {400: "The request is refused: the message says why (the param names the field)",
          401: "Missing or invalid API key",
          404: "The model is not the one this server serves",
          413: "The request body is over the server's limit (engc run --max-body-bytes)",
          429: "The queue is full (engc run --max-waiting): send the request elsewhere or later",
          500: "The server failed; the message holds the request id its log names",
          503: "The engine is down (a tensor-parallel rank died): the server exits; send the request elsewhere"}


def document(app, model_name: str, vocab_size: int, api_key: str | None, queue_limit: bool = False) -> dict:
    doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
    schemas = doc.setdefault("components", {}).setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas.update(ERROR_SCHEMAS)
    served = {"type": "string", "enum": [model_name], "description": "The model this server serves (another: 404)"}
    for schema in schemas.values():   # the request bodies name the model
        if "model" in schema.get("properties", {}):
            schema["properties"]["model"] = served
    for (name, field), facts in REFINED.items():
        prop = schemas.get(name, {}).get("properties", {}).get(field)
        if prop is not None:
            _refine(prop, {kind: {k: vocab_size - 1 if v is VOCAB else v for k, v in c.items()}
                           for kind, c in facts.items()})
    for path, operations in doc["paths"].items():
        for method, operation in operations.items():
            operation["responses"] = _responses(path, method, operation, api_key is not None, queue_limit)
            for parameter in operation.get("parameters", []):
                if parameter["name"] == "model_id":
                    parameter["schema"] = served
            if api_key and path != "/health":
                operation["security"] = [{"bearer": []}, {"x-api-key": []}]
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"},
                                                "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"}}
    return doc


def _refine(schema: dict, facts: dict[str, dict]) -> None:
    for branch in schema.get("anyOf", []):
        _refine(branch, facts)
    schema.update(facts.get(schema.get("type"), {}))
    if isinstance(schema.get("items"), dict):
        _refine(schema["items"], facts)


def _responses(path: str, method: str, operation: dict, keyed: bool, queue_limit: bool = False) -> dict:
    ok = operation["responses"].get("200", {"description": "Successful Response"})
    if path == "/metrics":
        ok = {"description": "The metrics in Prometheus' text format",
              "content": {"text/plain": {"schema": {"type": "string"}}}}
    elif path in STREAMED:
        ok["content"]["text/event-stream"] = {"schema": SSE_EVENT}
    out = {"200": dict(ok, headers=REQUEST_ID)}
    statuses = [500, 503]
    if method == "post":
        statuses += [400, 404, 413]
    if path in MODEL_ROUTES:
        statuses.append(404)
    if keyed and path != "/health":
        statuses.append(401)
    if queue_limit and path in STREAMED:   # the routes that queue work for the engine
        statuses.append(429)
    if path.startswith("/v1/messages"):
        shape = {"$ref": "#/components/schemas/AnthropicError"}
    else:
        shape = {"anyOf": [{"$ref": "#/components/schemas/OpenAIError"},
                           {"$ref": "#/components/schemas/AnthropicError"}]}
    for status in sorted(set(statuses)):
        out[str(status)] = {"description": ERRORS[status], "headers": REQUEST_ID,
                            "content": {"application/json": {"schema": shape}}}
    return out

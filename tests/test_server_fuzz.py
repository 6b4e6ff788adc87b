"""schemathesis against the server's own OpenAPI document, in process (ASGI), every operation, positive and
negative data, all of its checks: no server error, every status, content type, header and body as declared,
invalid data refused, undeclared methods answered 405 with Allow. Bounded examples, seeded, on a tiny model
whose context (4 KV blocks, 64 tokens) keeps the generations it sends short."""
import pytest
import torch

from engc.runtime.engine import EngineConfig
from live_server import LiveServer

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, settings  # noqa: E402 - after the skip: hypothesis comes with schemathesis

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def api(tiny_bundle):
    with LiveServer(tiny_bundle("llama"), EngineConfig(num_blocks=4)) as s:
        schema = schemathesis.openapi.from_asgi("/openapi.json", s.app)
        schema.config.generation.update(max_examples=10, deterministic=True, database="none",
                                        modes=[schemathesis.GenerationMode.POSITIVE,
                                               schemathesis.GenerationMode.NEGATIVE])
        # A request the schema allows can still be refused for what a schema cannot say: a prompt longer than
        # the context, token ids past the vocabulary, fields that need each other (tool_choice and tools, a
        # response_format's type and its pattern). Those are 400s in the error shape the document declares.
        schema.config.checks.positive_data_acceptance.expected_statuses = ["2xx", "400", "404"]
        yield schema


schema = schemathesis.pytest.from_fixture("api")


@schema.parametrize()
@settings(suppress_health_check=list(HealthCheck), deadline=None)
def test_the_server_answers_as_its_openapi_document_says(case):
    case.call_and_validate()

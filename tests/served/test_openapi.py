"""schemathesis fuzzes the published OpenAPI document against the app in-process (a tiny
random model on a thread core): no 5xx, and every answer matches the document."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance, response_schema_conformance, status_code_conformance,
)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def app(tiny_model_factory):
    from engine.config import EngineConfig
    from engine.engine import LLMEngine
    from engine.serving.app import create_app
    from engine.client.async_llm import AsyncLLM
    from engine.serving.openai.handlers import OpenAIServing

    cfg = EngineConfig.create(model=str(tiny_model_factory("openapi-tiny")), device="cpu", dtype="float32",
                              max_num_seqs=8, max_model_len=64, kv_cache_memory_bytes=64 * 8192)
    llm = AsyncLLM(LLMEngine(cfg))
    yield create_app(lambda: OpenAIServing(llm, "tiny"), max_body_bytes=64 << 10)
    llm.shutdown()


@pytest.fixture(scope="module")
def operations(app):
    """Every operation of the document the app itself publishes."""
    api = schemathesis.openapi.from_asgi("/openapi.json", app)
    ops = [result.ok() for result in api.get_all_operations()]
    assert {op.path for op in ops} >= {"/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"}
    return ops


# schemathesis's own pytest plugin does not load under pytest 9, so hypothesis drives it.
@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.function_scoped_fixture,
                                 HealthCheck.data_too_large])
@given(data=st.data())
def test_the_api_keeps_to_its_document(operations, data):
    op = data.draw(st.sampled_from(operations))
    case = data.draw(op.as_strategy())
    case.call_and_validate(checks=[not_a_server_error, status_code_conformance, content_type_conformance,
                                   response_schema_conformance])

"""/openapi.json is generated from the msgspec structs, and schemathesis fuzzes every route against it
(bounded examples): no 5xx, and every answer matches the schema and its documented status codes."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance, unsupported_method)

from server_util import RunningServer

MAX_EXAMPLES = 30


@pytest.fixture(scope="module")
def fuzz_server():
    s = RunningServer("--max-model-len", "128", "--max-n", "4", "--api-key", "fuzz-key")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def api_schema(fuzz_server):
    return schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")


def test_the_schema_lists_every_api_route(fuzz_server):
    doc = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
            "/generate", "/health"} <= set(doc["paths"])
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["max_tokens"]["anyOf"][0]["minimum"] == 1 and request["logprobs"]["anyOf"][0]["maximum"] == 20


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_fuzzed_requests_never_get_5xx_or_off_schema_answers(case):
    case.call_and_validate(headers={"Authorization": "Bearer fuzz-key"},
                           checks=[not_a_server_error, response_schema_conformance, status_code_conformance,
                                   content_type_conformance, unsupported_method])

"""/openapi.json is generated from the msgspec structs, and schemathesis fuzzes every route against it
(bounded examples): no 5xx, and every answer matches the schema and its documented status codes.

The fuzzing drives schemathesis through its public Python API (`APIOperation.as_strategy` under hypothesis'
`@given`), not its pytest plugin: the plugin reaches into pytest's private item attributes and broke with
pytest 9.2 (`'Function' object has no attribute '_nodeid'`), while this path depends on nothing private.
"""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (content_type_conformance, not_a_server_error, response_schema_conformance,
                                 status_code_conformance, unsupported_method)

from server_util import RunningServer

MAX_EXAMPLES = 20  # per operation and generation mode (20 x 2 x ~25 operations: ~1000 requests)
CHECKS = [not_a_server_error, response_schema_conformance, status_code_conformance, content_type_conformance,
          unsupported_method]
AUTH = {"Authorization": "Bearer fuzz-key"}


@pytest.fixture(scope="module")
def fuzz_server():
    s = RunningServer("--max-model-len", "128", "--max-n", "4", "--api-key", "fuzz-key", "--dtype", "float32")
    yield s
    s.stop()


def test_the_schema_lists_every_api_route(fuzz_server):
    doc = httpx.get(f"{fuzz_server.url}/openapi.json").json()
    assert doc["openapi"].startswith("3.")
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize", "/detokenize",
            "/generate", "/health"} <= set(doc["paths"])
    request = doc["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["max_tokens"]["anyOf"][0]["minimum"] == 1 and request["logprobs"]["anyOf"][0]["maximum"] == 20


def fuzz(operation, mode: GenerationMode) -> int:
    """Run `MAX_EXAMPLES` generated cases of one operation through every check; return how many ran."""
    ran = 0

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(max_examples=MAX_EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    def run(case):
        nonlocal ran
        ran += 1
        case.call_and_validate(headers=AUTH, checks=CHECKS)

    try:
        run()
    except Unsatisfiable:
        if mode is GenerationMode.POSITIVE:
            raise
        assert ran == 0  # an operation without parameters or body has no invalid input to send
    return ran


def test_fuzzed_requests_never_get_5xx_or_off_schema_answers(fuzz_server, subtests):
    schema = schemathesis.openapi.from_url(f"{fuzz_server.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {"POST /v1/completions", "POST /v1/chat/completions", "POST /generate"}
    total = 0
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            with subtests.test(operation=operation.label, mode=mode.value):
                total += fuzz(operation, mode)
    assert total >= len(operations)  # every operation ran at least one case
    assert httpx.get(f"{fuzz_server.url}/health").status_code == 200

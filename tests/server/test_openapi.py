"""The OpenAPI document is the server: schemathesis generates requests from /openapi.json for every
operation (valid and invalid ones), sends them to a live server, and checks each response against
the document (status code documented, content type documented, body matching its schema, headers)
and that none is a 5xx. Bounded: a few examples per operation, a small model, short outputs."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from polylane.server.config import Limits
from tests.server.conftest import SMOL, start_server

EXAMPLES = 12  # per operation
HEALTH_CHECKS = list(HealthCheck)
CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    response_headers_conformance,
]


@pytest.fixture(scope="module")
def live():
    # short outputs: at most 64 KV tokens and a 5 s deadline, so that any generated request ends fast
    server = start_server((SMOL,), limits=Limits(request_timeout_s=5.0, max_tokens_default=8), kv_tokens=64)
    try:
        yield server
    finally:
        server.stop()


def _operations(live):
    schema = schemathesis.openapi.from_url(f"{live.base_url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_every_response_conforms_to_the_document(live, mode):
    operations = _operations(live)
    assert len(operations) >= 10, [op.label for op in operations]
    checked = 0
    for operation in operations:

        @given(case=operation.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=HEALTH_CHECKS, database=None)
        def check(case):
            case.call_and_validate(base_url=live.base_url, checks=CHECKS)

        try:
            check()
        except Unsatisfiable:  # nothing invalid can be sent (an operation without parameters)
            assert mode is GenerationMode.NEGATIVE, operation.label
            continue
        checked += 1
    # every operation takes valid examples; invalid ones, those with a body or a query parameter
    least = 10 if mode is GenerationMode.POSITIVE else 4
    assert checked >= least, f"only {checked} operations took {mode.value} examples"


def test_the_document_says_what_the_server_does(live):
    with live.client() as http:
        document = http.get("/openapi.json").json()
    paths = document["paths"]
    completions = paths["/v1/completions"]["post"]["responses"]
    assert "422" not in completions and {"400", "404", "413", "429", "503"} <= set(completions), completions
    assert set(completions["200"]["content"]) == {"application/json", "text/event-stream"}
    assert "Retry-After" in completions["429"]["headers"]
    assert set(paths["/metrics"]["get"]["responses"]["200"]["content"]) == {"text/plain"}
    request = document["components"]["schemas"]["CompletionRequest"]["properties"]
    assert request["n"]["maximum"] == Limits().max_n
    forms = request["prompt"]["anyOf"]
    token_ids = next(form for form in forms if form.get("items", {}).get("type") == "integer")
    assert token_ids["items"]["maximum"] == live.engine.models[SMOL].tokenizer.vocab_size - 1
    assert not any("422" in op["responses"] for ops in paths.values() for op in ops.values())

"""The server's OpenAPI surface fuzzed from its own /openapi.json (schemathesis): bodies that
fit the schema and bodies that do not, generated for every operation, a bounded number each
(derandomized: a run is repeatable), against the tiny server. No answer may be a 5xx, every
status code must be one the schema declares for the operation, and every response (each event
of a stream too) must fit its declared content type and schema. The engine is idle and clean
afterwards."""

from __future__ import annotations

import collections

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

EXAMPLES = 15  # per operation and mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]
MODES = (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE)


def test_the_openapi_surface(tiny_server, clean_server):
    schema = schemathesis.openapi.from_url(tiny_server.base_url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.label for op in operations} >= {
        "POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
        "POST /detokenize", "GET /health", "GET /metrics", "POST /flush_cache"}
    failures, answered = [], collections.Counter()
    for operation in operations:
        for mode in MODES[:2 if operation.body else 1]:  # nothing to break without a body
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=EXAMPLES, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def fuzz(case):
                res = case.call_and_validate(checks=CHECKS, timeout=120)
                answered[operation.label, mode.value, res.status_code] += 1

            try:
                fuzz()
            except Exception as e:  # every operation runs; each failure is listed
                failures.append(f"{operation.label} ({mode.value}): {e}")
    assert not failures, "\n\n".join(failures)
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /tokenize",
                  "POST /detokenize"):  # the schema leads to answers, not only to errors
        assert answered[label, "positive", 200] > 0, answered

"""schemathesis against the running server's /openapi.json: no 5xx, every status and body as declared.
Bounded: a fixed number of examples per operation and a wall-clock budget (about a minute in all)."""

from __future__ import annotations

import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable

from server.config.server_config import ServerConfig
from tests.reliability.conftest import serving

schemathesis = pytest.importorskip("schemathesis")
from schemathesis import GenerationMode  # noqa: E402
from schemathesis.checks import (  # noqa: E402
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

EXAMPLES = 30  # per operation and generation mode
BUDGET_S = 60.0
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_model_dir):
    with serving(tiny_model_dir, ServerConfig(max_request_body=256 * 1024)) as running:
        yield running


def test_the_api_matches_its_schema(server):
    schema = schemathesis.openapi.from_url(f"{server.base_url}/openapi.json")
    deadline = time.monotonic() + BUDGET_S
    calls = 0
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=EXAMPLES,
                deadline=None,
                derandomize=True,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            @given(case=operation.as_strategy(generation_mode=mode))
            def run(case):
                nonlocal calls
                if time.monotonic() > deadline:
                    return
                if isinstance(case.body, dict) and case.body.get("stream") is True:
                    case.body["stream"] = False  # the schema describes the JSON response; SSE has its own tests
                case.call_and_validate(base_url=server.base_url, checks=CHECKS, timeout=30)
                calls += 1

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation without parameters)
                assert mode is GenerationMode.NEGATIVE
    assert calls >= 50
    server.wait_idle()


def test_every_status_the_server_sends_is_declared(server):
    """The error statuses of the generation routes, as the schema lists them."""
    import httpx

    paths = httpx.get(f"{server.base_url}/openapi.json", timeout=10).json()["paths"]
    for path in ("/v1/completions", "/v1/chat/completions"):
        declared = set(paths[path]["post"]["responses"])
        assert {"200", "400", "401", "404", "413", "415", "429", "500", "503", "504"} <= declared, path

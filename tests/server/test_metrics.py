"""/metrics after a known workload on a fresh server: exact counter values, Prometheus' own tooling.

The workload, run once for the module:
  1. a scrape before any request (the start-up warm-up generation must not count as a request);
  2. four completions (two non-streaming, two streaming) with token-id prompts of known lengths,
     `ignore_eos` and `max_tokens=GEN_TOKENS`; one chat completion; one completion rejected with 400;
  3. a scrape; then one streaming completion the client abandons after its first chunk; a scrape.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass

import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from server.config.server_config import ServerConfig
from tests.promtool import check_metrics
from tests.server.conftest import start_server

MODEL = "tiny"
PROMPT_LENGTHS = (3, 8, 12, 21)  # the 12-token prompt extends the 8-token one: a prefix-cache hit
GEN_TOKENS = 5
CHAT_MAX_TOKENS = 4
ABORTED_PROMPT_LENGTH = 6
ABORTED_MAX_TOKENS = 200
NUM_FINISHED = len(PROMPT_LENGTHS) + 1  # the completions and the chat

# Every metric the README documents (server/observability/metrics.py), by parsed family name and type.
DOCUMENTED_METRICS = {
    "pagedserve_prompt_tokens": "counter",
    "pagedserve_generation_tokens": "counter",
    "pagedserve_request_success": "counter",
    "pagedserve_request_failure": "counter",
    "pagedserve_request_rejected": "counter",
    "pagedserve_http_requests": "counter",
    "pagedserve_time_to_first_token_seconds": "histogram",
    "pagedserve_inter_token_latency_seconds": "histogram",
    "pagedserve_time_per_output_token_seconds": "histogram",
    "pagedserve_e2e_request_latency_seconds": "histogram",
    "pagedserve_request_queue_time_seconds": "histogram",
    "pagedserve_request_prompt_tokens": "histogram",
    "pagedserve_request_generation_tokens": "histogram",
    "pagedserve_iteration_tokens": "histogram",
    "pagedserve_grammar_compile_seconds": "histogram",
    "pagedserve_grammar_mask_fill_seconds": "histogram",
    "pagedserve_cache_config_info": "gauge",  # an Info: a constant-1 gauge in the text format
    "pagedserve_model_weight_bytes": "gauge",
    "pagedserve_num_requests_running": "gauge",
    "pagedserve_num_requests_waiting": "gauge",
    "pagedserve_kv_cache_usage_ratio": "gauge",
    "pagedserve_num_preemptions": "counter",
    "pagedserve_prefix_cache_queries": "counter",
    "pagedserve_prefix_cache_hits": "counter",
}


def prompt_ids(length: int, start: int = 10) -> list[int]:
    return list(range(start, start + length))


def _prompts() -> list[list[int]]:
    prompts = [prompt_ids(n, start=100 + 40 * i) for i, n in enumerate(PROMPT_LENGTHS)]
    prompts[2] = prompts[1] + prompt_ids(PROMPT_LENGTHS[2] - PROMPT_LENGTHS[1], start=300)
    return prompts


class Scrape:
    """One parsed /metrics exposition."""

    def __init__(self, text: str):
        self.text = text
        self.families = {f.name: f for f in text_string_to_metric_families(text)}
        self.samples = [s for f in self.families.values() for s in f.samples]

    def get(self, name: str, default: float | None = None, **labels: str) -> float:
        """The value of the one sample `name` whose labels include model_name="tiny" and `labels`."""
        wanted = {"model_name": MODEL, **labels}
        found = [
            s.value for s in self.samples if s.name == name and all(s.labels.get(k) == v for k, v in wanted.items())
        ]
        if not found:
            if default is not None:
                return default
            raise AssertionError(f"no sample {name}{wanted} in /metrics")
        assert len(found) == 1, (name, wanted, found)
        return found[0]


@dataclass
class Workload:
    before: Scrape
    after: Scrape  # after the finished and rejected requests
    after_abort: Scrape  # after the abandoned stream as well
    chat_prompt_tokens: int


def scrape(http) -> Scrape:
    response = http.get("/metrics")
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/plain")
    return Scrape(response.text)


@pytest.fixture(scope="module")
def fresh(tiny_model_dir):
    """A server of this module's own, so every counter starts from zero."""
    uv, thread, running = start_server(tiny_model_dir, ServerConfig(served_model_name=MODEL))
    yield running
    uv.should_exit = True
    thread.join(30)


@pytest.fixture(scope="module")
def workload(fresh) -> Workload:
    client = openai.OpenAI(base_url=f"{fresh.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with fresh.client() as http:
        before = scrape(http)
        for i, prompt in enumerate(_prompts()):
            kwargs = {"model": MODEL, "prompt": prompt, "max_tokens": GEN_TOKENS, "extra_body": {"ignore_eos": True}}
            if i % 2:
                chunks = list(client.completions.create(stream=True, **kwargs))
                assert chunks[-1].choices[0].finish_reason == "length"
            else:
                response = client.completions.create(**kwargs)
                assert response.usage.prompt_tokens == len(prompt)
                assert response.usage.completion_tokens == GEN_TOKENS
                assert response.choices[0].finish_reason == "length"
        chat = client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Hello there"}],
            max_tokens=CHAT_MAX_TOKENS,
            extra_body={"ignore_eos": True},
        )
        assert chat.choices[0].finish_reason == "length"
        assert chat.usage.completion_tokens == CHAT_MAX_TOKENS
        counted = http.post(
            "/tokenize", json={"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]}
        )
        assert counted.json()["count"] == chat.usage.prompt_tokens
        with pytest.raises(openai.BadRequestError):  # prompt + max_tokens over the 256-token context
            client.completions.create(model=MODEL, prompt=prompt_ids(10), max_tokens=1000)
        fresh.wait_idle()
        after = scrape(http)

        body = {
            "model": MODEL,
            "prompt": prompt_ids(ABORTED_PROMPT_LENGTH, start=400),
            "max_tokens": ABORTED_MAX_TOKENS,
            "ignore_eos": True,
            "stream": True,
        }
        with http.stream("POST", "/v1/completions", json=body) as response:
            assert response.status_code == 200
            next(line for line in response.iter_lines() if line.startswith("data: {"))
        fresh.wait_idle()
        after_abort = scrape(http)
    client.close()
    return Workload(before, after, after_abort, chat.usage.prompt_tokens)


def test_warm_up_generation_is_not_counted_as_a_request(workload):
    """The lifespan's warm-up runs through the engine (steps are counted) but is no request."""
    before = workload.before
    assert before.get("pagedserve_iteration_tokens_count") > 0  # the warm-up's steps
    for name in (
        "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total",
        "pagedserve_request_success_total",
        "pagedserve_request_prompt_tokens_count",
        "pagedserve_e2e_request_latency_seconds_count",
        "pagedserve_time_to_first_token_seconds_count",
    ):
        assert not [s for s in before.samples if s.name == name and s.value], name
    assert not [s for s in before.samples if s.name == "pagedserve_http_requests_total"]


def test_an_idle_replica_shows_its_request_series_at_zero(workload):
    """Before any request, every series whose labels are known is there at 0 (as vLLM's are), so an idle replica's
    rate() reads 0 rather than no data, and a request's first increment is not lost to a series born at 1."""
    before = workload.before
    for name in (
        "pagedserve_prompt_tokens_total",
        "pagedserve_generation_tokens_total",
        "pagedserve_time_to_first_token_seconds_count",
        "pagedserve_e2e_request_latency_seconds_count",
        "pagedserve_request_queue_time_seconds_count",
        "pagedserve_time_per_output_token_seconds_count",
        "pagedserve_grammar_compile_seconds_count",
    ):
        assert before.get(name) == 0, name
    for reason in ("stop", "length"):
        assert before.get("pagedserve_request_success_total", finished_reason=reason) == 0
    for reason in ("aborted", "rejected", "timeout", "error"):
        assert before.get("pagedserve_request_failure_total", reason=reason) == 0
    assert before.get("pagedserve_request_rejected_total", reason="queue_full") == 0


def test_token_and_request_counters_are_exact(workload):
    after = workload.after
    prompt_total = sum(PROMPT_LENGTHS) + workload.chat_prompt_tokens
    generation_total = GEN_TOKENS * len(PROMPT_LENGTHS) + CHAT_MAX_TOKENS
    assert after.get("pagedserve_prompt_tokens_total") == prompt_total
    assert after.get("pagedserve_generation_tokens_total") == generation_total
    assert after.get("pagedserve_request_success_total", finished_reason="length") == NUM_FINISHED
    assert {
        s.labels["finished_reason"] for s in after.samples if s.name == "pagedserve_request_success_total" and s.value
    } == {"length"}
    assert after.get("pagedserve_request_failure_total", reason="rejected") == 1
    assert after.get("pagedserve_request_failure_total", default=0.0, reason="aborted") == 0
    assert after.get("pagedserve_request_prompt_tokens_sum") == prompt_total
    assert after.get("pagedserve_request_generation_tokens_sum") == generation_total


def test_histogram_counts_are_exact(workload):
    after = workload.after
    for name in (
        "pagedserve_request_prompt_tokens",
        "pagedserve_request_generation_tokens",
        "pagedserve_e2e_request_latency_seconds",
        "pagedserve_time_to_first_token_seconds",
        "pagedserve_request_queue_time_seconds",
        "pagedserve_time_per_output_token_seconds",
    ):
        assert after.get(f"{name}_count") == NUM_FINISHED, name
        assert after.get(f"{name}_bucket", le="+Inf") == NUM_FINISHED, name
    # every finished request produced (max_tokens - 1) inter-token gaps
    gaps = (GEN_TOKENS - 1) * len(PROMPT_LENGTHS) + CHAT_MAX_TOKENS - 1
    assert after.get("pagedserve_inter_token_latency_seconds_count") == gaps
    assert after.get("pagedserve_request_generation_tokens_bucket", le="5.0") == NUM_FINISHED
    assert after.get("pagedserve_request_generation_tokens_bucket", le="2.0") == 0
    # latencies are positive and bounded by the test's own duration
    e2e_sum = after.get("pagedserve_e2e_request_latency_seconds_sum")
    assert 0 < after.get("pagedserve_time_to_first_token_seconds_sum") <= e2e_sum < 60


def test_http_requests_by_route_and_status(workload):
    after = workload.after
    assert after.get("pagedserve_http_requests_total", route="/v1/completions", status="200") == len(PROMPT_LENGTHS)
    assert after.get("pagedserve_http_requests_total", route="/v1/completions", status="400") == 1
    assert after.get("pagedserve_http_requests_total", route="/v1/chat/completions", status="200") == 1
    assert after.get("pagedserve_http_requests_total", route="/tokenize", status="200") == 1
    assert after.get("pagedserve_http_requests_total", route="/metrics", status="200") == 1  # the first scrape


def test_scheduler_gauges_and_counters(workload):
    for snapshot in (workload.after, workload.after_abort):
        assert snapshot.get("pagedserve_num_requests_running") == 0
        assert snapshot.get("pagedserve_num_requests_waiting") == 0
        assert snapshot.get("pagedserve_kv_cache_usage_ratio") == 0
        assert snapshot.get("pagedserve_num_preemptions_total") == 0
    after = workload.after
    queries, hits = after.get("pagedserve_prefix_cache_queries_total"), after.get("pagedserve_prefix_cache_hits_total")
    assert queries >= hits >= 8  # at least the shared 8-token prefix (two full 4-token blocks)
    assert after.get("pagedserve_iteration_tokens_count") > workload.before.get("pagedserve_iteration_tokens_count")
    assert after.get("pagedserve_iteration_tokens_sum") > 0


def test_cache_config_info(workload):
    info = [s for s in workload.after.samples if s.name == "pagedserve_cache_config_info"]
    assert len(info) == 1 and info[0].value == 1
    labels = info[0].labels
    assert labels["block_size"] == "4" and labels["num_blocks"] == "256" and labels["num_tokens"] == "1024"
    assert labels["enable_prefix_caching"] == "true" and labels["max_model_len"] == "256"
    assert labels["cache_dtype"] == "float32" and labels["attention_backend"] == "cpu"  # auto on CPU


def test_model_weight_bytes(workload):
    (sample,) = [s for s in workload.after.samples if s.name == "pagedserve_model_weight_bytes"]
    assert sample.labels["quantization"] == "none" and sample.value > 0


def test_every_sample_is_labelled_with_the_model_name(workload):
    samples = [s for s in workload.after_abort.samples if s.name.startswith("pagedserve_")]
    unlabelled = {s.name for s in samples if s.labels.get("model_name") != MODEL}
    assert not unlabelled
    assert all(s.name.startswith("pagedserve_") for s in workload.after_abort.samples)


def test_cache_config_info_is_labelled_with_the_model_name(workload):
    assert workload.after.get("pagedserve_cache_config_info", model_name=MODEL) == 1


def test_documented_metrics_are_exposed(workload):
    families = workload.after_abort.families
    exposed = {
        name: f.type for name, f in families.items() if not (name.endswith("_created") and f.type == "gauge")
    }  # prometheus_client's _created series
    assert exposed == DOCUMENTED_METRICS


def test_promtool_check_metrics(workload):
    for snapshot in (workload.before, workload.after, workload.after_abort):
        result = check_metrics(snapshot.text)
        assert result.returncode == 0, f"promtool check metrics:\n{result.stdout}{result.stderr}"
        assert result.stdout.strip() == result.stderr.strip() == "", f"promtool lint:\n{result.stdout}{result.stderr}"


def test_abandoned_stream_changes_no_success_counter(workload):
    after, later = workload.after, workload.after_abort
    assert later.get("pagedserve_request_success_total", finished_reason="length") == NUM_FINISHED
    assert (
        later.get("pagedserve_http_requests_total", route="/v1/completions", status="200") == len(PROMPT_LENGTHS) + 1
    )  # the stream's 200 went out before the client left
    generated = later.get("pagedserve_generation_tokens_total") - after.get("pagedserve_generation_tokens_total")
    assert 0 <= generated < ABORTED_MAX_TOKENS


def test_abandoned_stream_is_counted_as_aborted(fresh, workload):
    later = workload.after_abort
    deadline = time.monotonic() + 3
    with fresh.client() as http:  # the abort output reaches the event loop just after the engine is idle
        while (
            later.get("pagedserve_request_failure_total", default=0.0, reason="aborted") == 0
            and time.monotonic() < deadline
        ):
            time.sleep(0.1)
            later = scrape(http)
    after = workload.after
    assert later.get("pagedserve_request_failure_total", reason="aborted") == 1
    assert later.get("pagedserve_request_prompt_tokens_count") == NUM_FINISHED + 1
    assert (
        later.get("pagedserve_prompt_tokens_total") - after.get("pagedserve_prompt_tokens_total")
        == ABORTED_PROMPT_LENGTH
    )
    generated = later.get("pagedserve_generation_tokens_total") - after.get("pagedserve_generation_tokens_total")
    assert 1 <= generated < ABORTED_MAX_TOKENS
    assert later.get("pagedserve_e2e_request_latency_seconds_count") == NUM_FINISHED + 1
    assert later.get("pagedserve_time_to_first_token_seconds_count") == NUM_FINISHED + 1
    assert not math.isnan(later.get("pagedserve_e2e_request_latency_seconds_sum"))


@pytest.mark.parametrize(
    "kv_cache_dtype, label, backend",
    [
        ("bfloat16", "bfloat16", "auto"),
        ("fp8", "fp8", "auto"),
        ("fp8_e4m3", "fp8", "auto"),
        ("fp8_e5m2", "fp8_e5m2", "auto"),
    ],
)
def test_cache_config_info_shows_the_kv_cache_dtype(tiny_model_dir, kv_cache_dtype, label, backend):
    """--kv-cache-dtype: the info metric shows what the cache stores, not the model's dtype (e4m3 as "fp8"
    whichever of vLLM's two names chose it; e5m2 under auto, which takes the torch backend for it)."""
    from engine.async_engine import AsyncEngine
    from server.app import create_app
    from tests.engine.references import make_llm

    llm = make_llm(tiny_model_dir, kv_cache_dtype=kv_cache_dtype, attention_backend=backend)
    engine = AsyncEngine(llm.engine)
    if kv_cache_dtype == "fp8_e5m2":
        assert llm.engine.runner.backend.name == "torch"
    app = create_app(engine, ServerConfig(served_model_name=f"tiny-{kv_cache_dtype}-kv"))
    families = text_string_to_metric_families(app.state.server.metrics.render().decode())
    info = [s for f in families for s in f.samples if s.name == "pagedserve_cache_config_info"]
    assert engine.dtype == "float32" and info[0].labels["cache_dtype"] == label


def test_a_body_without_content_type_is_counted_under_its_route(fresh, workload):
    """A POST with no Content-Type header (Python's `requests.post(url, data=...)`, `curl -H 'Content-Type:'`) is
    read as JSON, and its response counted under its route (it was counted as route "unmatched")."""
    with fresh.client() as http:
        before = scrape(http)
        body = json.dumps({"model": MODEL, "prompt": prompt_ids(3, start=500), "max_tokens": 2}).encode()
        response = http.post("/v1/completions", content=body)
        assert "content-type" not in response.request.headers
        assert response.status_code == 200, response.text
        after = scrape(http)
    counted = {
        route: after.get("pagedserve_http_requests_total", default=0.0, route=route, status="200")
        - before.get("pagedserve_http_requests_total", default=0.0, route=route, status="200")
        for route in ("/v1/completions", "unmatched")
    }
    assert counted == {"/v1/completions": 1, "unmatched": 0}


def test_a_body_refused_before_routing_is_counted_under_its_route(fresh, workload):
    """The body guard answers before the router runs (415, 400 for a body that is not JSON): the response was
    counted as route "unmatched", out of every per-route query (the dashboard's request rate takes /v1/...),
    while the same refusal counted as a `rejected` failure of the API."""
    with fresh.client() as http:
        before = scrape(http)
        assert http.post("/v1/completions", content=b"x", headers={"Content-Type": "text/plain"}).status_code == 415
        assert (
            http.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"}).status_code
            == 400
        )
        assert http.post("/no/such/route", content=b"{}").status_code == 404
        after = scrape(http)

    def counted(route: str, status: str) -> float:
        return after.get("pagedserve_http_requests_total", default=0.0, route=route, status=status) - before.get(
            "pagedserve_http_requests_total", default=0.0, route=route, status=status
        )

    assert counted("/v1/completions", "415") == 1 and counted("/v1/chat/completions", "400") == 1
    assert counted("unmatched", "415") == counted("unmatched", "400") == 0
    assert counted("unmatched", "404") == 1  # a path no route matches stays "unmatched"

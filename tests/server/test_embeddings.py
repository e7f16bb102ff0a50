"""POST /v1/embeddings on a real uvicorn server, through the openai SDK (which asks for base64) and httpx:
the vectors the offline engine gives (and HF's, tests/engine/test_pooling.py), OpenAI's response shape and
errors, vLLM's chat-style `messages` input; a generative model refuses it and a pooling model refuses
generation."""

from __future__ import annotations

import base64
import json
import shlex
import struct
from urllib.parse import urlsplit

import numpy as np
import openai
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from engine.pooling import PoolingParams
from server.cli import ready_message
from server.config.server_config import ServerConfig
from tests.engine.factories import make_tiny_embedding_dir
from tests.engine.references import make_llm
from tests.promtool import check_metrics
from tests.server.conftest import serving

TEXTS = ["hello world, this is a test", "the quick brown fox jumps over the lazy dog " * 4]


@pytest.fixture(scope="module")
def embedding_dir(tmp_path_factory):
    return make_tiny_embedding_dir(tmp_path_factory.mktemp("embed"), matryoshka_dimensions=[16, 64])


@pytest.fixture(scope="module")
def embedder(embedding_dir):
    with serving(embedding_dir, ServerConfig(served_model_name="tiny-embed")) as running:
        yield running


@pytest.fixture(scope="module")
def reference(embedding_dir):
    """The offline engine's embeddings of TEXTS (which test_pooling.py checks against HF)."""
    llm = make_llm(embedding_dir)
    return {
        dims: [
            torch.tensor(r.outputs.embedding) for r in llm.embed(TEXTS, PoolingParams(dimensions=dims), use_tqdm=False)
        ]
        for dims in (None, 16)
    }


def test_the_openai_sdk_gets_the_engines_vectors(embedder, reference):
    """The SDK sends encoding_format base64 and decodes float32 itself."""
    response = embedder.sdk().embeddings.create(model="tiny-embed", input=TEXTS)
    assert response.object == "list" and response.model == "tiny-embed"
    assert [d.index for d in response.data] == [0, 1]
    for data, expected in zip(response.data, reference[None]):
        assert data.object == "embedding"
        torch.testing.assert_close(torch.tensor(data.embedding), expected)
    tokenizer = embedder.engine.tokenizer
    num_tokens = sum(len(tokenizer.encode(t)) for t in TEXTS)
    assert response.usage.prompt_tokens == response.usage.total_tokens == num_tokens
    embedder.wait_idle()


def test_floats_token_ids_and_dimensions(embedder, reference):
    with embedder.client() as client:
        body = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "float"}).json()
        assert body["id"].startswith("embd-") and isinstance(body["created"], int)
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), reference[None][0])
        ids = embedder.engine.tokenizer.encode(TEXTS[1])
        for given in (ids, [ids]):
            body = client.post("/v1/embeddings", json={"input": given, "encoding_format": "float"}).json()
            torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), reference[None][1])
        body = client.post("/v1/embeddings", json={"input": TEXTS, "dimensions": 16}).json()
        assert [len(d["embedding"]) for d in body["data"]] == [16, 16]
        torch.testing.assert_close(torch.tensor(body["data"][1]["embedding"]), reference[16][1])
        # vLLM's byte order of base64 vectors
        body = client.post(
            "/v1/embeddings", json={"input": TEXTS[0], "encoding_format": "base64", "endianness": "big"}
        ).json()
        raw = base64.b64decode(body["data"][0]["embedding"])
        vector = torch.tensor(struct.unpack(f">{len(raw) // 4}f", raw))
        torch.testing.assert_close(vector, reference[None][0])
        # null is the default (float)
        body = client.post("/v1/embeddings", json={"input": TEXTS[0], "encoding_format": None}).json()
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]), reference[None][0])
        # vLLM's truncate_prompt_tokens: the last tokens kept
        body = client.post("/v1/embeddings", json={"input": TEXTS[1], "truncate_prompt_tokens": 5}).json()
        assert body["usage"]["prompt_tokens"] == 5
        # vLLM's normalize extra
        body = client.post("/v1/embeddings", json={"input": TEXTS[0], "normalize": False}).json()
        norm = float(np.linalg.norm(body["data"][0]["embedding"]))
        assert abs(norm - 1.0) > 1e-3
    embedder.wait_idle()


def test_chat_messages_are_rendered_by_the_template(embedder):
    """vLLM's chat embeddings: the conversation as the chat template writes it, without a generation prompt."""
    messages = [{"role": "user", "content": "hello there"}]
    with embedder.client() as client:
        chat = client.post("/v1/embeddings", json={"messages": messages, "encoding_format": "float"}).json()
        rendered = client.post("/tokenize", json={"messages": messages, "add_generation_prompt": False}).json()
        by_ids = client.post("/v1/embeddings", json={"input": rendered["tokens"], "encoding_format": "float"}).json()
    assert chat["usage"]["prompt_tokens"] == rendered["count"]
    torch.testing.assert_close(torch.tensor(chat["data"][0]["embedding"]), torch.tensor(by_ids["data"][0]["embedding"]))
    embedder.wait_idle()


@pytest.mark.parametrize(
    "body,param,fragment",
    [
        ({"input": TEXTS[0], "dimensions": 8}, "dimensions", "matryoshka dimensions [16, 64]"),
        ({"input": TEXTS[0], "dimensions": 0}, "dimensions", "at least 1"),
        ({"input": ""}, "input", None),
        ({"input": []}, "input", "must not be empty"),
        ({}, "input", "exactly one of input or messages"),
        ({"input": "x", "messages": [{"role": "user", "content": "x"}]}, "input", "exactly one"),
        ({"input": [list(range(300))]}, "input", "context length is 256 tokens, but the input has 300"),
        ({"input": [[100000]]}, "input", "outside the vocabulary"),
        ({"input": "x", "model": "nope"}, "model", "nope"),
        ({"input": "x", "encoding_format": "bytes"}, "encoding_format", None),
        ({"input": "x", "embed_dtype": "float16"}, "embed_dtype", None),
        ({"input": "x", "priority": 3}, "priority", "scheduling-policy priority"),
    ],
)
def test_bad_requests_name_their_field(embedder, body, param, fragment):
    with embedder.client() as client:
        response = client.post("/v1/embeddings", json=body)
    error = response.json()["error"]
    assert response.status_code == (404 if param == "model" else 400), error
    assert error["param"] == param or param in (error["param"] or ""), error
    if fragment is not None:
        assert fragment in error["message"]
    embedder.wait_idle()


def test_a_pooling_model_generates_nothing(embedder):
    sdk = embedder.sdk()
    with pytest.raises(openai.BadRequestError, match="served for pooling"):
        sdk.completions.create(model="tiny-embed", prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="served for pooling"):
        sdk.chat.completions.create(model="tiny-embed", messages=[{"role": "user", "content": "hi"}])
    with embedder.client() as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == "tiny-embed"
        assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200
    embedder.wait_idle()


def scrape(client) -> tuple[str, dict[tuple[str, frozenset], float]]:
    """/metrics: its text, and every sample's value by (name, labels)."""
    response = client.get("/metrics")
    assert response.status_code == 200
    families = text_string_to_metric_families(response.text)
    return response.text, {(s.name, frozenset(s.labels.items())): s.value for f in families for s in f.samples}


def test_metrics_count_embedding_requests(embedder):
    """Each input is one request: finished ("stop") with its prompt tokens and no generated ones; an input the
    engine refuses is a rejected failure; the exposition stays valid for Prometheus."""
    with embedder.client() as client:
        _, before = scrape(client)
        prompt_tokens = 0
        for body in ({"input": TEXTS}, {"input": TEXTS[0], "dimensions": 16}):
            response = client.post("/v1/embeddings", json=body)
            assert response.status_code == 200
            prompt_tokens += response.json()["usage"]["prompt_tokens"]
        assert client.post("/v1/embeddings", json={"input": [[100000]]}).status_code == 400
        embedder.wait_idle()
        text, after = scrape(client)
    result = check_metrics(text)
    assert result.returncode == 0 and not result.stdout.strip(), f"promtool:\n{result.stdout}{result.stderr}"

    def grown(name: str, **labels: str) -> float:
        key = (name, frozenset({"model_name": "tiny-embed", **labels}.items()))
        return after[key] - before.get(key, 0.0)

    assert grown("pagedserve_request_success_total", finished_reason="stop") == 3
    assert grown("pagedserve_prompt_tokens_total") == prompt_tokens
    assert grown("pagedserve_generation_tokens_total") == 0
    assert grown("pagedserve_request_failure_total", reason="rejected") == 1
    assert grown("pagedserve_e2e_request_latency_seconds_count") == 3
    assert grown("pagedserve_request_prompt_tokens_sum") == prompt_tokens
    assert grown("pagedserve_http_requests_total", route="/v1/embeddings", status="200") == 2
    assert grown("pagedserve_http_requests_total", route="/v1/embeddings", status="400") == 1
    assert after[("pagedserve_num_requests_running", frozenset({"model_name": "tiny-embed"}.items()))] == 0


def test_the_start_up_lines_curl_embeds_on_a_pooling_model(embedder):
    """The ready-to-paste curl line that `pagedserve serve` prints asks a pooling model for an embedding (a
    completion would be refused), and the server answers it."""
    url = urlsplit(embedder.base_url)
    assert url.hostname is not None and url.port is not None
    pooler = embedder.engine.engine.pooler
    assert pooler is not None
    message = ready_message(url.hostname, url.port, "tiny-embed", False, pooling=pooler.task)
    curl = shlex.split(message.splitlines()[-1])
    assert urlsplit(curl[1]).path == "/v1/embeddings"
    with embedder.client() as client:
        response = client.post(
            curl[1], content=curl[curl.index("-d") + 1], headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 200, response.text
    assert len(response.json()["data"][0]["embedding"]) == 64
    assert json.loads(curl[curl.index("-d") + 1]) == {"model": "tiny-embed", "input": "The capital of France is"}
    embedder.wait_idle()


def test_a_generative_model_refuses_embeddings(server):
    with pytest.raises(openai.BadRequestError, match="does not support the Embeddings API") as caught:
        server.sdk().embeddings.create(model=server.model_name, input="hi")
    assert caught.value.body["param"] == "model"


def test_strict_params_refuse_unknown_fields(embedding_dir):
    with serving(embedding_dir, ServerConfig(strict_params=True)) as running, running.client() as client:
        response = client.post("/v1/embeddings", json={"input": "x", "colour": "blue"})
        assert response.status_code == 400 and response.json()["error"]["param"] == "colour"
        assert client.post("/v1/embeddings", json={"input": "x", "user": "u1"}).status_code == 200
        running.wait_idle()


def test_log_requests_names_the_inputs_never_their_text(embedding_dir, caplog):
    import logging

    secret = "the secret input text"
    with serving(embedding_dir, ServerConfig(enable_log_requests=True)) as running:
        with caplog.at_level(logging.INFO, logger="server.serving.pipeline"), running.client() as client:
            assert (
                client.post("/v1/embeddings", json={"input": [secret, "b"], "request_id": "embd-log"}).status_code
                == 200
            )
        running.wait_idle()
    lines = [r.getMessage() for r in caplog.records if r.name == "server.serving.pipeline"]
    tokens = len(running.engine.tokenizer.encode(secret))
    assert f"request embd-log-0: 2 pooled input(s), prompt tokens {tokens}," in "\n".join(lines)
    assert not any(secret in line for line in lines)


def test_the_pooling_api_gives_an_embedding_models_vectors(embedder, reference):
    """vLLM's POST /pooling: /v1/embeddings' request, each input's pooled vector in `data`."""
    with embedder.client() as client:
        body = client.post("/pooling", json={"input": TEXTS, "encoding_format": "float"}).json()
        assert body["id"].startswith("pool-") and body["object"] == "list" and body["model"] == "tiny-embed"
        assert [(d["index"], d["object"]) for d in body["data"]] == [(0, "pooling"), (1, "pooling")]
        for data, expected in zip(body["data"], reference[None]):
            torch.testing.assert_close(torch.tensor(data["data"]), expected)
        short = client.post("/pooling", json={"input": TEXTS[1], "dimensions": 16}).json()
        torch.testing.assert_close(torch.tensor(short["data"][0]["data"]), reference[16][1])
        encoded = client.post("/pooling", json={"input": TEXTS[0], "encoding_format": "base64"}).json()
        raw = base64.b64decode(encoded["data"][0]["data"])
        torch.testing.assert_close(torch.tensor(struct.unpack(f"={len(raw) // 4}f", raw)), reference[None][0])
        refused = client.post("/pooling", json={"input": TEXTS[0], "use_activation": False})
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "use_activation"
    embedder.wait_idle()


def test_a_generative_model_refuses_the_pooling_api(server):
    with server.client() as client:
        response = client.post("/pooling", json={"input": "hi"})
    assert response.status_code == 400 and "does not support the Pooling API" in response.json()["error"]["message"]

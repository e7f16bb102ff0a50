"""Routes and fields users of other OpenAI-compatible servers expect: GET /v1/models/{model} (the SDK's
`models.retrieve`), HEAD on /health and /metrics, `stream_options.continuous_usage_stats`."""

from __future__ import annotations

import logging

import openai
import pytest

from tests.server.sse_frames import stream_raw
from tests.server.test_errors import assert_error

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"


def test_sdk_retrieves_the_served_model(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    model = client.models.retrieve("tiny")
    assert model.id == "tiny" and model.object == "model"
    assert model.model_dump()["max_model_len"] == server.state.max_model_len
    listed = client.models.list().data[0].model_dump()
    assert {k: v for k, v in model.model_dump().items() if k != "created"} == {
        k: v for k, v in listed.items() if k != "created"
    }


@pytest.mark.parametrize("name", ["gpt-4o", "org/tiny", "tiny/extra"])
def test_an_unknown_model_id_is_a_404_in_the_envelope(server, name):
    with server.client() as c:
        error = assert_error(c.get(f"/v1/models/{name}"), 404, "model", "model_not_found")
    assert name in error["message"]
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve(name)


@pytest.mark.parametrize("path", ["/health", "/metrics"])
def test_head_probes_get_200_and_no_body(server, path):
    with server.client() as c:
        head, get = c.head(path), c.get(path)
    assert head.status_code == get.status_code == 200
    assert head.content == b""


def test_head_on_health_says_503_while_draining(server, monkeypatch):
    monkeypatch.setattr(server.state, "draining", True)
    with server.client() as c:
        response = c.head("/health")
    assert response.status_code == 503 and response.content == b""


CONTINUOUS = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize("n", [1, 2])
def test_completions_continuous_usage_counts_each_choice_on_every_chunk(server, n):
    payloads = stream_raw(
        server,
        COMPLETIONS,
        prompt="Hello there",
        max_tokens=5,
        ignore_eos=True,
        n=n,
        temperature=0,
        stream_options=CONTINUOUS,
    )
    *chunks, final = payloads
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 5 * n
    prompt_tokens = final["usage"]["prompt_tokens"]
    seen: dict[int, int] = {}
    for chunk in chunks:
        (choice,) = chunk["choices"]
        usage = chunk["usage"]
        assert usage["prompt_tokens"] == prompt_tokens  # one prompt: its tokens, once per choice
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        assert usage["completion_tokens"] >= seen.get(choice["index"], 0)  # cumulative for the choice
        seen[choice["index"]] = usage["completion_tokens"]
    assert seen == {i: 5 for i in range(n)}


def test_chat_continuous_usage_starts_at_zero_and_ends_at_the_total(server):
    payloads = stream_raw(
        server,
        CHAT,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        ignore_eos=True,
        temperature=0,
        stream_options=CONTINUOUS,
    )
    first, *chunks, final = payloads
    assert first["choices"][0]["delta"]["role"] == "assistant"
    assert first["usage"]["completion_tokens"] == 0
    assert all(chunk["usage"] is not None for chunk in chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 4 == final["usage"]["completion_tokens"]


def test_continuous_usage_without_include_usage_has_no_final_usage_chunk(server):
    payloads = stream_raw(
        server,
        COMPLETIONS,
        prompt="Hello",
        max_tokens=3,
        ignore_eos=True,
        stream_options={"continuous_usage_stats": True},
    )
    assert all(p["choices"] for p in payloads)  # no usage-only chunk
    assert payloads[-1]["usage"]["completion_tokens"] == 3


def test_without_continuous_usage_chunks_carry_no_usage(server):
    payloads = stream_raw(
        server, COMPLETIONS, prompt="Hello", max_tokens=3, ignore_eos=True, stream_options={"include_usage": True}
    )
    assert all(p["usage"] is None for p in payloads[:-1]) and payloads[-1]["usage"] is not None


@pytest.mark.parametrize("fields, param", [({"suffix": "and then"}, "suffix"), ({"best_of": 2}, "best_of")])
def test_unsupported_completion_parameters_carry_the_code(server, fields, param):
    with server.client() as c:
        response = c.post(COMPLETIONS, json={"model": "tiny", "prompt": "Hello", **fields})
    assert_error(response, 400, param, "unsupported_parameter")


def test_requests_are_not_logged_by_default(server, caplog):
    with caplog.at_level(logging.DEBUG, logger="server.serving.pipeline"), server.client() as c:
        reply = c.post(COMPLETIONS, json={"model": "tiny", "prompt": "a private prompt", "max_tokens": 2})
    assert reply.status_code == 200
    assert not [r for r in caplog.records if reply.json()["id"] in r.getMessage()]
    assert "private prompt" not in caplog.text


def test_several_served_names_each_answer_and_the_card_roots_at_the_checkpoint(tiny_model_dir):
    """`--served-model-name a b` (vLLM's nargs): /v1/models lists every name, each with `root` the checkpoint as
    given (it was the served name), a request may name any of them and is answered under that name, and one that
    names none gets the first (it exited 2: "unrecognized arguments")."""
    from server.config.server_config import ServerConfig
    from server.config.settings import load_settings
    from tests.server.conftest import serving

    settings = load_settings(["--served-model-name", "tiny-a", "tiny-b"], {})
    assert settings.server.served_model_name == ["tiny-a", "tiny-b"]
    assert load_settings([], {"PAGEDSERVE_SERVED_MODEL_NAME": "x, y"}).server.served_model_name == ["x", "y"]
    assert ServerConfig(served_model_name="one").served_model_name == ["one"]

    with serving(tiny_model_dir, settings.server) as running:
        client = running.sdk()
        cards = client.models.list().data
        assert [card.id for card in cards] == ["tiny-a", "tiny-b"]
        assert {card.model_dump()["root"] for card in cards} == {str(tiny_model_dir)}
        for name in ("tiny-a", "tiny-b"):
            assert client.completions.create(model=name, prompt="hi", max_tokens=1).model == name
        with running.client() as c:
            assert c.post("/v1/completions", json={"prompt": "hi", "max_tokens": 1}).json()["model"] == "tiny-a"
        assert 'model_name="tiny-a"' in running.state.metrics.render().decode()

"""A dense family beyond Llama (Gemma 2: sliding windows, soft-capping) and a mixture of experts (Qwen3-MoE)
served through the real server: /v1/completions over HTTP gives HF transformers' greedy tokens and logprobs."""

from __future__ import annotations

import json

import httpx
import pytest

from server.config.server_config import ServerConfig
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import hf_greedy
from tests.server.conftest import start_server

MAX_TOKENS = 12
PROMPTS = ([5, 17, 42, 8, 99, 3, 61, 7, 23, 11, 4, 88, 15, 9], [31, 2, 77, 45, 6, 12, 19, 53, 28, 70, 33])
FAMILIES = {
    "gemma2": ("gemma2", {}),
    "qwen3_moe": (
        "llama",
        dict(
            architectures=["Qwen3MoeForCausalLM"],
            model_type="qwen3_moe",
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            head_dim=16,
            num_hidden_layers=3,
            mlp_only_layers=[1],
            norm_topk_prob=True,
        ),
    ),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_server(request, tmp_path_factory):
    arch, overrides = FAMILIES[request.param]
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp(request.param), arch, **overrides)
    uv, thread, running = start_server(model_dir, ServerConfig(served_model_name=request.param))
    yield model_dir, running
    uv.should_exit = True
    thread.join(30)
    running.engine.engine.shutdown()


def test_greedy_completion_matches_hf(family_server):
    model_dir, server = family_server
    with server.client() as client:
        reply = client.post(
            "/v1/completions",
            json={
                "model": server.model_name,
                "prompt": list(PROMPTS),
                "max_tokens": MAX_TOKENS,
                "temperature": 0,
                "ignore_eos": True,
                "logprobs": 0,
            },
        )
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda c: c["index"])
    tokenizer = server.engine.tokenizer
    for prompt, choice in zip(PROMPTS, choices):
        tokens, logprobs = hf_greedy(model_dir, prompt, MAX_TOKENS)
        assert choice["text"] == tokenizer.decode(tokens)
        assert choice["logprobs"]["token_logprobs"] == pytest.approx(logprobs, abs=1e-4)
    server.wait_idle()


def test_streamed_chat_equals_the_whole_answer(family_server):
    _, server = family_server
    body = {
        "model": server.model_name,
        "messages": [{"role": "user", "content": "count: one two three"}],
        "max_tokens": MAX_TOKENS,
        "temperature": 0,
        "ignore_eos": True,
    }
    with server.client() as client:
        whole = client.post("/v1/chat/completions", json=body).json()["choices"][0]["message"]["content"]
        pieces = []
        with client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as stream:
            for line in stream.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    delta = json.loads(line[6:])["choices"]
                    pieces += [d["delta"].get("content") or "" for d in delta]
    assert "".join(pieces) == whole and whole
    server.wait_idle()


def test_the_served_family_is_named_in_models(family_server):
    _, server = family_server
    with httpx.Client(base_url=server.base_url, timeout=30) as client:
        assert client.get("/v1/models").json()["data"][0]["id"] == server.model_name

"""The error contract: every error is `{"error": {"message", "type", "param", "code"}}` with the
right HTTP status, and a bad parameter is a 400 naming it (DESIGN.md, "Error contract")."""

from __future__ import annotations

import time
import uuid

import openai
import pytest

from server.config.server_config import ServerConfig
from tests.server.conftest import start_server

COMPLETIONS = "/v1/completions"
CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "Hello"}]

TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    503: "service_unavailable_error",
}
ANY = object()


def assert_error(response, status: int, param=ANY, code=ANY) -> dict:
    """The exact envelope, its type for `status`, and (when given) its param and code."""
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    body = response.json()
    assert list(body) == ["error"]
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert error["type"] == TYPES[status]
    if param is not ANY:
        assert error["param"] == param, error
    if code is not ANY:
        assert error["code"] == code, error
    return error


def post(server, path: str, body) -> object:
    with server.client() as c:
        return c.post(path, json=body)


@pytest.fixture(scope="module")
def strict_server(tiny_model_dir):
    uv, thread, running = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny", strict_params=True))
    yield running
    running.wait_idle()
    uv.should_exit = True
    thread.join(30)


# ------------------------------------------------------------------ 400 naming the parameter

COMPLETION_CASES = [
    ({"temperature": -1}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"n": 0}, "n"),
    ({"n": "two"}, "n"),
    ({"logprobs": 21}, "logprobs"),
    ({"logprobs": -1}, "logprobs"),
    ({"logprobs": "many"}, "logprobs"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"frequency_penalty": -2.5}, "frequency_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"max_tokens": "ten"}, "max_tokens"),
    ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
    ({"min_tokens": -1}, "min_tokens"),
    ({"logit_bias": {"600": 1}}, "logit_bias"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"5": 500}}, "logit_bias"),
    ({"seed": 1.5}, "seed"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"echo": "maybe"}, "echo"),
    ({"stream": "sometimes"}, "stream"),
    ({"top_k": -5}, "top_k"),
    ({"min_p": 2}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"stream_options": {"include_usage": True, "bogus": 1}, "stream": True}, "stream_options"),
    ({"suffix": "and then"}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 1, "n": 2}, "best_of"),
]


@pytest.mark.parametrize(
    "fields, param", COMPLETION_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(COMPLETION_CASES)]
)
def test_completion_bad_parameter(server, fields, param):
    error = assert_error(post(server, COMPLETIONS, {"model": "tiny", "prompt": "Hello", **fields}), 400, param)
    assert param in error["message"]


PROMPT_CASES = [
    ("missing", None),
    ("empty list", []),
    ("empty string", ""),
    ("empty token list", [[]]),
    ("wrong type", 5),
    ("mixed list", [1, "a"]),
    ("token id out of vocab", [600]),
    ("negative token id", [-1]),
    ("second prompt out of vocab", [[1, 2], [9999]]),
]


@pytest.mark.parametrize("case, prompt", PROMPT_CASES, ids=[c for c, _ in PROMPT_CASES])
def test_completion_bad_prompt(server, case, prompt):
    body = {"model": "tiny", "max_tokens": 2}
    if case != "missing":
        body["prompt"] = prompt
    error = assert_error(post(server, COMPLETIONS, body), 400, "prompt")
    if "vocab" in case:
        assert "vocabulary" in error["message"]


CHAT_CASES = [
    ({"temperature": -1}, "temperature"),
    ({"top_p": 0}, "top_p"),
    ({"n": 0}, "n"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"min_tokens": 9, "max_tokens": 3}, "min_tokens"),
    ({"logit_bias": {"512": 1}}, "logit_bias"),
    ({"top_logprobs": 2}, "top_logprobs"),  # without logprobs
    ({"logprobs": "yes please"}, "logprobs"),
    ({"stop": {"a": 1}}, "stop"),
]


@pytest.mark.parametrize("fields, param", CHAT_CASES, ids=[f"{p}-{i}" for i, (_, p) in enumerate(CHAT_CASES)])
def test_chat_bad_parameter(server, fields, param):
    error = assert_error(post(server, CHAT, {"model": "tiny", "messages": MESSAGES, **fields}), 400, param)
    assert param in error["message"]


MESSAGES_CASES = [
    ("missing", None, "messages"),
    ("empty", [], "messages"),
    ("not a list", "Hello", "messages"),
    ("unknown role", [{"role": "robot", "content": "x"}], "messages"),
    ("no role", [{"content": "x"}], "messages"),
    ("function message", [*MESSAGES, {"role": "function", "content": "42", "name": "f"}], "messages[1].role"),
    ("user without content", [{"role": "user"}], "messages[0].content"),
    ("user with null content", [{"role": "user", "content": None}], "messages[0].content"),
    ("system without content", [{"role": "system"}, *MESSAGES], "messages[0].content"),
    ("assistant with neither content nor calls", [*MESSAGES, {"role": "assistant"}], "messages[1].content"),
    ("tool without tool_call_id", [*MESSAGES, {"role": "tool", "content": "42"}], "messages[1].tool_call_id"),
    ("text part without text", [{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
    (
        "text part of a number",
        [{"role": "user", "content": [{"type": "text", "text": 5}]}],
        "messages[0].content[0].text",
    ),
    ("no parts", [{"role": "user", "content": []}], "messages[0].content"),
    (
        "a user's refusal part",
        [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}],
        "messages[0].content[0]",
    ),
]


@pytest.mark.parametrize("case, messages, param", MESSAGES_CASES, ids=[c for c, _, _ in MESSAGES_CASES])
def test_chat_bad_messages(server, case, messages, param):
    body = {"model": "tiny"}
    if case != "missing":
        body["messages"] = messages
    error = assert_error(post(server, CHAT, body), 400, param)
    if case == "assistant with neither content nor calls":
        assert error["message"] == "an assistant message needs content."
    if case.startswith("text part"):
        assert error["code"] is None and "needs its 'text' as a string" in error["message"]


def test_an_assistant_refusal_part_is_history(server):
    """OpenAI's assistant content may hold a refusal part: the model said it, so the template shows its text."""
    refused = {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't help with that."}]}
    response = post(server, CHAT, {"model": "tiny", "max_tokens": 2, "messages": [*MESSAGES, refused, *MESSAGES]})
    assert response.status_code == 200, response.text


UNSUPPORTED_CASES = [
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0].type"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"reasoning_effort": "low"}, "reasoning_effort"),
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
]


@pytest.mark.parametrize("fields, param", UNSUPPORTED_CASES, ids=[p for _, p in UNSUPPORTED_CASES])
def test_chat_unsupported_feature(server, fields, param):
    error = assert_error(
        post(server, CHAT, {"model": "tiny", "messages": MESSAGES, **fields}), 400, param, "unsupported_parameter"
    )
    assert param in error["message"]


@pytest.mark.parametrize(
    "part",
    [
        {"type": "image_url", "image_url": {"url": "http://127.0.0.1/cat.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
    ],
    ids=["image", "audio"],
)
def test_chat_non_text_content_part(server, part):
    messages = [{"role": "user", "content": [{"type": "text", "text": "look"}, part]}]
    error = assert_error(
        post(server, CHAT, {"model": "tiny", "messages": messages}),
        400,
        "messages[0].content[1]",
        "unsupported_parameter",
    )
    assert part["type"] in error["message"]


# ------------------------------------------------------------------ model, context length


@pytest.mark.parametrize(
    "path, body",
    [
        (COMPLETIONS, {"prompt": "Hello"}),
        (CHAT, {"messages": MESSAGES}),
        (COMPLETIONS, {"prompt": "Hello", "stream": True}),
        ("/tokenize", {"prompt": "Hello"}),
        ("/detokenize", {"tokens": [1, 2]}),
    ],
    ids=["completions", "chat", "stream", "tokenize", "detokenize"],
)
def test_unknown_model_is_404(server, path, body):
    error = assert_error(post(server, path, {"model": "gpt-nonexistent", **body}), 404, "model", "model_not_found")
    assert "gpt-nonexistent" in error["message"]


def test_context_length_exceeded(server):
    error = assert_error(
        post(server, COMPLETIONS, {"model": "tiny", "prompt": [5] * 200, "max_tokens": 100}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    assert all(number in error["message"] for number in ("256", "200", "100"))

    error = assert_error(
        post(server, COMPLETIONS, {"model": "tiny", "prompt": [5] * 300, "max_tokens": 1}),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert "256" in error["message"] and "300" in error["message"]

    # refused before a stream starts: a plain JSON 400, not an event stream
    response = post(server, COMPLETIONS, {"model": "tiny", "prompt": [5] * 200, "max_tokens": 100, "stream": True})
    assert_error(response, 400, "max_tokens", "context_length_exceeded")

    with server.client() as c:
        n_prompt = c.post("/tokenize", json={"messages": MESSAGES}).json()["count"]
    error = assert_error(
        post(server, CHAT, {"model": "tiny", "messages": MESSAGES, "max_tokens": 250}),
        400,
        "max_tokens",
        "context_length_exceeded",
    )
    assert str(n_prompt) in error["message"] and "250" in error["message"] and "256" in error["message"]

    # exactly at the limit is fine
    out = post(server, COMPLETIONS, {"model": "tiny", "prompt": [5] * 250, "max_tokens": 6, "temperature": 0})
    assert out.status_code == 200, out.text


# ------------------------------------------------------------------ unknown fields


@pytest.mark.parametrize(
    "path, body",
    [
        (COMPLETIONS, {"prompt": "Hello"}),
        (CHAT, {"messages": MESSAGES}),
    ],
    ids=["completions", "chat"],
)
def test_unknown_fields_accepted_by_default(server, path, body):
    response = post(server, path, {"model": "tiny", "max_tokens": 2, "not_a_real_field": 1, **body})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize(
    "path, body",
    [
        (COMPLETIONS, {"prompt": "Hello"}),
        (CHAT, {"messages": MESSAGES}),
    ],
    ids=["completions", "chat"],
)
def test_unknown_fields_refused_when_strict(strict_server, path, body):
    error = assert_error(
        post(strict_server, path, {"model": "tiny", "max_tokens": 2, "not_a_real_field": 1, **body}),
        400,
        "not_a_real_field",
    )
    assert "not_a_real_field" in error["message"]
    # known fields, vLLM's extras included, still pass
    response = post(strict_server, path, {"model": "tiny", "max_tokens": 2, "top_k": 3, "ignore_eos": True, **body})
    assert response.status_code == 200, response.text


@pytest.mark.parametrize("path, body", [("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [5]})])
def test_tokenize_refuses_unknown_fields_when_strict(strict_server, path, body):
    assert_error(post(strict_server, path, {"not_a_real_field": 1, **body}), 400, "not_a_real_field")
    # a generation's structured-output extras constrain nothing here
    assert_error(post(strict_server, path, {"guided_json": {"type": "object"}, **body}), 400, "guided_json")
    assert post(strict_server, path, body).status_code == 200


# ------------------------------------------------------------------ HTTP-level errors


@pytest.mark.parametrize(
    "content",
    [b'{"model": "tiny", "prompt": "x",', b"not json", b"[1, 2]", b""],
    ids=["truncated", "garbage", "array", "empty"],
)
def test_malformed_body(server, content):
    with server.client() as c:
        response = c.post(COMPLETIONS, content=content, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_malformed_json_names_no_parameter(server):
    with server.client() as c:
        response = c.post(COMPLETIONS, content=b'{"model": "tiny",', headers={"content-type": "application/json"})
    assert_error(response, 400, None)


@pytest.mark.parametrize(
    "path, body, param",
    [
        (COMPLETIONS, b'{"model": "tiny", "max_tokens": 1, "prompt": "a\\ud800b"}', "prompt"),
        (CHAT, b'{"max_tokens": 1, "messages": [{"role": "user", "content": "\\udc00"}]}', "messages[0].content"),
        ("/v1/responses", b'{"max_output_tokens": 1, "input": ["ok", "x\\ud83c"]}', "input[1]"),
        ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ],
)
def test_lone_surrogate_is_400(server, path, body, param):
    """A \\u escape of half a surrogate pair decodes to no Unicode character: no tokenizer takes it (it was a 500)."""
    with server.client() as c:
        response = c.post(path, content=body, headers={"content-type": "application/json"})
        assert_error(response, 400, param)
        assert "surrogate" in response.json()["error"]["message"]
        # a whole pair is one character (U+1F389), as any JSON encoder may write it
        pair = b'{"model": "tiny", "max_tokens": 1, "prompt": "\\ud83c\\udf89"}'
        assert c.post(COMPLETIONS, content=pair, headers={"content-type": "application/json"}).status_code == 200


def test_unknown_route_is_404(server):
    with server.client() as c:
        assert_error(c.get("/v1/does-not-exist"), 404, None)
        assert_error(c.post("/nope", json={}), 404, None)


def test_wrong_method_is_405(server):
    with server.client() as c:
        for response in (c.get(COMPLETIONS), c.delete(CHAT), c.post("/v1/models")):
            assert_error(response, 405, None)
            assert response.headers["allow"]


# ------------------------------------------------------------------ the SDK's view


def test_sdk_nulls_mean_the_defaults(server):
    """OpenAI declares n, stream, echo and chat's logprobs nullable; the SDK sends `None` as null."""
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=2, n=None, stream=None, logprobs=None
    )
    assert len(chat.choices) == 1 and chat.choices[0].logprobs is None
    completion = client.completions.create(model="tiny", prompt="Hi", max_tokens=2, n=None, echo=None, stream=None)
    assert len(completion.choices) == 1 and completion.usage.completion_tokens <= 2
    response = client.responses.create(model="tiny", input="Hi", max_output_tokens=2, stream=None)
    assert response.object == "response"


def test_sdk_raises_typed_errors(server):
    client = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="tiny", prompt="Hello", temperature=-1)
    assert info.value.status_code == 400
    assert info.value.body["param"] == "temperature" and info.value.body["type"] == "invalid_request_error"
    assert info.value.param == "temperature"

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=300)
    assert info.value.status_code == 400 and info.value.code == "context_length_exceeded"

    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="nope", messages=MESSAGES)
    assert info.value.status_code == 404
    assert info.value.body == {
        "message": info.value.body["message"],
        "type": "not_found_error",
        "param": "model",
        "code": "model_not_found",
    }

    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            stream=True,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert info.value.body["param"] == "tool_choice"


# ------------------------------------------------------------------ known bugs


def test_chat_top_logprobs_out_of_range_names_top_logprobs(server):
    response = post(server, CHAT, {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21})
    assert_error(response, 400, "top_logprobs")


def test_chat_max_completion_tokens_names_itself(server):
    response = post(server, CHAT, {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 0})
    assert_error(response, 400, "max_completion_tokens")


def test_chat_refusals_name_chat_fields(server):
    """Refusals found after the sampling parameters (context length) name the fields chat has."""
    error = assert_error(
        post(server, CHAT, {"model": "tiny", "messages": MESSAGES, "max_completion_tokens": 250}),
        400,
        "max_completion_tokens",
        "context_length_exceeded",
    )
    assert "max_completion_tokens" in error["message"] and "max_tokens" not in error["message"].replace(
        "max_completion_tokens", ""
    )
    long_messages = [{"role": "user", "content": "hello " * 400}]
    assert_error(
        post(server, CHAT, {"model": "tiny", "messages": long_messages, "max_tokens": 1}),
        400,
        "messages",
        "context_length_exceeded",
    )
    error = assert_error(
        post(server, CHAT, {"model": "tiny", "messages": MESSAGES, "logprobs": True, "top_logprobs": 21}),
        400,
        "top_logprobs",
    )
    assert "top_logprobs" in error["message"]


@pytest.mark.parametrize("field, value", [("temperature", True), ("n", True), ("stream", "yes")])
def test_wrongly_typed_value_is_not_coerced(server, field, value):
    response = post(server, COMPLETIONS, {"model": "tiny", "prompt": "Hello", "max_tokens": 1, field: value})
    assert_error(response, 400, field)


def test_continuous_usage_stats_puts_usage_on_every_chunk(server):
    body = {
        "model": "tiny",
        "prompt": "Hello",
        "max_tokens": 3,
        "stream": True,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    with server.client() as c:
        response = c.post(COMPLETIONS, json=body)
    frames = [f for f in response.text.split("\n\n") if f.startswith("data: {")]
    assert response.status_code == 200 and frames and all('"usage":null' not in f for f in frames)


def test_duplicate_request_id_is_a_400(server, monkeypatch):
    runner = server.engine.engine.runner
    execute = runner.execute

    def slow_execute(scheduler_output):  # keeps the first request running while the second arrives
        time.sleep(0.05)
        return execute(scheduler_output)

    monkeypatch.setattr(runner, "execute", slow_execute)
    request_id = f"dup-{uuid.uuid4().hex}"
    body = {"model": "tiny", "prompt": "Hello", "temperature": 0, "request_id": request_id}
    long_stream = {**body, "max_tokens": 200, "ignore_eos": True, "stream": True}
    with server.client() as holder, holder.stream("POST", COMPLETIONS, json=long_stream) as running:
        assert running.status_code == 200
        lines = running.iter_lines()  # kept: dropping the iterator would close the stream (an abort)
        next(lines)  # the first request is in the engine now
        with server.client() as c:
            response = c.post(COMPLETIONS, json={**body, "max_tokens": 2})
        assert_error(response, 400, "request_id")


def test_draining_server_answers_503(server):
    server.state.draining = True  # what the app's lifespan sets at shutdown
    try:
        with server.client() as c:
            response = c.post(COMPLETIONS, json={"model": "tiny", "prompt": "hi", "max_tokens": 1})
        assert_error(response, 503)
    finally:
        server.state.draining = False

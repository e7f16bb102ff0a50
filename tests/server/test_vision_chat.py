"""Images in chat requests, on a real uvicorn server serving a tiny LLaVA (and a tiny Qwen2-VL), through the openai
SDK and httpx: data: URLs, http(s) URLs fetched from a loopback image server (redirects, --allowed-media-domains,
timeouts, sizes), the answers HF gives for the same images; refusals as 400s naming the part; the KV cache empty
after each."""

from __future__ import annotations

import contextlib
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Iterator

import httpx
import openai
import pytest

from server.config.server_config import ServerConfig
from tests.engine.factories import EOS_ID
from tests.engine.qwen_vl_factories import hf_greedy as qwen_hf_greedy
from tests.engine.qwen_vl_factories import hf_inputs, make_tiny_qwen_vl_dir, qwen_chat_text
from tests.engine.vision_factories import chat_text, data_url, hf_greedy, make_tiny_llava_dir, random_image
from tests.ports import free_port
from tests.server.conftest import RunningServer, pace_engine, serving

QUESTION = {"type": "text", "text": "What is in the picture?"}
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory):
    return make_tiny_llava_dir(tmp_path_factory.mktemp("llava-http"))


@pytest.fixture(scope="module")
def vlm(llava_dir) -> Iterator[RunningServer]:
    config = ServerConfig(served_model_name="tiny-llava", max_request_body=256 * 1024, media_fetch_timeout=1.0)
    with serving(llava_dir, config, limit_mm_per_prompt={"image": 2}) as running:
        yield running


@contextlib.contextmanager
def image_server(png: bytes) -> Iterator[str]:
    """A loopback HTTP server: /picture.png, /moved (302 to it), /away (302 to the same file at `localhost`),
    /slow (2 s before answering), /drip (its bytes in 8 parts 0.3 s apart: no single read waits a second),
    /big (300 KiB), anything else 404."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 - http.server's name
            port = self.server.server_address[1]
            if self.path == "/picture.png":
                self._send(200, png, "image/png")
            elif self.path in ("/moved", "/away"):
                host = "127.0.0.1" if self.path == "/moved" else "localhost"
                self.send_response(302)
                self.send_header("Location", f"http://{host}:{port}/picture.png")
                self.send_header("Content-Length", "0")
                self.end_headers()
            elif self.path == "/slow":
                time.sleep(2)
                self._send(200, png, "image/png")
            elif self.path == "/drip":
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(png)))
                self.end_headers()
                step = -(-len(png) // 8)
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                    for start in range(0, len(png), step):
                        self.wfile.write(png[start : start + step])
                        self.wfile.flush()
                        time.sleep(0.3)
            elif self.path == "/big":
                self._send(200, b"\0" * (300 * 1024), "image/png")
            else:
                self._send(404, b"no such picture", "text/plain")

        def _send(self, status: int, body: bytes, kind: str) -> None:
            self.send_response(status)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                self.wfile.write(body)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def ask(server: RunningServer, *parts, **extra):
    return server.sdk().chat.completions.create(
        model=server.model_name,
        messages=[{"role": "user", "content": list(parts)}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        **extra,
    )


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, "detail": "auto"}}


def expected_text(server: RunningServer, llava_dir, image) -> str:
    tokens, _ = hf_greedy(llava_dir, chat_text([image, QUESTION["text"]]), [image], MAX_TOKENS)
    return server.engine.tokenizer.decode(tokens, skip_special_tokens=True)


def refusal(server: RunningServer, *parts) -> dict:
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, *parts)
    return caught.value.body


def test_a_data_url_image_gets_hfs_answer(vlm, llava_dir):
    image = random_image(0)
    response = ask(vlm, image_part(data_url(image)), QUESTION)
    assert response.choices[0].message.content == expected_text(vlm, llava_dir, image)
    tokens = (
        vlm.client()
        .post("/tokenize", json={"messages": [{"role": "user", "content": [image_part(data_url(image)), QUESTION]}]})
        .json()["tokens"]
    )
    assert response.usage.prompt_tokens == len(tokens) and tokens.count(512) == 25
    streamed = vlm.sdk().chat.completions.create(
        model=vlm.model_name,
        messages=[{"role": "user", "content": [image_part(data_url(image, "JPEG")), QUESTION]}],
        max_tokens=MAX_TOKENS,
        temperature=0,
        stream=True,
    )
    assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices)
    vlm.wait_idle()


def test_http_image_urls_are_fetched(vlm, llava_dir):
    image = random_image(1)
    expected = expected_text(vlm, llava_dir, image)
    with image_server(_png(image)) as base:
        for path in ("/picture.png", "/moved"):
            assert ask(vlm, image_part(base + path), QUESTION).choices[0].message.content == expected
        missing = refusal(vlm, image_part(base + "/missing.png"), QUESTION)
        assert "HTTP 404" in missing["message"] and missing["param"] == "messages[0].content[0].image_url.url"
        for slow in ("/slow", "/drip"):  # (the timeout bounds the whole fetch, not each read)
            started = time.monotonic()
            assert "--media-fetch-timeout" in refusal(vlm, image_part(base + slow), QUESTION)["message"]
            assert time.monotonic() - started < 1.9
        assert "--max-request-body" in refusal(vlm, image_part(base + "/big"), QUESTION)["message"]
    vlm.wait_idle()


def test_a_requests_fetched_images_weigh_together_at_most_the_body_limit(vlm):
    """Each under --max-request-body (256 KiB here), two over it: a request's URLs cannot make the server hold
    more than its body could have brought (999 images of 4 MiB each, by default, before)."""
    image = random_image(5, 240, 240)  # (random pixels: a PNG of about 170 KB)
    png = _png(image)
    assert 128 * 1024 < len(png) < 256 * 1024
    with image_server(png) as base:
        assert ask(vlm, image_part(base + "/picture.png"), QUESTION).choices[0].message.content is not None
        body = refusal(vlm, image_part(base + "/picture.png"), image_part(base + "/picture.png"), QUESTION)
        assert "--max-request-body" in body["message"] and body["param"].endswith(".image_url.url")
    vlm.wait_idle()


def test_a_client_gone_while_its_image_is_prefilled_leaves_the_engine_empty(llava_dir, monkeypatch):
    """Chunks of 8 tokens, each step 0.2 s: the client gives up 0.7 s in (of 1 s of prompt), while its image's
    positions are being computed. The server aborts the request: no KV block held; it serves on, and the runner
    has dropped the aborted request's state and its image's embeddings (at its next step)."""
    config = ServerConfig(served_model_name="tiny-llava")
    with serving(llava_dir, config, max_num_batched_tokens=8, max_num_seqs=4) as server:
        pace_engine(server, monkeypatch, 0.2)
        runner = server.engine.engine.runner
        seen: list[str] = []  # the requests whose image rows a step computed
        add_rows = runner._add_image_rows

        def adding_rows(batch, state, *args):
            seen.append(state.request_id)
            return add_rows(batch, state, *args)

        monkeypatch.setattr(runner, "_add_image_rows", adding_rows)
        body = {
            "model": server.model_name,
            "messages": [{"role": "user", "content": [image_part(data_url(random_image(6))), QUESTION]}],
            "max_tokens": 4,
        }
        with pytest.raises(httpx.ReadTimeout):
            with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.7)) as http:
                http.post("/v1/chat/completions", json=body)
        assert seen  # its image was being computed when the client left
        server.wait_idle()  # (no KV block held)
        assert ask(server, image_part(data_url(random_image(6))), QUESTION).choices[0].finish_reason == "length"
        server.wait_idle()
        assert seen[0] not in runner.requests and all(not state.image_embeds for state in runner.requests.values())


def test_allowed_media_domains(llava_dir):
    image = random_image(2)
    config = ServerConfig(served_model_name="tiny-llava", allowed_media_domains=["127.0.0.1"])
    with serving(llava_dir, config) as server, image_server(_png(image)) as base:
        assert ask(server, image_part(base + "/picture.png"), QUESTION).choices[0].message.content
        away = refusal(server, image_part(base + "/away"), QUESTION)
        assert "'localhost'" in away["message"] and "--allowed-media-domains" in away["message"]
        direct = refusal(server, image_part(base.replace("127.0.0.1", "localhost") + "/picture.png"), QUESTION)
        assert "--allowed-media-domains" in direct["message"]
        server.wait_idle()


def test_parts_that_give_no_image_are_400s(vlm):
    image_url = image_part(data_url(random_image(3)))
    cases = [
        (image_part("data:image/png;base64,bm90IGEgcGljdHVyZQ=="), "is not an image"),
        (image_part("data:image/png;base64,%%%"), "invalid base64"),
        (image_part("data:text/plain;base64,aGk="), "not of an image"),
        (image_part("ftp://example.com/a.png"), "http(s), data: or file://"),
        (image_part("file:///etc/hostname"), "--allowed-local-media-path"),
        ({"type": "image_url"}, "needs its 'image_url' as an image"),
        ({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}, "not supported"),
    ]
    for part, message in cases:
        body = refusal(vlm, part, QUESTION)
        assert message in body["message"], body
        assert body["param"].startswith("messages[0].content[0]"), body
    too_many = refusal(vlm, image_url, image_url, image_url, QUESTION)
    assert "at most 2" in too_many["message"] and too_many["param"] == "messages"
    with pytest.raises(openai.BadRequestError, match="use_beam_search takes no images"):
        ask(vlm, image_url, QUESTION, extra_body={"use_beam_search": True, "n": 2})
    vlm.wait_idle()


def test_the_responses_api_takes_input_image_parts(vlm, llava_dir):
    image = random_image(5)
    response = vlm.sdk().responses.create(
        model=vlm.model_name,
        input=[
            {
                "role": "user",
                "content": [
                    {"type": "input_image", "image_url": data_url(image), "detail": "auto"},
                    {"type": "input_text", "text": QUESTION["text"]},
                ],
            }
        ],
        max_output_tokens=MAX_TOKENS,
        temperature=0,
    )
    assert response.output_text == expected_text(vlm, llava_dir, image)
    with pytest.raises(openai.BadRequestError, match="file_id"):
        vlm.sdk().responses.create(
            model=vlm.model_name,
            input=[{"role": "user", "content": [{"type": "input_image", "file_id": "file-1"}]}],
            max_output_tokens=MAX_TOKENS,
        )
    vlm.wait_idle()


def test_qwen2_vl_over_http(tmp_path):
    """Qwen2-VL (multimodal RoPE, its own processor's placeholders) gets HF's answer for an image of its own grid,
    streamed and not."""
    model_dir = make_tiny_qwen_vl_dir(tmp_path / "qwen2-vl")
    image = random_image(6, 30, 60)  # (an answer of MAX_TOKENS tokens: no end of turn among them)
    text = qwen_chat_text([image, QUESTION["text"]])
    tokens, _ = qwen_hf_greedy(model_dir, text, [image], MAX_TOKENS)
    tokens = tokens[: tokens.index(EOS_ID)] if EOS_ID in tokens else tokens  # (the server stops there)
    with serving(model_dir, ServerConfig(served_model_name="tiny-qwen2-vl")) as server:
        expected = server.engine.tokenizer.decode(tokens, skip_special_tokens=True)
        response = ask(server, image_part(data_url(image)), QUESTION)
        assert response.choices[0].message.content == expected
        assert response.usage.prompt_tokens == hf_inputs(model_dir, text, [image])["input_ids"].shape[1]
        streamed = server.sdk().chat.completions.create(
            model=server.model_name,
            messages=[{"role": "user", "content": [image_part(data_url(image)), QUESTION]}],
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
        )
        assert "".join(chunk.choices[0].delta.content or "" for chunk in streamed if chunk.choices) == expected
        server.wait_idle()


def test_a_text_model_refuses_image_parts(server):
    body = refusal(server, image_part(data_url(random_image(4))), QUESTION)
    assert "takes no images" in body["message"] and body["param"] == "messages[0].content[0]"


def _png(image) -> bytes:
    import base64

    return base64.b64decode(data_url(image).split(",", 1)[1])

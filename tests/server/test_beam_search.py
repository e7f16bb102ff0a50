"""use_beam_search on the generation routes (server/serving/beam_search.py), through the real SDK: n beams, best
first, as the offline beam search finds them; streamed as one chunk per choice; the fields a beam search would not
read refused by name; a client that leaves cancels the search and frees every KV block."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import httpx
import pytest

from engine import BeamSearchParams
from engine.sampling.beam_search import BeamSearch
from server.config.server_config import ServerConfig
from server.http.drain import drain
from tests.engine.references import make_llm
from tests.server.conftest import pace_engine, serving
from tests.server.test_disconnect import assert_gauges_reach_zero, successes

PROMPT = "The quick brown fox"


def offline_beams(model_dir, prompt_ids, width, max_tokens, **fields):
    """The beams the offline LLM's search finds on the server's checkpoint, in an engine of its own (the server's
    engine belongs to its loop thread)."""
    with make_llm(model_dir) as llm:
        params = BeamSearchParams(beam_width=width, max_tokens=max_tokens, **fields)
        (out,) = llm.beam_search([{"prompt_token_ids": prompt_ids}], params)
    return out.sequences


def test_completions_return_the_best_beams(server, tiny_model_dir):
    client = server.sdk()
    prompt_ids = server.engine.tokenizer.encode(PROMPT)
    out = client.completions.create(
        model="tiny",
        prompt=PROMPT,
        n=3,
        max_tokens=8,
        temperature=0,
        extra_body={"use_beam_search": True, "ignore_eos": True, "length_penalty": 0.5},
    )
    expected = offline_beams(tiny_model_dir, prompt_ids, 3, 8, ignore_eos=True, length_penalty=0.5)
    assert [c.index for c in out.choices] == [0, 1, 2]
    assert [c.text for c in out.choices] == [b.text for b in expected]
    assert len({c.text for c in out.choices}) == 3
    assert all(c.finish_reason == "length" for c in out.choices)
    assert out.usage.completion_tokens == 3 * 8 and out.usage.prompt_tokens == len(prompt_ids)


def test_width_one_is_the_greedy_completion_and_chat_streams_one_chunk_per_choice(server):
    client = server.sdk()
    extra = {"ignore_eos": True}
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0, extra_body=extra)
    beam = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=6, extra_body={**extra, "use_beam_search": True}
    )
    assert beam.choices[0].text == greedy.choices[0].text
    messages = [{"role": "user", "content": "Hi"}]
    kwargs = dict(model="tiny", messages=messages, n=2, max_tokens=5, extra_body={**extra, "use_beam_search": True})
    whole = client.chat.completions.create(**kwargs)
    streamed: dict[int, str] = {}
    finishes = {}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert finishes == {0: "length", 1: "length"}


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"top_p": 0.5}, "top_p"),
        ({"stop": ["x"]}, "stop"),
        ({"logprobs": 2}, "logprobs"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"n": 11}, "n"),
    ],
)
def test_fields_a_beam_search_does_not_read_are_refused(server, extra, param):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "use_beam_search": True, **extra}
    with server.client() as c:
        r = c.post("/v1/completions", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


def test_length_penalty_without_beam_search_is_refused_and_a_long_prompt_too(server):
    with server.client() as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "length_penalty": 2.0})
        assert r.status_code == 400 and r.json()["error"]["param"] == "length_penalty", r.text
        long = {"model": "tiny", "prompt": [5] * 5000, "max_tokens": 4, "use_beam_search": True}
        r = c.post("/v1/completions", json=long)
        assert r.status_code == 400, r.text
    assert_gauges_reach_zero(server)


def test_a_client_that_leaves_cancels_the_search(server, monkeypatch):
    """Steps paced at 20 ms: the search's 400 steps would run for 8 s and more after the client left; each step
    request finishes as a success, so the count stops growing once the search is cancelled."""
    pace_engine(server, monkeypatch, 0.02)
    body = {"model": "tiny", "prompt": PROMPT, "n": 4, "max_tokens": 400, "use_beam_search": True}
    body["ignore_eos"] = True
    before = successes(server)
    with httpx.Client(base_url=server.base_url, timeout=httpx.Timeout(10, read=0.5)) as http:
        with pytest.raises(httpx.ReadTimeout):
            http.post("/v1/completions", json=body)
    assert_gauges_reach_zero(server)
    steps = successes(server)
    time.sleep(0.5)
    assert successes(server) == steps < before + 400 * 4
    server.wait_idle(timeout=1)


def test_a_drain_between_two_steps_lets_the_search_finish(tiny_model_dir, monkeypatch):
    """Between two steps none of the search's engine requests runs (the engine counts none); a graceful drain
    that looks then still waits for the search, which ends as a success, not a 503. (The gap is widened here:
    the second step's requests reach the engine 0.3 s late.)"""
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny")) as running:
        engine_type = type(running.engine)
        add_requests = engine_type.add_requests
        loop: list[asyncio.AbstractEventLoop] = []
        between = threading.Event()

        async def late_second_step(self, inputs, **kwargs):
            if "-step1-" in inputs[0].request_id:
                loop.append(asyncio.get_running_loop())
                between.set()
                await asyncio.sleep(0.3)
            return await add_requests(self, inputs, **kwargs)

        monkeypatch.setattr(engine_type, "add_requests", late_second_step)
        body = {"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 4, "use_beam_search": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with running.client() as c:
                response = pool.submit(c.post, "/v1/completions", json={**body, "ignore_eos": True})
                assert between.wait(30)
                drained = asyncio.run_coroutine_threadsafe(drain(running.state, 30.0), loop[0])
                assert drained.result(60) == 0
                r = response.result(60)
        assert r.status_code == 200, r.text
        assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
        assert not running.state.beam_searches


def test_a_running_search_does_not_hold_places_in_the_queue(tiny_model_dir, monkeypatch):
    """--max-queued-requests bounds the sequences waiting for their first token: a search's beams wait until its
    first step is done (their one output comes at the end), so a search that runs does not fill the queue and
    another request is admitted, not refused with a 429."""
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny", max_queued_requests=2)) as running:
        pace_engine(running, monkeypatch, 0.02)
        first_step = threading.Event()
        advance = BeamSearch.advance

        def noting_advance(self, tops):
            advance(self, tops)
            first_step.set()

        monkeypatch.setattr(BeamSearch, "advance", noting_advance)
        body = {"model": "tiny", "prompt": PROMPT, "n": 2, "max_tokens": 60, "use_beam_search": True}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            with running.client() as c:
                search = pool.submit(c.post, "/v1/completions", json={**body, "ignore_eos": True})
                assert first_step.wait(30)
                time.sleep(0.1)  # (the places are given back on the event loop, after the step)
                assert running.state.admission.num_requests == 0
                other = c.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 2})
                assert other.status_code == 200, other.text
                assert not search.done()
                assert search.result(60).status_code == 200


@pytest.mark.parametrize("stream", [False, True], ids=["collected", "streamed"])
def test_a_search_stops_where_the_kv_cache_does(tiny_model_dir, stream):
    """30 KV blocks of 4 hold a sequence of 121 tokens, fewer than max_model_len: a search on a 100-token prompt
    asking 30 tokens gets the 21 the cache holds, as the offline search finds them, not an error after 21 steps
    (a plain request asking as much is refused at once: that is tested elsewhere)."""
    prompt = [5 + i % 7 for i in range(100)]
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny"), num_blocks=30) as running:
        client = running.sdk()
        extra = {"use_beam_search": True, "ignore_eos": True}
        out = client.completions.create(
            model="tiny", prompt=prompt, n=2, max_tokens=30, stream=stream, extra_body=extra
        )
        if stream:
            chunks = list(out)
            texts = {c.index: c.text for chunk in chunks for c in chunk.choices}
            reasons = {c.index: c.finish_reason for chunk in chunks for c in chunk.choices}
        else:
            texts = {c.index: c.text for c in out.choices}
            reasons = {c.index: c.finish_reason for c in out.choices}
            assert out.usage.completion_tokens == 2 * 21 and out.usage.prompt_tokens == 100
        running.wait_idle()
    expected = offline_beams(tiny_model_dir, prompt, 2, 21, ignore_eos=True)
    assert texts == {0: expected[0].text, 1: expected[1].text}
    assert reasons == {0: "length", 1: "length"}

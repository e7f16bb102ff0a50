"""AsyncEngine: the engine thread behind asyncio callers (streams, disconnects, rejections, death).

Each test runs its own event loop (`asyncio.run`) and its own AsyncEngine around a
module-wide EngineCore; every await is bounded by a timeout, and after each test
the core must be idle (no request left, every KV block free). Request ids are
unique across the module.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import threading
import time

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine, EngineDeadError, RequestInput
from engine.observer import EngineObserver
from engine.errors import InvalidParameterError, TokenIdOutOfVocabularyError
from engine.sampling.parallel import fan_out
from scheduler import ContextLengthExceededError, DuplicateRequestIdError, RequestRejectedError
from tests.engine.json_schemas import check_output
from tests.engine.references import assert_idle, make_llm

TIMEOUT_S = 30.0


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def fresh_llm(tiny_llama_dir):
    """A core of its own, for tests that may leave it broken."""
    return make_llm(tiny_llama_dir)


def prompt(seed: int, length: int = 12) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 512) for _ in range(length)]


def greedy(max_tokens: int, **kwargs) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, **kwargs)


def run_with_engine(llm, body, *, check_idle: bool = True):
    """Start an AsyncEngine on a fresh event loop, run `body(engine)` bounded in time, shut it down."""

    async def main():
        engine = AsyncEngine(llm.engine)
        engine.start()
        try:
            return await asyncio.wait_for(body(engine), TIMEOUT_S)
        finally:
            await engine.shutdown()

    result = asyncio.run(main())
    if check_idle:
        assert_idle(llm)
    return result


async def collect(engine: AsyncEngine, request_id: str, prompt_ids, params) -> list:
    return [out async for out in engine.generate(request_id, prompt_ids, params)]


async def wait_until_idle(core, timeout_s: float = 5.0) -> None:
    """Give the engine thread a bounded moment to process queued aborts: the scheduler frees the
    blocks, and a step message tells the runner to forget the requests (no runner state is left)."""
    deadline = time.monotonic() + timeout_s
    while core.has_work or core.scheduler.kv_cache_manager.usage > 0 or core.runner.num_requests:
        assert time.monotonic() < deadline, "the engine did not drop the request in time"
        await asyncio.sleep(0.01)


# ---------------------------------------------------------------------- streaming


def test_streams_incrementally_and_deltas_add_up_to_text(llm):
    prompt_ids = prompt(1)

    async def body(engine):
        return await collect(engine, "stream-1", prompt_ids, greedy(24))

    outputs = run_with_engine(llm, body)
    assert len(outputs) == 24  # one output per decoded token
    assert all(len(out.new_token_ids) == 1 for out in outputs)
    assert [out.num_output_tokens for out in outputs] == list(range(1, 25))
    assert [out.finished for out in outputs] == [False] * 23 + [True]
    final = outputs[-1]
    assert final.finish_reason == "length" and final.num_prompt_tokens == len(prompt_ids)
    assert "".join(out.text_delta for out in outputs) == final.text
    streamed_ids = [t for out in outputs for t in out.new_token_ids]
    # The same greedy tokens as the synchronous API on the same core.
    (offline,) = llm.generate([prompt_ids], greedy(24), use_tqdm=False)
    assert offline.outputs[0].token_ids == streamed_ids
    assert offline.outputs[0].text == final.text
    assert_idle(llm)


@pytest.mark.parametrize("include", [False, True])
def test_streamed_deltas_hold_back_a_stop_string(llm, include):
    prompt_ids = prompt(30 + include, 8)
    (offline,) = llm.generate([prompt_ids], greedy(24), use_tqdm=False)
    full = offline.outputs[0].text
    stop = next(
        full[i : i + 2] for i in range(3, len(full) - 1) if full[i : i + 2].isascii() and full[i : i + 2].isalnum()
    )
    at = full.find(stop)
    expected = full[: at + len(stop)] if include else full[:at]

    async def body(engine):
        params = greedy(24, stop=[stop], include_stop_str_in_output=include)
        return await collect(engine, f"stream-stop-{include}", prompt_ids, params)

    outputs = run_with_engine(llm, body)
    final = outputs[-1]
    assert final.finish_reason == "stop" and final.stop_reason == stop
    assert final.text == expected
    assert "".join(out.text_delta for out in outputs) == expected
    assert all(stop not in out.text for out in outputs[:-1])  # never streamed before it is resolved


def test_many_concurrent_requests_finish_with_their_token_counts(llm):
    max_tokens = [1 + (i * 7) % 23 for i in range(24)]  # more requests than max_num_seqs (16)

    async def body(engine):
        tasks = [collect(engine, f"many-{i}", prompt(100 + i, 3 + i % 9), greedy(n)) for i, n in enumerate(max_tokens)]
        return await asyncio.gather(*tasks)

    results = run_with_engine(llm, body)
    for n, outputs in zip(max_tokens, results):
        final = outputs[-1]
        assert final.finished and final.finish_reason == "length"
        assert final.num_output_tokens == n
        assert sum(len(out.new_token_ids) for out in outputs) == n
        assert "".join(out.text_delta for out in outputs) == final.text
        assert not any(out.finished for out in outputs[:-1])


# ---------------------------------------------------------------------- client disconnects


def test_closing_the_stream_early_aborts_and_frees_blocks(llm):
    async def body(engine):
        other = asyncio.create_task(collect(engine, "close-other", prompt(2), greedy(30)))
        stream = engine.generate("close-1", prompt(3), greedy(200))
        first = await stream.__anext__()
        assert not first.finished
        assert llm.engine.scheduler.kv_cache_manager.usage > 0
        await stream.aclose()  # the client went away
        others = await other
        await wait_until_idle(llm.engine)
        return others

    others = run_with_engine(llm, body)
    assert others[-1].num_output_tokens == 30  # a neighbour's disconnect does not disturb it


def test_cancelling_the_consumer_aborts_and_frees_blocks(llm):
    async def body(engine):
        got_first = asyncio.Event()

        async def consume():
            async for _ in engine.generate("cancel-1", prompt(4), greedy(200)):
                got_first.set()

        task = asyncio.create_task(consume())
        await got_first.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(llm.engine)

    run_with_engine(llm, body)


def test_cancelling_before_the_first_output_aborts(llm):
    async def body(engine):
        task = asyncio.create_task(collect(engine, "cancel-early", prompt(5, 60), greedy(150)))
        await asyncio.sleep(0)  # the request is queued, nothing produced yet
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await wait_until_idle(llm.engine)

    run_with_engine(llm, body)


def test_server_side_abort_ends_the_stream_with_finish_reason_abort(llm):
    async def body(engine):
        outputs = []
        async for out in engine.generate("abort-1", prompt(6), greedy(200)):
            outputs.append(out)
            if len(outputs) == 1:
                engine.abort(["abort-1"])
        return outputs

    outputs = run_with_engine(llm, body)
    assert outputs[-1].finish_reason == "abort"
    assert outputs[-1].num_output_tokens < 200
    assert not any(out.finished for out in outputs[:-1])


# ---------------------------------------------------------------------- rejections


@pytest.mark.parametrize(
    "prompt_len, max_tokens, token, param",
    [
        (200, 100, None, "max_tokens"),  # 300 > max_model_len 256
        (256, 1, None, "prompt"),  # the prompt alone fills the context
        (5, 4, 512, "prompt"),  # vocab is 0..511
        (5, 4, -1, "prompt"),
    ],
)
def test_rejected_request_raises_at_once(llm, prompt_len, max_tokens, token, param):
    prompt_ids = prompt(7, prompt_len)
    if token is not None:
        prompt_ids[2] = token

    async def body(engine):
        steps = llm.engine.num_steps
        with pytest.raises(RequestRejectedError) as info:
            await engine.generate(f"reject-{prompt_len}-{token}", prompt_ids, greedy(max_tokens)).__anext__()
        assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests
        assert engine.is_alive
        return info.value

    error = run_with_engine(llm, body)
    assert error.field == param
    if token is None:
        assert isinstance(error, ContextLengthExceededError)
    else:
        assert isinstance(error, TokenIdOutOfVocabularyError) and error.token_id == token


def test_request_id_in_use_is_rejected(llm):
    async def body(engine):
        first = engine.generate("dup-1", prompt(8), greedy(50))
        await first.__anext__()
        with pytest.raises(RequestRejectedError) as info:
            await engine.generate("dup-1", prompt(9), greedy(5)).__anext__()
        assert isinstance(info.value, DuplicateRequestIdError) and info.value.field == "request_id"
        await first.aclose()
        await wait_until_idle(llm.engine)

    run_with_engine(llm, body)


class Recorder(EngineObserver):
    def __init__(self, outputs: list):
        self.outputs = outputs

    def on_output(self, output) -> None:
        self.outputs.append(output)


def test_a_batch_is_admitted_all_or_none(llm):
    """One refused sequence refuses the batch: nothing of it runs, no output is published, its ids stay free."""
    published = []

    async def body(engine):
        engine.observe(Recorder(published))
        steps = llm.engine.num_steps
        batch = [
            RequestInput("batch-ok", prompt(22), greedy(4)),
            RequestInput("batch-long", prompt(23, 250), greedy(10)),
        ]
        with pytest.raises(ContextLengthExceededError):
            await engine.add_requests(batch)
        assert llm.engine.num_steps == steps and not llm.engine.has_unfinished_requests
        assert published == []
        with pytest.raises(DuplicateRequestIdError):  # checked before anything is queued
            await engine.add_requests([RequestInput("twin", prompt(24), greedy(2))] * 2)
        (stream,) = await engine.add_requests([batch[0]])  # the refused batch's id is free
        async with contextlib.aclosing(stream):
            return [out async for out in stream]

    outputs = run_with_engine(llm, body)
    assert outputs[-1].finished and outputs[-1].num_output_tokens == 4
    assert [out.finish_reason for out in published] == [out.finish_reason for out in outputs]


def test_arrival_time_is_the_callers(llm):
    """Queue time and time to first token count from the caller's arrival time, not from the engine call."""
    arrival = time.monotonic() - 1000.0  # as if the caller had spent 1000 s before calling

    async def body(engine):
        return [out async for out in engine.generate("arrival-1", prompt(25), greedy(2), arrival_time=arrival)]

    metrics = run_with_engine(llm, body)[-1].metrics
    assert metrics.arrival_time == arrival
    assert metrics.queue_time >= 1000.0 and metrics.time_to_first_token >= 1000.0


def test_more_grammars_in_flight_than_the_cache_holds_are_never_compiled_on_the_engine_thread(tiny_llama_dir):
    """Six distinct schemas in flight, a compiler cache of two, few KV blocks (preempted requests come back to
    the runner): each request holds its grammar from add_requests on; a compile on the engine thread fails."""
    llm = make_llm(tiny_llama_dir, num_blocks=30)
    compiler = llm.engine.grammar_compiler
    compiler.cache_size = 2
    compile_ = compiler.compile
    threads: list[str] = []

    def compile_off_the_engine_thread(constraint, field="structured_outputs"):
        threads.append(threading.current_thread().name)
        assert threading.current_thread().name != "pagedserve-engine", "a grammar compiled on the engine thread"
        return compile_(constraint, field)

    compiler.compile = compile_off_the_engine_thread
    schemas = [
        {
            "type": "object",
            "properties": {f"key{i}": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}}},
            "required": [f"key{i}"],
            "additionalProperties": False,
        }
        for i in range(6)
    ]
    inputs = [
        RequestInput(
            f"schema-{i}",
            prompt(60 + i, 24),
            SamplingParams(max_tokens=80, temperature=0, structured_outputs={"json": s}),
        )
        for i, s in enumerate(schemas)
    ]

    async def body(engine):
        streams = await engine.add_requests(inputs)

        async def drain(stream):
            async with contextlib.aclosing(stream):
                return [out async for out in stream][-1]

        return await asyncio.gather(*(drain(stream) for stream in streams))

    finals = run_with_engine(llm, body)
    assert len(threads) == len(schemas) and compiler.num_cached == 2
    assert llm.engine.stats().num_preemptions > 0
    for schema, final in zip(schemas, finals):
        assert final.finish_reason == "stop", final.text
        check_output(schema, final.text)


def test_engine_facts_without_reaching_into_the_core(llm):
    core, engine = llm.engine, AsyncEngine(llm.engine)  # facts need no engine thread
    assert engine.model_name == core.model_name
    assert engine.model_config == core.config.model
    assert engine.max_model_len == 256 and engine.vocab_size == 512
    assert engine.dtype == "float32"
    assert engine.attention_backend == core.runner.backend.name
    assert engine.tokenizer is core.tokenizer
    assert engine.scheduling_policy == "fcfs"
    cache = engine.kv_cache_config
    assert (cache.block_size, cache.num_blocks, cache.enable_prefix_caching) == (4, 256, True)
    assert engine.stats() == core.stats()


# ---------------------------------------------------------------------- n > 1


def test_fan_out_children_share_the_prompt_blocks(llm):
    prompt_ids = prompt(10, 21)  # five full blocks of 4
    params = SamplingParams(n=3, max_tokens=6, temperature=0.8, seed=11, ignore_eos=True)
    hits_before = llm.engine.stats().prefix_cache_hits

    async def body(engine):
        children = fan_out("fan-1", params)
        assert [child_id for child_id, _ in children] == ["fan-1-0", "fan-1-1", "fan-1-2"]
        return await asyncio.gather(*(collect(engine, cid, prompt_ids, p) for cid, p in children))

    results = run_with_engine(llm, body)
    assert all(outputs[-1].num_output_tokens == 6 for outputs in results)
    assert llm.engine.stats().prefix_cache_hits > hits_before
    assert sum(outputs[-1].num_cached_tokens > 0 for outputs in results) >= 2


# ---------------------------------------------------------------------- responsiveness


def test_event_loop_keeps_ticking_during_a_long_generation(llm):
    async def body(engine):
        done = asyncio.Event()
        gaps = []

        async def ticker():
            last = time.monotonic()
            while not done.is_set():
                await asyncio.sleep(0.01)
                now = time.monotonic()
                gaps.append(now - last)
                last = now

        tick = asyncio.create_task(ticker())
        results = await asyncio.gather(
            *(collect(engine, f"long-{i}", prompt(12 + i, 40), greedy(200)) for i in range(4))
        )
        done.set()
        await tick
        return results, gaps

    results, gaps = run_with_engine(llm, body)
    assert all(outputs[-1].num_output_tokens == 200 for outputs in results)
    assert len(gaps) >= 5
    assert max(gaps) < 0.5


# ---------------------------------------------------------------------- shutdown and failures


def test_shutdown_ends_the_thread_and_fails_waiting_streams(llm):
    async def body(engine):
        stream = engine.generate("shutdown-1", prompt(13), greedy(200))
        await stream.__anext__()
        await engine.shutdown()
        assert not engine.is_alive and engine.error is None
        with pytest.raises(EngineDeadError):
            while True:
                await stream.__anext__()
        with pytest.raises(EngineDeadError):
            await engine.generate("shutdown-2", prompt(14), greedy(5)).__anext__()

    run_with_engine(llm, body, check_idle=False)
    # The loop stopped with the request in flight; drop it so the core is idle for the next test.
    llm.engine.abort(list(llm.engine.scheduler.requests))
    assert_idle(llm)


def test_shutdown_of_an_idle_engine(llm):
    async def body(engine):
        await collect(engine, "idle-1", prompt(15), greedy(3))
        await engine.shutdown()
        assert not engine.is_alive and engine.error is None

    run_with_engine(llm, body)


def test_a_failing_step_marks_the_engine_dead(fresh_llm):
    core = fresh_llm.engine
    execute = core.runner.execute
    calls = []

    def faulty_execute(scheduler_output):
        if not scheduler_output.is_empty:
            calls.append(scheduler_output)
            if len(calls) == 3:
                raise RuntimeError("injected fault")
        return execute(scheduler_output)

    core.runner.execute = faulty_execute

    async def body(engine):
        outputs = []
        with pytest.raises(EngineDeadError, match="injected fault"):
            async for out in engine.generate("fault-1", prompt(16), greedy(50)):
                outputs.append(out)
        assert len(outputs) == 2  # the steps before the fault were delivered
        assert not engine.is_alive
        assert isinstance(engine.error, RuntimeError) and str(engine.error) == "injected fault"
        with pytest.raises(EngineDeadError):
            await engine.generate("fault-2", prompt(17), greedy(5)).__anext__()

    run_with_engine(fresh_llm, body, check_idle=False)
    core.abort(list(core.scheduler.requests))  # blocks can still be recovered from a dead core
    assert_idle(fresh_llm)


# ---------------------------------------------------------------------- regressions


def test_request_id_can_be_reused_once_finished(fresh_llm):
    async def body(engine):
        first = await collect(engine, "reuse-1", prompt(18), greedy(3))
        second = await collect(engine, "reuse-1", prompt(18), greedy(3))  # a client retrying with its id
        return first, second

    first, second = run_with_engine(fresh_llm, body)
    assert [o.new_token_ids for o in first] == [o.new_token_ids for o in second]


def test_a_request_with_n_above_one_is_refused_without_killing_the_engine(fresh_llm):
    async def body(engine):
        neighbour = asyncio.create_task(collect(engine, "n-neighbour", prompt(19), greedy(40)))
        try:
            with pytest.raises(InvalidParameterError, match="n must be 1"):  # checked once, where it is queued
                await collect(engine, "n-2", prompt(20), SamplingParams(n=2, max_tokens=4))
            assert engine.is_alive
        finally:
            (outputs,) = await asyncio.gather(neighbour, return_exceptions=True)
        assert not isinstance(outputs, BaseException), outputs
        assert outputs[-1].num_output_tokens == 40

    run_with_engine(fresh_llm, body)

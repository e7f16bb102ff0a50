"""An engine's memory is released when it is shut down (`LLM.shutdown()`, leaving `with LLM(...)`,
`AsyncEngine.shutdown()`) and when its last reference is dropped: a notebook or a test suite that builds
engines one after another must not keep each one's weights and KV cache (on a GPU, the next engine would
profile them as "other memory" and get no blocks).

Dropping is checked with the cyclic GC switched off: nothing in an engine may form a reference cycle,
since the server freezes what it loaded (a frozen cycle is never collected)."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import weakref

import pytest

from engine import SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine import EngineShutDownError
from engine.runner.cuda_graphs import EagerReplay
from tests.engine.references import assert_idle, make_llm

PARAMS = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)


@contextlib.contextmanager
def no_cyclic_gc():
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def held(llm) -> dict[str, weakref.ref]:
    """Weak references to what an engine must release: a KV tensor, the model, a weight, the runner."""
    runner = llm.engine.runner
    return {
        "kv": weakref.ref(runner.kv_cache.layers[0][0]),
        "model": weakref.ref(runner.model),
        "embed": weakref.ref(runner.model.embed),
        "runner": weakref.ref(runner),
    }


def alive(refs: dict[str, weakref.ref]) -> list[str]:
    return [name for name, ref in refs.items() if ref() is not None]


def test_leaving_with_releases_the_kv_cache_and_the_weights(tiny_llama_dir):
    with make_llm(tiny_llama_dir) as llm:
        assert len(llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)[0].outputs[0].token_ids) == 4
        refs = held(llm)
        llm.engine.add_request("unfinished", [1, 2, 3], PARAMS)  # still queued at the exit
    assert alive(refs) == ["runner"]  # the LLM is still referenced here; what it held is gone
    assert llm.engine.runner.kv_cache.layers == [] and llm.engine.runner.graphs is None
    assert_idle(llm)  # the queued request ended (aborted) and gave its blocks back
    with pytest.raises(EngineShutDownError, match="shut down"):
        llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    llm.shutdown()  # again: nothing to do


def test_dropping_the_last_reference_frees_the_engine_without_the_cyclic_gc(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    llm.generate([[5, 6, 7], list(range(10, 40))], PARAMS, use_tqdm=False)
    llm.engine.runner.capture_decode_graphs((1, 2, 4), EagerReplay)  # graphs hold the forward pass
    llm.generate([[5, 6, 7]], PARAMS, use_tqdm=False)
    assert llm.engine.runner.cuda_graphs != "off"
    refs = held(llm)
    with no_cyclic_gc():
        del llm
        assert alive(refs) == []


def test_building_an_engine_freezes_nothing(tiny_llama_dir):
    before = gc.get_freeze_count()
    with make_llm(tiny_llama_dir):
        assert gc.get_freeze_count() == before


def test_an_async_engine_stops_its_thread_and_the_owner_releases_the_core(tiny_llama_dir):
    llm = make_llm(tiny_llama_dir)
    refs = held(llm)
    engine = AsyncEngine(llm.engine)

    async def serve_then_stop():
        engine.start()
        await engine.shutdown()

    asyncio.run(serve_then_stop())
    assert not engine.is_alive and alive(refs) == ["kv", "model", "embed", "runner"]  # another may serve it
    llm.engine.shutdown()  # what the server does once uvicorn has returned
    assert alive(refs) == ["runner"]
    assert engine.dtype == "float32" and engine.quantization == "none" and engine.weight_bytes > 0

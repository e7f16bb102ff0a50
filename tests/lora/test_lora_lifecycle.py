"""Adapters come and go: refusals, unloading with requests in flight, LRU eviction and background loads,
and at most max_loras adapters in a step."""

from __future__ import annotations

import json
import random

import pytest

from engine import LoRAMix, LoRARequest, SamplingParams
from engine.errors import LoRAAdapterError, LoRANotFoundError, LoRARankError
from tests.engine.references import NEW_TOKENS, assert_idle, check_against_hf, make_llm
from tests.lora.adapters import make_adapter, merged_model_dir

PROMPT = random.Random(7).choices(range(3, 512), k=21)
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=0)


def _run(engine) -> dict:
    """Step until idle; request id -> its output token ids."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    return tokens


@pytest.fixture(scope="module")
def adapter_c(lora_base_dir, tmp_path_factory):
    return make_adapter(lora_base_dir, tmp_path_factory.mktemp("adapter-c"), seed=4, r=2, targets=("up_proj",))


@pytest.fixture(scope="module")
def merged(lora_base_dir, adapter_a, adapter_b, adapter_c, tmp_path_factory):
    return {
        name: merged_model_dir(lora_base_dir, [(path, 1.0)], tmp_path_factory.mktemp(f"merged-{name}"))
        for name, path in (("a", adapter_a), ("b", adapter_b), ("c", adapter_c))
    }


def test_refusals(lora_base_dir, adapter_a, tmp_path):
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=2) as llm:
        manager = llm.engine.lora_manager
        with pytest.raises(LoRARankError, match="rank 4, above max_lora_rank 2"):
            manager.add_lora(LoRARequest("a", str(adapter_a)))
        dora = make_adapter(lora_base_dir, tmp_path / "dora", seed=5, r=2, use_dora=True)
        with pytest.raises(LoRAAdapterError, match="DoRA"):
            manager.add_lora(LoRARequest("dora", str(dora)))
        with pytest.raises(LoRAAdapterError, match="no adapter_config.json"):
            manager.add_lora(LoRARequest("gguf", str(tmp_path / "adapter.gguf")))
        with pytest.raises(LoRANotFoundError, match="'nope'"):
            llm.engine.add_request("r", PROMPT, GREEDY, lora=LoRAMix.single("nope"))
        assert manager.list_loras() == []
        assert_idle(llm)
    with make_llm(lora_base_dir) as llm:  # without --enable-lora
        with pytest.raises(ValueError, match="enable-lora"):
            llm.engine.add_request("r", PROMPT, GREEDY, lora=LoRAMix.single("a"))


def test_unload_refuses_later_requests_and_finishes_running_ones(lora_base_dir, adapter_a, merged):
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        engine = llm.engine
        engine.lora_manager.add_lora(LoRARequest("a", str(adapter_a)))
        engine.add_request("running", PROMPT, GREEDY, lora=LoRAMix.single("a"))
        first = engine.step()  # its prompt computed, a token sampled
        assert engine.lora_manager.remove_lora("a") is True
        assert engine.lora_manager.remove_lora("a") is False
        with pytest.raises(LoRANotFoundError):
            engine.add_request("later", PROMPT, GREEDY, lora=LoRAMix.single("a"))
        tokens = _run(engine)
        assert first[0].new_token_ids + tokens["running"] == _reference(merged["a"])
        assert_idle(llm)


def test_lru_eviction_and_background_reload(lora_base_dir, adapter_a, adapter_b, adapter_c, merged):
    """max_cpu_loras 2: a third adapter evicts the least recently used idle one; a request for it waits while it
    loads in the background (the step loop runs the others meanwhile) and then gets its own output."""
    with make_llm(lora_base_dir, enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=8) as llm:
        engine, manager = llm.engine, llm.engine.lora_manager
        for name, path in (("a", adapter_a), ("b", adapter_b)):
            manager.add_lora(LoRARequest(name, str(path)))
        engine.add_request("b-warm", PROMPT, GREEDY, lora=LoRAMix.single("b"))  # b used after a: a is the LRU
        _run(engine)
        manager.add_lora(LoRARequest("c", str(adapter_c)))
        assert manager.loaded_names() == ["b", "c"]
        assert [r.name for r in manager.list_loras()] == ["a", "b", "c"]
        engine.add_request("base", PROMPT, GREEDY)
        engine.add_request("a-cold", PROMPT, GREEDY, lora=LoRAMix.single("a"))
        assert manager.is_loading and "a-cold" not in engine.scheduler.requests
        tokens = _run(engine)
        assert tokens["a-cold"] == _reference(merged["a"])
        assert tokens["base"] == _reference(lora_base_dir)
        assert "a" in manager.loaded_names() and len(manager.loaded_names()) == 2
        assert manager.stats().requests == {"a": 1, "b": 1}
        assert_idle(llm)


def test_busy_adapters_over_max_cpu_loras_are_evicted_once_idle(lora_base_dir, adapter_a, adapter_b, merged):
    """max_cpu_loras 1 and a burst naming two adapters: both stay loaded while they run (neither may go), then
    the loaded set comes back to one once they are idle, without waiting for another load."""
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8) as llm:
        engine, manager = llm.engine, llm.engine.lora_manager
        for name, path in (("a", adapter_a), ("b", adapter_b)):
            manager.add_lora(LoRARequest(name, str(path)))
        assert manager.loaded_names() == ["b"]
        long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        engine.add_request("b", PROMPT, long, lora=LoRAMix.single("b"))
        tokens: dict[str, list[int]] = {}
        for out in engine.step():  # b running
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        engine.add_request("a", PROMPT, GREEDY, lora=LoRAMix.single("a"))  # loads while b runs, then waits for it
        both = False
        while engine.has_work:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            both = both or len(manager.loaded_names()) == 2
        assert both  # b was running when a's load finished: neither could go
        assert tokens["a"] == _reference(merged["a"]) and len(tokens["b"]) == 64
        assert manager.loaded_names() == ["a"]
        assert_idle(llm)


def test_at_most_max_loras_adapters_run_together(lora_base_dir, adapter_a, adapter_b, adapter_c, merged):
    """Three adapters loaded, two slots: a request of the third waits (a base request passes it) until a slot
    frees."""
    with make_llm(lora_base_dir, enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=8) as llm:
        engine, manager = llm.engine, llm.engine.lora_manager
        for name, path in (("a", adapter_a), ("b", adapter_b), ("c", adapter_c)):
            manager.add_lora(LoRARequest(name, str(path)))
        for name in ("a", "b", "c"):
            engine.add_request(name, PROMPT, GREEDY, lora=LoRAMix.single(name))
        engine.add_request("base", PROMPT, GREEDY)
        tokens: dict[str, list[int]] = {}
        first_step = True
        while engine.has_work:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            assert len(engine.scheduler.running_adapters()) <= 2
            assert engine.runner.lora_slots.num_in_use <= 2
            if first_step:
                assert {r.request_id for r in engine.scheduler.running} == {"a", "b", "base"}
                assert manager.stats().running == ["a", "b"] and manager.stats().waiting == ["c"]
                first_step = False
        for name in ("a", "b", "c"):
            assert tokens[name] == _reference(merged[name]), name
        assert tokens["base"] == _reference(lora_base_dir)
        assert_idle(llm)


def _reference(model_dir) -> list[int]:
    from tests.engine.references import _hf_greedy_once

    return _hf_greedy_once(str(model_dir), tuple(PROMPT), NEW_TOKENS)[0]


def test_offline_lora_request_registers_on_first_use(lora_base_dir, adapter_a, merged):
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        results = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRARequest("a", str(adapter_a)))
        check_against_hf(merged["a"], [PROMPT], results)
        assert_idle(llm)


def test_vllm_spellings_of_a_lora_request_and_chat_through_one(lora_base_dir, adapter_a, merged):
    """vLLM's `LoRARequest(name, int_id, path)` and keyword names work as written; `chat` takes `lora_request`."""
    as_vllm = LoRARequest("a", 1, str(adapter_a))
    assert (
        as_vllm
        == LoRARequest(lora_name="a", lora_int_id=1, lora_path=str(adapter_a))
        == LoRARequest("a", str(adapter_a))
    )
    assert as_vllm.lora_name == "a" and as_vllm.lora_path == str(adapter_a)
    with pytest.raises(TypeError, match="name and a path"):
        LoRARequest("a")
    # a pathlib path, the local path when the path is empty, and vLLM's other fields (not read here)
    assert LoRARequest("a", adapter_a) == LoRARequest("a", 1, "", lora_local_path=str(adapter_a), base_model_name="m")
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=4) as llm:
        check_against_hf(merged["a"], [PROMPT], llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=as_vllm))
        conversation = [{"role": "user", "content": "Hi"}]
        with_adapter = llm.chat(conversation, GREEDY, use_tqdm=False, lora_request=as_vllm)[0]
        (alone,) = llm.generate(
            {"prompt_token_ids": with_adapter.prompt_token_ids}, GREEDY, use_tqdm=False, lora_request=as_vllm
        )
        assert with_adapter.outputs[0].token_ids == alone.outputs[0].token_ids
        assert_idle(llm)


def test_lora_modules_need_enable_lora(lora_base_dir, adapter_a):
    with pytest.raises(ValueError, match="enable_lora"):
        make_llm(lora_base_dir, lora_modules=[{"name": "a", "path": str(adapter_a)}])


def test_async_engine_loads_serves_and_unloads(lora_base_dir, adapter_a, adapter_b, merged):
    """Through the server's AsyncEngine: an adapter loaded off the engine thread, a cold one (evicted) reloaded
    in the background while a base request streams, an unknown name refused, an unload."""
    import asyncio

    from engine.async_engine import AsyncEngine

    async def body(engine: AsyncEngine) -> dict:
        await engine.add_lora(LoRARequest("a", str(adapter_a)))
        await engine.add_lora(LoRARequest("b", str(adapter_b)))  # max_cpu_loras 1: a is evicted
        outputs: dict[str, list[int]] = {}

        async def collect(request_id: str, lora) -> None:
            async for out in engine.generate(request_id, PROMPT, GREEDY, lora=lora):
                outputs.setdefault(request_id, []).extend(out.new_token_ids)

        await asyncio.gather(collect("a", LoRAMix.single("a")), collect("base", None))
        with pytest.raises(LoRANotFoundError):
            await collect("x", LoRAMix.single("x"))
        assert engine.remove_lora("a") and [r.name for r in engine.list_loras()] == ["b"]
        return outputs

    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=8) as llm:

        async def main() -> dict:
            engine = AsyncEngine(llm.engine)
            engine.start()
            try:
                return await asyncio.wait_for(body(engine), 60)
            finally:
                await engine.shutdown()

        outputs = asyncio.run(main())
        assert outputs["a"] == _reference(merged["a"])
        assert outputs["base"] == _reference(lora_base_dir)
        assert_idle(llm)


def test_lora_modules_registered_at_start_up(lora_base_dir, adapter_a, adapter_b, merged):
    """--lora-modules: the first max_cpu_loras loaded at start, the rest registered and loaded on first use."""
    modules = [{"name": "a", "path": str(adapter_a)}, {"name": "b", "path": str(adapter_b)}]
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=8, lora_modules=modules) as llm:
        manager = llm.engine.lora_manager
        assert manager.loaded_names() == ["a"] and [r.name for r in manager.list_loras()] == ["a", "b"]
        results = llm.generate([PROMPT], GREEDY, use_tqdm=False, lora_request=LoRAMix.single("b"))
        check_against_hf(merged["b"], [PROMPT], results)
        assert_idle(llm)


@pytest.mark.parametrize("loaded_at_start", [True, False])
def test_an_adapter_given_at_start_that_cannot_be_served_is_a_bad_setting(
    lora_base_dir, adapter_a, adapter_b, loaded_at_start
):
    """A --lora-modules adapter over --max-lora-rank (or missing) is a settings conflict naming the flag, so the
    server exits 2 as for any bad flag (it was "cannot load the model", exit 1), loaded at start or registered."""
    from engine.errors import SettingsConflictError

    modules = [{"name": "b", "path": str(adapter_b)}]  # rank 8
    if not loaded_at_start:
        modules.insert(0, {"name": "a", "path": str(adapter_a)})  # rank 4: loaded; b only registered
    with pytest.raises(SettingsConflictError, match="--lora-modules: .*rank"):
        make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=4, lora_modules=modules)
    with pytest.raises(SettingsConflictError, match="--lora-modules"):
        make_llm(lora_base_dir, enable_lora=True, lora_modules=[{"name": "gone", "path": str(lora_base_dir / "nope")}])


def test_a_cold_load_runs_in_slices_between_steps(lora_base_dir, adapter_a, merged, monkeypatch):
    """A request for an adapter not loaded: the engine reads it a slice per step while the base request decodes
    (never the whole load in one step), admits it the step after the last slice, and both get their own output;
    `begin_load` (the HTTP load route's path) is finished by the same steps and registers the adapter."""
    from engine.lora import lora_waiting, peft_adapter

    monkeypatch.setattr(peft_adapter, "READ_SLICE_BYTES", 1024)
    monkeypatch.setattr(peft_adapter, "TENSORS_PER_SLICE", 1)
    monkeypatch.setattr(lora_waiting, "LOAD_SLICE_SECONDS", 0.0)  # one slice per step
    monkeypatch.setattr(lora_waiting, "LOAD_STEP_SHARE", 0.0)
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=8) as llm:
        engine, manager = llm.engine, llm.engine.lora_manager
        manager.register(LoRARequest("a", str(adapter_a)))
        long = SamplingParams(max_tokens=64, temperature=0, ignore_eos=True)
        engine.add_request("base", PROMPT, long)
        engine.step()
        engine.add_request("a-cold", PROMPT, GREEDY, lora=LoRAMix.single("a"))
        loading_steps, base_tokens = 0, 0
        while "a" not in manager.loaded_names():
            outputs = engine.step()
            assert {out.request_id for out in outputs} <= {"base"}
            base_tokens += sum(len(out.new_token_ids) for out in outputs)  # the base request decodes meanwhile
            loading_steps += 1
        assert loading_steps > 10 and base_tokens >= loading_steps - 1 and "a-cold" not in engine.scheduler.requests
        first = [out.new_token_ids for out in engine.step() if out.request_id == "a-cold"]
        assert first and "a-cold" in engine.scheduler.requests  # admitted the step after its last slice
        future = manager.begin_load(LoRARequest("b", str(adapter_a)))
        tokens = _run(engine)
        assert first[0] + tokens["a-cold"] == _reference(merged["a"])
        assert future.done() and future.result().request.name == "b" and "b" in manager.loaded_names()
        assert [r.name for r in manager.list_loras()] == ["a", "b"]
        assert_idle(llm)


@pytest.mark.parametrize(
    "key, value, message",
    [
        ("alora_invocation_tokens", [5, 6], "alora_invocation_tokens is not served"),
        ("use_qalora", True, "use_qalora is not served"),
        ("init_lora_weights", "pissa_niter_4", "subtracted B A from the base weights"),
        ("init_lora_weights", "olora", "subtracted B A from the base weights"),
    ],
)
def test_adapters_whose_forward_is_not_plain_lora_are_refused(lora_base_dir, tmp_path, key, value, message):
    """PEFT's activated LoRA adapts the tokens from its invocation on only, QALoRA's A reads pooled inputs, PiSSA's
    and OLoRA's (saved unconverted) adapt a base they changed: served as plain LoRA over this base every token's
    output would differ from PEFT's."""
    adapter = make_adapter(lora_base_dir, tmp_path / "adapter", seed=5, r=2)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, key: value}))
    with make_llm(lora_base_dir, enable_lora=True, max_loras=1, max_lora_rank=2) as llm:
        with pytest.raises(LoRAAdapterError, match=message):
            llm.engine.lora_manager.add_lora(LoRARequest("x", str(adapter)))
        assert_idle(llm)

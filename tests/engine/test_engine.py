"""EngineCore behaviour: stop strings, seeds across batch compositions, abort, refusals, n > 1."""

import pytest

from engine import SamplingParams
from engine.sampling.parallel import fan_out
from scheduler import RequestRejectedError
from tests.engine.references import assert_idle


@pytest.fixture(autouse=True)
def idle_after(request):
    yield
    if "llm" in request.fixturenames:
        assert_idle(request.getfixturevalue("llm"))


def drain(engine):
    outputs = []
    while engine.has_unfinished_requests:
        outputs.extend(engine.step())
    return outputs


def test_streamed_deltas_add_up_to_text(llm):
    engine = llm.engine
    engine.add_request(
        "a",
        engine.tokenizer.encode("Hello, world! Café 東京"),
        SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
    )
    outputs = drain(engine)
    assert "".join(o.text_delta for o in outputs) == outputs[-1].text
    assert sum(len(o.new_token_ids) for o in outputs) == 40
    assert outputs[-1].finish_reason == "length" and outputs[-1].num_output_tokens == 40
    metrics = outputs[-1].metrics
    assert metrics.arrival_time <= metrics.first_scheduled_time < metrics.first_token_time <= metrics.finished_time


def test_stop_string_ends_request_and_is_excluded(llm):
    prompt = llm.get_tokenizer().encode("The quick brown fox")
    base = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True), use_tqdm=False
    )
    full = base[0].outputs[0].text
    stop = full[5:8]
    assert stop and full.find(stop) == 5
    (result,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=30, temperature=0, stop=[stop]), use_tqdm=False
    )
    out = result.outputs[0]
    assert out.text == full[:5] and out.finish_reason == "stop" and out.stop_reason == stop
    (kept,) = llm.generate(
        [{"prompt_token_ids": prompt}],
        SamplingParams(max_tokens=30, temperature=0, stop=stop, include_stop_str_in_output=True),
        use_tqdm=False,
    )
    assert kept.outputs[0].text == full[:8]


def test_stop_token_ids_and_eos(llm):
    prompt = [10, 20, 30]
    (base,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    tokens = base.outputs[0].token_ids
    (stopped,) = llm.generate(
        [prompt], SamplingParams(max_tokens=10, temperature=0, stop_token_ids=[tokens[3]]), use_tqdm=False
    )
    first = tokens.index(tokens[3])
    assert stopped.outputs[0].token_ids == tokens[: first + 1]
    assert stopped.outputs[0].finish_reason == "stop" and stopped.outputs[0].stop_reason == tokens[3]


def test_seeded_sampling_ignores_batch_composition(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    prompt = [5, 6, 7, 8]

    def run(others: int, position: int) -> list[int]:
        ids = []
        for i in range(others + 1):
            rid = f"seeded-{others}-{i}"
            if i == position:
                engine.add_request(rid, prompt, params)
                target = rid
            else:
                engine.add_request(rid, [9 + i] * (3 + 5 * i), SamplingParams(max_tokens=20, temperature=1.3))
            ids.append(rid)
        tokens = {}
        for out in drain(engine):
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
        return tokens[target]

    alone = run(0, 0)
    assert run(3, 2) == alone
    assert run(5, 0) == alone
    different = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=4321)
    engine.add_request("other-seed", prompt, different)
    assert [t for o in drain(engine) for t in o.new_token_ids] != alone


def test_parallel_samples_share_prompt_blocks(llm):
    engine = llm.engine
    hits_before = engine.stats().prefix_cache_hits
    prompt = list(range(40, 80))
    for child_id, child_params in fan_out("par", SamplingParams(n=4, max_tokens=8, temperature=0.8, seed=7)):
        engine.add_request(child_id, prompt, child_params)
    outputs = [o for o in drain(engine) if o.finished]
    assert sorted(o.request_id for o in outputs) == [f"par-{i}" for i in range(4)]
    assert engine.stats().prefix_cache_hits - hits_before >= 3 * 36  # 3 children x 9 full blocks of 4


def test_abort_returns_final_outputs(llm):
    engine = llm.engine
    engine.add_request("x", [1, 2, 3], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.add_request("y", [4, 5, 6], SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    aborted = engine.abort(["x", "y", "nope"])
    assert {o.request_id for o in aborted} == {"x", "y"}
    assert all(o.finish_reason == "abort" for o in aborted)
    engine.step()  # lets the runner drop their state
    assert engine.runner.num_requests == 0


@pytest.mark.parametrize(
    "prompt,params,param",
    [
        ([1] * 250, SamplingParams(max_tokens=10), "max_tokens"),
        ([1] * 300, SamplingParams(max_tokens=1), "prompt"),
        ([1, 99999], SamplingParams(max_tokens=1), "prompt"),
        ([1, 2], SamplingParams(max_tokens=1, logit_bias={70000: 1.0}), "logit_bias"),
        ([], SamplingParams(max_tokens=1), "prompt"),
        ([1] * 250, SamplingParams(max_tokens=None, min_tokens=100), "min_tokens"),  # past the context's rest
        ([1] * 300, SamplingParams(max_tokens=None, min_tokens=5), "prompt"),  # no room at all: the prompt's fault
    ],
)
def test_refusals_name_the_parameter(llm, prompt, params, param):
    with pytest.raises(RequestRejectedError) as info:
        llm.engine.add_request("bad", prompt, params)
    assert info.value.field == param
    assert llm.engine.runner.num_requests == 0


def test_default_max_tokens_fills_the_context(llm):
    engine = llm.engine
    engine.add_request("fill", [1] * 250, SamplingParams(max_tokens=None, ignore_eos=True))
    final = [o for o in drain(engine) if o.finished][0]
    assert final.num_output_tokens == engine.max_model_len - 250 and final.finish_reason == "length"


def test_min_tokens_through_the_engine(llm):
    (base,) = llm.generate([[3, 4, 5]], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True), use_tqdm=False)
    tokens = base.outputs[0].token_ids
    stop_id = tokens[0]
    (r,) = llm.generate(
        [[3, 4, 5]],
        SamplingParams(max_tokens=12, temperature=0, stop_token_ids=[stop_id], min_tokens=4),
        use_tqdm=False,
    )
    assert len(r.outputs[0].token_ids) >= 4
    assert stop_id not in r.outputs[0].token_ids[:4]


def test_request_id_reused_right_after_finishing(llm):
    engine = llm.engine
    engine.add_request("again", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
    first = [t for o in drain(engine) for t in o.new_token_ids]
    engine.add_request("again", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))  # before any step
    assert [t for o in drain(engine) for t in o.new_token_ids] == first
    for _ in range(3):
        engine.add_request("again", [1, 2, 3], SamplingParams(max_tokens=2, temperature=0))
        drain(engine)
    # the runner's state of each predecessor was replaced, its block-table row given back
    assert engine.runner.block_table.num_rows_in_use == engine.runner.num_requests <= 1


def test_stop_strings_wait_for_min_tokens(llm):
    prompt = llm.get_tokenizer().encode("The quick brown fox")
    (base,) = llm.generate(
        [{"prompt_token_ids": prompt}], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True), use_tqdm=False
    )
    first_token_text = llm.get_tokenizer().decode(base.outputs[0].token_ids[:1])
    stop = first_token_text[:1]
    assert stop
    params = SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop=[stop], min_tokens=3)
    (result,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    assert len(result.outputs[0].token_ids) >= 3  # the stop string in the first token did not end it


def test_stop_token_text_is_left_out_unless_asked(llm):
    prompt = [10, 20, 30]
    (base,) = llm.generate([prompt], SamplingParams(max_tokens=10, temperature=0, ignore_eos=True), use_tqdm=False)
    tokens = base.outputs[0].token_ids
    stop_id = tokens[2]
    cut = tokens.index(stop_id)
    tokenizer = llm.get_tokenizer()
    for include in (False, True):
        params = SamplingParams(
            max_tokens=10, temperature=0, stop_token_ids=[stop_id], include_stop_str_in_output=include
        )
        (r,) = llm.generate([prompt], params, use_tqdm=False)
        shown = tokens[: cut + 1] if include else tokens[:cut]
        assert r.outputs[0].token_ids == tokens[: cut + 1]
        assert r.outputs[0].text == tokenizer.decode(shown)

"""SamplingParams: defaults, normalisation, validation naming the parameter, copies."""

from __future__ import annotations

import math

import pytest

from engine.sampling.params import MAX_LOGPROBS, SamplingParams
from scheduler import RequestRejectedError


def test_defaults_mirror_vllm():
    params = SamplingParams()
    assert (params.n, params.temperature, params.top_p) == (1, 1.0, 1.0)
    assert params.top_k is None and params.min_p == 0.0
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.0, 0.0, 1.0)
    assert params.max_tokens == 16 and params.min_tokens == 0
    assert params.stop == [] and params.stop_token_ids == [] and params.logit_bias is None
    assert params.logprobs is None and params.prompt_logprobs is None and params.seed is None
    assert params.skip_special_tokens and params.spaces_between_special_tokens
    assert not params.ignore_eos and not params.include_stop_str_in_output


@pytest.mark.parametrize("top_k", [0, -1, None])
def test_top_k_disabled_values_become_none(top_k):
    assert SamplingParams(top_k=top_k).top_k is None


def test_normalisation():
    params = SamplingParams(stop="###", stop_token_ids=(5, 6), logit_bias={"12": 3, 7: -1.5})
    assert params.stop == ["###"]
    assert params.stop_token_ids == [5, 6]
    assert params.logit_bias == {12: 3.0, 7: -1.5}
    assert SamplingParams(stop=None, stop_token_ids=None).stop == []
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert isinstance(SamplingParams(temperature=1).temperature, float)


@pytest.mark.parametrize(
    "param, value",
    [
        ("n", 0),
        ("n", 1.5),
        ("n", True),
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "hot"),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("top_k", -2),
        ("top_k", 2.5),
        ("min_p", -0.01),
        ("min_p", 1.01),
        ("presence_penalty", 2.01),
        ("presence_penalty", -2.5),
        ("frequency_penalty", 3.0),
        ("frequency_penalty", -2.01),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("logit_bias", {1: 100.5}),
        ("logit_bias", {1: -101}),
        ("logit_bias", {-1: 1.0}),
        ("logit_bias", {"x": 1.0}),
        ("logit_bias", {1: math.nan}),
        ("logit_bias", [1, 2]),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("min_tokens", -1),
        ("logprobs", MAX_LOGPROBS + 1),
        ("logprobs", -1),
        ("prompt_logprobs", MAX_LOGPROBS + 1),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop", ""),
        ("stop", ["ok", 3]),
        ("stop", 3),
        ("stop_token_ids", [-1]),
        ("stop_token_ids", ["a"]),
        ("seed", 1.5),
    ],
)
def test_invalid_values_are_rejected_naming_the_param(param, value):
    with pytest.raises(RequestRejectedError) as info:
        SamplingParams(**{param: value})
    assert info.value.field == param
    assert param in info.value.message


def test_min_tokens_may_not_exceed_max_tokens():
    with pytest.raises(RequestRejectedError) as info:
        SamplingParams(max_tokens=4, min_tokens=5)
    assert info.value.field == "min_tokens"
    SamplingParams(max_tokens=5, min_tokens=5)
    SamplingParams(max_tokens=None, min_tokens=1000)


def test_boundary_values_are_accepted():
    SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        presence_penalty=-2.0,
        frequency_penalty=2.0,
        repetition_penalty=1e-3,
        logit_bias={0: -100, 5: 100},
        logprobs=0,
        prompt_logprobs=MAX_LOGPROBS,
        max_tokens=1,
        seed=-(2**63),
    )
    SamplingParams(logprobs=MAX_LOGPROBS, prompt_logprobs=0, max_tokens=None)


def test_derived_properties():
    assert SamplingParams(temperature=0.0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy
    assert not SamplingParams(temperature=0.01).is_greedy
    assert not SamplingParams().needs_penalties
    for penalty in ({"presence_penalty": 0.1}, {"frequency_penalty": -0.1}, {"repetition_penalty": 1.1}):
        assert SamplingParams(**penalty).needs_penalties
    assert not SamplingParams().needs_top_k_top_p
    assert SamplingParams(top_k=5).needs_top_k_top_p
    assert SamplingParams(top_p=0.9).needs_top_k_top_p
    assert SamplingParams(logprobs=0).needs_logprobs and not SamplingParams().needs_logprobs


def test_replace_validates_and_copies():
    params = SamplingParams(stop=["a"], logit_bias={1: 2.0})
    copy = params.clone()
    copy.stop.append("b")
    copy.logit_bias[3] = 1.0
    assert params.stop == ["a"] and params.logit_bias == {1: 2.0}
    assert params.replace(temperature=0.5).temperature == 0.5
    with pytest.raises(RequestRejectedError) as info:
        params.replace(top_p=2.0)
    assert info.value.field == "top_p"


def test_children_get_consecutive_seeds():
    params = SamplingParams(n=3, seed=41, temperature=0.8)
    children = [params.for_child(i) for i in range(3)]
    assert [c.seed for c in children] == [41, 42, 43]
    assert all(c.n == 1 and c.temperature == 0.8 for c in children)
    assert SamplingParams(n=2).for_child(1).seed is None
    with pytest.raises(ValueError):
        params.for_child(3)


def test_verify_vocab_refuses_bias_outside_the_vocabulary():
    SamplingParams(logit_bias={99: 1.0}).verify_vocab(100)
    with pytest.raises(RequestRejectedError) as info:
        SamplingParams(logit_bias={100: 1.0}).verify_vocab(100)
    assert info.value.field == "logit_bias"


@pytest.mark.parametrize(
    "kwargs,param",
    [
        ({"n": 129}, "n"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["x" * 257]}, "stop"),
    ],
)
def test_request_size_limits(kwargs, param):
    with pytest.raises(RequestRejectedError) as info:
        SamplingParams(**kwargs)
    assert info.value.field == param

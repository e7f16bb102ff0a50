"""The checkpoint's generation_config.json as vLLM reads it: its repetition_penalty, temperature, top_k, top_p
and min_p are the defaults of requests that leave them unset (`--generation-config auto`, the default), over a
real server and the offline API; `vllm` keeps the neutral defaults."""

from __future__ import annotations

import json
import shutil

import pytest

from engine import SamplingParams
from engine.errors import SettingsConflictError
from engine.loading.generation_defaults import read_sampling_defaults
from engine.loading.loader import CheckpointError
from server.config.server_config import ServerConfig
from tests.engine.references import make_llm
from tests.server.conftest import serving

PROMPT = "The quick brown fox"
# top_k 1 makes every default request greedy, whatever its temperature; the penalty changes which tokens win
MODEL_DEFAULTS = {"temperature": 0.7, "top_k": 1, "top_p": 0.9, "repetition_penalty": 1.5}


@pytest.fixture(scope="module")
def recommending_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model, its generation_config.json recommending sampling settings (as Qwen's, Llama's do)."""
    path = shutil.copytree(tiny_model_dir, tmp_path_factory.mktemp("gencfg") / "model")
    config = json.loads((path / "generation_config.json").read_text())
    (path / "generation_config.json").write_text(json.dumps({**config, "do_sample": True, **MODEL_DEFAULTS}))
    return path


@pytest.fixture(scope="module")
def recommending_server(recommending_model_dir):
    with serving(recommending_model_dir, ServerConfig(served_model_name="tiny")) as running:
        yield running


def test_requests_that_leave_sampling_unset_take_the_models_generation_config(recommending_server):
    client = recommending_server.sdk()
    # the model's defaults, spelled out: greedy (top_k 1) under its repetition penalty
    spelled = (
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"repetition_penalty": 1.5}
        )
        .choices[0]
        .text
    )
    plain_greedy = (
        client.completions.create(
            model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"repetition_penalty": 1.0}
        )
        .choices[0]
        .text
    )
    assert spelled != plain_greedy  # (the penalty shows in this model's greedy tokens)
    for seed in (1, 2, 3):  # unset top_k and repetition_penalty: the model's, so every seed gives the same text
        text = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, seed=seed).choices[0].text
        assert text == spelled
    chat = [{"role": "user", "content": PROMPT}]
    chat_spelled = client.chat.completions.create(
        model="tiny", messages=chat, max_tokens=8, temperature=0, extra_body={"repetition_penalty": 1.5}
    )
    chat_default = client.chat.completions.create(model="tiny", messages=chat, max_tokens=8, seed=4)
    assert chat_default.choices[0].message.content == chat_spelled.choices[0].message.content
    # a request's own values win: top_k -1 (disabled) at temperature 0 and no penalty is plain greedy
    own = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, extra_body={"top_k": -1, "repetition_penalty": 1.0}
    )
    assert own.choices[0].text == plain_greedy


def test_the_responses_api_reports_the_models_defaults(recommending_server):
    reply = recommending_server.sdk().responses.create(model="tiny", input=PROMPT, max_output_tokens=4)
    assert (reply.temperature, reply.top_p) == (0.7, 0.9)


def test_offline_defaults_and_generation_config_vllm(recommending_model_dir):
    llm = make_llm(recommending_model_dir)
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.repetition_penalty) == (0.7, 1, 0.9, 1.5)
        assert defaults.min_p == 0.0 and defaults.max_tokens == 16  # what the file does not set stays vLLM's
        spelled = SamplingParams(temperature=0, repetition_penalty=1.5)
        expected = llm.generate(PROMPT, spelled, use_tqdm=False)[0].outputs[0].text
        assert llm.generate(PROMPT, use_tqdm=False)[0].outputs[0].text == expected
        (reply,) = llm.chat([{"role": "user", "content": PROMPT}], use_tqdm=False)
        (spelled_reply,) = llm.chat([{"role": "user", "content": PROMPT}], spelled, use_tqdm=False)
        assert reply.outputs[0].text == spelled_reply.outputs[0].text
    finally:
        llm.shutdown()
    neutral = make_llm(recommending_model_dir, generation_config="vllm")
    try:
        defaults = neutral.get_default_sampling_params()
        assert (defaults.temperature, defaults.top_k, defaults.repetition_penalty) == (1.0, None, 1.0)
    finally:
        neutral.shutdown()


def test_a_generation_config_directory_and_a_bad_value(recommending_model_dir, tiny_model_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "generation_config.json").write_text(json.dumps({"top_k": 5, "min_p": 0.1}))
    llm = make_llm(tiny_model_dir, generation_config=str(other))
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.min_p, defaults.temperature) == (5, 0.1, 1.0)
    finally:
        llm.shutdown()
    with pytest.raises(SettingsConflictError, match="no generation_config.json"):  # a bad setting: exit 2
        make_llm(tiny_model_dir, generation_config=str(tmp_path / "missing"))
    bad = shutil.copytree(recommending_model_dir, tmp_path / "bad")
    (bad / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "top_p": 0.0}))
    with pytest.raises(CheckpointError, match="generation_config.json: top_p must be in"):
        make_llm(bad)


def test_override_generation_config_sets_defaults_over_the_files(recommending_model_dir):
    """vLLM's --override-generation-config: its keys over the file's (auto), or alone (vllm)."""
    for source, expected in (("auto", (0.2, 1, 0.9, 1.5)), ("vllm", (0.2, None, 1.0, 1.0))):
        defaults = read_sampling_defaults(source, recommending_model_dir, {"temperature": 0.2})
        params = SamplingParams(**defaults)
        assert (params.temperature, params.top_k, params.top_p, params.repetition_penalty) == expected
    llm = make_llm(recommending_model_dir, override_generation_config={"top_k": 3, "min_p": 0.05})
    try:
        defaults = llm.get_default_sampling_params()
        assert (defaults.top_k, defaults.min_p, defaults.temperature) == (3, 0.05, 0.7)
    finally:
        llm.shutdown()
    with pytest.raises(SettingsConflictError, match="'max_new_tokens' cannot be overridden"):
        read_sampling_defaults("auto", recommending_model_dir, {"max_new_tokens": 5})
    with pytest.raises(SettingsConflictError, match="--override-generation-config: top_p must be in"):
        read_sampling_defaults("auto", recommending_model_dir, {"top_p": 0.0})


def test_the_models_eos_list_ends_generation_when_the_tokenizer_comes_from_elsewhere(tiny_model_dir, tmp_path):
    """vLLM reads the eos ids of the model's generation_config.json, wherever `--tokenizer` points (a model
    directory without tokenizer files, as hub repos of converted weights often are)."""
    model = shutil.copytree(tiny_model_dir, tmp_path / "model")
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "eos_token_id": [2, 1]}))  # 1: <|im_start|>
    tokenizer_dir = tmp_path / "tokenizer"
    tokenizer_dir.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tiny_model_dir / name, tokenizer_dir / name)
    llm = make_llm(model, tokenizer=str(tokenizer_dir))
    try:
        assert llm.get_tokenizer().eos_token_ids == frozenset({1, 2})
        params = SamplingParams(max_tokens=4, temperature=0, logit_bias={1: 100.0})  # <|im_start|> first
        (out,) = llm.generate(PROMPT, params, use_tqdm=False)[0].outputs
        assert (out.finish_reason, out.token_ids) == ("stop", [1])
    finally:
        llm.shutdown()

"""Speculative decoding through the real server: per-request control, the same greedy text, the metrics,
and the settings that turn it on (flag, environment, YAML) or refuse it at start-up."""

from __future__ import annotations

import json

import pytest

from server.config.server_config import ServerConfig
from server.config.settings import SettingsError, load_settings
from tests.engine.eagle_factories import make_eagle_head
from tests.engine.medusa_factories import make_medusa_heads
from tests.engine.mlp_speculator_factories import make_mlp_speculator
from tests.server.conftest import serving, start_server

NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 4,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 4,
    "step_cost_model": False,
}  # no start-up timing: on a loaded machine it could price every draft out
LOOPING_PROMPT = [5, 6, 7, 8, 9] * 4 + [40, 41]  # the tiny model's greedy continuation loops on it


@pytest.fixture(scope="module")
def spec_server(tiny_model_dir):
    uv, thread, running = start_server(tiny_model_dir, ServerConfig(served_model_name="tiny"), speculative_config=NGRAM)
    yield running
    uv.should_exit = True
    thread.join(30)


def complete(client, **fields):
    body = {
        "model": "tiny",
        "prompt": LOOPING_PROMPT,
        "max_tokens": 32,
        "temperature": 0,
        "ignore_eos": True,
        "logprobs": 1,
        **fields,
    }
    response = client.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]


def test_speculation_on_and_off_give_the_same_greedy_text_and_the_metrics_count_it(spec_server):
    with spec_server.client() as client:
        off = complete(client, speculative=False)
        on = complete(client)
        fewer = complete(client, num_speculative_tokens=1, stream=False)
        assert on["text"] == off["text"] == fewer["text"]
        assert on["logprobs"]["tokens"] == off["logprobs"]["tokens"]
        assert on["logprobs"]["token_logprobs"] == pytest.approx(off["logprobs"]["token_logprobs"], abs=1e-5)
        chat = client.post(
            "/v1/chat/completions",
            json={
                "model": "tiny",
                "messages": [{"role": "user", "content": "a b a b a b a b"}],
                "max_tokens": 8,
                "temperature": 0,
                "speculative": False,
            },
        )
        assert chat.status_code == 200
        metrics = client.get("/metrics").text
    spec_server.wait_idle()
    values = {
        line.split(" ")[0]: float(line.split(" ")[1])
        for line in metrics.splitlines()
        if line.startswith("pagedserve_spec_decode")
    }
    accepted = values['pagedserve_spec_decode_num_accepted_tokens_total{model_name="tiny"}']
    assert 0 < accepted <= values['pagedserve_spec_decode_num_draft_tokens_total{model_name="tiny"}']
    assert values['pagedserve_spec_decode_num_drafts_total{model_name="tiny"}'] > 0
    assert values['pagedserve_spec_decode_num_accepted_tokens_per_pos_total{model_name="tiny",position="0"}'] > 0


def _sdk_outputs_without_and_with_speculation(running) -> list[tuple]:
    """(completion text, its tokens, streamed chat text) through the openai SDK, with `speculative: false` then on;
    afterwards the engine is idle and drafts were verified."""
    sdk = running.sdk()
    outputs = []
    for speculative in (False, True):
        completion = sdk.completions.create(
            model="tiny",
            prompt=LOOPING_PROMPT,
            max_tokens=24,
            temperature=0,
            logprobs=1,
            extra_body={"ignore_eos": True, "speculative": speculative},
        )
        stream = sdk.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": "the quick brown fox"}],
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"speculative": speculative},
        )
        chat = "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)
        choice = completion.choices[0]
        outputs.append((choice.text, choice.logprobs.tokens, chat))
    running.wait_idle()
    assert running.engine.engine.stats().speculation.num_draft_tokens > 0
    return outputs


def test_an_eagle3_head_served_gives_the_greedy_text_of_no_speculation(tiny_model_dir, tmp_path):
    """The openai SDK against a server whose drafts come from an EAGLE-3 head (reading the tiny model's layers 0,
    1 and 1): completions and streamed chat equal their runs with `speculative: false`; drafts were verified."""
    head = make_eagle_head(tmp_path / "head", "eagle3", feature_layers=[0, 1, 1], draft_vocab=300)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "step_cost_model": False}
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny"), speculative_config=config) as running:
        without, with_drafts = _sdk_outputs_without_and_with_speculation(running)
        assert without == with_drafts
        proposer = running.engine.engine.scheduler.proposer
        assert proposer.num_requests == 0 and proposer.cache.num_free_blocks == proposer.cache.num_blocks


@pytest.mark.parametrize("method", ["medusa", "mlp_speculator"])
def test_last_state_drafters_served_give_the_greedy_text_of_no_speculation(method, tiny_model_dir, tmp_path):
    """The openai SDK against a server whose drafts come from Medusa heads, or from an MLP speculator named as
    vLLM's guides name IBM's (a model alone, its method read from its config): a completion and a streamed chat
    equal their runs with `speculative: false`; drafts were verified and the proposer holds nothing after."""
    if method == "medusa":
        config = {"method": "medusa", "model": str(make_medusa_heads(tmp_path / "heads", num_heads=3))}
    else:
        config = {"model": str(make_mlp_speculator(tmp_path / "speculator"))}
    config.update(num_speculative_tokens=3, step_cost_model=False)
    with serving(tiny_model_dir, ServerConfig(served_model_name="tiny"), speculative_config=config) as running:
        without, with_drafts = _sdk_outputs_without_and_with_speculation(running)
        assert without == with_drafts
        assert running.engine.engine.scheduler.proposer.num_requests == 0


def test_a_bad_per_request_value_is_a_400_naming_it(spec_server):
    with spec_server.client() as client:
        response = client.post(
            "/v1/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2, "num_speculative_tokens": -1}
        )
        assert response.status_code == 400
        assert response.json()["error"]["param"] == "num_speculative_tokens"


def test_the_shared_server_without_speculation_shows_no_spec_metrics(server):
    with server.client() as client:
        assert "pagedserve_spec_decode" not in client.get("/metrics").text


def test_a_lookup_max_alone_below_the_default_min_is_taken():
    """`{"prompt_lookup_max": 1}` alone was refused (the default min, 2, above it); the range is then 1..1. A min
    given above the max is still refused (test_a_bad_config_is_refused_at_start_up_naming_the_flag)."""
    from engine.spec_decode.speculative_config import SpeculativeConfig

    alone = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=1)
    assert (alone.prompt_lookup_min, alone.prompt_lookup_max) == (1, 1)
    wide = SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_max=4)
    assert (wide.prompt_lookup_min, wide.prompt_lookup_max) == (2, 4)


def test_the_flag_the_environment_and_yaml_set_it(tmp_path):
    flag = load_settings(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}'], {})
    assert flag.engine.speculative_config.num_speculative_tokens == 3
    assert flag.engine.speculative_config.prompt_lookup_max == 5
    env = load_settings([], {"PAGEDSERVE_SPECULATIVE_CONFIG": '{"num_speculative_tokens": 2, "prompt_lookup_max": 6}'})
    assert (env.engine.speculative_config.num_speculative_tokens, env.engine.speculative_config.prompt_lookup_max) == (
        2,
        6,
    )
    preset = tmp_path / "spec.yaml"
    preset.write_text("speculative_config:\n  method: ngram\n  num_speculative_tokens: 5\n")
    assert load_settings(["--config", str(preset)], {}).engine.speculative_config.num_speculative_tokens == 5
    assert (
        load_settings(["--config", str(preset), "--speculative-config", "none"], {}).engine.speculative_config is None
    )


def test_vllms_earlier_names_of_mtp_are_read_as_mtp():
    for name in ("mtp", "deepseek_mtp", "glm4_moe_mtp"):
        settings = load_settings(["--speculative-config", f'{{"method": "{name}", "num_speculative_tokens": 1}}'], {})
        assert settings.engine.speculative_config.method == "mtp"


def test_a_model_without_a_method_is_a_draft_model_as_vllm_reads_it():
    settings = load_settings(["--speculative-config", '{"model": "/some/draft", "num_speculative_tokens": 3}'], {})
    speculative = settings.engine.speculative_config
    assert (speculative.method, speculative.model, speculative.num_speculative_tokens) == (
        "draft_model",
        "/some/draft",
        3,
    )


@pytest.mark.parametrize(
    "value, message",
    [
        ('{"method": "medusa", "num_speculative_tokens": 3}', 'method "medusa" needs "model"'),
        ('{"method": "mlp_speculator", "num_speculative_tokens": 3}', 'method "mlp_speculator" needs "model"'),
        (
            '{"model": "/some/draft", "num_speculative_tokens": 3, "draft_tensor_parallel_size": 2}',
            "draft_tensor_parallel_size: Input should be 1",
        ),
        ('{"method": "eagle3", "num_speculative_tokens": 3}', 'method "eagle3" needs "model"'),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'method "draft_model" needs "model"'),
        ('{"method": "suffix", "model": "/some/draft", "num_speculative_tokens": 3}', 'goes with method "draft_model"'),
        (
            '{"method": "suffix", "num_speculative_tokens": 3, "suffix_decoding_min_token_prob": 2}',
            "suffix_decoding_min_token_prob: Input should be less than or equal to 1 (got 2)",
        ),
        ('{"method": "medusa2", "num_speculative_tokens": 3}', "unknown speculative method"),
        ('{"method": "ngram"}', "num_speculative_tokens"),
        ('{"num_speculative_tokens": 0}', "num_speculative_tokens: Input should be greater than or equal to 1"),
        (
            '{"num_speculative_tokens": 2, "prompt_lookup_min": 5, "prompt_lookup_max": 3}',
            "must be <= prompt_lookup_max",
        ),
        ('{"num_speculative_tokens": 2, "lookahead": 1}', "lookahead: unknown key (expected one of: adaptive,"),
        ("{not json", "not valid JSON"),
        ("[4]", "expected a JSON object"),
    ],
)
def test_a_bad_config_is_refused_at_start_up_naming_the_flag(value, message):
    with pytest.raises(SettingsError, match="--speculative-config") as caught:
        load_settings(["--speculative-config", value], {})
    assert message in str(caught.value)


def test_bench_serve_reports_the_acceptance(spec_server, tiny_model_dir, tmp_path, capsys):
    from server.benchmark.serve import main

    out = tmp_path / "result.json"
    code = main(
        [
            "--base-url",
            spec_server.base_url,
            "--tokenizer",
            str(tiny_model_dir),
            "--num-prompts",
            "4",
            "--input-len",
            "16",
            "--output-len",
            "48",
            "--max-concurrency",
            "4",
            "--ignore-eos",
            "--temperature",
            "0",
            "--result-json",
            str(out),
            "--disable-tqdm",
        ]
    )
    assert code == 0
    spec = json.loads(out.read_text())["speculative_decoding"]
    assert spec["num_drafts"] > 0 and spec["mean_acceptance_length"] >= 1
    assert "Speculative decoding: mean acceptance length" in capsys.readouterr().out

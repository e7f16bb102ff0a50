"""Multi-LoRA over HTTP: a real uvicorn server started from `pagedserve serve` flags (--enable-lora --lora-modules
...) on the tiny model with random PEFT adapters, reached with the OpenAI SDK; its tokens are the offline engine's
for the same adapter (greedy, float32)."""

from __future__ import annotations

import json
import shutil

import httpx
import openai
import pytest

from engine.async_engine import AsyncEngine
from engine.builder import build_engine
from engine.lora.request import LoRAMix, LoRARequest
from engine.sampling.params import SamplingParams
from server.config.settings import load_settings
from tests.engine.references import TINY_PRESET, make_llm
from tests.lora.adapters import make_adapter
from tests.promtool import check_metrics
from tests.server.conftest import pace_engine, serve_engine

KEY = "lora-key"
PROMPT = "The quick brown fox"
MESSAGES = [{"role": "user", "content": "Name a colour."}]
MAX_TOKENS = 10
RANKS = {"a": 8, "b": 4, "c": 8, "big": 32}  # big: over --max-lora-rank 16
MIX = (("a", 0.5), ("b", 0.5))


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-adapters")
    return {
        name: make_adapter(tiny_model_dir, root / name, seed=seed, r=rank, alpha=2 * rank)
        for seed, (name, rank) in enumerate(RANKS.items())
    }


@pytest.fixture(scope="module")
def expected(tiny_model_dir, adapters):
    """The offline engine's texts: per adapter (None: the base model, "mix": MIX), for PROMPT and for MESSAGES."""
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)
    with make_llm(tiny_model_dir, enable_lora=True, max_lora_rank=16) as llm:
        tokenizer = llm.engine.tokenizer
        chat_prompt = {"prompt_token_ids": tokenizer.encode(tokenizer.render_chat(MESSAGES, True), False)}
        requests = {name: LoRARequest(name, str(adapters[name])) for name in ("a", "b", "c")}  # loaded on first use
        texts = {}
        for key, lora in [(None, None), *requests.items(), ("mix", LoRAMix(MIX))]:
            (plain,) = llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False)
            (chat,) = llm.generate(chat_prompt, params, lora_request=lora, use_tqdm=False)
            texts[key] = (plain.outputs[0].text, chat.outputs[0].text)
    assert len({texts[key] for key in texts}) == len(texts), "the adapters must change the tiny model's output"
    return texts


@pytest.fixture(scope="module")
def lora_server(tiny_model_dir, adapters):
    b = json.dumps({"name": "b", "path": str(adapters["b"]), "base_model_name": "tiny-base"})
    argv = ["--config", str(TINY_PRESET), "--model", str(tiny_model_dir), "--served-model-name", "tiny", "tiny-alias"]
    argv += ["--enable-lora", "--lora-modules", f"a={adapters['a']}", b, "--max-lora-rank", "16"]
    argv += ["--allow-runtime-lora-updating", "--api-key", KEY]
    settings = load_settings(argv, {})
    engine = AsyncEngine(build_engine(settings.engine, served_model_name="tiny"))
    uv, thread, running = serve_engine(engine, settings.server)
    yield running
    uv.should_exit = True
    thread.join(30)


@pytest.fixture
def sdk(lora_server):
    return openai.OpenAI(base_url=f"{lora_server.base_url}/v1", api_key=KEY, max_retries=0)


def complete(sdk, model, **extra):
    return sdk.completions.create(model=model, prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=0, **extra)


def chat(sdk, model, **extra):
    return sdk.chat.completions.create(model=model, messages=MESSAGES, max_tokens=MAX_TOKENS, temperature=0, **extra)


def test_the_model_field_picks_the_adapter_on_every_route(lora_server, sdk, expected):
    for model, key in (("a", "a"), ("b", "b"), ("tiny", None)):
        completion = complete(sdk, model)
        assert (completion.model, completion.choices[0].text) == (model, expected[key][0])
        reply = chat(sdk, model)
        assert (reply.model, reply.choices[0].message.content) == (model, expected[key][1])
    response = sdk.responses.create(
        model="a", input=MESSAGES[0]["content"], max_output_tokens=MAX_TOKENS, temperature=0
    )
    assert (response.model, response.output_text) == ("a", expected["a"][1])
    streamed = "".join(chunk.choices[0].text for chunk in complete(sdk, "b", stream=True) if chunk.choices)
    assert streamed == expected["b"][0]
    lora_server.wait_idle()


def test_the_lora_extension_mixes_adapters_over_the_base(lora_server, sdk, expected):
    mix = [{"name": name, "scale": scale} for name, scale in MIX]
    assert complete(sdk, "tiny", extra_body={"lora": mix}).choices[0].text == expected["mix"][0]
    assert chat(sdk, "tiny", extra_body={"lora": mix}).choices[0].message.content == expected["mix"][1]
    single = [{"name": "a", "scale": 1.0}]
    assert complete(sdk, "tiny", extra_body={"lora": single}).choices[0].text == expected["a"][0]
    with pytest.raises(openai.BadRequestError) as refused:
        complete(sdk, "a", extra_body={"lora": mix})
    assert refused.value.body["param"] == "lora"
    for bad in ([], [{"name": "a", "scale": 1.0}] * 2, [{"name": "a", "scale": "x"}]):
        with pytest.raises(openai.BadRequestError) as refused:
            complete(sdk, "tiny", extra_body={"lora": bad})
        assert refused.value.body["param"] == "lora"
    with pytest.raises(openai.NotFoundError) as unknown:
        complete(sdk, "tiny", extra_body={"lora": [{"name": "nope", "scale": 1.0}]})
    assert (unknown.value.body["code"], unknown.value.body["param"]) == ("model_not_found", "lora")
    lora_server.wait_idle()


def test_every_served_model_name_is_the_base_model(lora_server, sdk, adapters, expected):
    """With --enable-lora only the first --served-model-name was taken: the others, listed by /v1/models, were a
    404 on the generation routes, and an adapter could be loaded under one of them."""
    completion = complete(sdk, "tiny-alias")
    assert (completion.model, completion.choices[0].text) == ("tiny-alias", expected[None][0])
    assert chat(sdk, "tiny-alias").choices[0].message.content == expected[None][1]
    mix = [{"name": name, "scale": scale} for name, scale in MIX]
    mixed = complete(sdk, "tiny-alias", extra_body={"lora": mix})
    assert (mixed.model, mixed.choices[0].text) == ("tiny-alias", expected["mix"][0])
    with lora_server.client() as client:
        taken = client.post("/v1/load_lora_adapter", json={"lora_name": "tiny-alias", "lora_path": str(adapters["c"])})
    assert (taken.status_code, taken.json()["error"]["param"]) == (400, "lora_name")
    lora_server.wait_idle()


def test_models_lists_the_adapters_with_parent_and_root(sdk, adapters):
    cards = {card.id: card for card in sdk.models.list().data}
    assert list(cards) == ["tiny", "tiny-alias", "a", "b"]
    assert (cards["a"].parent, cards["a"].root) == ("tiny", str(adapters["a"]))
    assert (cards["b"].parent, cards["b"].root) == ("tiny-base", str(adapters["b"]))
    assert getattr(cards["tiny"], "parent", None) is None
    assert sdk.models.retrieve("b").root == str(adapters["b"])


def test_an_unknown_model_is_openais_404(lora_server):
    with lora_server.client() as client:
        reply = client.post("/v1/completions", json={"model": "nope", "prompt": PROMPT, "max_tokens": 2})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert (error["type"], error["param"], error["code"]) == ("not_found_error", "model", "model_not_found")
    assert "'nope'" in error["message"] and "'a'" in error["message"]


def test_load_use_unload_at_run_time(lora_server, sdk, adapters, expected, monkeypatch):
    with lora_server.client() as client:
        loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
        assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'c' added successfully.")
        assert complete(sdk, "c").choices[0].text == expected["c"][0]
        assert "c" in [card.id for card in sdk.models.list().data]
        again = client.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": str(adapters["c"])})
        assert again.status_code == 400 and "already been loaded" in again.json()["error"]["message"]
        big = client.post("/v1/load_lora_adapter", json={"lora_name": "big", "lora_path": str(adapters["big"])})
        assert (big.status_code, big.json()["error"]["param"]) == (400, "lora_path")
        assert "rank 32" in big.json()["error"]["message"]
        missing = client.post("/v1/load_lora_adapter", json={"lora_name": "m", "lora_path": str(adapters["c"]) + "x"})
        assert missing.status_code == 404
        pace_engine(lora_server, monkeypatch, 0.02)  # so the stream below is still running when c is unloaded
        stream = complete(sdk, "c", stream=True)
        first = next(iter(stream))
        unloaded = client.post("/v1/unload_lora_adapter", json={"lora_name": "c"})
        assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'c' removed successfully.")
        rest = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert first.choices[0].text + rest == expected["c"][0]  # in flight: finished with c's weights
        with pytest.raises(openai.NotFoundError):
            complete(sdk, "c")
        assert client.post("/v1/unload_lora_adapter", json={"lora_name": "c"}).status_code == 404
        no_key = httpx.post(f"{lora_server.base_url}/v1/unload_lora_adapter", json={"lora_name": "a"})
        assert no_key.status_code == 401 and no_key.json()["error"]["type"] == "authentication_error"
    assert "c" not in [card.id for card in sdk.models.list().data]
    lora_server.wait_idle()


@pytest.mark.parametrize(
    "config",
    [
        [1, 2],  # not an object
        {"r": None},
        {"lora_alpha": None},
        {"rank_pattern": [8]},
        {"alpha_pattern": {"(": 2}},  # not a regular expression
        {"modules_to_save": 5},
    ],
    ids=["list", "r-null", "alpha-null", "rank-pattern-list", "alpha-pattern-regex", "modules-to-save-int"],
)
def test_a_malformed_adapter_config_is_a_400_naming_lora_path(lora_server, adapters, tmp_path, config):
    """Fields of the wrong type reached the reader: an AttributeError or TypeError, a 500."""
    broken = tmp_path / "broken"
    shutil.copytree(adapters["a"], broken)
    good = json.loads((broken / "adapter_config.json").read_text())
    (broken / "adapter_config.json").write_text(json.dumps({**good, **config} if isinstance(config, dict) else config))
    with lora_server.client() as client:
        reply = client.post("/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(broken)})
        assert (reply.status_code, reply.json()["error"]["param"]) == (400, "lora_path"), reply.text
        assert "adapter_config.json" in reply.json()["error"]["message"]
        assert "broken" not in [card["id"] for card in client.get("/v1/models").json()["data"]]


def test_without_the_flag_the_endpoints_and_adapters_are_404(server):
    with server.client() as client:
        for path in ("/v1/load_lora_adapter", "/v1/unload_lora_adapter"):
            reply = client.post(path, json={"lora_name": "a", "lora_path": "/nowhere"})
            assert reply.status_code == 404 and "error" in reply.json()
        mix = client.post("/v1/completions", json={"prompt": "x", "lora": [{"name": "a", "scale": 1.0}]})
        assert (mix.status_code, mix.json()["error"]["param"]) == (400, "lora")


def lora_info(client: httpx.Client) -> str:
    (line,) = [
        line for line in client.get("/metrics").text.splitlines() if line.startswith("pagedserve_lora_requests_info{")
    ]
    return line


def test_metrics_show_the_lora_gauge_and_the_requests_per_adapter(lora_server, sdk, monkeypatch):
    complete(sdk, "a")
    pace_engine(lora_server, monkeypatch, 0.02)
    with lora_server.client() as client:
        with sdk.completions.create(model="b", prompt=PROMPT, max_tokens=50, temperature=0, stream=True) as stream:
            next(iter(stream))
            assert 'running_lora_adapters="b"' in lora_info(client)
        lora_server.wait_idle()
        text = client.get("/metrics").text
    info = [line for line in text.splitlines() if line.startswith("pagedserve_lora_requests_info{")]
    assert len(info) == 1
    for label in ('max_lora="4"', 'running_lora_adapters=""', 'waiting_lora_adapters=""', 'model_name="tiny"'):
        assert label in info[0]
    (count,) = [line for line in text.splitlines() if line.startswith('pagedserve_lora_requests_total{lora_name="a"')]
    assert float(count.split()[-1]) >= 1
    result = check_metrics(text)
    assert result.returncode == 0 and result.stdout.strip() == result.stderr.strip() == "", (
        result.stdout + result.stderr
    )


def test_kv_cache_is_empty_again_after_aborted_adapter_requests(lora_server, sdk, monkeypatch):
    pace_engine(lora_server, monkeypatch, 0.02)
    for extra in ({}, {"extra_body": {"lora": [{"name": name, "scale": scale} for name, scale in MIX]}}):
        stream = sdk.completions.create(
            model="a" if not extra else "tiny", prompt=PROMPT, max_tokens=100, temperature=0, stream=True, **extra
        )
        next(iter(stream))
        stream.close()  # the client leaves mid-stream
    with (
        pytest.raises(httpx.ReadTimeout),
        httpx.Client(base_url=lora_server.base_url, headers={"Authorization": f"Bearer {KEY}"}, timeout=0.2) as client,
    ):
        client.post("/v1/completions", json={"model": "b", "prompt": PROMPT, "max_tokens": 100})
    lora_server.wait_idle(timeout=20)

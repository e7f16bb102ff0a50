"""Pooling models (embeddings): `LLM.embed` against HF transformers' base model on the same tiny random weights
(float32: the last hidden state pooled as Sentence Transformers pools it), across families, pooling types,
chunked prefill, prefix-cache hits, preemption, Matryoshka dimensions and the runner settings."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from engine import SamplingParams
from engine.errors import InvalidParameterError, SettingsConflictError
from engine.pooling import PoolingParams
from engine.pooling.pooler_config import PoolerConfig, model_pooler
from tests.engine.factories import make_tiny_embedding_dir
from tests.engine.references import assert_idle, make_llm
from tests.engine.test_moe_equivalence import FAMILIES as MOE_FAMILIES

PROMPTS = [
    "hello world, this is a test",
    "the quick brown fox jumps over the lazy dog " * 8,  # 90 tokens: chunked at max_num_batched_tokens 32 below
    "a",
]
FAMILIES = {
    "llama": ("llama", {}),
    "qwen3": ("qwen3", {}),
    "gemma2": ("gemma2", {}),  # the generic decoder: (1 + w) norms folded at load, embeddings scaled
    "starcoder2": ("starcoder2", {}),  # its final norm a LayerNorm with a bias
    # base models whose tensors carry no prefix (GPTNeoXModel's embed_in, layers; GPTJModel's wte, h): the CausalLM's
    # gpt_neox. / transformer. is what their names are read under
    "gpt_neox": ("gpt_neox", {}),
    "gptj": ("gptj", {}),
    "falcon_new": ("falcon_new", {}),
    "gpt_bigcode": ("gpt_bigcode", {}),
    "mixtral": ("llama", dict(architectures=["MixtralForCausalLM"], model_type="mixtral", num_local_experts=8)),
    # the generic decoder with experts: LayerNorms (the final one's bias), a biased LM head the base model lacks
    "phimoe": ("llama", dict(num_experts_per_tok=2, **MOE_FAMILIES["phimoe"])),
}


def hf_embeddings(model_dir, prompts, mode: str = "lasttoken", normalize: bool = True, dimensions=None):
    """What Sentence Transformers computes over HF's base model: the last hidden state pooled, truncated,
    normalized."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = []
    with torch.no_grad():
        for prompt in prompts:
            ids = tokenizer(prompt, return_tensors="pt").input_ids
            hidden = model(ids).last_hidden_state[0]  # [T, hidden]
            vector = {"lasttoken": hidden[-1], "mean_tokens": hidden.mean(0), "cls_token": hidden[0]}[mode]
            if dimensions is not None:
                vector = vector[:dimensions]
            out.append(F.normalize(vector, dim=-1) if normalize else vector)
    return out


def assert_close(results, references):
    assert len(results) == len(references)
    for result, reference in zip(results, references):
        got = torch.tensor(result.outputs.embedding)
        assert got.shape == reference.shape
        torch.testing.assert_close(got, reference, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", FAMILIES)
def test_base_model_checkpoints_embed_as_hf(tmp_path, family):
    """A checkpoint saved as the HF base model (architectures ["LlamaModel"], no LM head) is served for pooling
    without being told: the last token's final hidden state, normalized (vLLM's embedding default)."""
    arch, overrides = FAMILIES[family]
    model_dir = make_tiny_embedding_dir(tmp_path / family, arch, **overrides)
    assert json.loads((model_dir / "config.json").read_text())["architectures"][0].endswith("Model")
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    assert llm.engine.pooler is not None and llm.engine.runner.model.lm_head is None
    results = llm.embed(PROMPTS, use_tqdm=False)
    assert_close(results, hf_embeddings(model_dir, PROMPTS))
    assert [r.prompt_token_ids for r in results] == [llm.get_tokenizer().encode(p) for p in PROMPTS]
    assert_idle(llm)


@pytest.mark.parametrize("mode", ["mean_tokens", "cls_token", "lasttoken"])
@pytest.mark.parametrize("normalize", [True, False])
def test_sentence_transformers_pooling_is_read_from_the_checkpoint(tmp_path, mode, normalize):
    """modules.json and the Pooling module's config choose MEAN / CLS / LAST and whether vectors are normalized;
    the long prompt's mean spans its prefill chunks."""
    model_dir = make_tiny_embedding_dir(tmp_path / "st", pooling_mode=mode, normalize=normalize)
    llm = make_llm(model_dir, max_num_batched_tokens=32)
    assert_close(llm.embed(PROMPTS, use_tqdm=False), hf_embeddings(model_dir, PROMPTS, mode, normalize))
    assert_idle(llm)


def test_pooler_config_overrides_the_checkpoint(tmp_path):
    model_dir = make_tiny_embedding_dir(tmp_path / "st", pooling_mode="lasttoken")
    llm = make_llm(model_dir, pooler_config={"pooling_type": "MEAN", "normalize": False})
    assert_close(llm.embed(PROMPTS, use_tqdm=False), hf_embeddings(model_dir, PROMPTS, "mean_tokens", False))
    # a request's own normalize wins over the pooler's
    again = llm.embed(PROMPTS[:1], PoolingParams(normalize=True), use_tqdm=False)
    assert_close(again, hf_embeddings(model_dir, PROMPTS[:1], "mean_tokens", True))


def test_a_generative_checkpoint_converted_for_embeddings(tiny_llama_dir):
    """--convert embed (or --runner pooling) serves a ForCausalLM checkpoint's base model; its LM head is left
    unloaded. A generative model's LLM refuses embed, and a pooling model's refuses generate."""
    llm = make_llm(tiny_llama_dir, convert="embed")
    assert llm.engine.runner.model.lm_head is None
    assert_close(llm.embed(PROMPTS, use_tqdm=False), hf_embeddings(tiny_llama_dir, PROMPTS))
    with pytest.raises(InvalidParameterError, match="pooling"):
        llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False)
    assert_idle(llm)
    legacy = make_llm(tiny_llama_dir, task="embed")
    assert legacy.engine.pooler is not None
    generative = make_llm(tiny_llama_dir)
    assert generative.engine.pooler is None
    with pytest.raises(ValueError, match="needs a pooling model that does embed: this is a generative model"):
        generative.embed("hi", use_tqdm=False)


def test_prefix_cache_hits_give_the_same_embeddings(tmp_path):
    """LAST pooling takes prefix-cache hits (the last token is always computed); MEAN recomputes every row."""
    model_dir = make_tiny_embedding_dir(tmp_path / "e")
    llm = make_llm(model_dir)
    first = llm.embed(PROMPTS, use_tqdm=False)
    second = llm.embed(PROMPTS, use_tqdm=False)
    assert second[1].num_cached_tokens > 0
    for a, b in zip(first, second):
        torch.testing.assert_close(torch.tensor(a.outputs.embedding), torch.tensor(b.outputs.embedding))
    mean = make_llm(model_dir, pooler_config={"pooling_type": "MEAN"})
    mean.embed(PROMPTS, use_tqdm=False)
    again = mean.embed(PROMPTS, use_tqdm=False)
    assert [r.num_cached_tokens for r in again] == [0, 0, 0]
    assert_close(again, hf_embeddings(model_dir, PROMPTS, "mean_tokens"))


def test_a_pooling_request_sent_back_mid_prompt_is_pooled_afresh(tmp_path):
    """A request preempted (here: sent back by `recompute`, as a preemption does) after some of its prompt chunks
    is pooled from its start when it resumes: its partial sum went with its runner state. Every block comes
    back."""
    model_dir = make_tiny_embedding_dir(tmp_path / "e", pooling_mode="mean_tokens")
    llm = make_llm(model_dir, max_num_batched_tokens=16)
    engine = llm.engine
    prompt = llm.get_tokenizer().encode(PROMPTS[1])
    engine.add_request("long", prompt, PoolingParams())
    engine.step()
    engine.step()  # two chunks of 16 computed, and summed
    assert engine.scheduler.requests["long"].num_computed_tokens == 32
    engine.scheduler.recompute(["long"])
    outputs = []
    while engine.has_work:
        outputs += engine.step()
    assert engine.stats().num_preemptions == 1
    (final,) = [out for out in outputs if out.finished]
    torch.testing.assert_close(
        torch.tensor(final.embedding), hf_embeddings(model_dir, PROMPTS[1:2], "mean_tokens")[0], atol=2e-5, rtol=1e-4
    )
    assert_idle(llm)


def test_an_aborted_pooling_request_frees_its_blocks(tmp_path):
    llm = make_llm(make_tiny_embedding_dir(tmp_path / "e"), max_num_batched_tokens=16)
    engine = llm.engine
    engine.add_request("long", llm.get_tokenizer().encode(PROMPTS[1]), PoolingParams())
    engine.step()
    (aborted,) = engine.abort(["long"])
    assert aborted.finish_reason == "abort" and aborted.embedding is None
    while engine.has_work:
        engine.step()
    assert_idle(llm)


def test_matryoshka_dimensions(tmp_path):
    """`dimensions` keeps the first components, normalized at that length, for a model that lists them; other
    models and sizes are refused by name."""
    model_dir = make_tiny_embedding_dir(tmp_path / "m", matryoshka_dimensions=[16, 32])
    llm = make_llm(model_dir)
    assert_close(
        llm.embed(PROMPTS, PoolingParams(dimensions=16), use_tqdm=False),
        hf_embeddings(model_dir, PROMPTS, dimensions=16),
    )
    with pytest.raises(InvalidParameterError, match=r"matryoshka dimensions \[16, 32\]"):
        llm.embed("hi", PoolingParams(dimensions=8), use_tqdm=False)
    # vLLM's one PoolingParams per prompt
    mixed = llm.embed(PROMPTS[:2], pooling_params=[PoolingParams(dimensions=16), PoolingParams()], use_tqdm=False)
    assert [r.outputs.hidden_size for r in mixed] == [16, 64]
    with pytest.raises(ValueError, match="got 1 PoolingParams for 2 prompts"):
        llm.embed(PROMPTS[:2], pooling_params=[PoolingParams()], use_tqdm=False)
    assert_idle(llm)
    plain = make_llm(make_tiny_embedding_dir(tmp_path / "p"))
    with pytest.raises(InvalidParameterError, match="does not support matryoshka"):
        plain.embed("hi", PoolingParams(dimensions=16), use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="at least 1"):
        PoolingParams(dimensions=0)
    assert_idle(plain)


def test_a_default_dimensions_the_model_lacks_is_refused_at_start_up(tmp_path):
    """--pooler-config's dimensions is checked as a request's would be, its message naming no model (none is
    served yet)."""
    config = SimpleNamespace(hidden_size=64, matryoshka_dimensions=[16, 64])
    with pytest.raises(SettingsConflictError) as caught:
        model_pooler(config, tmp_path, PoolerConfig(dimensions=32))
    assert (
        str(caught.value)
        == "--pooler-config dimensions 32: must be one of the matryoshka dimensions [16, 64] of the model"
    )
    with pytest.raises(SettingsConflictError, match="cannot be set: the model does not support matryoshka"):
        model_pooler(SimpleNamespace(hidden_size=64), tmp_path, PoolerConfig(dimensions=16))
    assert model_pooler(config, tmp_path, PoolerConfig(dimensions=16)).default_dimensions == 16


def test_pooling_settings_that_cannot_hold(tmp_path, tiny_llama_dir):
    with pytest.raises(SettingsConflictError, match="--pooler-config applies to a pooling model"):
        make_llm(tiny_llama_dir, pooler_config={"pooling_type": "MEAN"})
    with pytest.raises(SettingsConflictError, match="--convert embed needs --runner pooling"):
        make_llm(tiny_llama_dir, convert="embed", runner="generate")
    with pytest.raises(SettingsConflictError, match="speculative decoding"):
        make_llm(tiny_llama_dir, runner="pooling", speculative_config={"method": "ngram", "num_speculative_tokens": 2})
    with pytest.raises(ValueError, match="pooling_type"):
        make_llm(tiny_llama_dir, runner="pooling", pooler_config={"pooling_type": "MAX"})
    dense = make_tiny_embedding_dir(tmp_path / "dense", pooling_mode="lasttoken")
    modules = json.loads((dense / "modules.json").read_text())
    modules.append({"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"})
    (dense / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(SettingsConflictError, match="models.Dense"):
        make_llm(dense)


def test_a_prompt_longer_than_the_context_is_refused(tmp_path):
    from scheduler import ContextLengthExceededError

    llm = make_llm(make_tiny_embedding_dir(tmp_path / "e"), max_model_len=16)
    with pytest.raises(ContextLengthExceededError, match="17 prompt tokens exceed max_model_len 16"):
        llm.embed([list(range(17))], use_tqdm=False)
    assert len(llm.embed([list(range(16))], use_tqdm=False)[0].outputs.embedding) == 64
    # truncate_prompt_tokens keeps the last tokens; -1 (vLLM's, as the server takes it) as many as the context holds
    (cut,) = llm.embed([list(range(20))], truncate_prompt_tokens=-1, use_tqdm=False)
    assert cut.prompt_token_ids == list(range(4, 20))
    (last,) = llm.embed([list(range(4, 20))], use_tqdm=False)
    torch.testing.assert_close(torch.tensor(cut.outputs.embedding), torch.tensor(last.outputs.embedding))
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.embed("hi", truncate_prompt_tokens=0, use_tqdm=False)
    assert_idle(llm)


def test_pooling_params_are_imported_as_vllms_are():
    """`from vllm import LLM, PoolingParams`, as vLLM's examples write it."""
    import engine

    assert engine.PoolingParams is PoolingParams and "PoolingParams" in engine.__all__

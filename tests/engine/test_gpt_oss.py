"""GPT-OSS against HF transformers on a tiny random checkpoint made here (sliding and full layers with a window
shorter than the prompts, 4 experts top-2, YaRN, attention sinks, q/k/v/o, router and expert biases set away from
zero, a clamp low enough to bite), in float32: greedy tokens identical and logprobs within 1e-4, batched and alone
on the cpu and torch backends, in batch-invariant mode, under chunked prefill with preemption, with prefix-cache
hits, and prompt logprobs; the checkpoint's names as transformers writes them (MXFP4 checkpoints:
test_gpt_oss_mxfp4.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine import SamplingParams
from tests.engine.factories import make_tiny_tokenizer, tiny_config_dict
from tests.engine.references import assert_idle, check_against_hf, hf_model, hf_prompt_logprobs, make_llm
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy

LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention"]
GPT_OSS = dict(
    architectures=["GptOssForCausalLM"],
    model_type="gpt_oss",
    num_hidden_layers=3,
    head_dim=16,
    intermediate_size=48,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=LAYER_TYPES,
    swiglu_limit=0.6,
    swiglu_alpha=1.702,
    attention_bias=True,
    pad_token_id=0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 64,
    },
)


def make_gpt_oss_dir(path: Path, **overrides) -> Path:
    """A tiny random GPT-OSS checkpoint, its sinks and biases drawn away from HF's zero initialisation."""
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config_dict = tiny_config_dict("llama", **{**GPT_OSS, **overrides})
    config_dict.pop("rope_theta", None)
    config = AutoConfig.for_model(**config_dict)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if name.endswith("sinks"):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 2.0)
            elif name.endswith(("bias", "_bias")):
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=0
    ).save_pretrained(path)
    make_tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_gpt_oss_dir(tmp_path_factory.mktemp("gpt_oss"))


def test_the_checkpoint_is_what_transformers_writes(model_dir):
    """The names and shapes the loader reads, and that sinks, biases and the clamp change the output."""
    from safetensors import safe_open

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys() if name.startswith("model.layers.0.")}
    p = "model.layers.0."
    assert shapes[p + "self_attn.sinks"] == (4,)
    assert shapes[p + "mlp.experts.gate_up_proj"] == (4, 64, 96) and shapes[p + "mlp.experts.gate_up_proj_bias"] == (
        4,
        96,
    )
    assert shapes[p + "mlp.experts.down_proj"] == (4, 48, 64) and shapes[p + "mlp.experts.down_proj_bias"] == (4, 64)
    assert shapes[p + "mlp.router.weight"] == (4, 64) and shapes[p + "mlp.router.bias"] == (4,)
    assert shapes[p + "self_attn.o_proj.bias"] == (64,)

    model = hf_model(str(model_dir))
    ids = torch.tensor([mixed_prompts()[6]])
    with torch.inference_mode():
        base = model(ids).logits
        layer = model.model.layers[0]
        sinks = layer.self_attn.sinks.clone()
        layer.self_attn.sinks.fill_(-1e4)
        without_sinks = model(ids).logits
        layer.self_attn.sinks.copy_(sinks)
        for block in model.model.layers:
            block.mlp.experts.limit = 1e4
        unclamped = model(ids).logits
        for block in model.model.layers:
            block.mlp.experts.limit = GPT_OSS["swiglu_limit"]
    assert (base - without_sinks).abs().max() > 0.05 and (base - unclamped).abs().max() > 0.05


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_batch_and_alone(model_dir, backend):
    prompts = mixed_prompts()
    with make_llm(model_dir, attention_backend=backend) as llm:
        model = llm.engine.runner.model
        assert llm.engine.runner.backend.name == backend and type(model).__name__ == "GptOssForCausalLM"
        assert [a.sliding_window for a in model.attention_layers] == [8, None, 8]
        assert all(a.sinks is not None for a in model.attention_layers)
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))
        check_against_hf(model_dir, prompts[6:7], run_greedy(llm, prompts[6:7]))  # 60 tokens, alone


def test_batch_invariant_mode(model_dir):
    prompts = mixed_prompts(5)
    with make_llm(model_dir, batch_invariant=True, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.engine.runner.backend.name == "cpu-batch-invariant"
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def test_chunked_prefill_with_preemption(model_dir):
    # Three layer groups (full, and the two sliding layers as two groups) of one layer each: a block is one layer's.
    with make_llm(model_dir, num_blocks=40, block_size=4, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.engine.scheduler.kv_cache_manager.group_windows == (None, 8, 8)
        prompts = mixed_prompts(3)
        results = run_greedy(llm, prompts)
        assert llm.engine.stats().num_preemptions > 0
        check_against_hf(model_dir, prompts, results)


def test_prefix_cache_hits(model_dir):
    with make_llm(model_dir, enable_prefix_caching=True, max_num_batched_tokens=32) as llm:
        prompts = mixed_prompts(2, shared_prefix=21)
        results = run_greedy(llm, prompts[:2]) + run_greedy(llm, prompts[2:])
        assert any(r.num_cached_tokens >= 20 for r in results[2:])
        check_against_hf(model_dir, prompts, results)


def test_prompt_logprobs(model_dir):
    prompt = mixed_prompts(4)[6]  # 60 tokens: several chunks, past the window and YaRN's original context
    with make_llm(model_dir, max_num_batched_tokens=16) as llm:
        sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        got = [lp.logprob for lp in result.prompt_logprobs[1:]]
        assert got == pytest.approx(hf_prompt_logprobs(model_dir, prompt), abs=1e-4)
        assert_idle(llm)


def test_a_backend_without_sinks_is_refused(model_dir):
    """flash-attn releases without `learnable_sink` cannot serve it: refused by name (the feature check)."""
    from engine.attention.flash_backend import FlashAttentionBackend, FlashKernel
    from engine.attention.layer_attention import check_backend_serves
    from transformers import AutoConfig

    from engine.models import build_model

    model = build_model(AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))
    backend = FlashAttentionBackend(FlashKernel(2, "2.8", lambda *a, **k: None))
    with pytest.raises(ValueError, match="cannot serve GptOssForCausalLM: it does not implement attention sinks"):
        check_backend_serves(backend, model.attention_layers, "GptOssForCausalLM")

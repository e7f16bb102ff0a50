"""Gemma 1, 2 and 3 (text), Phi-3, OLMo 2, Granite, Cohere, Cohere 2, GLM-4, GLM-4-0414, StarCoder2, SmolLM3, OLMo 3,
Arcee, ERNIE 4.5, EXAONE 4, Phi-2, GPT-NeoX (its parallel and sequential residuals), Seed-OSS, Apertus, GPT-J,
GPT-BigCode (multi-query and multi-head) and Falcon (Falcon-7B's, Falcon-40B's and the sequential layer) against HF
transformers on tiny random checkpoints made here (tests/engine/factories.py's DENSE_FAMILIES: windows shorter than
the prompts, scales and caps off their defaults; norms and biases random where HF would leave them 0 or 1), in
float32: greedy tokens identical and logprobs within 1e-4, batched and alone, on the cpu backend (and the torch one where
windows or caps make the backends differ), under chunked prefill with preemption and prefix-cache hits, and prompt
logprobs; refusals of what is not served."""

from __future__ import annotations

import dataclasses
from functools import lru_cache

import pytest
import torch
from transformers import AutoConfig

from engine import SamplingParams
from engine import platform as engine_platform
from engine.layers.fused_decode import _model_fits
from engine.models import build_model
from tests.engine.factories import DENSE_FAMILIES, make_tiny_model_dir, tiny_config_dict
from tests.engine.references import assert_idle, check_against_hf, hf_greedy_of, hf_prompt_logprobs, make_llm
from tests.engine.references import record_peak_blocks
from tests.engine.test_model_equivalence import NEW_TOKENS, mixed_prompts, run_greedy


FAMILIES = sorted(DENSE_FAMILIES)


def _attention_variants(family: str) -> bool:
    """Whether the family's tiny checkpoint has sliding windows or soft-capped scores: what the attention backends
    compute each their own way (the rest of the forward is one code path whichever backend attends)."""
    config = tiny_config_dict(family)
    return any(config.get(key) is not None for key in ("sliding_window", "attn_logit_softcapping"))


WINDOWED = [family for family in FAMILIES if _attention_variants(family)]


def pytest_generate_tests(metafunc):
    """Every test over every family (one checkpoint per family for the module), but the torch backend's and the
    sliding layers' over the families with windows or caps."""
    if "model_dir" not in metafunc.fixturenames:
        return
    if "backend" in metafunc.fixturenames:
        cases = [(family, "cpu") for family in FAMILIES] + [(family, "torch") for family in WINDOWED]
        metafunc.parametrize("model_dir, backend", cases, indirect=["model_dir"], scope="module")
    else:
        families = WINDOWED if metafunc.function is test_sliding_layers_hold_only_their_windows_blocks else FAMILIES
        metafunc.parametrize("model_dir", families, indirect=True, scope="module")


@pytest.fixture(scope="module")
def model_dir(request, tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp(request.param), request.param)


def test_batch_and_alone(model_dir, backend):
    prompts = mixed_prompts()
    with make_llm(model_dir, attention_backend=backend) as llm:
        # the cpu backend: decode steps fused where float32 takes column blocks (AVX2 and AVX-512 builds)
        runner = llm.engine.runner
        assert runner.backend.name == backend and (runner.model.fused is not None) == (
            backend == "cpu" and runner.backend.kernels.f32_column_blocks
        )
        if runner.model.fused is not None:  # declined where the native step lacks the recipe (Cohere's)
            assert _model_fits(runner.model, runner.kv_cache.layers) == runner.model.fused_recipe
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))
        check_against_hf(model_dir, prompts[6:7], run_greedy(llm, prompts[6:7]))  # 60 tokens, alone


def test_batch_and_alone_on_packed_float32_weights(model_dir, monkeypatch):
    """oneDNN's packed weights, unfused: float32 on builds without float32 column blocks (engine/platform.py's
    cpu_linear declines)."""
    monkeypatch.setattr(engine_platform, "cpu_linear", lambda backend, dtype: None)
    prompts = mixed_prompts()
    with make_llm(model_dir, attention_backend="cpu", dtype="float32") as llm:
        assert llm.engine.runner.model.fused is None and llm.engine.runner.model.linear.name == "onednn-packed"
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def test_batch_invariant_mode(model_dir):
    """The batch-invariant kernels (every query through the native decode kernel, windows and caps included)."""
    prompts = mixed_prompts(5)
    with make_llm(model_dir, batch_invariant=True, max_num_batched_tokens=16, max_num_seqs=4) as llm:
        assert llm.engine.runner.backend.name == "cpu-batch-invariant"
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def _layer_windows(model_dir) -> list:
    return [attention.sliding_window for attention in _built(model_dir).attention_layers]


@lru_cache(maxsize=None)
def _built(model_dir):
    return build_model(AutoConfig.from_pretrained(model_dir), torch.float32, torch.device("cpu"))


def test_chunked_prefill_preemption_and_prefix_hits(model_dir):
    """Prompts in chunks of 16 tokens, a pool small enough to preempt, and prompts sharing a 21-token prefix with
    two that finished before them: prefix-cache hits."""
    # A model whose every layer slides (Phi-3 here) holds only its windows' blocks: a smaller pool preempts.
    num_blocks = 12 if all(_layer_windows(model_dir)) else 30
    settings = dict(num_blocks=num_blocks, block_size=4, max_num_batched_tokens=16, max_num_seqs=4)
    with make_llm(model_dir, **settings, enable_prefix_caching=True) as llm:
        prompts = mixed_prompts(3, shared_prefix=21)
        results = run_greedy(llm, prompts[:2]) + run_greedy(llm, prompts[2:])
        assert llm.engine.stats().num_preemptions > 0
        assert any(r.num_cached_tokens >= 20 for r in results[2:])
        check_against_hf(model_dir, prompts, results)


def test_sliding_layers_hold_only_their_windows_blocks(model_dir):
    """A sliding-window layer group frees the blocks behind its window as a request goes on (the full layers keep
    theirs), and the tokens stay HF's: the pool's peak over a long request is that of its full layers plus a
    window's worth, not every layer's whole sequence."""
    windows = _layer_windows(model_dir)
    assert any(windows)
    prompt = mixed_prompts(6)[6]  # 60 tokens, past every window
    with make_llm(model_dir, block_size=4, max_num_batched_tokens=16, num_blocks=256) as llm:
        kv = llm.engine.scheduler.kv_cache_manager
        assert len(kv.group_windows) == (1 if all(windows) else 2)  # all sliding, or sliding and full halves
        peak = record_peak_blocks(llm)
        check_against_hf(model_dir, [prompt], run_greedy(llm, [prompt]))
    num_blocks = -(-(len(prompt) + NEW_TOKENS) // 4)  # the sequence's blocks in one group
    window_blocks = -(-(max(w for w in windows if w) + 16) // 4) + 1  # a window and a chunk
    full_groups = len(kv.group_windows) - 1
    assert peak[0] <= full_groups * num_blocks + window_blocks < len(kv.group_windows) * num_blocks


def test_prompt_logprobs(model_dir):
    prompt = mixed_prompts(4)[6]  # 60 tokens: several chunks, past every window
    with make_llm(model_dir, max_num_batched_tokens=16) as llm:
        sp = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1)
        (result,) = llm.generate([{"prompt_token_ids": prompt}], sp, use_tqdm=False)
        got = [lp.logprob for lp in result.prompt_logprobs[1:]]
        assert got == pytest.approx(hf_prompt_logprobs(model_dir, prompt), abs=1e-4)
        assert_idle(llm)


def config_of(family: str, **overrides):
    return AutoConfig.for_model(**tiny_config_dict(family, **overrides))


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("gemma2", {"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        (
            "gemma2",
            {"hidden_activation": "gelu"},
            r"hidden_activation 'gelu' is not supported \(supported: gelu_pytorch",
        ),
        ("granite", {"hidden_act": "relu"}, "hidden_act 'relu' is not supported"),
        ("gemma", {"hidden_act": "relu"}, r"hidden_act 'relu' is not supported \(supported: gelu_pytorch"),
        ("gemma", {"use_bidirectional_attention": True}, "use_bidirectional_attention is not supported"),
        ("glm", {"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
        ("starcoder2", {"hidden_act": "gelu"}, r"hidden_act 'gelu' is not supported \(supported: gelu_pytorch"),
        ("phi", {"hidden_act": "relu"}, r"PhiForCausalLM: hidden_act 'relu' is not supported \(supported: gelu, gelu_"),
        ("phi", {"partial_rotary_factor": 0.35}, "PhiForCausalLM: partial_rotary_factor 0.35 rotates 5 of 16"),
        ("gpt_neox", {"num_key_value_heads": 2}, "GPTNeoXForCausalLM: num_key_value_heads 2 is not served"),
        (
            "gpt_neox",
            {"hidden_act": "silu"},
            r"hidden_act 'silu' is not supported \(supported: gelu, gelu_pytorch_tanh",
        ),
        ("glm4", {"partial_rotary_factor": 0.35}, "partial_rotary_factor 0.35 rotates 5 of 16 dimensions"),
        (
            "glm4",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"RoPE scaling 'dynamic' is not supported",
        ),
        (
            "olmo2",
            {"rope_parameters": {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}},
            r"RoPE scaling 'dynamic' is not supported \(supported: default, linear, llama3, yarn, longrope\)",
        ),
        ("cohere", {"hidden_act": "gelu"}, r"CohereForCausalLM: hidden_act 'gelu' is not supported \(supported: silu"),
        ("cohere", {"logit_scale": None}, "CohereForCausalLM: logit_scale must be set"),
        (
            "cohere2",
            {"layer_types": ["sliding_attention", "chunked_attention", "sliding_attention", "full_attention"]},
            r"layer types \['chunked_attention'\] are not supported",
        ),
        (
            "smollm3",
            {"use_sliding_window": False},
            "SmolLM3ForCausalLM: sliding_attention layers need use_sliding_window and a sliding_window",
        ),
        ("smollm3", {"no_rope_layers": [1, 0]}, "no_rope_layers must name each of the 4 layers"),
        ("arcee", {"hidden_act": "silu"}, r"ArceeForCausalLM: hidden_act 'silu' is not supported \(supported: relu2\)"),
        ("arcee", {"sliding_window": 8}, "ArceeForCausalLM: sliding_window is not supported"),
        ("seed_oss", {"hidden_act": "gelu"}, r"SeedOssForCausalLM: hidden_act 'gelu' is not supported"),
        (
            "apertus",
            {"hidden_act": "silu"},
            r"ApertusForCausalLM: hidden_act 'silu' is not supported \(supported: xielu",
        ),
        ("gptj", {"activation_function": "relu"}, r"GPTJForCausalLM: activation_function 'relu' is not supported"),
        ("gptj", {"num_key_value_heads": 2}, "GPTJForCausalLM: num_key_value_heads 2 is not served"),
        ("gpt_bigcode", {"add_cross_attention": True}, "GPTBigCodeForCausalLM: add_cross_attention is not supported"),
        (
            "gpt_bigcode",
            {"num_key_value_heads": 2},
            r"GPTBigCodeForCausalLM: num_key_value_heads 2 disagrees with multi_query True \(1 KV heads\)",
        ),
        ("gpt_bigcode", {"activation_function": "relu"}, "GPTBigCodeForCausalLM: activation_function 'relu' is not"),
        ("falcon", {"alibi": True}, r"FalconForCausalLM: alibi is not supported \(RoPE only\)"),
        (
            "falcon_new",
            {"parallel_attn": False},
            "FalconForCausalLM: new_decoder_architecture without parallel_attn is not supported",
        ),
        (
            "falcon",
            {"num_key_value_heads": 2},
            "FalconForCausalLM: num_key_value_heads 2 disagrees with its 1 KV heads",
        ),
        (
            "falcon_sequential",
            {"num_kv_heads": 2, "num_key_value_heads": 2},
            "FalconForCausalLM: num_kv_heads 2 without new_decoder_architecture or multi_query",
        ),
        ("falcon", {"activation": "relu"}, r"FalconForCausalLM: activation 'relu' is not supported \(supported: gelu"),
        ("gptj", {"rotary_dim": 5}, "GPTJForCausalLM: rotary_dim 5 is not an even number of at most 16"),
    ],
)
def test_unsupported_config_fields_are_refused(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(config_of(family, **overrides), torch.float32, torch.device("cpu"))


def test_unservable_partial_rotary_longrope_factors_and_multimodal_gemma_are_refused():
    phi3 = config_of("phi3")
    phi3.rope_parameters["partial_rotary_factor"] = 0.3  # 4.8 -> 4 of 16 dimensions: 2 factors, not 8
    with pytest.raises(ValueError, match="LongRoPE short_factor has 8 entries; the 4 rotated dimensions of a head"):
        build_model(phi3, torch.float32, torch.device("cpu"))
    phi3.rope_parameters["partial_rotary_factor"] = 0.35  # 5.6 -> 5 dimensions: no pairs
    with pytest.raises(ValueError, match="partial_rotary_factor 0.35 rotates 5 of 16 dimensions"):
        build_model(phi3, torch.float32, torch.device("cpu"))
    gemma3 = config_of("gemma3")
    gemma3.architectures, gemma3.model_type = ["Gemma3ForConditionalGeneration"], "gemma3"
    with pytest.raises(ValueError, match=r"not supported; supported: .*Gemma3ForCausalLM"):
        build_model(gemma3, torch.float32, torch.device("cpu"))


def test_cohere2_rotates_only_its_sliding_layers():
    """Cohere 2's global layers have no positional embedding; a layer rotates when it has a window, as in HF (with
    no window at all, none does)."""
    arch = build_model(config_of("cohere2"), torch.float32, torch.device("cpu")).arch
    assert arch.layer_rope == (0, None, 0, None) and [a.sliding_window for a in arch.layer_attention] == [8, None] * 2
    arch = build_model(config_of("cohere2", sliding_window=None), torch.float32, torch.device("cpu")).arch
    assert arch.layer_rope == (None,) * 4 and not arch.positional_layers


def test_smollm3_and_exaone4_leave_layers_without_rope():
    """SmolLM3's NoPE layers are its no_rope_layers' zeros, whatever their window; EXAONE 4's global layers rotate
    only when no layer has a window (as HF)."""
    arch = build_model(config_of("smollm3"), torch.float32, torch.device("cpu")).arch
    assert arch.layer_rope == (0, None, 0, None) and [a.sliding_window for a in arch.layer_attention] == [
        8,
        8,
        None,
        None,
    ]
    arch = build_model(config_of("exaone4"), torch.float32, torch.device("cpu")).arch
    assert arch.layer_rope == (0, None, 0, None) and [a.sliding_window for a in arch.layer_attention] == [8, None] * 2
    config = config_of("exaone4", sliding_window=None, layer_types=["full_attention"] * 4)
    arch = build_model(config, torch.float32, torch.device("cpu")).arch
    assert arch.layer_rope == (0,) * 4 and arch.positional_layers


def test_layernorm_shifts_where_the_arch_has_them(tmp_path, monkeypatch):
    """DecoderArch.norm_bias (nn.LayerNorm's shift; no family here has it yet): Cohere's layer with a shift on each
    LayerNorm, read from each norm's `.bias`, gives HF's Cohere whose LayerNorms add those shifts; without it the
    same checkpoint is refused (its shifts would go unused)."""
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM
    from transformers.models.cohere.modeling_cohere import CohereLayerNorm

    import engine.models.families as families

    model_dir = make_tiny_model_dir(tmp_path / "cohere", "cohere")
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    state = load_file(str(model_dir / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    for name, module in hf.named_modules():
        if isinstance(module, CohereLayerNorm) and module.weight.dim() == 1:  # the layers' and the final one
            shift = torch.randn(module.weight.shape, generator=generator) * 0.2
            module.forward = lambda x, norm=module, shift=shift: CohereLayerNorm.forward(norm, x) + shift
            state[name + ".bias"] = shift
    save_file(state, str(model_dir / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match="3 checkpoint tensors were not used by the model: layers.0.input_layernorm.bias"
    ):
        make_llm(model_dir)
    cohere = families.ARCH_READERS["CohereForCausalLM"]
    monkeypatch.setitem(
        families.ARCH_READERS, "CohereForCausalLM", lambda config: dataclasses.replace(cohere(config), norm_bias=True)
    )
    prompts = mixed_prompts()[4:7]
    with make_llm(model_dir) as llm:
        results = run_greedy(llm, prompts)
    for prompt, result in zip(prompts, results):
        tokens, logprobs = hf_greedy_of(hf, prompt, NEW_TOKENS)
        assert result.outputs[0].token_ids == tokens
        assert [lp.logprob for lp in result.outputs[0].logprobs] == pytest.approx(logprobs, abs=1e-4)

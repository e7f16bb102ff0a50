"""The mixtures of experts on the generic decoder (OLMoE, Granite MoE, Phi-3.5-MoE, Llama 4) beyond their equivalence
with HF (tests/engine/test_moe_equivalence.py): Phi-3.5-MoE's sparsemixer routing equal to transformers' own function,
its LongRoPE's factor set and mscale, Llama 4's routing and experts equal to transformers' modules, its chunked local
attention past one chunk equal to HF's, and the config fields refused at start-up by name."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import AutoConfig

from engine.errors import SettingsConflictError
from engine.layers.layer_ops import TorchLayerOps
from engine.layers.linear import Linear
from engine.layers.moe import ExpertWeights, SharedExpert, SparseMoeBlock
from engine.layers.moe_routing import select_top_sigmoid, sparse_mixer
from engine.loading.model_config import ModelConfig
from engine.layers.rotary import inverse_frequencies
from engine.models import build_model
from engine.models.decoder_moe import DecoderMoeForCausalLM
from tests.engine.factories import make_tiny_tokenizer, tiny_config_dict
from tests.engine.references import check_against_hf, make_llm, record_peak_blocks
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy
from tests.engine.test_moe_equivalence import FAMILIES, SHORT_FACTORS


def config_of(family: str, **overrides):
    """The family's tiny config, its nested dicts copied (a test may change them in place)."""
    settings = copy.deepcopy({"num_experts_per_tok": 2, **FAMILIES[family], **overrides})
    return AutoConfig.for_model(**tiny_config_dict("llama", **settings))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [0.0, 0.01, 0.1, 0.5])
def test_sparse_mixer_is_transformers_sparsemixer_at_inference(dtype, eps):
    """Bit for bit, ties included (logits rounded to a coarse grid tie often: the lowest index wins in both)."""
    # (imported here: transformers' Phi-MoE module imports triton, which tests/engine/triton must import first)
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 16, generator=generator) * 2
    tied = (logits * 2).round() / 2  # many exact ties
    for scores in (logits.to(dtype), tied.to(dtype), -logits.abs().to(dtype)):  # all-negative rows too
        weights, experts = sparsemixer(scores, jitter_eps=eps, training=False, top_k=2)
        routing = sparse_mixer(scores, eps)
        assert torch.equal(routing.expert_ids, experts) and torch.equal(routing.weights, weights)
        assert routing.weights.dtype == dtype and (routing.expert_ids[:, 0] != routing.expert_ids[:, 1]).all()


def test_phimoe_longrope_serves_one_factor_set_with_its_mscale():
    """Within the original context the short factors and short_mscale (what HF computes there); a max_model_len
    past it the long factors and long_mscale for every position (HF's Phi-3.5-MoE port keeps the short factors
    with long_mscale there; Microsoft's code and vLLM take the long ones)."""
    config = config_of("phimoe")
    head_dim = 16
    for max_model_len, factors, mscale in [(256, SHORT_FACTORS, 1.3), (512, [f * 2 for f in SHORT_FACTORS], 1.7)]:
        model = build_model(config, torch.float32, torch.device("cpu"), max_model_len=max_model_len)
        assert isinstance(model, DecoderMoeForCausalLM) and model.arch.norm_kind == "layer"
        inv_freq = inverse_frequencies(head_dim, 10000.0, {"rope_type": "longrope", "short_factor": factors}, None)
        angles = torch.arange(max_model_len).float()[:, None] * inv_freq[None, :]
        cos = torch.cat([angles, angles], dim=-1).cos() * mscale
        torch.testing.assert_close(model.rotary.cos, cos, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "family, overrides, message",
    [
        ("olmoe", {"clip_qkv": 8.0}, "OlmoeForCausalLM: clip_qkv 8.0 is not supported"),
        ("olmoe", {"sliding_window": 16}, "OlmoeForCausalLM: sliding_window is not supported"),
        ("granitemoe", {"hidden_act": "gelu"}, "GraniteMoeForCausalLM: hidden_act 'gelu' is not supported"),
        (
            "llama4",
            {"rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e4}},
            r"Llama4ForCausalLM: RoPE scaling 'linear' is not supported \(supported: default, llama3\)",
        ),
        (
            "llama4",
            {"layer_types": ["full_attention", "sliding_attention"] * 2},
            "Llama4ForCausalLM: layer_types must name each of the 4 layers, of the types full_attention, "
            "chunked_attention",
        ),
        ("llama4", {"moe_layers": [1, 4]}, r"moe_layers \[1, 4\] name layers outside the model's 4"),
        (
            "phimoe",
            {"num_experts_per_tok": 3},
            "num_experts_per_tok 3 is not supported for phimoe: its sparsemixer routing picks exactly 2",
        ),
        (
            "phimoe",
            {
                "rope_parameters": {
                    "rope_type": "linear",
                    "factor": 2.0,
                    "rope_theta": 1e4,
                    "short_mscale": 1,
                    "long_mscale": 1,
                }
            },
            r"PhimoeForCausalLM: RoPE scaling 'linear' is not supported \(supported: default, longrope\)",
        ),
    ],
)
def test_unsupported_config_fields_are_refused(family, overrides, message):
    with pytest.raises(ValueError, match=message):
        build_model(config_of(family, **overrides), torch.float32, torch.device("cpu"))


def test_phimoe_longrope_without_its_mscales_is_refused():
    config = config_of("phimoe")
    del config.rope_parameters["long_mscale"]  # (transformers' own check runs when the config is made)
    with pytest.raises(ValueError, match=r"LongRoPE needs short_mscale and long_mscale, got \[1.3, None\]"):
        build_model(config, torch.float32, torch.device("cpu"))


def _llama4_moe(dtype: torch.dtype, top_k: int):
    """transformers' Llama4TextMoe of the tiny config with random weights, and the same weights as a SparseMoeBlock."""
    from transformers.models.llama4.modeling_llama4 import Llama4TextMoe

    torch.manual_seed(0)
    hf = Llama4TextMoe(config_of("llama4", num_experts_per_tok=top_k)).to(dtype).eval()
    with torch.no_grad():
        for param in hf.parameters():
            param.normal_(0, 0.3)
    experts = ExpertWeights(  # (HF's [E, H, 2I] and [E, I, H], transposed as the loader does)
        hf.experts.gate_up_proj.detach().transpose(1, 2).contiguous(),
        hf.experts.down_proj.detach().transpose(1, 2).contiguous(),
    )
    shared_mlp = hf.shared_expert
    shared = SharedExpert(
        torch.cat([shared_mlp.gate_proj.weight, shared_mlp.up_proj.weight]).detach(),
        shared_mlp.down_proj.weight.detach(),
        None,
    )
    block = SparseMoeBlock(
        hf.router.weight.detach(),
        experts,
        top_k,
        False,
        Linear(),
        shared,
        True,
        select=lambda logits: select_top_sigmoid(logits, top_k),
        scores_on_input=True,
    )
    return hf, block


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("top_k", [1, 2])
def test_llama4_routing_and_experts_are_transformers_modules(dtype, top_k):
    """The router's choices and sigmoid weights bit for bit (the logits from the same product); the block's output,
    each chosen expert's input scaled by its weight, the shared expert added, as Llama4TextMoe's."""
    hf, block = _llama4_moe(dtype, top_k)
    x = torch.randn(37, 64, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        scores, logits = hf.router(x)
        routing = select_top_sigmoid(logits, top_k)
        # (HF's scores: each chosen expert's sigmoid, the others' sigmoid(-inf) = 0)
        assert torch.equal(torch.zeros_like(scores).scatter_(1, routing.expert_ids, routing.weights), scores)
        want, _ = hf(x)
        got = block.forward(x, Linear(), TorchLayerOps())
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got, want, atol=tolerance, rtol=tolerance)


@pytest.fixture(scope="module")
def llama4_chunked(tmp_path_factory):
    """Llama 4 whose RoPE layers attend within chunks of 16 positions: the tests' prompts and outputs cross
    several chunk boundaries (its NoPE layers attend to every key)."""
    from tests.engine.test_moe_equivalence import make_moe_dir

    return make_moe_dir(tmp_path_factory.mktemp("llama4") / "chunked", "llama4", attention_chunk_size=16)


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"attention_backend": "torch"},
        {"max_num_batched_tokens": 12, "max_num_seqs": 3},  # prompts cut at other places than the chunks
        {"block_size": 16, "num_blocks": 24},  # one block per chunk; preemption
    ],
    ids=["cpu", "torch", "chunked-prefill", "block-16-preemption"],
)
def test_llama4_chunked_attention_past_one_chunk_is_hfs(llama4_chunked, settings):
    """Each RoPE layer's query sees its own chunk's keys only (the step cut into virtual requests at the chunks'
    boundaries, attention/local_chunks.py): HF's greedy tokens and logprobs on sequences of up to 60 + 8 tokens,
    batched and alone, with prefix-cache hits on the repeated prompt."""
    prompts = mixed_prompts()
    with make_llm(llama4_chunked, **settings) as llm:
        assert {attention.chunk for attention in llm.engine.runner.model.attention_layers} == {16, None}
        check_against_hf(llama4_chunked, prompts, run_greedy(llm, prompts))
        check_against_hf(llama4_chunked, prompts[6:7], run_greedy(llm, prompts[6:7]))


def test_llama4_chunked_layers_hold_only_their_chunks_blocks(llama4_chunked):
    """The chunked layers' KV groups free the blocks before each request's current chunk (the NoPE layers' group
    keeps them all), the tokens still HF's: the pool's peak over a 68-token request is its full group's sequence
    plus a chunk and a step per chunked group, not every group's whole sequence. With a KV tier (which holds one
    full-attention group) the chunked layers stay in the full group."""
    prompt = mixed_prompts(6)[6]  # 60 tokens + 8 new: past four chunks of 16
    with make_llm(llama4_chunked, block_size=4, max_num_batched_tokens=16, num_blocks=256) as llm:
        kv = llm.engine.scheduler.kv_cache_manager
        chunked = sum(1 for chunk in kv.group_chunks if chunk == 16)
        assert chunked >= 1 and None in kv.group_chunks
        peak = record_peak_blocks(llm)
        check_against_hf(llama4_chunked, [prompt], run_greedy(llm, [prompt]))
    sequence = -(-(len(prompt) + 8) // 4)  # one group's blocks for the whole sequence
    full = len(kv.group_chunks) - chunked
    assert peak[0] <= full * sequence + chunked * (-(-(16 + 16) // 4) + 1) < len(kv.group_chunks) * sequence
    with make_llm(llama4_chunked, block_size=4, swap_space=0.001) as llm:
        assert not any(llm.engine.scheduler.kv_cache_manager.group_chunks)


def test_llama4_chunks_the_block_size_does_not_divide_are_refused(llama4_chunked):
    with pytest.raises(SettingsConflictError, match="attention_chunk_size 16.*--block-size 32 does not"):
        make_llm(llama4_chunked, block_size=32)


def test_llama4_context_is_the_models_and_a_chunk_that_holds_it_is_causal():
    """max_model_len defaults to the model's context, past the chunk; a chunk as long as max_model_len or longer
    holds every position, and is served as causal attention (no cut steps)."""
    config = config_of("llama4", attention_chunk_size=64)
    assert ModelConfig().resolve_max_model_len(config) == 256
    model = build_model(config, torch.float32, torch.device("cpu"), max_model_len=256)
    assert {attention.chunk for attention in model.attention_layers} == {64, None}
    assert model.rotary.cos.shape[0] == 256  # (a row per position served)
    whole = build_model(config, torch.float32, torch.device("cpu"), max_model_len=64)
    assert {attention.chunk for attention in whole.attention_layers} == {None}


def test_llama4_layers_as_the_config_places_them():
    model = build_model(config_of("llama4"), torch.float32, torch.device("cpu"))
    assert isinstance(model, DecoderMoeForCausalLM)
    assert model.moe.sparse_layers == (1, 3) and model.arch.layer_rope == (0, None, 0, None)
    assert model.arch.intermediate_size == 96 and model.moe.expert_intermediate_size == 48
    assert model.arch.qk_norm == "l2" and model.arch.temperature_tuning == (4.0, 0.5) and not model.fused_recipe


def test_llama4_multimodal_checkpoint_serves_its_language_model(tmp_path):
    """Llama4ForConditionalGeneration: its language model (language_model.*) served as Llama4ForCausalLM, the vision
    model's and projector's tensors skipped, token for token with that language model alone in HF; its images
    are not served (no vision encoder is built)."""
    from transformers import Llama4Config, Llama4ForConditionalGeneration

    text = tiny_config_dict("llama", num_experts_per_tok=2, **FAMILIES["llama4"])
    del text["architectures"], text["model_type"]
    vision = dict(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=64,
        vision_output_dim=32,
        image_size=56,
        patch_size=14,
        projector_input_dim=32,
        projector_output_dim=32,
    )
    config = Llama4Config(text_config=text, vision_config=vision, architectures=["Llama4ForConditionalGeneration"])
    torch.manual_seed(0)
    whole = Llama4ForConditionalGeneration(config).eval()
    whole.save_pretrained(tmp_path / "whole")
    language_model = whole.language_model
    language_model.config.architectures = ["Llama4ForCausalLM"]
    language_model.save_pretrained(tmp_path / "text")
    for path in (tmp_path / "whole", tmp_path / "text"):
        make_tiny_tokenizer().save_pretrained(path)
    prompts = mixed_prompts()[3:6]
    with make_llm(tmp_path / "whole") as llm:
        assert llm.engine.runner.vision is None and llm.engine.runner.model.moe_blocks
        results = run_greedy(llm, prompts)
    check_against_hf(tmp_path / "text", prompts, results)

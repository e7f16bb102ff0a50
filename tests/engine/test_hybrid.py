"""Granite 4.0's hybrid decoder (GraniteMoeHybridForCausalLM: Mamba-2 and attention layers) against transformers on
tiny random checkpoints: greedy tokens identical and logprobs within 1e-4 in float32, batched, in prompt chunks,
through preemptions, with and without experts, NoPE and RoPE; the Mamba-2 layer alone against transformers' in
float64; what hybrid models are not served with, refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from engine import SamplingParams
from engine.errors import SettingsConflictError
from engine.layers.mamba2 import DECODE_ROWS, MambaWeights, mamba_mix
from engine.layers.recurrent_state import MambaShape, RecurrentStates
from tests.engine.factories import make_tiny_model_dir
from tests.engine.references import assert_idle, check_against_hf, make_llm
from tests.engine.test_model_equivalence import mixed_prompts, run_greedy
from tests.engine.test_moe_int_quantization import (
    METHODS,
    PARAMS,
    PROMPTS,
    QUANTIZED,
    dequantized_copy,
    prompt_logprobs_of,
)

GRANITE_HYBRID = dict(
    architectures=["GraniteMoeHybridForCausalLM"],
    model_type="granitemoehybrid",
    num_hidden_layers=4,
    layer_types=["mamba", "attention", "mamba", "mamba"],
    num_local_experts=6,
    num_experts_per_tok=2,
    intermediate_size=48,
    shared_intermediate_size=80,
    embedding_multiplier=12.0,
    residual_multiplier=0.22,
    attention_multiplier=0.015625,
    logits_scaling=2.0,
    position_embedding_type="nope",
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_expand=2,
    mamba_d_conv=4,
    mamba_chunk_size=8,  # prompts and chunks cross several of the scan's chunks
)


def make_hybrid_dir(path, **overrides):
    return make_tiny_model_dir(path, "llama", random_norms=True, **{**GRANITE_HYBRID, **overrides})


NEMOTRON_H = dict(
    architectures=["NemotronHForCausalLM"],
    model_type="nemotron_h",
    hybrid_override_pattern="M-*-MM-",  # Mamba-2, MLP and attention blocks (the older field: layers_block_type read)
    intermediate_size=96,
    head_dim=16,
    mamba_num_heads=8,
    mamba_head_dim=16,
    ssm_state_size=16,
    n_groups=2,
    conv_kernel=4,
    chunk_size=8,
    layer_norm_epsilon=1e-5,
)


def make_nemotron_h_dir(path, **overrides):
    config = {**NEMOTRON_H, **overrides}
    return make_tiny_model_dir(path, "llama", random_norms=True, **config)


@pytest.fixture(scope="module")
def nemotron_h(tmp_path_factory):
    return make_nemotron_h_dir(tmp_path_factory.mktemp("nemotron_h") / "dense")


@pytest.mark.parametrize(
    "settings",
    [{}, {"max_num_batched_tokens": 12, "max_num_seqs": 3}, {"num_blocks": 20, "max_num_seqs": 4}],
    ids=["batched", "chunked-prefill", "preemption"],
)
def test_nemotron_h_is_hfs(nemotron_h, settings):
    """Blocks of one mixer each (Mamba-2, attention without RoPE, relu^2 MLP) by transformers' names (backbone.,
    mixer.): HF's greedy tokens and logprobs, batched, in chunks and through preemptions."""
    prompts = mixed_prompts()
    with make_llm(nemotron_h, **settings) as llm:
        engine = llm.engine
        assert engine.runner.states is not None and engine.runner.states.ssm.shape[0] == 3
        assert len(engine.runner.kv_cache.layers) == 1
        check_against_hf(nemotron_h, prompts, run_greedy(llm, prompts))
        if "num_blocks" in settings:
            assert engine.scheduler.num_preemptions > 0


BAMBA = dict(
    architectures=["BambaForCausalLM"],
    model_type="bamba",
    num_hidden_layers=4,
    attn_layer_indices=[1],
    mamba_n_heads=8,
    mamba_d_head=16,
    mamba_d_state=16,
    mamba_n_groups=2,
    mamba_expand=2,
    mamba_chunk_size=8,
    attention_bias=True,
    mlp_bias=True,
)


def test_bamba_is_hfs(tmp_path):
    """Bamba: Llama's layer with RoPE over half of each head, its MLP under feed_forward, Mamba-2 layers but on
    attn_layer_indices, biases: HF's greedy tokens and logprobs, in prompt chunks."""
    model_dir = make_tiny_model_dir(tmp_path / "bamba", "llama", random_norms=True, **BAMBA)
    prompts = mixed_prompts()
    with make_llm(model_dir, max_num_batched_tokens=12, max_num_seqs=3) as llm:
        assert len(llm.engine.runner.kv_cache.layers) == 1
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))


def test_nemotron_h_experts_are_refused(tmp_path):
    with pytest.raises(ValueError, match="mixture-of-experts blocks"):
        make_llm(make_nemotron_h_dir(tmp_path, hybrid_override_pattern="M*E", n_routed_experts=4))


LFM2 = dict(
    architectures=["Lfm2ForCausalLM"],
    model_type="lfm2",
    num_hidden_layers=4,
    layer_types=["conv", "full_attention", "conv", "conv"],
    intermediate_size=96,  # (the SwiGLU's width: 256, as transformers adjusts it)
    norm_eps=1e-5,
    conv_L_cache=3,
    conv_bias=True,
    tie_word_embeddings=True,
)


@pytest.fixture(scope="module")
def lfm2(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("lfm2") / "lfm2", "llama", random_norms=True, **LFM2)


@pytest.mark.parametrize(
    "settings",
    [{}, {"attention_backend": "torch"}, {"max_num_batched_tokens": 12, "max_num_seqs": 3}, {"num_blocks": 20}],
    ids=["cpu", "torch", "chunked-prefill", "preemption"],
)
def test_lfm2_is_hfs(lfm2, settings):
    """Short-convolution layers (B * x convolved, times C; a window of 2 gated inputs per request) beside RoPE
    attention with per-head q/k norms: HF's greedy tokens and logprobs, batched, in chunks and through preemptions."""
    prompts = mixed_prompts()
    with make_llm(lfm2, **settings) as llm:
        engine = llm.engine
        assert engine.runner.states is not None and engine.runner.states.conv.shape[0] == 3
        assert len(engine.runner.kv_cache.layers) == 1
        check_against_hf(lfm2, prompts, run_greedy(llm, prompts))
        check_against_hf(lfm2, prompts[6:7], run_greedy(llm, prompts[6:7]))
        if "num_blocks" in settings:
            assert engine.scheduler.num_preemptions > 0


QWEN3_5 = dict(
    architectures=["Qwen3_5ForCausalLM"],
    model_type="qwen3_5_text",
    num_hidden_layers=4,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    head_dim=16,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=16,
    linear_value_head_dim=8,
    linear_conv_kernel_dim=4,
)


@pytest.fixture(scope="module")
def qwen3_5(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_5") / "dense", "llama", random_norms=True, **QWEN3_5)


QWEN3_5_MOE = dict(
    QWEN3_5,
    architectures=["Qwen3_5MoeForCausalLM"],
    model_type="qwen3_5_moe_text",
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=80,
)


@pytest.fixture(scope="module")
def qwen3_5_moe(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_5") / "moe", "llama", random_norms=True, **QWEN3_5_MOE)


QWEN3_NEXT = dict(
    QWEN3_5_MOE,
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    intermediate_size=96,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[2],  # (a dense MLP between the sparse layers)
)


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("qwen3_next") / "q", "llama", random_norms=True, **QWEN3_NEXT)


def test_qwen3_next_is_hfs(qwen3_next):
    """Qwen3-Next: its linear attention's projections fused by key head (reordered at load), a dense layer among the
    sparse ones: HF's greedy tokens and logprobs, in prompt chunks."""
    prompts = [*mixed_prompts(), [(7 * i) % 500 + 3 for i in range(130)]]
    with make_llm(qwen3_next, max_num_batched_tokens=24, max_num_seqs=4) as llm:
        check_against_hf(qwen3_next, prompts, run_greedy(llm, prompts))


def test_qwen3_5_moe_is_hfs(qwen3_5_moe):
    """Qwen3.5's layers with Qwen2-MoE's experts and gated shared expert in every MLP: HF's greedy tokens and
    logprobs, in prompt chunks."""
    prompts = [*mixed_prompts(), [(7 * i) % 500 + 3 for i in range(130)]]
    with make_llm(qwen3_5_moe, max_num_batched_tokens=24, max_num_seqs=4) as llm:
        check_against_hf(qwen3_5_moe, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize(
    "settings",
    [{}, {"attention_backend": "torch"}, {"max_num_batched_tokens": 12, "max_num_seqs": 3}, {"num_blocks": 40}],
    ids=["cpu", "torch", "chunked-prefill", "preemption"],
)
def test_qwen3_5_is_hfs(qwen3_5, settings):
    """Gated DeltaNet layers (the delta rule over chunks of 64: a 130-token prompt crosses two boundaries) beside
    attention whose heads' outputs are gated, with partial RoPE and zero-centred norms: HF's greedy tokens and
    logprobs, batched, in chunks and through preemptions."""
    prompts = [*mixed_prompts(), [(7 * i) % 500 + 3 for i in range(130)]]
    with make_llm(qwen3_5, **settings) as llm:
        engine = llm.engine
        states = engine.runner.states
        assert states is not None and states.ssm.shape[0] == 3 and states.ssm.shape[2:] == (4, 16, 8)
        assert len(engine.runner.kv_cache.layers) == 1
        check_against_hf(qwen3_5, prompts, run_greedy(llm, prompts))
        if "num_blocks" in settings:
            assert engine.scheduler.num_preemptions > 0


@pytest.fixture(scope="module")
def hybrid_moe(tmp_path_factory):
    return make_hybrid_dir(tmp_path_factory.mktemp("granite_hybrid") / "moe")


@pytest.fixture(scope="module")
def hybrid_dense(tmp_path_factory):
    """Without experts (the shared MLP is each layer's MLP), with RoPE, the attention layers first and last."""
    return make_hybrid_dir(
        tmp_path_factory.mktemp("granite_hybrid") / "dense",
        num_local_experts=0,
        position_embedding_type="rope",
        layer_types=["attention", "mamba", "mamba", "attention"],
    )


@pytest.mark.parametrize(
    "settings",
    [
        {},
        {"attention_backend": "torch"},
        {"max_num_batched_tokens": 12, "max_num_seqs": 3},  # prompts in chunks across steps
        {"num_blocks": 20, "max_num_seqs": 4},  # preemption: resumed requests recompute from a zeroed state
    ],
    ids=["cpu", "torch", "chunked-prefill", "preemption"],
)
def test_granite_hybrid_is_hfs(hybrid_moe, settings):
    """Each request's Mamba-2 states carried from step to step (its chunks, its decodes beside others' prompts)
    give HF's greedy tokens and logprobs, batched and alone; the prompt repeated gives the same again (its rows
    zeroed for the next request)."""
    prompts = mixed_prompts()
    with make_llm(hybrid_moe, **settings) as llm:
        engine = llm.engine
        assert not engine.scheduler.kv_cache_manager.enable_caching  # (tiny.yaml asks for it: turned off)
        assert engine.runner.states is not None and engine.runner.states.ssm.shape[0] == 3  # three Mamba-2 layers
        assert len(engine.runner.kv_cache.layers) == 1  # the attention layer alone
        check_against_hf(hybrid_moe, prompts, run_greedy(llm, prompts))
        check_against_hf(hybrid_moe, prompts[6:7], run_greedy(llm, prompts[6:7]))
        if "num_blocks" in settings:
            assert engine.scheduler.num_preemptions > 0


def test_granite_hybrid_without_experts_with_rope_is_hfs(hybrid_dense):
    prompts = mixed_prompts()
    with make_llm(hybrid_dense) as llm:
        assert len(llm.engine.runner.kv_cache.layers) == 2
        check_against_hf(hybrid_dense, prompts, run_greedy(llm, prompts))


def test_granite_hybrid_stops_and_aborts_leave_nothing(hybrid_moe):
    """Requests that end early (max_tokens 1) and one aborted mid-decode leave the pool empty, and
    the rows they held serve the next requests from zero."""
    prompts = mixed_prompts()
    with make_llm(hybrid_moe) as llm:
        short = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        llm.generate([{"prompt_token_ids": p} for p in prompts], short, use_tqdm=False)
        engine = llm.engine
        engine.add_request("aborted", prompts[6], SamplingParams(max_tokens=50, temperature=0))
        for _ in range(3):
            engine.step()
        engine.abort(["aborted"])
        engine.step()
        assert_idle(llm)
        check_against_hf(hybrid_moe, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize(
    "overrides, flag",
    [
        ({"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, "--speculative-config"),
        ({"enable_lora": True}, "--enable-lora"),
        ({"kv_cache_dir": "unused"}, "KV tiers"),
    ],
)
def test_granite_hybrid_refuses_what_recurrent_states_cannot_serve(hybrid_moe, tmp_path, overrides, flag):
    if "kv_cache_dir" in overrides:
        overrides = {"kv_cache_dir": str(tmp_path / "tier")}
    with pytest.raises(SettingsConflictError, match=flag):
        make_llm(hybrid_moe, **overrides)


def test_granite_hybrid_is_refused_as_a_draft_model(hybrid_moe, tiny_llama_dir):
    """A hybrid draft for another target: its forward passes would carry no recurrent states (each pass's rows
    read as one sequence from zero), so it is refused rather than drafting from garbage."""
    speculative = {"method": "draft_model", "model": str(hybrid_moe), "num_speculative_tokens": 2}
    with pytest.raises(SettingsConflictError, match="draft model.*GraniteMoeHybridForCausalLM"):
        make_llm(tiny_llama_dir, speculative_config=speculative)


def test_states_take_their_share_of_the_kv_budget(hybrid_moe):
    """The recurrent states of max_num_seqs requests come out of the KV cache budget; a budget they fill is refused
    naming --max-num-seqs."""
    with make_llm(hybrid_moe, num_blocks=None, kv_cache_memory=2**20) as llm:
        states = llm.engine.runner.states
        assert states is not None
        state_bytes, spec = states.nbytes, llm.engine.runner.kv_cache.spec
        assert llm.engine.runner.kv_cache.num_blocks == (2**20 - state_bytes) // spec.bytes_per_block - 1
    with pytest.raises(SettingsConflictError, match="--max-num-seqs"):
        make_llm(hybrid_moe, num_blocks=None, kv_cache_memory=state_bytes // 2)


def test_default_max_num_seqs_is_lowered_to_what_the_states_leave_room_for(hybrid_moe):
    """Without --max-num-seqs, the default 256 requests' states would take more than half the budget: fewer run (the
    runner's rows, the scheduler's batch), the rest of the budget holding KV blocks; the tokens are HF's."""
    import yaml

    from engine import LLM
    from tests.engine.references import TINY_PRESET

    preset = yaml.safe_load(TINY_PRESET.read_text())
    scheduler = {key: value for key, value in preset["scheduler"].items() if key != "max_num_seqs"}
    scheduler["max_num_batched_tokens"] = 256  # (the default batch's decodes: a token each)
    budget = 4 * 2**20
    kwargs = dict(scheduler, block_size=4, kv_cache_memory=budget, dtype="float32", device="cpu", cpu_threads=1)
    with LLM(str(hybrid_moe), **kwargs) as llm:
        engine = llm.engine
        per_row = engine.runner.model.recurrent_state_bytes(1)
        assert 256 * per_row > budget // 2
        rows = budget // 2 // per_row
        assert engine.runner.limits.max_num_seqs == engine.scheduler.scheduler_config.max_num_seqs == rows
        assert engine.runner.states is not None and engine.runner.states.rows == rows
        assert (
            engine.runner.kv_cache.num_blocks
            == (budget - rows * per_row) // engine.runner.kv_cache.spec.bytes_per_block - 1
        )
        prompts = mixed_prompts()
        check_against_hf(hybrid_moe, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize("model", ["hybrid_moe", "nemotron_h", "lfm2", "qwen3_5"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_hybrid_quantized_serves_the_dequantized_model(request, tmp_path, method, model):
    """--quantization int8|int4 quantizes the Mamba-2 layers' in_proj and out_proj beside the attention, the experts
    and the MLPs: the engine serves exactly the model whose matrices are the quantized ones dequantized."""
    model_dir = request.getfixturevalue(model)
    round_trip, weight_type = METHODS[method]
    with make_llm(model_dir, quantization=method) as llm:
        mixers = llm.engine.runner.model.mixers.values()
        assert all(isinstance(w, weight_type) for mixer in mixers for w in (mixer.in_proj, mixer.out_proj))
        got = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    # (and each recurrent mixer's in_proj(s) and out_proj, LFM2's attention out_proj)
    mixers = r".*\.(?:mamba|mixer|conv|self_attn|linear_attn)\.(?:in_proj\w*|out_proj)\.weight"
    pattern = re.compile(rf"{QUANTIZED.pattern}|{mixers}")
    with make_llm(dequantized_copy(model_dir, tmp_path / "deq", round_trip, pattern)) as reference:
        want = reference.generate(PROMPTS, PARAMS, use_tqdm=False)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        torch.testing.assert_close(prompt_logprobs_of(g), prompt_logprobs_of(w), rtol=0, atol=1e-3)


def _hf_mamba_layer(dtype: torch.dtype):
    from transformers import GraniteMoeHybridConfig
    from transformers.models.granitemoehybrid.modeling_granitemoehybrid import GraniteMoeHybridMambaLayer

    config = GraniteMoeHybridConfig(
        hidden_size=64,
        mamba_n_heads=8,
        mamba_d_head=16,
        mamba_d_state=16,
        mamba_n_groups=2,
        mamba_expand=2,
        mamba_chunk_size=8,
        layer_types=["mamba"],
        num_hidden_layers=1,
    )
    torch.manual_seed(0)
    layer = GraniteMoeHybridMambaLayer(config, 0).to(dtype)
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
        layer.A_log.copy_(torch.log(torch.rand(8) + 0.5))
    shape = MambaShape(8, 16, 16, 2, 4, 128, 8, (0.0, float("inf")), config.rms_norm_eps)
    weights = MambaWeights(
        layer.in_proj.weight.float(),
        None,
        layer.conv1d.weight[:, 0].float(),
        layer.conv1d.bias.float(),
        layer.dt_bias.float(),
        -torch.exp(layer.A_log.float()),
        layer.D.float(),
        layer.norm.weight.float(),
        layer.out_proj.weight.float(),
        None,
    )
    return layer, shape, weights


def _linear(x, weight, bias=None):
    return torch.nn.functional.linear(x, weight, bias)


def test_mamba_layer_in_pieces_is_transformers_whole_in_float64():
    """A 37-token sequence in chunks of 13, three decodes and 21 (the scan's chunk is 8), and two requests in one
    step (a decode beside another's prompt) on other state rows: transformers' layer on the whole sequence in
    float64, within 1e-5 (the mixer computes in float32)."""
    layer, shape, weights = _hf_mamba_layer(torch.float64)
    x = torch.randn(1, 37, 64, dtype=torch.float64)
    with torch.no_grad():
        want = layer(x)[0]
    x32 = x[0].float()
    torch.testing.assert_close(mamba_mix(x32, weights, shape, _linear, None, 0).double(), want, atol=1e-5, rtol=0)
    states = RecurrentStates(shape.state, 1, 4, torch.float32, torch.device("cpu"))
    pieces, position = [], 0
    for count in (13, 1, 1, 1, 21):
        step = states.step([2], [0, count], [position + count], 1 if count == 1 else 0)
        pieces.append(mamba_mix(x32[position : position + count], weights, shape, _linear, step, 0))
        position += count
    torch.testing.assert_close(torch.cat(pieces).double(), want, atol=1e-5, rtol=0)
    first = mamba_mix(x32[:10], weights, shape, _linear, states.step([1], [0, 10], [10], 0), 0)
    both = mamba_mix(  # request on row 1 decodes its 11th token; a new one on row 2 (its old state zeroed) prefills 20
        torch.cat([x32[10:11], x32[:20]]), weights, shape, _linear, states.step([1, 2], [0, 1, 21], [11, 20], 1), 0
    )
    torch.testing.assert_close(torch.cat([first, both[:1]]).double(), want[:11], atol=1e-5, rtol=0)
    torch.testing.assert_close(both[1:].double(), want[:20], atol=1e-5, rtol=0)


def test_mamba_layer_decodes_more_requests_than_one_slice():
    """41 requests' 4-token prompts in one step, then their decodes in one step (more than DECODE_ROWS, so in slices):
    transformers' layer over each whole sequence."""
    layer, shape, weights = _hf_mamba_layer(torch.float64)
    count = DECODE_ROWS + 9
    x = torch.randn(count, 5, 64, dtype=torch.float64)
    with torch.no_grad():
        want = layer(x)
    x32 = x.float()
    states = RecurrentStates(shape.state, 1, count, torch.float32, torch.device("cpu"))
    rows = list(range(count))
    prompts = states.step(rows, [4 * i for i in range(count + 1)], [4] * count, 0)
    first = mamba_mix(x32[:, :4].reshape(-1, 64), weights, shape, _linear, prompts, 0)
    decodes = states.step(rows, list(range(count + 1)), [5] * count, count)
    last = mamba_mix(x32[:, 4], weights, shape, _linear, decodes, 0)
    # (float32 against float64 over 41 random sequences: 1e-4, where the single sequences above hold 1e-5)
    torch.testing.assert_close(first.reshape(count, 4, 64).double(), want[:, :4], atol=1e-4, rtol=0)
    torch.testing.assert_close(last.double(), want[:, 4], atol=1e-4, rtol=0)


def test_gated_delta_net_in_pieces_is_transformers_whole_in_float64():
    """Qwen3.5's linear attention over 150 tokens (three chunks of the delta rule) whole, and in pieces of 70, three
    decodes and 77 carrying the conv window and state: transformers' layer in float64, within 2e-5."""
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from engine.layers.gated_delta_net import DeltaNetShape, DeltaNetWeights, delta_net_mix

    config = Qwen3_5TextConfig(
        hidden_size=64,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        **{name: value for name, value in QWEN3_5.items() if name.startswith("linear_")},
    )
    torch.manual_seed(0)
    layer = Qwen3_5GatedDeltaNet(config, 0).double()
    with torch.no_grad():
        for param in layer.parameters():
            param.normal_(0, 0.3)
        layer.A_log.copy_(torch.log(torch.rand(4) + 0.5))
        x = torch.randn(1, 150, 64, dtype=torch.float64)
        want = layer(x)[0]
    shape = DeltaNetShape(2, 4, 16, 8, 4, config.rms_norm_eps)
    projections = [getattr(layer, f"in_proj_{part}").weight for part in ("qkv", "z", "b", "a")]
    weights = DeltaNetWeights(
        torch.cat(projections).float(),
        layer.conv1d.weight[:, 0].float(),
        layer.dt_bias.float(),
        -torch.exp(layer.A_log.float()),
        layer.norm.weight.float(),
        layer.out_proj.weight.float(),
    )
    x32 = x[0].float()
    torch.testing.assert_close(delta_net_mix(x32, weights, shape, _linear, None, 0).double(), want, atol=2e-5, rtol=0)
    states = RecurrentStates(shape.state, 1, 4, torch.float32, torch.device("cpu"))
    pieces, position = [], 0
    for count in (70, 1, 1, 1, 77):
        step = states.step([3], [0, count], [position + count], 1 if count == 1 else 0)
        pieces.append(delta_net_mix(x32[position : position + count], weights, shape, _linear, step, 0))
        position += count
    torch.testing.assert_close(torch.cat(pieces).double(), want, atol=2e-5, rtol=0)


@pytest.mark.parametrize("variant", ["dense", "moe"])
def test_qwen3_5_multimodal_checkpoint_serves_its_language_model(request, tmp_path, variant):
    """Qwen3.5's releases are multimodal (Qwen3_5(Moe)ForConditionalGeneration): their language model
    (model.language_model.*) is served as the text model, the vision encoder's (model.visual.*) and the
    multi-token-prediction layer's (mtp.*) tensors left unread; the same tokens and logprobs as the text checkpoint
    (which, with mtp.* tensors beside it, serves the same too)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    text_dir = request.getfixturevalue("qwen3_5" if variant == "dense" else "qwen3_5_moe")
    whole = tmp_path / "multimodal"
    shutil.copytree(text_dir, whole)
    state = load_file(str(text_dir / "model.safetensors"))
    state = {
        (f"model.language_model.{name[6:]}" if name.startswith("model.") else name): t for name, t in state.items()
    }
    state["model.visual.patch_embed.proj.weight"] = torch.zeros(4, 3)
    state["mtp.fc.weight"] = torch.zeros(4, 4)
    save_file(state, str(whole / "model.safetensors"))
    text_config = json.loads((text_dir / "config.json").read_text())
    architecture = "Qwen3_5ForConditionalGeneration" if variant == "dense" else "Qwen3_5MoeForConditionalGeneration"
    config = {
        "architectures": [architecture],
        "model_type": "qwen3_5" if variant == "dense" else "qwen3_5_moe",
        "text_config": {key: value for key, value in text_config.items() if key != "architectures"},
        "vision_config": {
            "depth": 1,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "out_hidden_size": 64,
        },
        "tie_word_embeddings": False,
    }
    (whole / "config.json").write_text(json.dumps(config))
    prompts = mixed_prompts()[3:7]
    with make_llm(text_dir) as llm:
        want = run_greedy(llm, prompts)
    with make_llm(whole) as llm:
        got = run_greedy(llm, prompts)
    text_with_mtp = tmp_path / "text-with-mtp"  # (the text checkpoint's mtp.* tensors are left unread too)
    shutil.copytree(text_dir, text_with_mtp)
    save_file(
        {**load_file(str(text_dir / "model.safetensors")), "mtp.fc.weight": torch.zeros(4, 4)},
        str(text_with_mtp / "model.safetensors"),
    )
    with make_llm(text_with_mtp) as llm:
        got_text = run_greedy(llm, prompts)
    for g, w in [*zip(got, want), *zip(got_text, want)]:
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert [lp.logprob for lp in g.outputs[0].logprobs] == pytest.approx(
            [lp.logprob for lp in w.outputs[0].logprobs]
        )

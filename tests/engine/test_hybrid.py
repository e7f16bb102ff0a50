"""The hybrid families (recurrent layers beside attention: Granite 4.0-H, Bamba and Nemotron-H's Mamba-2 (Nemotron 3
with mixture-of-experts blocks too), LFM2's short convolutions, Qwen3.5, Qwen3.5-MoE and Qwen3-Next's Gated DeltaNet)
against transformers on tiny random checkpoints: greedy tokens identical and logprobs within 1e-4 in float32, batched,
in prompt chunks, through preemptions; the Mamba-2 and Gated DeltaNet layers alone against transformers' in float64;
quantized weights, the states' share of the KV cache budget, multimodal Qwen3.5 checkpoints; what hybrid models are not
served with, refused by name."""

from __future__ import annotations

import re

import pytest
import torch

from engine import SamplingParams
from engine.errors import SettingsConflictError
from engine.layers.mamba2 import MambaWeights, mamba_mix
from engine.layers.recurrent_state import DECODE_ROWS, MambaShape, RecurrentStates
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


QWEN3_5_MOE = dict(
    QWEN3_5,
    architectures=["Qwen3_5MoeForCausalLM"],
    model_type="qwen3_5_moe_text",
    num_experts=6,
    num_experts_per_tok=2,
    moe_intermediate_size=48,
    shared_expert_intermediate_size=80,
)


QWEN3_NEXT = dict(
    QWEN3_5_MOE,
    architectures=["Qwen3NextForCausalLM"],
    model_type="qwen3_next",
    intermediate_size=96,
    norm_topk_prob=True,
    decoder_sparse_step=1,
    mlp_only_layers=[2],  # (a dense MLP between the sparse layers)
)


NEMOTRON_3 = dict(
    NEMOTRON_H,
    hybrid_override_pattern="M*EME-",  # mixture-of-experts blocks between Mamba-2, attention and MLP blocks
    n_routed_experts=8,
    num_experts_per_tok=3,
    moe_intermediate_size=32,
    moe_shared_expert_intermediate_size=48,
    n_group=4,
    topk_group=2,
    norm_topk_prob=True,
    routed_scaling_factor=2.5,
)


def make_nemotron_h_dir(path, **overrides):
    return make_tiny_model_dir(path, "llama", random_norms=True, **{**NEMOTRON_H, **overrides})


FAMILIES = {  # name: (config, attention layers)
    "granite-4.0-h": (GRANITE_HYBRID, 1),
    # without experts (the shared MLP is each layer's MLP), with RoPE, the attention layers first and last
    "granite-4.0-h-dense": (
        dict(
            GRANITE_HYBRID,
            num_local_experts=0,
            position_embedding_type="rope",
            layer_types=["attention", "mamba", "mamba", "attention"],
        ),
        2,
    ),
    "bamba": (BAMBA, 1),
    "nemotron_h": (NEMOTRON_H, 1),
    "nemotron_3": (NEMOTRON_3, 1),
    "lfm2": (LFM2, 1),
    "qwen3_5": (QWEN3_5, 1),
    "qwen3_5_moe": (QWEN3_5_MOE, 1),
    "qwen3_next": (QWEN3_NEXT, 1),
}
"""Every hybrid family (Granite 4.0-H with and without experts, Bamba, Nemotron-H: Mamba-2; LFM2: short
convolutions; Qwen3.5, Qwen3.5-MoE, Qwen3-Next: Gated DeltaNet), as the tests build it."""


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """Each family's tiny checkpoint, made when a test first asks for it."""
    made: dict = {}

    def model_dir(name: str):
        if name not in made:
            made[name] = make_tiny_model_dir(
                tmp_path_factory.mktemp(name) / name, "llama", random_norms=True, **FAMILIES[name][0]
            )
        return made[name]

    return model_dir


@pytest.fixture(scope="module")
def hybrid_moe(family_dirs):
    return family_dirs("granite-4.0-h")


LONG_PROMPT = [(7 * i) % 500 + 3 for i in range(130)]  # (three of the delta rule's chunks of 64)


@pytest.mark.parametrize(
    "settings",
    [{}, {"attention_backend": "torch"}, {"max_num_batched_tokens": 12, "max_num_seqs": 3}, {"num_blocks": 40}],
    ids=["cpu", "torch", "chunked-prefill", "preemption"],
)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_is_hfs(family_dirs, family, settings):
    """Each request's recurrent states carried from step to step (its prompt's chunks, its decodes beside others'
    prompts) give HF's greedy tokens and logprobs, batched, in chunks and through preemptions (resumed requests
    recompute from a zeroed state); the KV cache holds the attention layers alone; the prompt repeated gives the
    same again (its rows zeroed for the next request)."""
    model_dir = family_dirs(family)
    prompts = [*mixed_prompts(), LONG_PROMPT]
    with make_llm(model_dir, **settings) as llm:
        engine = llm.engine
        assert engine.scheduler.kv_cache_manager.snapshots is not None  # (tiny.yaml asks for prefix caching)
        assert engine.runner.states is not None
        assert len(engine.runner.kv_cache.layers) == FAMILIES[family][1]
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))
        check_against_hf(model_dir, prompts[6:7], run_greedy(llm, prompts[6:7]))
        if "num_blocks" in settings:
            assert engine.scheduler.num_preemptions > 0


def test_nemotron_3_latent_experts_are_hfs_on_one_and_two_ranks(tmp_path):
    """moe_latent_size: the routed experts run in a narrower width between fc1_latent_proj and fc2_latent_proj (the
    router and the shared expert on the hidden state): HF's tokens and logprobs; on two ranks (each its share of
    every expert, or half the experts whole) the tokens of one process. Their biases (mlp_bias) are refused."""
    from tests.distributed.test_tensor_parallel import assert_same, generate

    model_dir = make_nemotron_h_dir(tmp_path / "latent", **{**NEMOTRON_3, "moe_latent_size": 24})
    prompts = mixed_prompts()
    with make_llm(model_dir) as llm:
        block = llm.engine.runner.model.moe_blocks[2]
        assert block.latent is not None and llm.engine.runner.model.moe.latent_size == 24
        check_against_hf(model_dir, prompts, run_greedy(llm, prompts))
    expected, _ = generate(model_dir, prompts[:4], 1)
    assert_same(generate(model_dir, prompts[:4], 2)[0], expected)
    assert_same(generate(model_dir, prompts[:4], 2, enable_expert_parallel=True)[0], expected)
    with pytest.raises(ValueError, match="mlp_bias"):
        make_llm(make_nemotron_h_dir(tmp_path / "bias", **{**NEMOTRON_3, "mlp_bias": True}))


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


def test_granite_4_micro_of_attention_layers_alone_serves_as_a_draft_model(tmp_path, tiny_llama_dir):
    """Granite 4.0 Micro's config is a hybrid one whose layers all attend: no state to carry, so it drafts (the
    target's greedy tokens kept, drafts proposed and some accepted)."""
    micro = make_hybrid_dir(
        tmp_path / "micro", num_local_experts=0, position_embedding_type="rope", layer_types=["attention"] * 4
    )
    prompts = mixed_prompts()[:4]
    with make_llm(tiny_llama_dir) as llm:
        expected = [r.outputs[0].token_ids for r in run_greedy(llm, prompts)]
    speculative = {"method": "draft_model", "model": str(micro), "num_speculative_tokens": 2, "step_cost_model": False}
    with make_llm(tiny_llama_dir, speculative_config=speculative) as llm:
        assert [r.outputs[0].token_ids for r in run_greedy(llm, prompts)] == expected
        stats = llm.engine.scheduler.spec_decode_stats
        assert stats is not None and stats.num_draft_tokens > 0


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


def test_default_snapshots_take_what_the_requests_leave_of_half_the_budget(hybrid_moe):
    """With --max-num-seqs given and --state-snapshots not, the snapshots take what the requests' states leave of half
    the budget (none left: no prefix caching); --state-snapshots alone taking half of it is refused."""
    with make_llm(hybrid_moe) as llm:
        per_row = llm.engine.runner.model.recurrent_state_bytes(1)
    for share, slots in ((20, 4), (16, 0)):  # (16 requests: tiny.yaml's --max-num-seqs)
        with make_llm(hybrid_moe, num_blocks=None, kv_cache_memory=2 * share * per_row + 1) as llm:
            engine = llm.engine
            states = engine.runner.states
            assert states is not None and (states.rows, states.snapshots) == (16, slots)
            kv = engine.scheduler.kv_cache_manager
            assert kv.enable_caching == bool(slots) and (kv.snapshots is not None) == bool(slots)
    import yaml

    from engine import LLM
    from tests.engine.references import TINY_PRESET

    preset = yaml.safe_load(TINY_PRESET.read_text())
    scheduler = {key: value for key, value in preset["scheduler"].items() if key != "max_num_seqs"}
    scheduler["max_num_batched_tokens"] = 256  # (the default batch's decodes: a token each)
    with pytest.raises(SettingsConflictError, match="--state-snapshots 40 take half"):
        LLM(
            str(hybrid_moe),
            **scheduler,
            block_size=4,
            kv_cache_memory=2 * 40 * per_row,
            state_snapshots=40,
            dtype="float32",
        )


def test_mamba_cache_mode_none_serves_without_prefix_caching(hybrid_moe):
    with make_llm(hybrid_moe, mamba_cache_mode="none") as llm:
        engine = llm.engine
        assert not engine.scheduler.kv_cache_manager.enable_caching
        assert engine.runner.states is not None and engine.runner.states.snapshots == 0


@pytest.mark.parametrize("snapshots", [None, 5, 0])
def test_default_max_num_seqs_is_lowered_to_what_the_states_leave_room_for(hybrid_moe, snapshots):
    """Without --max-num-seqs, the default 256 requests' states and as many snapshots (or --state-snapshots) would
    take more than half the budget: fewer requests run (the runner's rows, the scheduler's batch), the rest of the
    budget holding KV blocks; the tokens are HF's. No snapshots: no prefix caching."""
    import yaml

    from engine import LLM
    from tests.engine.references import TINY_PRESET

    preset = yaml.safe_load(TINY_PRESET.read_text())
    scheduler = {key: value for key, value in preset["scheduler"].items() if key != "max_num_seqs"}
    scheduler["max_num_batched_tokens"] = 256  # (the default batch's decodes: a token each)
    budget = 4 * 2**20
    kwargs = dict(scheduler, block_size=4, kv_cache_memory=budget, dtype="float32", device="cpu", cpu_threads=1)
    with LLM(str(hybrid_moe), state_snapshots=snapshots, **kwargs) as llm:
        engine = llm.engine
        per_row = engine.runner.model.recurrent_state_bytes(1)
        assert 256 * per_row > budget // 2
        share = budget // 2 // per_row
        rows = share // 2 if snapshots is None else share - snapshots
        slots = rows if snapshots is None else snapshots
        assert engine.runner.limits.max_num_seqs == engine.scheduler.scheduler_config.max_num_seqs == rows
        states = engine.runner.states
        assert states is not None and (states.rows, states.snapshots) == (rows, slots)
        kv = engine.scheduler.kv_cache_manager
        assert kv.enable_caching == bool(slots) and (kv.snapshots.num_slots if kv.snapshots else 0) == slots
        assert (
            engine.runner.kv_cache.num_blocks
            == (budget - (rows + slots) * per_row) // engine.runner.kv_cache.spec.bytes_per_block - 1
        )
        prompts = mixed_prompts()
        check_against_hf(hybrid_moe, prompts, run_greedy(llm, prompts))


@pytest.mark.parametrize("model", ["granite-4.0-h", "nemotron_3", "lfm2", "qwen3_5"])
@pytest.mark.parametrize("method", sorted(METHODS))
def test_hybrid_quantized_serves_the_dequantized_model(family_dirs, tmp_path, method, model):
    """--quantization int8|int4 quantizes the Mamba-2 layers' in_proj and out_proj beside the attention, the experts
    and the MLPs: the engine serves exactly the model whose matrices are the quantized ones dequantized."""
    model_dir = family_dirs(model)
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
def test_qwen3_5_multimodal_checkpoint_serves_its_language_model(family_dirs, tmp_path, variant):
    """Qwen3.5's releases are multimodal (Qwen3_5(Moe)ForConditionalGeneration): their language model
    (model.language_model.*) is served as the text model, the vision encoder's (model.visual.*) and the
    multi-token-prediction layer's (mtp.*) tensors left unread; the same tokens and logprobs as the text checkpoint
    (which, with mtp.* tensors beside it, serves the same too)."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    text_dir = family_dirs("qwen3_5" if variant == "dense" else "qwen3_5_moe")
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


def test_nemotron_3_experts_stored_stacked_are_read_alike(tmp_path):
    """Experts as transformers holds them in memory (`mixer.experts.up_proj` [E, I, H], `mixer.experts.down_proj`
    [E, H, I]) serve the tokens the per-expert checkpoint does, in one process and cut over two ranks."""
    from safetensors.torch import load_file, save_file

    from tests.distributed.test_tensor_parallel import assert_same, generate

    per_expert = make_nemotron_h_dir(tmp_path / "per-expert", **NEMOTRON_3)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    for path in per_expert.iterdir():
        if path.name != "model.safetensors":
            (stacked / path.name).write_bytes(path.read_bytes())
    state = load_file(str(per_expert / "model.safetensors"))
    for layer in (2, 4):  # (NEMOTRON_3's mixture-of-experts blocks)
        for matrix in ("up_proj", "down_proj"):
            names = [f"backbone.layers.{layer}.mixer.experts.{e}.{matrix}.weight" for e in range(8)]
            state[f"backbone.layers.{layer}.mixer.experts.{matrix}"] = torch.stack([state.pop(n) for n in names])
    save_file(state, str(stacked / "model.safetensors"), metadata={"format": "pt"})
    prompts = mixed_prompts()[:4]
    expected, _ = generate(per_expert, prompts, 1)
    assert_same(generate(stacked, prompts, 1)[0], expected)
    assert_same(generate(stacked, prompts, 2)[0], expected)

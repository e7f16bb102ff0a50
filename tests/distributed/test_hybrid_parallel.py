"""Granite 4.0-H, Nemotron-H (Mamba-2 and attention layers), LFM2 (short convolutions) and Qwen3.5 (Gated DeltaNet) on
two tensor-parallel ranks: each rank its share of the Mamba-2 heads (LFM2: of the convolutions' channels; Qwen3.5:
of the linear attention's key heads, with their value heads; the Mamba-2 heads' in_proj rows, conv channels, dt, A,
D, norm channels and out_proj columns; the groups of B and C cut when they divide, else the one group whole on both
ranks, its gated norm's mean square all-reduced), of the attention heads and of the experts or the dense MLP, and
its own recurrent states: the tokens and logprobs of one process, with chunked prefill and preemption, with expert
parallelism and with int8; Mamba-2 heads or groups that do not divide refused by number."""

from __future__ import annotations

import pytest

from engine import LLM
from engine.errors import SettingsConflictError
from tests.distributed.test_tensor_parallel import TINY, assert_same, generate
from tests.engine.factories import make_tiny_model_dir
from tests.engine.test_hybrid import (
    BAMBA,
    LFM2,
    NEMOTRON_3,
    QWEN3_5,
    QWEN3_5_MOE,
    QWEN3_NEXT,
    make_hybrid_dir,
    make_nemotron_h_dir,
)
from tests.engine.test_model_equivalence import mixed_prompts

pytestmark = pytest.mark.timeout(300)

VARIANTS = {
    "moe-2-groups": {},  # B and C's 2 groups: one per rank
    # one group, on both ranks (its norm across them); one KV head replicated; the shared MLP alone, with RoPE
    "dense-1-group": dict(
        num_local_experts=0,
        mamba_n_groups=1,
        num_key_value_heads=1,
        position_embedding_type="rope",
        layer_types=["attention", "mamba", "mamba", "attention"],
    ),
}


OTHER_FAMILIES = ("nemotron_h", "nemotron_3", "lfm2", "qwen3_5", "qwen3_5_moe", "qwen3_next", "bamba")


@pytest.mark.parametrize("variant", [*sorted(VARIANTS), *OTHER_FAMILIES])
def test_hybrid_on_two_ranks_is_one_process(tmp_path, variant):
    """Nemotron-H: its blocks' mixers (Mamba-2, attention, MLP) under their names `backbone.layers.N.mixer.*`, the
    embedding `backbone.embeddings` vocab-parallel."""
    if variant == "nemotron_h":
        model_dir = make_nemotron_h_dir(tmp_path / variant)
    elif variant == "nemotron_3":  # its ungated experts' up rows and down columns cut, or whole experts held
        model_dir = make_nemotron_h_dir(tmp_path / variant, **NEMOTRON_3)
    elif variant == "bamba":  # its biases cut with their rows (o_proj's and down's on rank 0)
        model_dir = make_tiny_model_dir(tmp_path / variant, "llama", random_norms=True, **BAMBA)
    elif variant == "lfm2":  # its convolutions cut by channels, the attention's out_proj and w2 row-parallel
        model_dir = make_tiny_model_dir(tmp_path / variant, "llama", random_norms=True, **LFM2)
    elif variant.startswith("qwen3"):  # its key heads (one per rank) with their value heads; q_proj by heads
        # (Qwen3-Next: its projections' rows by key head, each rank's whole groups reordered as its own)
        config = {"qwen3_5_moe": QWEN3_5_MOE, "qwen3_next": QWEN3_NEXT}.get(variant, QWEN3_5)
        model_dir = make_tiny_model_dir(tmp_path / variant, "llama", random_norms=True, **config)
    else:
        model_dir = make_hybrid_dir(tmp_path / variant, **VARIANTS[variant])
    prompts = mixed_prompts(11)
    expected, _ = generate(model_dir, prompts, 1, num_blocks=20)
    got, stats = generate(model_dir, prompts, 2, num_blocks=20)
    assert stats.num_preemptions > 0
    assert_same(got, expected)
    if variant.startswith("moe") or variant in ("qwen3_5_moe", "qwen3_next", "nemotron_3"):
        assert_same(generate(model_dir, prompts, 2, num_blocks=20, enable_expert_parallel=True)[0], expected)
    int8, _ = generate(model_dir, prompts[:4], 1, quantization="int8")
    assert_same(generate(model_dir, prompts[:4], 2, quantization="int8")[0], int8)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"mamba_n_heads": 6, "mamba_d_head": 32, "mamba_expand": 3, "mamba_n_groups": 3}, "3 Mamba-2 groups"),
        ({"mamba_n_heads": 3, "mamba_d_head": 64, "mamba_expand": 3, "mamba_n_groups": 1}, "3 Mamba-2 heads"),
    ],
    ids=["groups", "heads"],
)
def test_mamba_sizes_that_do_not_divide_are_refused(tmp_path, overrides, message):
    model_dir = make_hybrid_dir(tmp_path, **overrides)
    with pytest.raises(SettingsConflictError, match=message):
        LLM(str(model_dir), **TINY, tensor_parallel_size=2)


@pytest.mark.parametrize("family", ["granite-4.0-h", "nemotron_3", "lfm2", "qwen3_next"])
def test_hybrid_on_two_pipeline_stages_is_one_process(tmp_path, family):
    """Each stage keeps its own recurrent layers' states (Granite 4.0-H's second stage holds Mamba-2 layers alone:
    no KV cache of its own) and steps in flight overlap: the tokens and logprobs of one process, with chunked
    prefill and preemption."""
    from tests.distributed.test_pipeline_parallel import GREEDY, run
    from tests.distributed.test_pipeline_parallel import assert_same as assert_same_steps
    from tests.engine.test_hybrid import FAMILIES

    model_dir = make_tiny_model_dir(tmp_path / family, "llama", random_norms=True, **FAMILIES[family][0])
    prompts = mixed_prompts(21)
    expected = run(model_dir, prompts, GREEDY, num_blocks=20)
    got = run(model_dir, prompts, GREEDY, num_blocks=20, pipeline_parallel_size=2)
    assert got[3].num_preemptions > 0
    assert got[4] == 2  # (both stages had a step)
    assert_same_steps(got, expected)
    if family == "granite-4.0-h":  # (the pool sized from the budgets: the second stage, holding no KV, sets none)
        sized = run(model_dir, prompts, GREEDY, kv_cache_memory=2**22, pipeline_parallel_size=2)
        assert_same_steps(sized, expected)


@pytest.mark.parametrize("parallel", [{"tensor_parallel_size": 2}, {"pipeline_parallel_size": 2}], ids=["tp", "pp"])
@pytest.mark.parametrize("family", ["granite-4.0-h", "qwen3_5"])
def test_prefix_hits_restore_every_ranks_states(tmp_path, family, parallel):
    """Each rank (each stage) takes and restores its own layers' snapshots as the step messages say: the same
    prompt again, a chat's next turn and a shared prompt's junction hit as in one process, with transformers'
    tokens and logprobs."""
    from tests.engine.references import check_against_hf, make_llm
    from tests.engine.test_hybrid import FAMILIES
    from tests.engine.test_hybrid_prefix_cache import chat_rounds

    model_dir = make_tiny_model_dir(tmp_path / family, "llama", random_norms=True, **FAMILIES[family][0])
    with make_llm(model_dir, **parallel) as llm:
        prompts, results = chat_rounds(llm)
        check_against_hf(model_dir, prompts, results)
        assert [r.num_cached_tokens for r in results] == [0, 48, 60, 0, 0, 68]


def test_nemotron_3_without_mlp_blocks_is_cut_whatever_the_unused_dense_width(tmp_path):
    """Nemotron 3 Nano's blocks are Mamba-2, attention and experts, no plain MLP: its config's intermediate_size is
    read by no layer, so ranks that do not divide it (nor, in int4, its groups) still serve the model."""
    from tests.engine.test_hybrid import NEMOTRON_3

    model_dir = make_nemotron_h_dir(
        tmp_path, **{**NEMOTRON_3, "hybrid_override_pattern": "M*EME", "intermediate_size": 97}
    )
    prompts = mixed_prompts(11)[:4]
    expected, _ = generate(model_dir, prompts, 1)
    assert_same(generate(model_dir, prompts, 2)[0], expected)

"""DeepSeek's grouped top-k routing against a float64 reference written from the papers' description, one token
at a time; and which layers a DeepSeek config makes sparse."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from engine.layers.grouped_routing import GroupedTopK

EXPERTS, GROUPS, TOKENS = 16, 4, 40


def reference(logits: torch.Tensor, router: GroupedTopK, bias) -> list[dict[int, float]]:
    """Per token {expert: weight}, float64: score, pick the best groups, the best experts in them, weigh."""
    chosen = []
    for row in logits.double():
        scores = torch.softmax(row, 0) if router.scoring == "softmax" else torch.sigmoid(row)
        choice = scores + (0 if bias is None else bias.double())
        allowed = list(range(EXPERTS))
        if router.method != "greedy":
            size = EXPERTS // GROUPS
            groups = [choice[g * size : (g + 1) * size] for g in range(GROUPS)]
            rank = [
                g.max().item() if router.method == "group_limited_greedy" else g.topk(2).values.sum().item()
                for g in groups
            ]
            best = sorted(range(GROUPS), key=lambda g: -rank[g])[: router.topk_groups]
            allowed = [e for e in allowed if e // size in best]
        experts = sorted(allowed, key=lambda e: -choice[e].item())[: router.top_k]
        weights = torch.stack([scores[e] for e in experts])
        if router.renormalize:
            weights = weights / weights.sum()
        chosen.append({e: w.item() * router.scaling_factor for e, w in zip(experts, weights)})
    return chosen


@pytest.mark.parametrize(
    "scoring, method, renormalize, with_bias",
    [
        ("softmax", "greedy", False, False),  # DeepSeek-V2 (and V2-Lite)
        ("softmax", "group_limited_greedy", False, False),  # DeepSeek-V2's group-limited routing
        ("sigmoid", "noaux_tc", True, True),  # DeepSeek-V3: the bias steers the choice, not the weights
        ("sigmoid", "noaux_tc", False, True),
    ],
)
def test_routing_matches_the_float64_reference(scoring, method, renormalize, with_bias):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(TOKENS, EXPERTS, generator=generator) * 2
    bias = torch.randn(EXPERTS, generator=generator) * 0.3 if with_bias else None
    router = GroupedTopK(
        top_k=3,
        scoring=scoring,
        method=method,
        num_groups=GROUPS,
        topk_groups=2,
        renormalize=renormalize,
        scaling_factor=2.5,
        correction_bias=bias,
    )
    routing = router(logits)
    for t, expected in enumerate(reference(logits, router, bias)):
        got = dict(zip(routing.expert_ids[t].tolist(), routing.weights[t].tolist()))
        assert sorted(got) == sorted(expected), f"token {t}: other experts"
        assert [got[e] for e in sorted(got)] == pytest.approx([expected[e] for e in sorted(got)], rel=1e-6)
    if method != "greedy":  # every token's experts lie in at most topk_group groups
        assert all(len(set((routing.expert_ids[t] // (EXPERTS // GROUPS)).tolist())) <= 2 for t in range(TOKENS))


def test_unknown_routing_is_refused():
    with pytest.raises(ValueError, match="topk_method 'sparse'"):
        GroupedTopK(
            top_k=2,
            scoring="softmax",
            method="sparse",
            num_groups=1,
            topk_groups=1,
            renormalize=False,
            scaling_factor=1.0,
        )


def _config(**fields):
    base = dict(
        model_type="deepseek_v3",
        num_hidden_layers=6,
        first_k_dense_replace=1,
        n_routed_experts=8,
        moe_intermediate_size=8,
        n_shared_experts=1,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        n_group=2,
        topk_group=1,
        routed_scaling_factor=1.0,
        num_attention_heads=2,
        q_lora_rank=None,
        kv_lora_rank=4,
        qk_nope_head_dim=4,
        qk_rope_head_dim=2,
        v_head_dim=4,
    )
    return SimpleNamespace(**{**base, **fields})


def test_sparse_layers_follow_first_k_dense_replace_and_moe_layer_freq():
    from engine.models.deepseek_arch import read_deepseek

    assert read_deepseek(_config(), None).moe.sparse_layers == (1, 2, 3, 4, 5)
    assert read_deepseek(_config(moe_layer_freq=2), None).moe.sparse_layers == (2, 4)
    assert read_deepseek(_config(first_k_dense_replace=3), None).moe.sparse_layers == (3, 4, 5)


def test_yarn_mscale_scales_the_softmax_as_hf():
    from engine.models.deepseek_arch import read_deepseek

    yarn = {
        "rope_type": "yarn",
        "factor": 40.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    }
    mscale = 0.1 * torch.log(torch.tensor(40.0)).item() + 1.0
    assert read_deepseek(_config(), yarn).mla.softmax_scale == pytest.approx(6**-0.5 * mscale**2)
    assert read_deepseek(_config(), None).mla.softmax_scale == pytest.approx(6**-0.5)


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(model_type="deepseek_v2", norm_topk_prob=True, topk_method="greedy"), "norm_topk_prob"),
        (dict(scoring_func="softmax"), "scoring_func='softmax'"),
        (dict(model_type="deepseek_v2", topk_method="noaux_tc", norm_topk_prob=False), "topk_method='noaux_tc'"),
        (dict(n_group=3), "not a multiple of n_group"),
    ],
)
def test_unserved_routing_fields_are_refused(fields, message):
    from engine.models.deepseek_arch import read_deepseek

    with pytest.raises(ValueError, match=message):
        read_deepseek(_config(**fields), None)

"""Attention sinks in the Triton kernels against the float64 reference (under Triton's interpreter on CPU): a mixed
step through the prefill kernel (windows, a soft-cap), decodes through the split-KV decode kernel (the reduction
adds each sink once) and unsplit, and GPT-OSS's greedy tokens through the triton backend against HF."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from engine.attention.kv_cache import KVCacheSpec  # noqa: E402
from engine.attention.layer_attention import SINKS, LayerAttention  # noqa: E402
from engine.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from engine.kernels.triton import paged_decode  # noqa: E402
from tests.engine.paged_steps import random_paged_step, reference_attention  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SINK_VALUES = torch.tensor([3.0, -2.0, 0.5, 8.0])


@pytest.mark.parametrize(
    "layer",
    [
        LayerAttention(0.25, sinks=SINK_VALUES),
        LayerAttention(0.25, sliding_window=6, sinks=SINK_VALUES),
        LayerAttention(0.3, sliding_window=3, softcap=2.0, sinks=-SINK_VALUES),
    ],
    ids=["sinks", "window", "window-cap"],
)
def test_backend_mixed_step(layer):
    """Decodes, a chunk continuing a prefix, a fresh prompt: one varlen prefill-kernel call."""
    step = random_paged_step(
        [(37, 1), (5, 1), (30, 12), (9, 9)],
        2,
        block_size=4,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        num_blocks=40,
        device=DEVICE,
    )
    backend = TritonAttentionBackend()
    assert SINKS in backend.attention_features
    metadata = backend.build_metadata(step.metadata, KVCacheSpec(1, 4, 2, 16, torch.float32))
    backend.write_kv(step.key, step.value, step.key_cache, step.value_cache, metadata)
    got = backend.attend(step.query, step.key, step.value, step.key_cache, step.value_cache, metadata, layer)
    expected = reference_attention(step, layer.scale, layer.sliding_window, layer.softcap, layer.sinks)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("partition_size", [16, 512], ids=["split", "one-partition"])
@pytest.mark.parametrize("window", [None, 20])
def test_decode_kernel_adds_each_sink_once(partition_size, window):
    step = random_paged_step(
        [(70, 1), (12, 1)], 2, block_size=8, num_heads=4, num_kv_heads=2, head_dim=16, num_blocks=16, device=DEVICE
    )
    caches = step.key_cache.view(-1, 2, 16), step.value_cache.view(-1, 2, 16)
    caches[0][step.metadata.slot_mapping] = step.key
    caches[1][step.metadata.slot_mapping] = step.value
    got = paged_decode(
        step.query,
        step.key_cache,
        step.value_cache,
        step.metadata.block_table,
        step.metadata.seq_lens,
        0.25,
        partition_size=partition_size,
        window=window,
        sinks=SINK_VALUES.to(DEVICE),
    )
    expected = reference_attention(step, 0.25, window, None, SINK_VALUES)
    torch.testing.assert_close(got.double().cpu(), expected, atol=1e-4, rtol=1e-4)


def test_gpt_oss_greedy_tokens_match_hf(tmp_path):
    """The whole model through the triton backend, chunked prefill and decodes, against HF transformers."""
    from tests.engine.references import hf_greedy, make_llm
    from tests.engine.test_gpt_oss import make_gpt_oss_dir
    from tests.engine.test_model_equivalence import NEW_TOKENS, mixed_prompts, run_greedy

    model_dir = make_gpt_oss_dir(tmp_path / "gpt_oss")
    prompts = mixed_prompts()[4:7]  # 17, 33 and 60 tokens: past the window of 8
    with make_llm(model_dir, attention_backend="triton", max_num_batched_tokens=32, max_num_seqs=4) as llm:
        assert llm.engine.runner.backend.name == "triton"
        results = run_greedy(llm, prompts)
    for prompt, result in zip(prompts, results):
        expected, expected_lps = hf_greedy(model_dir, prompt, NEW_TOKENS)
        assert result.outputs[0].token_ids == expected
        assert [lp.logprob for lp in result.outputs[0].logprobs] == pytest.approx(expected_lps, abs=1e-4)

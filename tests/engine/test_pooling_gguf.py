"""Pooling models (embeddings) from GGUF files: the embedded SmolLM2 (no model named) served for pooling with its
Q4_1 blocks kept (--quantization gguf) in bfloat16 and float32, and a tiny float GGUF against HF's base model on
the same weights."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine import LLM
from tests.engine.factories import make_tiny_gguf, make_tiny_model_dir
from tests.engine.references import assert_idle, make_llm

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "a",
]


def embedded_vectors(dtype: str) -> list[torch.Tensor]:
    with LLM(
        None,
        dtype=dtype,
        device="cpu",
        runner="pooling",
        quantization="gguf",
        max_model_len=256,
        kv_cache_memory="16MiB",
    ) as llm:
        model = llm.engine.runner.model
        assert model.quantization == "gguf" and model.lm_head is None  # (the tied LM head is never prepared)
        vectors = [torch.tensor(r.outputs.embedding) for r in llm.embed(PROMPTS, use_tqdm=False)]
        assert_idle(llm)
    return vectors


def test_the_embedded_model_embeds_in_bfloat16_and_float32(embedded_checkpoint):
    """Unit vectors of the hidden size; bfloat16's point where float32's do."""
    by_dtype = {dtype: embedded_vectors(dtype) for dtype in ("bfloat16", "float32")}
    for vectors in by_dtype.values():
        assert [v.shape for v in vectors] == [torch.Size([576])] * len(PROMPTS)
        for vector in vectors:
            assert torch.isfinite(vector).all()
            assert abs(float(vector.norm()) - 1.0) < 1e-4
    for half, full in zip(by_dtype["bfloat16"], by_dtype["float32"]):
        assert float(F.cosine_similarity(half, full, dim=0)) > 0.99


@pytest.mark.parametrize("quantization", ["none", "gguf"])
def test_a_float_gguf_embeds_as_hf(tmp_path, quantization):
    """F32 blocks, read as float weights or kept as GGUF blocks: the last token's final hidden state of HF's base
    model on the checkpoint the file was written from, normalized."""
    from transformers import AutoModel

    model_dir = make_tiny_model_dir(tmp_path / "tiny", "llama")
    gguf_path = make_tiny_gguf(model_dir, tmp_path / "tiny.gguf")
    llm = make_llm(gguf_path, runner="pooling", quantization=quantization, max_num_batched_tokens=32)
    assert llm.engine.pooler is not None and llm.engine.runner.model.quantization == quantization
    results = llm.embed(PROMPTS, use_tqdm=False)
    hf = AutoModel.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        for result in results:
            hidden = hf(torch.tensor([result.prompt_token_ids])).last_hidden_state[0, -1]
            torch.testing.assert_close(
                torch.tensor(result.outputs.embedding), F.normalize(hidden, dim=-1), atol=2e-5, rtol=1e-4
            )
    assert len(results[1].prompt_token_ids) > 32  # (chunked)
    assert_idle(llm)

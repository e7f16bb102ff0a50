"""Sequence classification models (rerankers, reward and label models): `LLM.classify` against HF transformers'
`AutoModelForSequenceClassification` on the same tiny random weights (float32): the `score` matrix over the last
token's final hidden state, through softmax (several labels) or sigmoid (one)."""

from __future__ import annotations

import pytest
import torch

from engine.errors import InvalidParameterError
from engine.pooling import PoolingParams
from tests.engine.factories import make_tiny_classifier_dir, make_tiny_embedding_dir
from tests.engine.references import assert_idle, make_llm

PROMPTS = ["hello world, this is a test", "the quick brown fox jumps over the lazy dog " * 8, "a"]


def hf_logits(model_dir, prompts) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with torch.no_grad():
        return [model(tokenizer(p, return_tensors="pt").input_ids).logits[0] for p in prompts]


def probs_of(results) -> list[torch.Tensor]:
    return [torch.tensor(r.outputs.probs) for r in results]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma2"])
def test_classifiers_give_hfs_probabilities(tmp_path, arch):
    model_dir = make_tiny_classifier_dir(tmp_path / arch, arch, num_labels=3)
    llm = make_llm(model_dir, max_num_batched_tokens=32)  # the long prompt in chunks
    pooler = llm.engine.pooler
    assert pooler is not None and pooler.task == "classify" and pooler.labels == ("label_0", "label_1", "label_2")
    assert llm.engine.runner.model.lm_head is None
    results = llm.classify(PROMPTS, use_tqdm=False)
    for got, logits in zip(probs_of(results), hf_logits(model_dir, PROMPTS)):
        torch.testing.assert_close(got, torch.softmax(logits, -1), atol=2e-5, rtol=1e-4)
    raw = llm.classify(PROMPTS, PoolingParams(use_activation=False), use_tqdm=False)
    for got, logits in zip(probs_of(raw), hf_logits(model_dir, PROMPTS)):
        torch.testing.assert_close(got, logits, atol=2e-5, rtol=1e-4)
    assert results[0].outputs.num_classes == 3
    assert_idle(llm)


def test_one_label_is_a_sigmoid_score(tmp_path):
    """A reranker's one logit, through sigmoid: a relevance in (0, 1)."""
    model_dir = make_tiny_classifier_dir(tmp_path / "one", num_labels=1)
    llm = make_llm(model_dir)
    for got, logits in zip(probs_of(llm.classify(PROMPTS, use_tqdm=False)), hf_logits(model_dir, PROMPTS)):
        torch.testing.assert_close(got, torch.sigmoid(logits), atol=2e-5, rtol=1e-4)


def test_what_a_classifier_and_an_embedder_refuse(tmp_path, tiny_llama_dir):
    classifier = make_llm(make_tiny_classifier_dir(tmp_path / "c"))
    with pytest.raises(ValueError, match="does embed: this is a classify model"):
        classifier.embed("hi", use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="dimensions applies to embeddings"):
        classifier.classify("hi", PoolingParams(dimensions=4), use_tqdm=False)
    embedder = make_llm(make_tiny_embedding_dir(tmp_path / "e"))
    with pytest.raises(ValueError, match="does classify: this is a embed model"):
        embedder.classify("hi", use_tqdm=False)
    with pytest.raises(InvalidParameterError, match="use_activation applies to classification"):
        embedder.embed("hi", PoolingParams(use_activation=False), use_tqdm=False)
    with pytest.raises(ValueError, match="needs its classifier, score.weight"):
        make_llm(tiny_llama_dir, convert="classify")
    assert_idle(classifier)
    assert_idle(embedder)

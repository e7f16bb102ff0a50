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


def test_score_with_a_reranker_and_with_an_embedding_model(tmp_path):
    """LLM.score: a one-label classifier scores each pair tokenized together; an embedding model, the cosine of the
    two texts' embeddings; pairs one against many or pairwise, else a refusal naming the field."""
    from transformers import AutoTokenizer

    query, documents = "what does the fox do", ["the quick brown fox jumps", "a lazy dog sleeps", "the fox"]
    reranker_dir = make_tiny_classifier_dir(tmp_path / "r", "qwen3", num_labels=1)
    reranker = make_llm(reranker_dir)
    tokenizer = AutoTokenizer.from_pretrained(reranker_dir)
    pairs = [tokenizer(text=query, text_pair=d)["input_ids"] for d in documents]
    expected = [torch.sigmoid(x)[0] for x in hf_logits_of_ids(reranker_dir, pairs)]
    scored = reranker.score(query, documents, use_tqdm=False)
    assert [r.prompt_token_ids for r in scored] == pairs
    torch.testing.assert_close(
        torch.tensor([r.outputs.score for r in scored]), torch.stack(expected), atol=2e-5, rtol=1e-4
    )
    (cut,) = reranker.score(query, documents[0], truncate_prompt_tokens=5, use_tqdm=False)
    assert cut.prompt_token_ids == pairs[0][:5]  # a pair keeps its first tokens, the query's, as the server's
    pairwise = reranker.score(documents[:2], documents[1:], use_tqdm=False)
    assert len(pairwise) == 2
    with pytest.raises(InvalidParameterError, match="text_2 has 1 texts for 2 text_1"):
        reranker.score(documents[:2], documents[:1], use_tqdm=False)
    with pytest.raises(ValueError, match="one label; this one has 3"):
        make_llm(make_tiny_classifier_dir(tmp_path / "c")).score("a", "b", use_tqdm=False)
    embedder = make_llm(make_tiny_embedding_dir(tmp_path / "e"))
    vectors = {
        t: torch.tensor(r.outputs.embedding)
        for t, r in zip([query, *documents], embedder.embed([query, *documents], use_tqdm=False))
    }
    cosines = [torch.nn.functional.cosine_similarity(vectors[query], vectors[d], dim=0) for d in documents]
    got = [r.outputs.score for r in embedder.score(query, documents, use_tqdm=False)]
    torch.testing.assert_close(torch.tensor(got), torch.stack(cosines), atol=1e-5, rtol=1e-5)
    assert_idle(reranker)
    assert_idle(embedder)


def hf_logits_of_ids(model_dir, encodings) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in encodings]


@pytest.mark.parametrize(
    "num_labels, extra, expected",
    [
        (3, {}, "softmax"),
        (1, {}, "sigmoid"),
        (3, {"problem_type": "multi_label_classification"}, "sigmoid"),
        (3, {"problem_type": "regression"}, None),
        (1, {"problem_type": "regression"}, None),
        (1, {"problem_type": "single_label_classification"}, "sigmoid"),  # (softmax over one label: always 1)
        (1, {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Softmax"}}, "sigmoid"),
        (1, {"sentence_transformers": {"activation_fn": "torch.nn.modules.linear.Identity"}}, None),
        (3, {"sentence_transformers": {"activation_fn": "torch.nn.modules.activation.Sigmoid"}}, "sigmoid"),
    ],
)
def test_a_classifiers_activation(tmp_path, num_labels, extra, expected):
    """vLLM's choice of activation: problem_type's, or a CrossEncoder's activation_fn; one label is never put
    through a softmax (a constant 1), but through a sigmoid, as vLLM's PoolerClassify does."""
    from types import SimpleNamespace

    from engine.pooling.pooler_config import model_pooler

    config = SimpleNamespace(
        **{"hidden_size": 8, "num_labels": num_labels, "id2label": {}, "problem_type": None, **extra}
    )
    assert model_pooler(config, tmp_path, None, task="classify").activation == expected

"""POST /classify, and /score and /rerank with a one-label classifier (a cross-encoder reranker), on a real server:
the probabilities and scores HF transformers' `AutoModelForSequenceClassification` gives on the same tiny random
weights (float32), a pair tokenized together as the tokenizer joins a text pair."""

from __future__ import annotations

import shlex
from urllib.parse import urlsplit

import pytest
import torch

from server.cli import ready_message
from server.config.server_config import ServerConfig
from tests.engine.factories import make_tiny_classifier_dir
from tests.server.conftest import serving

TEXTS = ["hello world, this is a test", "the quick brown fox jumps over the lazy dog"]
QUERY = "what does the fox do"
DOCUMENTS = ["the quick brown fox jumps", "a lazy dog sleeps all day", "the fox", "numbers 1 2 3 4 5"]


def hf_logits(model_dir, encodings) -> list[torch.Tensor]:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [model(torch.tensor([ids])).logits[0] for ids in encodings]


@pytest.fixture(scope="module")
def labeller_dir(tmp_path_factory):
    return make_tiny_classifier_dir(tmp_path_factory.mktemp("labels"), num_labels=3)


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory):
    return make_tiny_classifier_dir(tmp_path_factory.mktemp("reranker"), "qwen3", num_labels=1)


@pytest.fixture(scope="module")
def labeller(labeller_dir):
    with serving(labeller_dir, ServerConfig(served_model_name="tiny-labels")) as running:
        yield running


@pytest.fixture(scope="module")
def reranker(reranker_dir):
    with serving(reranker_dir, ServerConfig(served_model_name="tiny-reranker")) as running:
        yield running


def test_classify_gives_hfs_probabilities_and_the_best_label(labeller, labeller_dir):
    tokenizer = labeller.engine.tokenizer
    expected = [torch.softmax(x, -1) for x in hf_logits(labeller_dir, [tokenizer.encode(t) for t in TEXTS])]
    with labeller.client() as client:
        body = client.post("/classify", json={"input": TEXTS}).json()
        raw = client.post("/v1/classify", json={"input": TEXTS[0], "use_activation": False}).json()
        refused = client.post("/v1/embeddings", json={"input": "x"})
    assert body["object"] == "list" and body["model"] == "tiny-labels"
    for data, probs in zip(body["data"], expected):
        torch.testing.assert_close(torch.tensor(data["probs"]), probs, atol=2e-5, rtol=1e-4)
        assert data["num_classes"] == 3 and data["label"] == f"label_{int(probs.argmax())}"
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in TEXTS)
    logits = hf_logits(labeller_dir, [tokenizer.encode(TEXTS[0])])[0]
    torch.testing.assert_close(torch.tensor(raw["data"][0]["probs"]), logits, atol=2e-5, rtol=1e-4)
    assert refused.status_code == 400 and "a pooling model that does classify" in refused.json()["error"]["message"]
    with labeller.client() as client:  # several labels: no relevance score to rank by
        response = client.post("/rerank", json={"query": QUERY, "documents": DOCUMENTS})
    assert response.status_code == 400 and response.json()["error"]["param"] == "model"
    labeller.wait_idle()


def test_the_pooling_api_gives_a_classifiers_probabilities(labeller, labeller_dir):
    """vLLM's POST /pooling on a classification model: each input's class probabilities (raw logits with
    use_activation false), as /classify gives them."""
    tokenizer = labeller.engine.tokenizer
    logits = hf_logits(labeller_dir, [tokenizer.encode(t) for t in TEXTS])
    with labeller.client() as client:
        body = client.post("/pooling", json={"input": TEXTS, "encoding_format": "float"}).json()
        raw = client.post("/pooling", json={"input": TEXTS[0], "use_activation": False}).json()
        refused = client.post("/pooling", json={"input": TEXTS[0], "dimensions": 2})
    assert [d["object"] for d in body["data"]] == ["pooling", "pooling"]
    for data, expected in zip(body["data"], logits):
        torch.testing.assert_close(torch.tensor(data["data"]), torch.softmax(expected, -1), atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.tensor(raw["data"][0]["data"]), logits[0], atol=1e-5, rtol=1e-4)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "dimensions"
    labeller.wait_idle()


def test_a_reranker_scores_pairs_as_hf(reranker, reranker_dir):
    hf_tokenizer = reranker.engine.tokenizer.hf
    pairs = [hf_tokenizer(text=QUERY, text_pair=d)["input_ids"] for d in DOCUMENTS]
    expected = [float(torch.sigmoid(x)[0]) for x in hf_logits(reranker_dir, pairs)]
    with reranker.client() as client:
        scored = client.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS}).json()
        ranked = client.post("/v1/rerank", json={"query": QUERY, "documents": DOCUMENTS, "top_n": 3}).json()
    assert [d["score"] for d in scored["data"]] == pytest.approx(expected, abs=1e-5)
    assert scored["usage"]["prompt_tokens"] == sum(len(p) for p in pairs)
    with reranker.client() as client:  # a pair cut to its first tokens: the query's are kept
        cut = client.post("/score", json={"text_1": QUERY, "text_2": DOCUMENTS[0], "truncate_prompt_tokens": 5})
    assert cut.json()["usage"]["prompt_tokens"] == 5
    expected_cut = float(torch.sigmoid(hf_logits(reranker_dir, [pairs[0][:5]])[0])[0])
    assert cut.json()["data"][0]["score"] == pytest.approx(expected_cut, abs=1e-5)
    order = sorted(range(len(DOCUMENTS)), key=lambda i: -expected[i])[:3]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx([expected[i] for i in order], abs=1e-5)
    reranker.wait_idle()


def test_classify_on_an_embedding_or_generative_model_is_refused(server):
    with server.client() as client:
        response = client.post("/classify", json={"input": "x"})
    assert response.status_code == 400
    assert "does not support the Classification API: it is served for generation" in response.json()["error"]["message"]


def test_the_start_up_curl_line_of_a_classifier_classifies(labeller):
    """A classifier refuses embeddings: the ready message's line asks /classify, and the server answers it."""
    url = urlsplit(labeller.base_url)
    assert url.hostname is not None and url.port is not None
    message = ready_message(url.hostname, url.port, "tiny-labels", False, pooling="classify")
    curl = shlex.split(message.splitlines()[-1])
    with labeller.client() as client:
        response = client.post(
            curl[1], content=curl[curl.index("-d") + 1], headers={"Content-Type": "application/json"}
        )
    assert response.status_code == 200, response.text
    assert response.json()["data"][0]["num_classes"] == 3
    labeller.wait_idle()

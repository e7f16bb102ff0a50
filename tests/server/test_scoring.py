"""POST /score and /rerank (also /v1/score, /v1/rerank, /v2/rerank) on a real server serving a pooling model: each
pair's score is the cosine of the offline engine's embeddings of its two texts, a rerank orders the documents by
it; errors name their field, the routes need the API key, and a generative model refuses them."""

from __future__ import annotations

import httpx
import numpy as np
import pytest

from server.config.server_config import ServerConfig
from tests.engine.factories import make_tiny_embedding_dir
from tests.engine.references import make_llm
from tests.server.conftest import serving

QUERY = "what does the fox do"
DOCUMENTS = ["the quick brown fox jumps", "a lazy dog sleeps all day", "the fox", "numbers 1 2 3 4 5"]
KEY = "k-score-7Qx2"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_embedding_dir(tmp_path_factory.mktemp("score"))


@pytest.fixture(scope="module")
def scorer(model_dir):
    with serving(model_dir, ServerConfig(served_model_name="tiny-embed", api_keys=[KEY])) as running:
        yield running


@pytest.fixture(scope="module")
def vectors(model_dir):
    llm = make_llm(model_dir)
    texts = [QUERY, *DOCUMENTS]
    return {
        t: np.asarray(r.outputs.embedding, dtype=np.float64) for t, r in zip(texts, llm.embed(texts, use_tqdm=False))
    }


def cosine(a, b) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def post(server, path, body, key=KEY):
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    with httpx.Client(base_url=server.base_url, headers=headers, timeout=60) as client:
        return client.post(path, json=body)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
def test_one_text_against_many_and_pairwise(scorer, vectors, path):
    body = post(scorer, path, {"text_1": QUERY, "text_2": DOCUMENTS}).json()
    assert body["object"] == "list" and body["model"] == "tiny-embed"
    assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
    expected = [cosine(vectors[QUERY], vectors[d]) for d in DOCUMENTS]
    np.testing.assert_allclose([d["score"] for d in body["data"]], expected, atol=1e-5)
    tokenizer = scorer.engine.tokenizer
    assert body["usage"]["prompt_tokens"] == sum(len(tokenizer.encode(t)) for t in [QUERY, *DOCUMENTS])  # each once
    pairwise = post(scorer, path, {"text_1": DOCUMENTS[:2], "text_2": DOCUMENTS[2:]}).json()
    expected = [
        cosine(vectors[DOCUMENTS[0]], vectors[DOCUMENTS[2]]),
        cosine(vectors[DOCUMENTS[1]], vectors[DOCUMENTS[3]]),
    ]
    np.testing.assert_allclose([d["score"] for d in pairwise["data"]], expected, atol=1e-5)
    scorer.wait_idle()


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_their_score(scorer, vectors, path):
    scores = {i: cosine(vectors[QUERY], vectors[d]) for i, d in enumerate(DOCUMENTS)}
    order = sorted(scores, key=lambda i: -scores[i])
    body = post(scorer, path, {"query": QUERY, "documents": DOCUMENTS}).json()
    assert body["id"].startswith("rerank-") and body["model"] == "tiny-embed"  # (vLLM's prefix)
    assert [r["index"] for r in body["results"]] == order
    for result in body["results"]:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert result["relevance_score"] == pytest.approx(scores[result["index"]], abs=1e-5)
    top = post(scorer, path, {"query": QUERY, "documents": DOCUMENTS, "top_n": 2, "return_documents": False}).json()
    assert [r["index"] for r in top["results"]] == order[:2]
    assert all(r.get("document") is None for r in top["results"])
    as_objects = post(scorer, path, {"query": QUERY, "documents": [{"text": d} for d in DOCUMENTS]}).json()
    assert [r["index"] for r in as_objects["results"]] == order
    scorer.wait_idle()


@pytest.mark.parametrize(
    "path,body,param",
    [
        ("/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
        ("/score", {"text_1": [], "text_2": "x"}, "text_1"),
        ("/score", {"text_1": "x", "text_2": ""}, "text_2"),
        ("/score", {"text_1": "x"}, "text_2"),
        ("/rerank", {"query": "q", "documents": []}, "documents"),
        ("/rerank", {"query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
        ("/rerank", {"query": "q", "documents": ["d"], "model": "nope"}, "model"),
        ("/rerank", {"query": "q", "documents": ["d " * 400]}, "documents"),
    ],
)
def test_bad_requests_name_their_field(scorer, path, body, param):
    response = post(scorer, path, body)
    assert response.status_code == (404 if param == "model" else 400), response.text
    assert param in (response.json()["error"]["param"] or ""), response.json()
    scorer.wait_idle()


@pytest.mark.parametrize("path", ["/score", "/rerank", "/v2/rerank", "/v1/embeddings"])
def test_the_routes_need_the_api_key(scorer, path):
    body = {"text_1": "a", "text_2": "b"} if path == "/score" else {"query": "a", "documents": ["b"]}
    if path == "/v1/embeddings":
        body = {"input": "a"}
    assert post(scorer, path, body, key=None).status_code == 401
    assert post(scorer, path, body).status_code == 200
    scorer.wait_idle()


def test_a_generative_model_refuses_scoring(server):
    with server.client() as client:
        response = client.post("/rerank", json={"query": "q", "documents": ["d"]})
    assert response.status_code == 400
    assert "does not support the Score API" in response.json()["error"]["message"]

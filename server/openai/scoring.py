"""POST /score and POST /rerank (vLLM's scoring API, and the Jina / Cohere rerank shape), for a model served for
pooling: a pair's score is the cosine similarity of the two texts' embeddings, as vLLM scores with an embedding
model. Each distinct text is embedded once, through the serving pipeline, as /v1/embeddings embeds it."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.pooling.params import PoolingParams
from server.http.errors import ERROR_RESPONSES, bad_request
from server.openai.protocol import new_id, now
from server.serving.pipeline import Generation, PoolingRequest, start_pooling
from server.serving.prompts import TextPrompts
from server.state import ServerState

router = APIRouter()


class _ScoringFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: each text keeps its last tokens
    priority: int = 0
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None


class ScoreRequest(_ScoringFields):
    """vLLM's: `text_1` against each of `text_2` (one against many), or pairwise (two lists of one length)."""

    text_1: Union[str, list[str]]
    text_2: Union[str, list[str]]


class RerankDocument(BaseModel):
    model_config = ConfigDict(extra="allow")

    text: str


class RerankRequest(_ScoringFields):
    """Jina's and Cohere's rerank, as vLLM takes it: `documents` ordered by relevance to `query`, the best
    `top_n` (0 or none: all)."""

    query: str
    documents: list[Union[str, RerankDocument]]
    top_n: Optional[int] = None
    return_documents: bool = True


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: ScoreUsage


class RerankResult(BaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rerank"))
    model: str
    usage: ScoreUsage
    results: list[RerankResult]


@router.post("/score", response_model=ScoreResponse, responses=ERROR_RESPONSES)
@router.post("/v1/score", response_model=ScoreResponse, responses=ERROR_RESPONSES, include_in_schema=False)
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    arrival_time = time.monotonic()
    firsts = [body.text_1] if isinstance(body.text_1, str) else body.text_1
    seconds = [body.text_2] if isinstance(body.text_2, str) else body.text_2
    if not firsts or not seconds:
        raise bad_request("text_1 and text_2 must not be empty.", param="text_1" if not firsts else "text_2")
    if len(firsts) > 1 and len(firsts) != len(seconds):
        raise bad_request(
            f"text_1 has {len(firsts)} texts and text_2 {len(seconds)}: give one text_1, or as many as text_2.",
            param="text_2",
        )
    pairs = [(firsts[0] if len(firsts) == 1 else firsts[i], second) for i, second in enumerate(seconds)]
    texts = [text for pair in pairs for text in pair]
    generation, vectors = await _embed(request, body, texts, "text_2", arrival_time)
    data = [ScoreData(index=i, score=_cosine(vectors[a], vectors[b])) for i, (a, b) in enumerate(pairs)]
    return ScoreResponse(id=generation.request_id, model=generation.model, data=data, usage=_usage(generation))


@router.post("/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES)
@router.post("/v1/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES, include_in_schema=False)
@router.post("/v2/rerank", response_model=RerankResponse, responses=ERROR_RESPONSES, include_in_schema=False)
async def rerank(body: RerankRequest, request: Request) -> RerankResponse:
    arrival_time = time.monotonic()
    if not body.documents:
        raise bad_request("documents must not be empty.", param="documents")
    if body.top_n is not None and body.top_n < 0:
        raise bad_request(f"top_n must be 0 (all) or more, got {body.top_n}.", param="top_n")
    documents = [d if isinstance(d, RerankDocument) else RerankDocument(text=d) for d in body.documents]
    texts = [body.query, *(d.text for d in documents)]
    generation, vectors = await _embed(request, body, texts, "documents", arrival_time)
    scores = [_cosine(vectors[body.query], vectors[d.text]) for d in documents]
    order = sorted(range(len(documents)), key=lambda i: -scores[i])  # (stable: equal scores keep their order)
    if body.top_n:
        order = order[: body.top_n]
    results = [
        RerankResult(index=i, document=documents[i] if body.return_documents else None, relevance_score=scores[i])
        for i in order
    ]
    return RerankResponse(id=generation.request_id, model=generation.model, usage=_usage(generation), results=results)


async def _embed(
    request: Request, body: _ScoringFields, texts: list[str], param: str, arrival_time: float
) -> tuple[Generation, dict[str, np.ndarray]]:
    """Every distinct text's embedding, through the pooling pipeline (`param`: the field its errors name)."""
    state: ServerState = request.app.state.server
    distinct = list(dict.fromkeys(texts))
    generation = await start_pooling(
        state,
        PoolingRequest(
            body=body,
            model=body.model,
            request_id=body.request_id or new_id("score"),
            prompt=TextPrompts(distinct, param=param, truncate_prompt_tokens=body.truncate_prompt_tokens),
            params=PoolingParams(),
            priority=body.priority,
            cache_salt=body.cache_salt,
            field_names={"prompt": param},
            api="Score API",
        ),
        arrival_time,
    )
    results = await generation.collect(request)
    return generation, {text: np.asarray(result.embedding, dtype=np.float64) for text, result in zip(distinct, results)}


def _cosine(a: np.ndarray, b: np.ndarray) -> float:
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(a @ b) / norms if norms else 0.0


def _usage(generation: Generation) -> ScoreUsage:
    num_tokens = sum(len(prompt) for prompt in generation.prompts)
    return ScoreUsage(prompt_tokens=num_tokens, total_tokens=num_tokens)

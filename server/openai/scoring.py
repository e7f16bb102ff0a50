"""POST /score and POST /rerank (vLLM's scoring API, and the Jina / Cohere rerank shape), for a model served for
pooling, scored as vLLM scores: with an embedding model, a pair's score is the cosine similarity of the two
texts' embeddings (each distinct text embedded once); with a one-label classifier (a cross-encoder reranker), the
classifier's score of the pair tokenized together as the tokenizer joins a text pair. Either way through the
serving pipeline, as /v1/embeddings goes."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.outputs import OutputAccumulator
from engine.errors import RequestRejectedError
from engine.pooling.params import PoolingParams
from engine.pooling.scoring import cosine, pair_up
from server.http.errors import ERROR_RESPONSES, bad_request, rejection_error
from server.openai.protocol import PoolingUsage, new_id, now
from server.serving.pipeline import Generation, PoolingRequest, start_pooling
from server.serving.prompts import PairPrompts, Prompt, TextPrompts
from server.state import ServerState

router = APIRouter()


class _ScoringFields(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: each text (or pair) keeps its last tokens
    use_activation: Optional[bool] = None  # a classifier's: false scores with its raw logit
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


class ScoreResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("score"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ScoreData]
    usage: PoolingUsage


class RerankResult(BaseModel):
    index: int
    document: Optional[RerankDocument] = None
    relevance_score: float


class RerankResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("rerank"))
    model: str
    usage: PoolingUsage
    results: list[RerankResult]


@router.post("/score", response_model=ScoreResponse, responses=ERROR_RESPONSES)
@router.post("/v1/score", response_model=ScoreResponse, responses=ERROR_RESPONSES, include_in_schema=False)
async def score(body: ScoreRequest, request: Request) -> ScoreResponse:
    arrival_time = time.monotonic()
    try:
        pairs = pair_up(body.text_1, body.text_2)
    except RequestRejectedError as exc:
        raise rejection_error(exc) from None
    generation, scores = await _scores(request, body, pairs, "text_2", "score", arrival_time)
    data = [ScoreData(index=i, score=value) for i, value in enumerate(scores)]
    return ScoreResponse(
        id=generation.request_id, model=generation.model, data=data, usage=PoolingUsage.of(generation.num_prompt_tokens)
    )


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
    pairs = [(body.query, d.text) for d in documents]
    generation, scores = await _scores(request, body, pairs, "documents", "rerank", arrival_time)
    order = sorted(range(len(documents)), key=lambda i: -scores[i])  # (stable: equal scores keep their order)
    if body.top_n:
        order = order[: body.top_n]
    results = [
        RerankResult(index=i, document=documents[i] if body.return_documents else None, relevance_score=scores[i])
        for i in order
    ]
    return RerankResponse(
        id=generation.request_id,
        model=generation.model,
        usage=PoolingUsage.of(generation.num_prompt_tokens),
        results=results,
    )


async def _scores(
    request: Request, body: _ScoringFields, pairs: list[tuple[str, str]], param: str, kind: str, arrival_time: float
) -> tuple[Generation, list[float]]:
    """Each pair's score, by the model's kind (`param`: the field the errors name; `kind`: "score" or "rerank",
    the request id's prefix)."""
    state: ServerState = request.app.state.server
    pooler = state.engine.pooler
    if pooler is not None and pooler.task == "classify":
        if len(pooler.labels) != 1:
            raise bad_request(
                f"scoring takes a classifier with one label (a relevance score); this one has {len(pooler.labels)}.",
                param="model",
            )
        joined = PairPrompts(pairs, param, body.truncate_prompt_tokens)
        generation, results = await _pool(request, body, joined, param, kind, arrival_time)
        return generation, [(result.embedding or [0.0])[0] for result in results]
    if body.use_activation is not None:
        raise bad_request(
            "use_activation applies to a classifier's scores, not an embedding model's.", param="use_activation"
        )
    distinct = list(dict.fromkeys(text for pair in pairs for text in pair))
    texts = TextPrompts(distinct, param=param, truncate_prompt_tokens=body.truncate_prompt_tokens)
    generation, results = await _pool(request, body, texts, param, kind, arrival_time)
    vectors = {text: result.embedding or [] for text, result in zip(distinct, results)}
    return generation, [cosine(vectors[a], vectors[b]) for a, b in pairs]


async def _pool(
    request: Request,
    body: _ScoringFields,
    prompt: Prompt,
    param: str,
    kind: str,
    arrival_time: float,
) -> tuple[Generation, list[OutputAccumulator]]:
    generation = await start_pooling(
        request.app.state.server,
        PoolingRequest(
            body=body,
            model=body.model,
            request_id=body.request_id or new_id(kind),
            prompt=prompt,
            params=PoolingParams(use_activation=body.use_activation),
            priority=body.priority,
            cache_salt=body.cache_salt,
            field_names={"prompt": param},
            api="Score API",
            tasks=("embed", "classify"),
        ),
        arrival_time,
    )
    return generation, await generation.collect(request)

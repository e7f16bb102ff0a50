"""POST /classify (vLLM's): a sequence classification model's class probabilities for each input, through the
serving pipeline as /v1/embeddings goes."""

from __future__ import annotations

import time
from typing import Literal, Optional, Union

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import RequestRejectedError
from engine.pooling.params import PoolingParams
from server.http.errors import ERROR_RESPONSES, rejection_error
from server.openai.protocol import PoolingUsage, new_id, now
from server.serving.pipeline import PoolingRequest, start_pooling
from server.serving.prompts import TextPrompts
from server.state import ServerState

router = APIRouter()


class ClassificationRequest(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    input: Union[str, list[str], list[int], list[list[int]]]
    user: Optional[str] = None
    # vLLM extras
    use_activation: Optional[bool] = None  # false: the raw logits
    add_special_tokens: bool = True
    truncate_prompt_tokens: Optional[int] = None
    priority: int = 0
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None


class ClassificationData(BaseModel):
    index: int
    label: Optional[str]
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("classify"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[ClassificationData]
    usage: PoolingUsage


@router.post("/classify", response_model=ClassificationResponse, responses=ERROR_RESPONSES)
@router.post("/v1/classify", response_model=ClassificationResponse, responses=ERROR_RESPONSES, include_in_schema=False)
async def classify(body: ClassificationRequest, request: Request) -> ClassificationResponse:
    arrival_time = time.monotonic()
    state: ServerState = request.app.state.server
    try:
        params = PoolingParams(use_activation=body.use_activation)
    except RequestRejectedError as exc:
        raise rejection_error(exc) from None
    generation = await start_pooling(
        state,
        PoolingRequest(
            body=body,
            model=body.model,
            request_id=body.request_id or new_id("classify"),
            prompt=TextPrompts(
                body.input,
                param="input",
                add_special_tokens=body.add_special_tokens,
                truncate_prompt_tokens=body.truncate_prompt_tokens,
            ),
            params=params,
            priority=body.priority,
            cache_salt=body.cache_salt,
            field_names={"prompt": "input"},
            api="Classification API",
            tasks=("classify",),
        ),
        arrival_time,
    )
    results = await generation.collect(request)
    pooler = state.engine.pooler
    labels = pooler.labels if pooler is not None else ()
    data = []
    for choice, result in zip(generation.choices, results):
        probs = result.embedding or []
        best = max(range(len(probs)), key=probs.__getitem__) if probs else None
        label = labels[best] if best is not None and best < len(labels) else None
        data.append(ClassificationData(index=choice.index, label=label, probs=probs, num_classes=len(probs)))
    return ClassificationResponse(
        id=generation.request_id,
        model=generation.model,
        data=data,
        usage=PoolingUsage.of(generation.num_prompt_tokens),
    )

"""POST /v1/embeddings: OpenAI's embeddings protocol (and vLLM's chat-style `messages` input) in and out of the
serving pipeline, for a model served for pooling."""

from __future__ import annotations

import base64
import time
from typing import Any, Literal, Optional, Union

import numpy as np
from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field

from engine.errors import RequestRejectedError
from engine.pooling.params import PoolingParams
from server.http.errors import ERROR_RESPONSES, bad_request, rejection_error
from server.openai.protocol import ChatMessage, PoolingUsage, new_id, now
from server.serving.pipeline import PoolingRequest, start_pooling
from server.serving.prompts import ChatPrompt, Prompt, TextPrompts
from server.state import ServerState

router = APIRouter()

# vLLM's byte orders of a base64 embedding ("native": this machine's)
_BYTE_ORDERS = {"native": "=", "little": "<", "big": ">"}


class EmbeddingRequest(BaseModel):
    """OpenAI's embeddings request, with vLLM's extras; `messages` (vLLM's chat embeddings) in place of `input`
    renders a conversation by the chat template first."""

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    input: Optional[Union[str, list[str], list[int], list[list[int]]]] = None
    encoding_format: Optional[Literal["float", "base64"]] = None  # None: float
    dimensions: Optional[int] = None
    user: Optional[str] = None
    # vLLM extras
    messages: Optional[list[ChatMessage]] = None
    add_generation_prompt: bool = False  # (vLLM's chat-embedding default: the conversation as it stands)
    continue_final_message: bool = False
    chat_template: Optional[str] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    add_special_tokens: Optional[bool] = None  # None: true for input, false for messages (the template writes them)
    truncate_prompt_tokens: Optional[int] = None
    normalize: Optional[bool] = None
    priority: int = 0
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    embed_dtype: Literal["float32"] = "float32"  # (vLLM's other storage types are not served)
    endianness: Literal["native", "little", "big"] = "native"


class EmbeddingData(BaseModel):
    index: int
    object: Literal["embedding"] = "embedding"
    embedding: Union[list[float], str]


class EmbeddingResponse(BaseModel):
    id: str = Field(default_factory=lambda: new_id("embd"))
    object: Literal["list"] = "list"
    created: int = Field(default_factory=now)
    model: str
    data: list[EmbeddingData]
    usage: PoolingUsage


@router.post("/v1/embeddings", response_model=EmbeddingResponse, responses=ERROR_RESPONSES)
async def create_embeddings(body: EmbeddingRequest, request: Request) -> EmbeddingResponse:
    generation, vectors = await pool_inputs(body, request, "embd")
    data = [EmbeddingData(index=i, embedding=encoded(vector, body)) for i, vector in vectors]
    return EmbeddingResponse(
        id=generation.request_id,
        model=generation.model,
        data=data,
        usage=PoolingUsage.of(generation.num_prompt_tokens),
    )


async def pool_inputs(
    body: EmbeddingRequest,
    request: Request,
    id_prefix: str,
    api: str = "Embeddings API",
    tasks: tuple[str, ...] = ("embed",),
    **settings: Any,
) -> tuple[Any, list[tuple[int, list[float]]]]:
    """An `EmbeddingRequest`-shaped body's inputs through the serving pipeline (/v1/embeddings', /pooling's):
    the generation and each choice's (index, pooled vector). `settings`: the request's PoolingParams fields
    beyond dimensions and normalize (a 400 naming a bad one)."""
    arrival_time = time.monotonic()
    state: ServerState = request.app.state.server
    try:
        params = PoolingParams(dimensions=body.dimensions, normalize=body.normalize, **settings)
    except RequestRejectedError as exc:
        raise rejection_error(exc) from None
    generation = await start_pooling(
        state,
        PoolingRequest(
            body=body,
            model=body.model,
            request_id=body.request_id or new_id(id_prefix),
            prompt=prompt_of(body),
            params=params,
            priority=body.priority,
            cache_salt=body.cache_salt,
            field_names={"prompt": "messages" if body.messages is not None else "input"},
            api=api,
            tasks=tasks,
        ),
        arrival_time,
    )
    results = await generation.collect(request)
    vectors = []
    for choice, result in zip(generation.choices, results):
        assert result.embedding is not None  # (a request that failed raised in collect)
        vectors.append((choice.index, result.embedding))
    return generation, vectors


def prompt_of(body: EmbeddingRequest) -> Prompt:
    if (body.input is None) == (body.messages is None):
        raise bad_request("give exactly one of input or messages.", param="input")
    if body.messages is not None:
        return ChatPrompt(
            body.messages,
            body.add_generation_prompt,
            add_special_tokens=bool(body.add_special_tokens),
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            truncate_prompt_tokens=body.truncate_prompt_tokens,
            chat_template=body.chat_template,
        )
    assert body.input is not None
    return TextPrompts(
        body.input,
        param="input",
        add_special_tokens=body.add_special_tokens is not False,
        truncate_prompt_tokens=body.truncate_prompt_tokens,
    )


def encoded(embedding: list[float], body: EmbeddingRequest) -> Union[list[float], str]:
    """The vector as asked: a list of floats, or base64 of its float32 bytes (what the OpenAI SDKs ask for and
    decode), in `endianness` byte order."""
    if body.encoding_format != "base64":
        return embedding
    return base64.b64encode(np.asarray(embedding, dtype=_BYTE_ORDERS[body.endianness] + "f4").tobytes()).decode()

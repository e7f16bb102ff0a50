"""GET /v1/models and GET /v1/models/{model}: the served model, then its LoRA adapters (with --enable-lora).

An adapter's card says where it comes from as vLLM's does: `root` is its directory, `parent` the base model
id (its --lora-modules base_model_name when given)."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.http.errors import ERROR_RESPONSES, model_not_found
from server.openai.protocol import ModelCard, ModelList, now
from server.state import ServerState

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    state: ServerState = request.app.state.server
    return ModelList(data=[_card(state, name) for name in state.model_ids])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """One served model or adapter (ids may hold a slash, as hub ids do); 404 in OpenAI's envelope for any other id."""
    state: ServerState = request.app.state.server
    if model not in state.model_ids:
        raise model_not_found(model, state.model_ids)
    return _card(state, model)


def _card(state: ServerState, name: str) -> ModelCard:
    adapter = state.adapters.card(name) if state.adapters is not None else None
    if adapter is not None:
        return ModelCard(
            id=name, created=now(), root=adapter.path, parent=adapter.parent, max_model_len=state.max_model_len
        )
    return ModelCard(id=name, created=now(), root=state.engine.model_source, max_model_len=state.max_model_len)

"""GET /v1/models and GET /v1/models/{model}."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.http.errors import ERROR_RESPONSES, APIError
from server.openai.protocol import ModelCard, ModelList, now
from server.state import ServerState

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    state: ServerState = request.app.state.server
    return ModelList(data=[_card(state, name) for name in state.served_model_names])


@router.get("/v1/models/{model:path}", response_model=ModelCard, responses=ERROR_RESPONSES)
async def retrieve_model(model: str, request: Request) -> ModelCard:
    """One served model (ids may hold a slash, as hub ids do); 404 in OpenAI's envelope for any other id."""
    state: ServerState = request.app.state.server
    if model not in state.served_model_names:
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {', '.join(map(repr, state.served_model_names))}.",
            param="model",
            code="model_not_found",
        )
    return _card(state, model)


def _card(state: ServerState, name: str) -> ModelCard:
    return ModelCard(id=name, created=now(), root=state.engine.model_name, max_model_len=state.max_model_len)

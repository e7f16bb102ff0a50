"""GET /v1/models."""

from __future__ import annotations

from fastapi import APIRouter, Request

from server.errors import ERROR_RESPONSES
from server.protocol import ModelCard, ModelList, now
from server.state import ServerState

router = APIRouter()


@router.get("/v1/models", response_model=ModelList, responses=ERROR_RESPONSES)
async def list_models(request: Request) -> ModelList:
    state: ServerState = request.app.state.server
    root = state.engine.model_name
    return ModelList(data=[ModelCard(id=name, created=now(), root=root, max_model_len=state.max_model_len)
                           for name in state.served_model_names])

"""The Responses API's endpoints on a stored response (`GET`/`DELETE /v1/responses/{id}`, `.../cancel`,
`.../input_items`): this server keeps none (`store` is answered false), so each is OpenAI's 404 for an id it does
not know, saying why, as vLLM answers them without its response store; not the bare 404 of a path never routed."""

from __future__ import annotations

from fastapi import APIRouter

from server.http.errors import ERROR_RESPONSES, APIError

router = APIRouter()


@router.get("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def retrieve_response(response_id: str):
    raise not_stored(response_id)


@router.delete("/v1/responses/{response_id}", responses=ERROR_RESPONSES)
async def delete_response(response_id: str):
    raise not_stored(response_id)


@router.post("/v1/responses/{response_id}/cancel", responses=ERROR_RESPONSES)
async def cancel_response(response_id: str):
    raise not_stored(response_id)


@router.get("/v1/responses/{response_id}/input_items", responses=ERROR_RESPONSES)
async def list_input_items(response_id: str):
    raise not_stored(response_id)


def not_stored(response_id: str) -> APIError:
    return APIError(
        404,
        f"Response with id {response_id!r} not found: this server is stateless and stores no responses "
        "(store is answered false).",
        param="response_id",
    )

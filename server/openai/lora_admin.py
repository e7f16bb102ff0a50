"""POST /v1/load_lora_adapter and /v1/unload_lora_adapter: vLLM's run-time adapter endpoints, bodies and replies.

Mounted only with --enable-lora and --allow-runtime-lora-updating (or VLLM_ALLOW_RUNTIME_LORA_UPDATING=true):
without them the paths are a 404, as in vLLM. Under /v1/, so behind the API key like every other route there.
"""

from __future__ import annotations

from typing import Any, Optional, Union

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict, Field

from server.http.errors import ERROR_RESPONSES, APIError, bad_request
from server.state import ServerState

router = APIRouter()


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False  # vLLM's: replace an adapter of that name (refused here: unload, then load)


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    lora_name: str = Field(min_length=1)
    lora_int_id: Optional[int] = None  # vLLM's internal id: adapters are named here, so only None is taken


_SUCCESS: dict[Union[int, str], dict[str, Any]] = {
    200: {"description": "Success (a line of text, as vLLM answers)", "content": {"text/plain": {}}}
}


@router.post("/v1/load_lora_adapter", response_class=PlainTextResponse, responses={**_SUCCESS, **ERROR_RESPONSES})
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Load a PEFT adapter directory or a llama.cpp `.gguf` adapter under a name that requests may then send
    as their `model`."""
    adapters = _adapters(request)
    if body.load_inplace:
        raise bad_request(
            "load_inplace is not supported: unload the adapter, then load it again.",
            param="load_inplace",
            code="unsupported_parameter",
        )
    await adapters.load(body.lora_name, body.lora_path)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")


@router.post("/v1/unload_lora_adapter", response_class=PlainTextResponse, responses={**_SUCCESS, **ERROR_RESPONSES})
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """Stop serving an adapter: later requests naming it get a 404; those already running finish."""
    adapters = _adapters(request)
    if body.lora_int_id is not None:
        raise bad_request(
            "lora_int_id is not supported: adapters are unloaded by lora_name.",
            param="lora_int_id",
            code="unsupported_parameter",
        )
    adapters.unload(body.lora_name)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")


def _adapters(request: Request):
    state: ServerState = request.app.state.server
    if state.adapters is None:  # mounted only with --enable-lora: never here
        raise APIError(404, "Not Found")
    if state.draining or not state.engine.is_alive:
        raise APIError(503, "the server is shutting down" if state.draining else "the engine is not running")
    return state.adapters

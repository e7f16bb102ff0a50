"""POST /tokenize and POST /detokenize (vLLM's extras)."""

from __future__ import annotations

import asyncio
from typing import Mapping

from fastapi import APIRouter, Request
from pydantic import BaseModel

from engine.text.tokenizer import check_token_ids

from server.http.errors import ERROR_RESPONSES, bad_request
from server.serving.checks import check_extra_fields, check_model
from server.serving.unsupported import VLLM_EXTRAS, Unsupported, refuse_unsupported
from server.openai.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from server.serving.prompts import ChatPrompt
from server.openai.tools.calls import plan_tools
from server.state import ServerState

router = APIRouter()


@router.post("/tokenize", response_model=TokenizeResponse, responses=ERROR_RESPONSES)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state: ServerState = request.app.state.server
    check_model(body.model, state.model_ids)
    _check_fields(body, state, {})
    if (body.prompt is None) == (body.messages is None):
        raise bad_request("give exactly one of prompt or messages.", param="prompt")
    if body.tools is not None and body.messages is None:
        raise bad_request("tools are shown to a chat template: give messages.", param="tools")
    tokenizer = state.tokenizer  # large texts: tokenized off the event loop
    if body.prompt is not None:
        tokens = await asyncio.to_thread(tokenizer.encode, body.prompt, body.add_special_tokens)
    else:
        messages = body.messages or []  # given: exactly one of the two is
        tools = plan_tools(body.tools, None).tools if body.tools else None  # validated as the chat route does
        prompt = ChatPrompt(  # (a vision-language model's images expanded into their placeholder tokens)
            messages,
            body.add_generation_prompt,
            tools,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
            chat_template=body.chat_template,
            check_length=False,
        )
        tokens = (await prompt.token_ids(state))[0]
    strings = tokenizer.hf.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.max_model_len, tokens=tokens, token_strs=strings)


@router.post("/detokenize", response_model=DetokenizeResponse, responses=ERROR_RESPONSES)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state: ServerState = request.app.state.server
    check_model(body.model, state.model_ids)
    _check_fields(body, state, {})
    check_token_ids(body.tokens, state.engine.vocab_size, "tokens")
    text = await asyncio.to_thread(state.tokenizer.decode, body.tokens, False)
    return DetokenizeResponse(prompt=text)


def _check_fields(body: BaseModel, state: ServerState, unsupported: Mapping[str, Unsupported]) -> None:
    """As on the generation routes: a field of `unsupported` or a vLLM extra this server does not implement
    (chat_template, ...) is a 400, other unknown fields are logged, or refused under --strict-params."""
    refuse_unsupported(body, unsupported)
    # the structured-output extras constrain a generation: here they are as unknown as any other field
    check_extra_fields(body, state.config.strict_params, known=VLLM_EXTRAS)

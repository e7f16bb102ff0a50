"""OpenAI request and response shapes (completions, chat, models, tokenize), with vLLM's extras.

Requests keep unknown fields (`model_extra`): the server logs and accepts them, as vLLM
does, or refuses them under `--strict-params`. Fields that OpenAI defines but this
server does not implement are declared here so they can be refused by name.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    ValidationInfo,
    field_validator,
    model_serializer,
)

# ------------------------------------------------------------------ requests


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False
    continuous_usage_stats: bool = False
    # OpenAI's: random padding on each chunk against length side channels. This server never pads, so false
    # (what latency-minded clients send) is what it does; true is refused by name (serving/checks.py).
    include_obfuscation: Optional[bool] = None


class LoRAPart(BaseModel):
    """One adapter of a request's `lora` mix (pagedserve's extension): its name and the scale its delta gets."""

    model_config = ConfigDict(extra="forbid", strict=True)

    name: str = Field(min_length=1)
    scale: float = 1.0


class SamplingFields(BaseModel):
    """Fields shared by completions and chat (OpenAI's and vLLM's extras at top level).

    Strict types: `true` is not a temperature and "yes" is not a boolean.
    """

    model_config = ConfigDict(extra="allow", strict=True)

    model: Optional[str] = None
    n: int = 1
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: Optional[float] = None
    frequency_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    request_id: Optional[str] = None
    cache_salt: Optional[str] = None
    return_tokens_as_token_ids: Optional[bool] = None  # None: --return-tokens-as-token-ids
    use_beam_search: bool = False  # n is the beam width (serving/beam_search.py)
    length_penalty: float = 1.0
    # speculative decoding, per request (pagedserve's own)
    speculative: bool = True
    num_speculative_tokens: Optional[int] = None
    # a weighted mix of LoRA adapters over the base model (pagedserve's own; one adapter: set `model` to it)
    lora: Optional[list[LoRAPart]] = None

    @field_validator("n", "stream", "echo", "logprobs", mode="before", check_fields=False)
    @classmethod
    def _null_is_default(cls, value: Any, info: ValidationInfo) -> Any:
        """OpenAI declares these nullable (null: the default), and its SDK sends `n=None` as null."""
        if value is None and info.field_name is not None:
            return cls.model_fields[info.field_name].get_default()
        return value


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: str


class CompletionRequest(SamplingFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None
    response_format: Optional[ResponseFormat] = None  # (vLLM's extra on completions: as chat's)
    add_special_tokens: bool = True  # vLLM's: a text prompt gets the tokenizer's special tokens (BOS)
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: each prompt's last n tokens (-1: max_model_len)
    truncation_side: Optional[Literal["left", "right"]] = None  # vLLM's: right keeps the first n instead
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and this many alternatives


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Optional[Union[str, list[dict[str, Any]]]] = None
    name: Optional[str] = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    response_format: Optional[ResponseFormat] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    functions: Optional[list[dict[str, Any]]] = None
    function_call: Optional[Union[str, dict[str, Any]]] = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message left open for the model to continue
    chat_template_kwargs: Optional[dict[str, Any]] = None  # vLLM's: more variables for the chat template
    chat_template: Optional[str] = None  # vLLM's: this request's own template (--trust-request-chat-template)
    truncate_prompt_tokens: Optional[int] = None  # vLLM's: the rendered prompt's last n tokens (-1: max_model_len)
    truncation_side: Optional[Literal["left", "right"]] = None  # vLLM's: right keeps the first n instead
    prompt_logprobs: Optional[int] = None  # vLLM's: each prompt token's logprob and this many alternatives
    echo: bool = False  # vLLM's: the answer starts with the last message's text when that is the assistant's
    add_special_tokens: bool = False  # vLLM's: the rendered template also gets the tokenizer's special tokens
    # OpenAI fields with no implementation here: refused when set (server/serving/unsupported.py).
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None
    store: Optional[bool] = None
    metadata: Optional[dict[str, Any]] = None
    service_tier: Optional[str] = None
    verbosity: Optional[str] = None


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields: logged, or refused under --strict-params

    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    tools: Optional[list[dict[str, Any]]] = None  # shown to the chat template, as the chat route does
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as on the chat route
    chat_template_kwargs: Optional[dict[str, Any]] = None  # as on the chat route
    chat_template: Optional[str] = None  # as on the chat route
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[str] = None
    tokens: list[int]


# ------------------------------------------------------------------ responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: Optional[PromptTokensDetails] = None


class PoolingUsage(BaseModel):
    """The usage of a pooling response (embeddings, classification, scores): its inputs' tokens; none generated."""

    prompt_tokens: int
    total_tokens: int

    @classmethod
    def of(cls, num_tokens: int) -> "PoolingUsage":
        return cls(prompt_tokens=num_tokens, total_tokens=num_tokens)


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[Optional[float]] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[Optional[dict[str, float]]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry at a prompt position (vLLM's `Logprob`): its logprob, its rank, its text."""

    logprob: float
    rank: Optional[int] = None
    decoded_token: Optional[str] = None


# vLLM's prompt_logprobs: per prompt position (the first None) the prompt's token, then the best alternatives,
# keyed by token id
PromptLogprobs = list[Optional[dict[int, PromptLogprob]]]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: Optional[CompletionLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: Optional[list[int]] = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: Optional[list[ChatTokenLogprob]] = None
    refusal: Optional[list[ChatTokenLogprob]] = None


class _ReasoningWhenSet(BaseModel):
    """A message that carries `reasoning` (vLLM's, under --reasoning-parser) only when it has some: without a
    parser the shapes stay OpenAI's."""

    reasoning: Optional[str] = None

    @model_serializer(mode="wrap")
    def _without_unset_reasoning(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = handler(self)
        if data.get("reasoning") is None:
            data.pop("reasoning", None)
        return data


class AssistantMessage(_ReasoningWhenSet):
    role: str = "assistant"  # --response-role's, or the last message's without add_generation_prompt (as vLLM)
    content: Optional[str] = None
    refusal: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None
    prompt_logprobs: Optional[PromptLogprobs] = None


class DeltaMessage(_ReasoningWhenSet):
    role: Optional[str] = None
    content: Optional[str] = None
    tool_calls: Optional[list[dict[str, Any]]] = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: Optional[ChatLogprobs] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Optional[Usage] = None
    system_fingerprint: Optional[str] = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagedserve"
    root: Optional[str] = None  # the base model's source; a LoRA adapter's directory
    parent: Optional[str] = None  # a LoRA adapter's base model id (None for the base itself)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None  # the vocabulary's strings of the tokens, with return_token_strs


class DetokenizeResponse(BaseModel):
    prompt: str

"""HTTP server configuration: where to listen, who may call, how strict to be (pydantic, unknown keys refused)."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling.params import MAX_LOGPROBS
from engine.text.tokenizer import TEMPLATE_RENDERER_ARGUMENTS

LogLevel = Literal["debug", "info", "warning", "error", "critical"]
# what a browser's Origin header can hold: scheme://host[:port] (no path, no trailing slash), or "null"
_ORIGIN = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^/\s\"']+")


class ServerConfig(BaseModel):
    """The `server` section of a preset; what `create_app` needs besides the engine.

    `api_keys` empty means no authentication; otherwise a request needs
    `Authorization: Bearer <one of the keys>`. The keys never appear in repr/str.
    """

    model_config = ConfigDict(extra="forbid")

    host: str = Field("127.0.0.1", min_length=1, description="address to bind")
    port: int = Field(8000, ge=0, le=65535, description="TCP port; 0 = any free port")
    api_keys: list[str] = Field(
        default_factory=list, repr=False, description="accepted bearer tokens; empty = no authentication"
    )
    served_model_name: Optional[list[str]] = Field(
        None,
        min_length=1,
        description="the model ids clients may send (the first: reported where a request names none, and in the "
        "metrics); None = the model's source",
    )
    strict_params: bool = Field(False, description="also reject request fields the OpenAI API does not define")
    stream_interval: int = Field(
        1,
        ge=1,
        description="vLLM's --stream-interval: a streamed choice sends its first token at once, then a chunk every "
        "N new tokens (and its last): fewer events per token, for clients that do not need each one",
    )
    log_level: LogLevel = "info"
    uvicorn_log_level: Optional[Literal["trace", "debug", "info", "warning", "error", "critical"]] = Field(
        None, description="uvicorn's log level alone (vLLM's --uvicorn-log-level; None: log_level)"
    )
    uvicorn_access_log: bool = Field(True, description="an access log line per HTTP request (uvicorn's)")
    tool_call_parser: Literal["hermes", "llama3_json"] = Field(
        "hermes", description="how tool calls are found in the text under tool_choice auto"
    )
    reasoning_parser: Optional[Literal["deepseek_r1", "qwen3"]] = Field(
        None, description="how a reasoning model's thinking is told from its answer (server/openai/reasoning.py)"
    )
    enable_auto_tool_choice: bool = Field(
        True,
        description="vLLM's switch of tool_choice auto, which this server always serves (calls parsed with "
        "tool_call_parser): taken, and false refused",
    )
    response_role: str = Field(
        "assistant", min_length=1, description="the role of a chat answer to a new turn (add_generation_prompt)"
    )
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto",
        description="how a message's content reaches the chat template: text, or OpenAI's list of parts; auto "
        "reads it from the template (engine/text/chat_content_format.py)",
    )
    trust_request_chat_template: bool = Field(
        False, description="a request's own chat_template is rendered (else refused, as vLLM refuses it)"
    )
    default_chat_template_kwargs: Optional[dict[str, Any]] = Field(
        None, description="template variables every chat request gets, under its own chat_template_kwargs"
    )
    return_tokens_as_token_ids: bool = Field(
        False, description="logprobs' tokens as 'token_id:<id>' unless a request says otherwise (vLLM's flag)"
    )
    enable_force_include_usage: bool = Field(
        False, description="every stream ends with a usage chunk, as if it asked with stream_options.include_usage"
    )
    allowed_origins: list[str] = Field(default_factory=lambda: ["*"], description="CORS allowed origins")
    allowed_methods: list[str] = Field(default_factory=lambda: ["*"], description="CORS allowed methods")
    allowed_headers: list[str] = Field(default_factory=lambda: ["*"], description="CORS allowed request headers")
    allow_credentials: bool = Field(False, description="CORS: browsers may send cookies and credentials")
    enable_request_id_headers: bool = Field(
        False, description="each response carries X-Request-Id: the request's own, else a new one"
    )
    disable_fastapi_docs: bool = Field(False, description="no /docs, /redoc or /openapi.json")
    middleware: list[str] = Field(
        default_factory=list,
        description="import paths of ASGI middleware classes (added) or functions (as @app.middleware('http'))",
    )
    disable_access_log_for_endpoints: list[str] = Field(
        default_factory=list, description="paths whose requests get no access-log line (e.g. /health, /metrics)"
    )
    uds: Optional[str] = Field(None, description="listen on this Unix domain socket instead of host:port")
    h11_max_incomplete_event_size: Optional[int] = Field(
        None, ge=1, description="bytes of an HTTP head (or chunk) still incomplete at most (uvicorn's h11 limit)"
    )
    h11_max_header_count: Optional[int] = Field(
        256, ge=1, description="headers a request may carry at most (431 beyond; vLLM's default); None: no limit"
    )
    log_config_file: Optional[str] = Field(
        None, description="a JSON logging config (logging.config.dictConfig) for pagedserve and uvicorn"
    )
    log_error_stack: bool = Field(False, description="log the traceback of every error response, not only 500s")
    metrics_require_auth: bool = Field(False, description="/metrics also needs an API key (when keys are set)")
    # limits (see README, "Running in production")
    max_queued_requests: Optional[int] = Field(
        None, ge=1, description="sequences admitted but not yet generating, at most; None = 4 x max_num_seqs"
    )
    max_queued_tokens: Optional[int] = Field(
        None, ge=1, description="prompt tokens of those sequences, at most; None = the KV cache's capacity"
    )
    request_timeout: Optional[float] = Field(
        None, gt=0, description="seconds a request may wait and run before it is aborted; None = no deadline"
    )
    shutdown_timeout: float = Field(
        30.0, ge=0, description="seconds in-flight requests get to finish after SIGTERM/SIGINT"
    )
    max_request_body: int = Field(4 * 2**20, ge=1024, description="request body bytes at most (413 beyond)")
    allowed_media_domains: Optional[list[str]] = Field(
        None,
        description="vLLM's --allowed-media-domains: the hosts whose http(s) image URLs the server fetches "
        "(None: any host)",
    )
    media_fetch_timeout: float = Field(
        5.0,
        gt=0,
        description="seconds an image URL's fetch may take, redirects included (vLLM's VLLM_IMAGE_FETCH_TIMEOUT); a "
        "request's fetched images together are bounded by max_request_body",
    )
    max_logprobs: int = Field(
        MAX_LOGPROBS,
        ge=0,
        le=MAX_LOGPROBS,
        description="alternatives per token a request may ask for, at most "
        "(completions' logprobs, chat's top_logprobs)",
    )
    enable_log_requests: bool = Field(
        False,
        description="log each generation request at info: id, route, token counts and sampling "
        "settings, never its text",
    )
    root_path: str = Field("", description="path prefix of a proxy in front (FastAPI's root_path)")
    ssl_keyfile: Optional[str] = Field(None, description="TLS private key (PEM); with ssl_certfile, serve HTTPS")
    ssl_certfile: Optional[str] = Field(None, description="TLS certificate chain (PEM)")
    ssl_ca_certs: Optional[str] = Field(
        None, description="CA certificates (PEM) that client certificates are checked against"
    )
    ssl_cert_reqs: int = Field(0, ge=0, le=2, description="client certificates: 0 not asked, 1 optional, 2 required")
    ssl_ciphers: Optional[str] = Field(None, description="OpenSSL cipher list for TLS 1.2 and below")
    enable_ssl_refresh: bool = Field(
        False, description="reload the key, certificate and CA files when they change, without a restart"
    )

    @field_validator("enable_auto_tool_choice")
    @classmethod
    def _auto_tool_choice_is_always_on(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "tool_choice auto is always served (its calls parsed with --tool-call-parser); it cannot be turned off"
            )
        return value

    @field_validator("default_chat_template_kwargs")
    @classmethod
    def _check_template_kwargs(cls, value: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
        for key in value or {}:
            if key in TEMPLATE_RENDERER_ARGUMENTS:
                raise ValueError(f"{key!r} is an argument of the template's renderer, not a template variable")
        return value

    @field_validator("allowed_origins")
    @classmethod
    def _check_origins(cls, origins: list[str]) -> list[str]:
        """An entry no Origin header can equal would refuse its browser silently: a bad setting instead."""
        for origin in origins:
            if origin not in ("*", "null") and not _ORIGIN.fullmatch(origin):
                raise ValueError(
                    f"{origin!r} is not an origin: give *, null or scheme://host[:port], with no path or trailing slash "
                    "(e.g. https://app.example.com)"
                )
        return origins

    @field_validator("served_model_name", mode="before")
    @classmethod
    def _names(cls, value: Any) -> Any:
        """One name is a list of one (a YAML preset's, ServerConfig(served_model_name="x"))."""
        return [value] if isinstance(value, str) else value

    @field_validator("served_model_name")
    @classmethod
    def _check_names(cls, names: Optional[list[str]]) -> Optional[list[str]]:
        if names is not None and not all(name.strip() for name in names):
            raise ValueError("a served model name must not be empty")
        return names

    @field_validator("root_path")
    @classmethod
    def _check_root_path(cls, value: str) -> str:
        if value and (not value.startswith("/") or value.endswith("/")):
            raise ValueError(f"must start with / and not end with one, e.g. /api (got {value!r})")
        return value

    @model_validator(mode="after")
    def _check_ssl(self) -> "ServerConfig":
        if (self.ssl_keyfile is None) != (self.ssl_certfile is None):
            raise ValueError("ssl_keyfile and ssl_certfile go together (--ssl-keyfile and --ssl-certfile)")
        https = self.ssl_certfile is not None
        for name, given in (
            ("ssl_ca_certs", self.ssl_ca_certs is not None),
            ("ssl_cert_reqs", self.ssl_cert_reqs != 0),
            ("ssl_ciphers", self.ssl_ciphers is not None),
            ("enable_ssl_refresh", self.enable_ssl_refresh),
        ):
            if given and not https:
                raise ValueError(f"{name} needs HTTPS: give --ssl-keyfile and --ssl-certfile too")
        if self.ssl_cert_reqs != 0 and self.ssl_ca_certs is None:
            raise ValueError("ssl_cert_reqs asks for client certificates: give --ssl-ca-certs to check them against")
        return self

    @field_validator("disable_access_log_for_endpoints")
    @classmethod
    def _check_paths(cls, paths: list[str]) -> list[str]:
        for path in paths:
            if not path.startswith("/"):
                raise ValueError(f"{path!r} is not a path: give paths such as /health")
        return paths

    @property
    def scheme(self) -> str:
        return "https" if self.ssl_certfile is not None else "http"

    @field_validator("max_request_body", mode="before")
    @classmethod
    def _parse_size(cls, value):
        from engine.cache_config import parse_size

        return parse_size(value) if isinstance(value, str) else value

    @field_validator("api_keys")
    @classmethod
    def _check_keys(cls, keys: list[str]) -> list[str]:
        for index, key in enumerate(keys):
            if not key or any(char.isspace() for char in key):
                # never echo the key itself
                raise ValueError(f"API key #{index + 1} is empty or contains whitespace")
            if not (key.isascii() and key.isprintable()):
                # a header carries bytes: the SDKs cannot send such a key, and curl's UTF-8 never matched it
                raise ValueError(f"API key #{index + 1} has a character outside printable ASCII")
        return keys

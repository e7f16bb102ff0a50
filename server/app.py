"""The FastAPI application factory: routes, the error envelope, auth, metrics, engine lifecycle."""

from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager
from typing import Callable, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import BaseRoute

from engine.async_engine import AsyncEngine, EngineDeadError
from engine.pooling.params import PoolingParams
from engine.sampling.params import SamplingParams
from scheduler import RequestRejectedError
from server.serving.admission import Admission
from server.serving.lora_adapters import LoRAAdapters
from server.http.auth_metrics import AuthAndMetrics
from server.http.body_guard import BodyGuard
from server.config.server_config import ServerConfig
from server.http.errors import APIError, error_body, handle_error
from server.http.header_limit import HeaderLimit
from server.http.request_id_header import RequestIdHeader
from server.http.user_middleware import install_middleware
from server.observability.gpu_monitor import cuda_devices, start_gpu_monitor
from server.openai.chat_templates import ChatTemplates
from server.openai.logprob_format import LogprobFormatter
from server.observability.lora_metrics import LoRACollector
from server.observability.metrics import ServerMetrics, cache_info
from server.http import ops
from server.openai import chat, classify, completions, embeddings, lora_admin, models, pooling, scoring, tokenize
from server.openai.responses import route as responses
from server.openai.responses import stored as stored_responses
from server.state import ServerState

logger = logging.getLogger(__name__)

_AUTH_PREFIXES = ("/v1/", "/v2/", "/tokenize", "/detokenize", "/score", "/rerank", "/classify", "/pooling")
_WATCH_INTERVAL_S = 0.1


def create_app(
    engine: AsyncEngine,
    server_config: ServerConfig,
    *,
    on_ready: Optional[Callable[[], None]] = None,
    on_engine_death: Optional[Callable[[BaseException], None]] = None,
) -> FastAPI:
    """The app serving `engine`. Its lifespan starts the engine thread, warms the model up
    (one short generation) before /health reports ready, starts the GPU monitor where the
    engine runs on CUDA, watches the engine loop (`on_engine_death` is called on the event loop
    if it fails), and stops them all at shutdown."""
    state = _make_state(engine, server_config)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        await _warm_up(state)
        state.metrics.counting_requests = True  # the warm-up is not a request to count
        monitor = await asyncio.to_thread(start_gpu_monitor, cuda_devices(engine.device))
        state.metrics.gpu_monitor = monitor
        watcher = asyncio.create_task(_watch_engine(engine, on_engine_death))
        if on_ready is not None:
            on_ready()
        yield
        watcher.cancel()
        state.draining = True
        await engine.shutdown()
        if monitor is not None:
            state.metrics.gpu_monitor = None
            await asyncio.to_thread(monitor.close)

    docs: dict = (
        {"openapi_url": None, "docs_url": None, "redoc_url": None} if server_config.disable_fastapi_docs else {}
    )
    app = FastAPI(title="pagedserve", description="OpenAI-compatible LLM inference server", lifespan=lifespan, **docs)
    app.state.server = state
    routers = [
        completions,
        chat,
        responses,
        stored_responses,
        embeddings,
        pooling,
        scoring,
        classify,
        models,
        tokenize,
        ops,
    ]
    if state.adapters is not None and state.adapters.config.allow_runtime_lora_updating:
        routers.append(lora_admin)  # else the paths are a 404, as in vLLM
    for module in routers:
        app.include_router(module.router)
    _install_error_handlers(app, state)
    json_paths = [
        route.path
        for module in routers
        for route in module.router.routes
        if getattr(route, "body_field", None) is not None
    ]
    app.add_middleware(  # after auth
        BodyGuard,
        max_bytes=server_config.max_request_body,
        json_paths=json_paths,
        on_refusal=lambda status: state.metrics.observe_failure("rejected"),  # as a 400 from validation counts
    )
    _install_middleware(app, state, [route for module in routers for route in module.router.routes])
    if server_config.enable_request_id_headers:
        app.add_middleware(RequestIdHeader)
    install_middleware(app, server_config.middleware)  # the operator's own, outermost (as vLLM adds them)
    _drop_default_422(app)
    return app


def _drop_default_422(app: FastAPI) -> None:
    """Validation errors are 400s in OpenAI's envelope: take FastAPI's 422 out of the schema."""
    build = app.openapi

    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = build()
            for path in schema.get("paths", {}).values():
                for operation in path.values():
                    operation.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                schema.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]  # FastAPI's documented way to change the schema


def _make_state(engine: AsyncEngine, config: ServerConfig) -> ServerState:
    names = config.served_model_name or [engine.model_name]
    name = names[0]
    cache = engine.kv_cache_config
    assert cache.num_blocks is not None  # sized when the engine was built
    metrics = ServerMetrics(
        name,
        engine.stats,
        cache_info(
            num_blocks=cache.num_blocks,
            block_size=cache.block_size,
            enable_prefix_caching=cache.enable_prefix_caching,
            dtype=engine.kv_cache_dtype,
            attention_backend=engine.attention_backend,
            max_model_len=engine.max_model_len,
            cuda_graphs=engine.cuda_graphs,
        ),
    )
    metrics.model_weight_bytes.labels(name, engine.quantization).set(engine.weight_bytes)
    engine.observe(metrics)
    admission = Admission(*queue_limits(config, engine), on_reject=metrics.observe_rejected)
    adapters = None
    if engine.lora_manager is not None:  # --enable-lora
        adapters = LoRAAdapters(engine, names, engine.lora_manager.config)
        metrics.registry.register(LoRACollector(name, engine.lora_stats))
    return ServerState(
        engine=engine,
        config=config,
        served_model_names=names,
        metrics=metrics,
        formatter=LogprobFormatter(engine.tokenizer, config.return_tokens_as_token_ids),
        admission=admission,
        templates=ChatTemplates(engine.tokenizer, config),
        adapters=adapters,
    )


def queue_limits(config: ServerConfig, engine: AsyncEngine) -> tuple[int, int]:
    """(sequences, prompt tokens) that may wait at most: the flags, else 4 x max_num_seqs and the KV
    cache's capacity in tokens (at least one full context)."""
    cache = engine.kv_cache_config
    assert cache.num_blocks is not None  # sized when the engine was built
    max_requests = config.max_queued_requests or 4 * engine.max_num_seqs
    max_tokens = config.max_queued_tokens or max(cache.num_blocks * cache.block_size, engine.max_model_len)
    return max_requests, max_tokens


async def _watch_engine(engine: AsyncEngine, on_death: Optional[Callable[[BaseException], None]]) -> None:
    """Until the engine loop fails: then tell `on_death` (the CLI exits non-zero so a supervisor restarts)."""
    while engine.error is None:
        await asyncio.sleep(_WATCH_INTERVAL_S)
    logger.error("the engine loop died (%r): every request gets a 503 from now on", engine.error)
    if on_death is not None:
        on_death(engine.error)


async def _warm_up(state: ServerState) -> None:
    prompt = state.tokenizer.encode("Hello") or [0]
    params: Union[SamplingParams, PoolingParams] = (
        SamplingParams(max_tokens=2, temperature=0) if state.engine.pooler is None else PoolingParams()
    )
    async for _ in state.engine.generate("warmup", prompt, params):
        pass
    state.ready = True
    logger.info("warm-up done; ready to serve %s", ", ".join(state.model_ids))


def _install_error_handlers(app: FastAPI, state: ServerState) -> None:
    async def failed(request: Request, exc: Exception):
        """APIError, RequestRejectedError (400), EngineDeadError (503), anything else (500)."""
        error = handle_error(exc, state.metrics, request.url.path, log_stack=state.config.log_error_stack)
        return JSONResponse(error.body(), status_code=error.status, headers=error.headers)

    for exception in (APIError, RequestRejectedError, EngineDeadError, Exception):
        app.add_exception_handler(exception, failed)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError):
        state.metrics.observe_failure("rejected")
        first = exc.errors()[0] if exc.errors() else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            return JSONResponse(
                error_body(400, f"the request body is not valid JSON: {first.get('msg')}"), status_code=400
            )
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = loc[0] if loc else None  # the request field, as OpenAI names it
        message = f"{'.'.join(loc)}: {first.get('msg')}" if loc else str(first.get("msg"))
        return JSONResponse(error_body(400, message, param=param), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        return JSONResponse(
            error_body(exc.status_code, str(exc.detail)),
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )


def _install_middleware(app: FastAPI, state: ServerState, routes: list[BaseRoute]) -> None:
    keys = [key.encode() for key in state.config.api_keys]
    prefixes = _AUTH_PREFIXES + (("/metrics",) if state.config.metrics_require_auth else ())
    app.add_middleware(AuthAndMetrics, keys=keys, prefixes=prefixes, metrics=state.metrics, routes=routes)
    if state.config.h11_max_header_count is not None:
        app.add_middleware(HeaderLimit, max_headers=state.config.h11_max_header_count)
    app.add_middleware(
        CORSMiddleware,
        allow_origins=state.config.allowed_origins,
        allow_methods=state.config.allowed_methods,
        allow_headers=state.config.allowed_headers,
        allow_credentials=state.config.allow_credentials,
    )

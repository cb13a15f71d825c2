"""The FastAPI app: OpenAI-compatible completions and chat completions on the online engine.

The app is assembled here from its parts: ``intake`` (the API key, the body under its
limits), ``translate`` (an OpenAI body into prompts and ``SamplingParams``), ``calls``
(the engine requests of a call, streamed as server-sent events or gathered) and
``responses`` (OpenAI's response shapes, written once for completions and chat).
``begin_drain`` / ``end_streams`` implement a graceful shutdown (see
``cbgen.frontends.server.lifecycle``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..online import Engine
from .adapters import ServedAdapters
from .calls import Call, Calls
from .choices import ChoiceWriter
from .guard import LOOPBACK_HOSTS, APIGuard
from .intake import DEFAULT_MAX_BODY_BYTES, api_keys, check_api_key, read_json
from .logprobs import TokenStrings
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import APIError, error_body
from .reasoning import reasoning_parser_class
from .responses import ResponseShape
from .tool_parsers import tool_parser_class
from .translate import (
    DEFAULT_COMPLETION_MAX_TOKENS,
    MAX_PRIORITY,
    MAX_STOP_STRINGS,
    Translated,
    Translator,
    max_token_chars,
)

__all__ = [
    "DEFAULT_COMPLETION_MAX_TOKENS",
    "DEFAULT_MAX_BODY_BYTES",
    "MAX_PRIORITY",
    "MAX_STOP_STRINGS",
    "create_app",
    "max_token_chars",
]

logger = logging.getLogger(__name__)


class _Server:
    """The app's state: the engine, the translator, the running calls, the drain flag."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        api_key: str | Sequence[str] | None,
        max_body_bytes: int,
        max_choices: int,
        max_tokens_limit: int | None,
        tokenizer_threads: int,
        body_timeout: float,
        fair_share_choices: int,
        client_fair_share: int | None,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.api_keys = api_keys(api_key)
        self.max_body_bytes = max_body_bytes
        self.body_timeout = body_timeout
        self.max_model_len = engine.core.max_model_len
        self.metrics = ServerMetrics(engine, model_name)
        self.translator = Translator(
            tokenizer,
            model_name,
            self.max_model_len,
            max_choices,
            max_tokens_limit,
            tokenizer_threads,
        )
        self.calls = Calls(engine, self.metrics, fair_share_choices, client_fair_share)
        self.token_strings = TokenStrings(tokenizer)  # logprobs' token texts, cached
        self.draining = False  # no new calls (SIGTERM)
        self.adapters = ServedAdapters(engine, model_name)  # LoRA adapters, by name
        self.translator.adapters = self.adapters.names
        self.translator.compile_structured = engine.check_structured_output

    @property
    def jobs(self) -> set[Call]:
        """The calls with requests in the engine."""
        return self.calls.jobs

    # -- graceful shutdown ----------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new calls (503) and report draining on /health; running calls go on."""
        self.draining = True

    def end_streams(self) -> None:
        """The drain time is over: cancel what still runs; streams send a final error event."""
        self.calls.end_streams()

    def close(self) -> None:
        self.translator.close()

    # -- endpoints ------------------------------------------------------------------------

    async def authorize(self, request: Request) -> None:
        request.state.api_key_index = check_api_key(request, self.api_keys)

    async def completions(self, request: Request) -> Any:
        t0 = time.perf_counter()
        work = await self.translator.completion(await self.read_json(request))
        return await self.run(work, t0, request)

    async def chat_completions(self, request: Request) -> Any:
        t0 = time.perf_counter()
        work = await self.translator.chat(await self.read_json(request))
        return await self.run(work, t0, request)

    def client_of(self, work: Translated, request: Request) -> str | None:
        """Who sent a call, for the per-client share: its ``user``, else its API key when
        the server has several (one key names no one: every client holds it)."""
        if work.client is not None or len(self.api_keys) < 2:
            return work.client
        return f"key:{request.state.api_key_index}"

    async def read_json(self, request: Request) -> Any:
        return await read_json(request, self.max_body_bytes, self.body_timeout)

    async def run(self, work: Translated, t0: float, request: Request) -> Any:
        work.client = self.client_of(work, request)
        writer = ChoiceWriter(work.report, self.token_strings, work.chat, work.prompts, work.n)
        model = work.model or self.model_name  # responses name what the call asked for
        call = Call(work, ResponseShape.new(work.chat, model, writer, work.messages), t0)
        return await self.calls.run(call, request)

    def health(self) -> JSONResponse:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.engine.is_running:
            return JSONResponse({"status": "ok", "model": self.model_name})
        body = {"status": "engine not running"}
        if self.engine.failure is not None:
            body["error"] = self.engine.failure
        return JSONResponse(body, status_code=503)

    def models(self) -> dict[str, Any]:
        base = {
            "id": self.model_name,
            "object": "model",
            "created": 0,
            "owned_by": "cbgen",
            "max_model_len": self.max_model_len,
        }
        return {"object": "list", "data": [base, *self.adapters.model_cards(self.max_model_len)]}

    # -- LoRA adapters at run time (``enable_lora_runtime_updates``) ------------------------

    async def load_lora_adapter(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.adapters.load(await self.read_json(request)))

    async def unload_lora_adapter(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.adapters.unload(await self.read_json(request)))


def create_app(
    engine: Engine,
    tokenizer: Any,
    model_name: str,
    api_key: str | Sequence[str] | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_choices: int = 128,
    max_tokens_limit: int | None = None,
    allowed_origins: Collection[str] = (),
    allowed_hosts: Collection[str] | None = None,
    tokenizer_threads: int = 2,
    body_timeout: float = 30.0,
    fair_share_choices: int = 8,
    client_fair_share: int | None = 16,
    lora_modules: Mapping[str, str] | None = None,
    enable_lora_runtime_updates: bool = False,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (started here if it is not running).

    ``api_key`` (one key or several) guards every ``/v1/`` route
    (``Authorization: Bearer <key>``);
    ``/health`` and ``/metrics`` stay open. ``max_body_bytes`` bounds a request body
    (413 past it); ``max_choices`` bounds the engine requests one call may add
    (prompts × ``n``); ``max_tokens_limit`` bounds ``max_tokens`` (400 past it, and the
    default when a call gives none). Browser requests: an ``Origin`` outside
    ``allowed_origins`` gets 403 (allowed ones get CORS headers); without an API key
    only ``Host`` names in ``allowed_hosts`` are served (default: loopback names).
    A body that has not fully arrived ``body_timeout`` seconds after its head gets 408.
    The choices of one call past its first ``fair_share_choices`` (prompts × ``n``) run
    one priority lower, so a wide call yields slots to other calls (a waiting request of
    higher priority preempts running ones) instead of starving them. Across calls, a
    client (the call's ``user``, or its API key when there are several) with
    ``client_fair_share`` requests unfinished adds its next ones one priority lower
    (``None``: no per-client share).
    ``lora_modules`` (name -> PEFT adapter folder) are loaded now (``ValueError`` naming
    the first that cannot be) and served under their names: a call's ``model`` picks
    one. ``enable_lora_runtime_updates`` adds ``POST /v1/load_lora_adapter`` and
    ``/v1/unload_lora_adapter`` (behind the API key).
    ``tool_call_parser`` (``hermes``, ``llama3_json``, ``mistral`` or a name given to
    ``register_tool_parser``) reads the model's own tool calls for ``tool_choice:
    "auto"``; ``reasoning_parser`` (``deepseek_r1``, ``qwen3``) splits a chat answer's
    thinking into ``reasoning_content`` (``ValueError`` for an unknown name).
    The caller owns the engine and closes it after the server stops.
    """
    if tokenizer is None:
        raise ValueError("the server needs the model's tokenizer")
    if max_body_bytes < 1:
        raise ValueError(f"max_body_bytes must be positive, got {max_body_bytes}")
    if engine.tokenizer is None:
        raise ValueError("the online engine needs the tokenizer (Engine(model, tokenizer))")
    engine.start()
    if max_tokens_limit is not None and max_tokens_limit < 1:
        raise ValueError(f"max_tokens_limit must be positive, got {max_tokens_limit}")
    tools = None if tool_call_parser is None else tool_parser_class(tool_call_parser)
    reasoning = None if reasoning_parser is None else reasoning_parser_class(reasoning_parser)
    server = _Server(
        engine,
        tokenizer,
        model_name,
        api_key,
        max_body_bytes,
        max_choices,
        max_tokens_limit,
        tokenizer_threads,
        body_timeout,
        fair_share_choices,
        client_fair_share,
    )
    server.translator.tool_parser = tools
    server.translator.reasoning_parser = reasoning
    try:
        server.adapters.load_at_start(lora_modules or {})
    except BaseException:
        server.close()  # the tokenizer pool; the caller still owns (and closes) the engine
        raise
    app = FastAPI(title="cbgen", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.cbgen = server
    auth = [Depends(server.authorize)]

    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return JSONResponse(
            error_body(str(exc.detail), kind), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(error_body(str(exc)), status_code=400)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("cbgen server: unhandled error")
        return JSONResponse(
            error_body(f"Internal server error: {type(exc).__name__}", "server_error"),
            status_code=500,
        )

    @app.post("/v1/completions", dependencies=auth)
    async def completions(request: Request) -> Any:
        return await server.completions(request)

    @app.post("/v1/chat/completions", dependencies=auth)
    async def chat_completions(request: Request) -> Any:
        return await server.chat_completions(request)

    @app.get("/v1/models", dependencies=auth)
    async def models() -> Any:
        return server.models()

    if enable_lora_runtime_updates:

        @app.post("/v1/load_lora_adapter", dependencies=auth)
        async def load_lora_adapter(request: Request) -> Any:
            return await server.load_lora_adapter(request)

        @app.post("/v1/unload_lora_adapter", dependencies=auth)
        async def unload_lora_adapter(request: Request) -> Any:
            return await server.unload_lora_adapter(request)

    @app.get("/health")
    async def health() -> Response:
        return server.health()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )
    if allowed_hosts is None and not server.api_keys:
        allowed_hosts = LOOPBACK_HOSTS
    app.add_middleware(
        APIGuard,
        metrics=server.metrics,
        allowed_origins=allowed_origins,
        allowed_hosts=None if server.api_keys else allowed_hosts,
        draining=lambda: server.draining,
    )
    return app

"""The FastAPI app: OpenAI-compatible completions and chat completions on the online engine.

Every API call becomes one engine request per choice (``n`` samples of each prompt,
sample ``i`` seeded with ``seed + i``), all read by one coroutine through
``Engine.stream_many_async``. A streamed answer is written as server-sent events; a
plain one is gathered while a watcher waits for the client to go away. Either way, a
client that disconnects, or stops reading for ``stream_timeout`` seconds, cancels its
requests and their KV blocks come back before the next step.

Tokenizing and chat templates run on a small thread pool, after a cheap length check,
so one huge prompt never stalls the event loop (and every other stream) while it is
encoded. ``begin_drain`` / ``end_streams`` implement a graceful shutdown (see
``cbgen.server.lifecycle``).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from ..input_processor import fan_out
from ..online import Engine, EngineClosedError, EngineOverloadedError, OnlineRequestOutput
from ..request import FinishReason
from ..sampling import SamplingParams
from .guard import LOOPBACK_HOSTS, APIGuard
from .metrics import CONTENT_TYPE, ServerMetrics
from .protocol import (
    CHAT_NEUTRAL,
    COMPLETION_NEUTRAL,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_unsupported,
    error_body,
    finish_reason_name,
    parse,
)
from .responses import ResponseShape, TimedStreamingResponse, sse

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 1 << 20
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_PRIORITY = 1 << 31  # |priority| bound: an ordering key, not a number to compute with
_DRAIN_LIMIT = 64 << 20  # read (and drop) at most this much of an oversized body
_SHUTDOWN_MESSAGE = "The server is shutting down; the request was cut short."


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (an upper bound, from the vocabulary's
    token strings: byte-level and SentencePiece pieces are at least as long as their text),
    so a text of ``c`` characters has at least ``c / max_token_chars`` tokens."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # no vocabulary to read: no cheap bound
        return 1 << 30
    return max((len(token) for token in vocab), default=1) or 1


class _Job:
    """One API call: its engine requests (one per choice) and what they produced."""

    def __init__(
        self,
        kind: str,
        n: int,
        stream: bool,
        include_usage: bool,
        t0: float,
        timeout: float | None = None,
    ) -> None:
        prefix = "cmpl" if kind == "completion" else "chatcmpl"
        self.kind = kind
        self.id = f"{prefix}-{uuid.uuid4().hex}"
        self.created = int(time.time())
        self.n = n
        self.stream = stream
        self.include_usage = include_usage
        self.t0 = t0
        self.timeout = timeout
        self.rids: list[str] = []
        self.choices: Any = None  # the AsyncStreamGroup of every choice
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.done = False  # every choice finished (not cut short by the client)

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


def _strip_request_prefix(message: str) -> str:
    # The engine's messages start with "request 'id': "; the id means nothing to the client.
    if message.startswith("request '") and "': " in message:
        return message.split("': ", 1)[1]
    return message


class _Server:
    def __init__(
        self,
        engine: Engine,
        tokenizer: Any,
        model_name: str,
        api_key: str | None,
        max_body_bytes: int,
        max_choices: int,
        max_tokens_limit: int | None,
        tokenizer_threads: int,
        body_timeout: float,
        fair_share_choices: int,
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.max_choices = max_choices
        self.max_tokens_limit = max_tokens_limit
        self.body_timeout = body_timeout
        self.fair_share_choices = fair_share_choices
        self.max_model_len = engine.core.max_model_len
        self.max_prompt_chars = self.max_model_len * max_token_chars(tokenizer)
        self.metrics = ServerMetrics(engine, model_name)
        self.tokenize_pool = ThreadPoolExecutor(tokenizer_threads, "cbgen-tokenize")
        self.jobs: set[_Job] = set()  # calls with requests in the engine
        self.draining = False  # no new calls (SIGTERM)
        self.shutting_down = False  # the drain time is over: open streams end with an error

    # -- graceful shutdown ----------------------------------------------------------------

    def begin_drain(self) -> None:
        """Refuse new calls (503) and report draining on /health; running calls go on."""
        self.draining = True

    def end_streams(self) -> None:
        """The drain time is over: cancel what still runs; streams send a final error event."""
        self.shutting_down = True
        for job in list(self.jobs):
            self.cancel(job)

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- request checks -------------------------------------------------------------------

    async def authorize(self, request: Request) -> None:
        if self.api_key is None:
            return
        header = request.headers.get("authorization")
        if not header:
            raise APIError(
                401,
                "Missing API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            token.strip().encode(), self.api_key.encode()
        ):
            raise APIError(
                401,
                "Incorrect API key provided.",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(self, request: Request) -> Any:
        limit = self.max_body_bytes
        too_big = APIError(
            413,
            f"Request body too large: the limit is {limit} bytes.",
            code="request_too_large",
        )
        declared = request.headers.get("content-length")
        oversized = declared is not None and declared.isdigit() and int(declared) > limit
        try:
            body, oversized = await asyncio.wait_for(
                self._read_body(request, oversized), self.body_timeout
            )
        except asyncio.TimeoutError:
            raise APIError(
                408,
                f"The request body did not arrive within {self.body_timeout:g} s.",
                code="request_timeout",
                headers={"Connection": "close"},
            ) from None
        if oversized:
            raise too_big
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise APIError(400, f"The body is not valid JSON: {exc}") from None
        except RecursionError:
            raise APIError(400, "The body is not valid JSON: it is nested too deeply.") from None
        except ValueError as exc:  # e.g. an integer past Python's 4,300-digit conversion limit
            raise APIError(400, f"The body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise APIError(400, "The body must be a JSON object.")
        return data

    async def _read_body(self, request: Request, oversized: bool) -> tuple[bytearray, bool]:
        limit = self.max_body_bytes
        body = bytearray()
        drained = 0
        async for chunk in request.stream():
            if oversized:  # read the rest and drop it, so the client gets the 413 cleanly
                drained += len(chunk)
                if drained > _DRAIN_LIMIT:
                    break
                continue
            body += chunk
            if len(body) > limit:
                oversized = True
                drained = len(body)
                body = bytearray()
        return body, oversized

    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(
                404,
                f"The model {model!r} does not exist; this server serves {self.model_name!r}.",
                param="model",
                code="model_not_found",
            )

    def sampling(
        self, req: Any, prompt_len: int, max_tokens: int | None, default_max: int | None
    ) -> SamplingParams:
        limit = self.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens (at least one new token must fit).",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        cap = self.max_tokens_limit
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
            if cap is not None:
                max_tokens = min(max_tokens, cap)
        elif max_tokens < 1:
            raise APIError(400, f"max_tokens must be at least 1, got {max_tokens}.", "max_tokens")
        elif cap is not None and max_tokens > cap:
            raise APIError(
                400,
                f"max_tokens must be at most {cap} on this server, got {max_tokens}.",
                "max_tokens",
            )
        elif prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but "
                f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0.0 <= temperature <= 2.0:
            raise APIError(400, f"temperature must be in [0, 2], got {temperature}.", "temperature")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0.0 < top_p <= 1.0:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
        if top_k < 0:
            raise APIError(400, f"top_k must be >= 0 (0 or -1 = off), got {top_k}.", "top_k")
        priority = req.priority
        if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise APIError(
                400,
                f"priority must be within +-2**31 (lower runs first), got {priority}.",
                "priority",
            )
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            priority=priority,
        )

    def num_choices(self, req: Any, num_prompts: int) -> int:
        n = 1 if req.n is None else req.n
        if n < 1 or n * num_prompts > self.max_choices:
            raise APIError(
                400,
                f"n must be between 1 and {self.max_choices // max(num_prompts, 1)} "
                f"(at most {self.max_choices} choices per call), got {n}.",
                param="n",
            )
        return n

    def stops(self, req: Any) -> list[str] | None:
        stop = req.stop
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(
                400,
                f"stop takes up to {MAX_STOP_STRINGS} non-empty strings.",
                param="stop",
            )
        return stops or None

    # -- running a call -------------------------------------------------------------------

    def start(
        self,
        job: _Job,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stop: list[str] | None,
    ) -> None:
        """Add one engine request per choice and attach their stream (all or nothing)."""
        engine = self.engine
        try:
            for prompt, base in zip(prompts, params, strict=True):
                for sample in fan_out(job.id, dataclasses.replace(base, n=job.n)):
                    if len(job.rids) >= self.fair_share_choices:  # a wide call yields
                        sample = dataclasses.replace(sample, priority=sample.priority + 1)
                    rid = engine.add_request(
                        prompt, sample, f"{job.id}-{len(job.rids)}", stop=stop, timeout=job.timeout
                    )
                    job.rids.append(rid)
            job.choices = engine.stream_many_async(job.rids)
        except ValueError as exc:
            self.cancel(job)
            raise APIError(400, _strip_request_prefix(str(exc))) from None
        except EngineOverloadedError as exc:
            self.cancel(job)
            raise APIError(
                429,
                f"The server is busy: {exc}",
                type="server_error",
                code="server_overloaded",
                headers={"Retry-After": str(max(1, round(exc.retry_after)))},
            ) from None
        except EngineClosedError as exc:
            self.cancel(job)
            raise APIError(503, f"The engine is not running: {exc}", type="server_error") from None
        self.jobs.add(job)
        job.prompt_tokens = sum(len(p) for p in prompts)
        self.metrics.prompt_tokens.inc(job.prompt_tokens)

    def cancel(self, job: _Job) -> None:
        self.jobs.discard(job)
        if job.choices is not None:
            job.choices.close()  # cancels the requests not finished
        for rid in job.rids:
            self.engine.cancel(rid)

    async def deltas(self, job: _Job) -> AsyncIterator[tuple[int, OnlineRequestOutput]]:
        """Every choice's deltas as they come, tagged with the choice index; times tokens."""
        metrics = self.metrics
        last: list[float | None] = [None] * len(job.rids)
        remaining = len(job.rids)
        try:
            async for index, delta in job.choices:
                now = time.perf_counter()
                count = len(delta.new_token_ids)
                if count:
                    previous = last[index]
                    if previous is None:
                        metrics.ttft.observe(now - job.t0)
                    else:
                        gap = (now - previous) / count
                        for _ in range(count):
                            metrics.itl.observe(gap)
                    last[index] = now
                    metrics.generation_tokens.inc(count)
                    job.completion_tokens += count
                if delta.finished:
                    remaining -= 1
                    metrics.e2e.observe(now - job.t0)
                    metrics.finished.labels(str(delta.finish_reason)).inc()
                yield index, delta
            job.done = remaining == 0
        finally:
            self.jobs.discard(job)
            if not job.done:
                self.cancel(job)

    async def collect(self, job: _Job, request: Request) -> list[OnlineRequestOutput]:
        """Every choice's final output; cancels them if the client disconnects first."""
        finals: list[Any] = [None] * len(job.rids)

        async def run() -> None:
            async with contextlib.aclosing(self.deltas(job)) as deltas:
                async for index, delta in deltas:
                    if delta.finished:
                        finals[index] = delta

        async def disconnected() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass

        task = asyncio.create_task(run())
        watcher = asyncio.create_task(disconnected())
        try:
            await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
                self.cancel(job)
                self.metrics.disconnects.inc()
        if task.cancelled():
            raise APIError(499, "The client closed the request.", code="client_closed_request")
        task.result()
        if any(final is None for final in finals):  # ended by end_streams()
            raise APIError(503, _SHUTDOWN_MESSAGE, type="server_error")
        for final in finals:
            if final.finish_reason is FinishReason.ERROR:
                raise APIError(500, f"Generation failed: {final.error}", type="server_error")
            if self.shutting_down and final.finish_reason is FinishReason.ABORTED:
                raise APIError(503, _SHUTDOWN_MESSAGE, type="server_error")
        return finals

    async def sse(self, job: _Job) -> AsyncIterator[str]:
        """The server-sent events of a streamed call, ending with ``data: [DONE]``."""
        shape = self.shape(job)
        head = shape.chunk_head()
        tail = {"usage": None} if job.include_usage else {}
        try:
            if shape.chat:
                for index in range(len(job.rids)):
                    yield sse({**head, "choices": [shape.role_choice(index)], **tail})
            async with contextlib.aclosing(self.deltas(job)) as deltas:
                async for index, delta in deltas:
                    if delta.finish_reason is FinishReason.ERROR:
                        message = f"Generation failed: {delta.error}"
                        yield sse(error_body(message, "server_error"))
                        break
                    if self.shutting_down and delta.finish_reason is FinishReason.ABORTED:
                        yield sse(error_body(_SHUTDOWN_MESSAGE, "server_error"))
                        break
                    text = delta.new_text or ""
                    if not text and not delta.finished:
                        continue
                    reason = finish_reason_name(delta.finish_reason) if delta.finished else None
                    choice = shape.chunk_choice(index, text, reason)
                    yield sse({**head, "choices": [choice], **tail})
                else:  # every delta read; not all finished if end_streams() cut it
                    if not job.done and self.shutting_down:
                        yield sse(error_body(_SHUTDOWN_MESSAGE, "server_error"))
            if job.include_usage:
                yield sse({**head, "choices": [], "usage": job.usage()})
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.disconnects.inc()
            raise
        finally:
            if not job.done:
                self.cancel(job)

    def stream_response(self, job: _Job) -> StreamingResponse:
        # The background task also cancels a job whose stream never started (client gone).
        return TimedStreamingResponse(
            self.sse(job),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(self.cancel, job),
            send_timeout=self.engine.stream_timeout,
        )

    # -- endpoints ------------------------------------------------------------------------

    async def completions(self, request: Request) -> Any:
        t0 = time.perf_counter()
        req: CompletionRequest = parse(CompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        check_unsupported(req, COMPLETION_NEUTRAL, best_of_ok=req.n or 1)
        n = self.num_choices(req, self.num_prompts(req.prompt))
        stop = self.stops(req)
        include_usage = self.include_usage(req)
        prompts = await self.off_loop(self.completion_prompts, req.prompt)
        params = [
            self.sampling(req, len(p), req.max_tokens, DEFAULT_COMPLETION_MAX_TOKENS)
            for p in prompts
        ]
        job = _Job("completion", n, bool(req.stream), include_usage, t0, req.timeout)
        return await self.run(job, request, prompts, params, stop)

    async def chat_completions(self, request: Request) -> Any:
        t0 = time.perf_counter()
        req: ChatCompletionRequest = parse(ChatCompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        check_unsupported(req, CHAT_NEUTRAL)
        messages = chat_messages(req.messages)
        n = self.num_choices(req, 1)
        stop = self.stops(req)
        include_usage = self.include_usage(req)
        self.check_length(sum(len(m["content"]) for m in messages), "messages")
        prompt = await self.off_loop(self.chat_prompt, messages)
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        params = [self.sampling(req, len(prompt), max_tokens, None)]
        job = _Job("chat", n, bool(req.stream), include_usage, t0, req.timeout)
        return await self.run(job, request, [prompt], params, stop)

    async def run(
        self,
        job: _Job,
        request: Request,
        prompts: list[list[int]],
        params: list[SamplingParams],
        stop: list[str] | None,
    ) -> Any:
        """Start the call's requests; stream them, or gather them into one response."""
        self.start(job, prompts, params, stop)
        if job.stream:
            return self.stream_response(job)
        finals = await self.collect(job, request)
        return self.shape(job).response(finals, job.usage())

    def shape(self, job: _Job) -> ResponseShape:
        return ResponseShape(job.kind == "chat", job.id, job.created, self.model_name)

    def include_usage(self, req: Any) -> bool:
        if req.stream_options is None:
            return False
        if not req.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true.", "stream_options"
            )
        return req.stream_options.include_usage

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work on the tokenizer pool, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_pool, fn, *args)

    def check_length(self, chars: int, param: str) -> None:
        """A cheap 400 for text that cannot fit, before anything is tokenized."""
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"The prompt has {chars} characters: more than this model's context of "
                f"{self.max_model_len} tokens can hold.",
                param=param,
                code="context_length_exceeded",
            )

    @staticmethod
    def _prompt_list(prompt: Any) -> list[Any]:
        if isinstance(prompt, str):
            return [prompt]
        if prompt and isinstance(prompt[0], int):
            return [prompt]
        return list(prompt)

    def num_prompts(self, prompt: Any) -> int:
        """Check the prompts' count and lengths before tokenizing; return the count."""
        prompts = self._prompt_list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty.", param="prompt")
        if len(prompts) > self.max_choices:
            raise APIError(
                400, f"At most {self.max_choices} prompts per call, got {len(prompts)}.", "prompt"
            )
        self.check_length(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        return len(prompts)

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        """Token ids of every prompt (runs on the tokenizer pool)."""
        out = []
        for p in self._prompt_list(prompt):
            if isinstance(p, str):
                try:
                    ids = self.tokenizer(p)["input_ids"]
                except (UnicodeError, ValueError, TypeError) as exc:  # e.g. a lone surrogate
                    raise APIError(
                        400, f"The prompt could not be tokenized: {exc}", param="prompt"
                    ) from None
            else:
                ids = list(p)
            if not ids:
                raise APIError(400, "prompt is empty (it encodes to no tokens).", param="prompt")
            out.append(ids)
        return out

    def chat_prompt(self, messages: list[dict[str, str]]) -> list[int]:
        if getattr(self.tokenizer, "chat_template", None) is None:
            raise APIError(400, "This model has no chat template; use /v1/completions.")
        try:
            encoded = self.tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=True
            )
        except Exception as exc:  # the template rejected the conversation (e.g. role order)
            raise APIError(400, f"The chat template failed: {exc}", param="messages") from None
        return list(encoded["input_ids"])

    def health(self) -> JSONResponse:
        if self.draining:
            return JSONResponse({"status": "draining"}, status_code=503)
        if self.engine.is_running:
            return JSONResponse({"status": "ok", "model": self.model_name})
        return JSONResponse({"status": "engine not running"}, status_code=503)

    def models(self) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": self.model_name,
                    "object": "model",
                    "created": 0,
                    "owned_by": "cbgen",
                    "max_model_len": self.max_model_len,
                }
            ],
        }


def create_app(
    engine: Engine,
    tokenizer: Any,
    model_name: str,
    api_key: str | None = None,
    *,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    max_choices: int = 128,
    max_tokens_limit: int | None = None,
    allowed_origins: Collection[str] = (),
    allowed_hosts: Collection[str] | None = None,
    tokenizer_threads: int = 2,
    body_timeout: float = 30.0,
    fair_share_choices: int = 8,
) -> FastAPI:
    """An OpenAI-compatible app serving ``engine`` (started here if it is not running).

    ``api_key`` guards every ``/v1/`` route (``Authorization: Bearer <key>``);
    ``/health`` and ``/metrics`` stay open. ``max_body_bytes`` bounds a request body
    (413 past it); ``max_choices`` bounds the engine requests one call may add
    (prompts × ``n``); ``max_tokens_limit`` bounds ``max_tokens`` (400 past it, and the
    default when a call gives none). Browser requests: an ``Origin`` outside
    ``allowed_origins`` gets 403 (allowed ones get CORS headers); without an API key
    only ``Host`` names in ``allowed_hosts`` are served (default: loopback names).
    A body that has not fully arrived ``body_timeout`` seconds after its head gets 408.
    The choices of one call past its first ``fair_share_choices`` (prompts × ``n``) run
    one priority lower, so a wide call yields slots to other calls (a waiting request of
    higher priority preempts running ones) instead of starving them.
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
    )
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
    if allowed_hosts is None and api_key is None:
        allowed_hosts = LOOPBACK_HOSTS
    app.add_middleware(
        APIGuard,
        metrics=server.metrics,
        allowed_origins=allowed_origins,
        allowed_hosts=None if api_key is not None else allowed_hosts,
        draining=lambda: server.draining,
    )
    return app

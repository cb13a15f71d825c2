"""Running API calls on the online engine: fan-out, stream merging, timing, cancelling.

Every call becomes one engine request per choice (``n`` samples of each prompt, sample
``i`` seeded with ``seed + i``), all read by one coroutine through
``Engine.stream_many_async``. A streamed answer is written as server-sent events; a
plain one is gathered while a watcher waits for the client to go away. Either way, a
client that disconnects, or stops reading for ``stream_timeout`` seconds, cancels its
requests and their KV blocks come back before the next step. Time to first token,
inter-token latency and end-to-end time are observed here, as the deltas arrive.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ...core.input_processor import fan_out, strip_request_prefix
from ...requests.request import FinishReason
from ..online import Engine, EngineClosedError, EngineOverloadedError, OnlineRequestOutput
from .metrics import ServerMetrics
from .protocol import APIError, error_body, finish_detail, finish_reason_name
from .responses import ResponseShape, TimedStreamingResponse, sse
from .translate import Translated

SHUTDOWN_MESSAGE = "The server is shutting down; the request was cut short."


class Call:
    """One API call: its engine requests (one per choice) and what they produced."""

    def __init__(self, work: Translated, shape: ResponseShape, t0: float) -> None:
        self.work = work
        self.shape = shape
        self.id = shape.call_id
        self.n = work.n
        self.stream = work.stream
        self.include_usage = work.include_usage
        self.t0 = t0
        self.timeout = work.timeout
        self.rids: list[str] = []
        self.choices: Any = None  # the AsyncStreamGroup of every choice
        self.prompt_tokens = 0
        self.completion_tokens = 0
        self.done = False  # every choice finished (not cut short by the client)
        self.client = work.client  # who sent it, for the per-client share (None: unknown)
        self.counted = 0  # its requests counted in the client's in-flight total

    def usage(self) -> dict[str, int]:
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "total_tokens": self.prompt_tokens + self.completion_tokens,
        }


class Calls:
    """The calls with requests in the engine, and how each one runs.

    A call's choices past its first ``fair_share_choices`` run one priority lower, so a
    wide call yields slots to other calls instead of starving them. The same holds
    across calls per client (the call's ``user``, or its API key when the server has
    several): a request added while its client already has ``client_fair_share``
    requests unfinished runs one priority lower, so a client sending many calls at once
    yields to one sending few."""

    def __init__(
        self,
        engine: Engine,
        metrics: ServerMetrics,
        fair_share_choices: int,
        client_fair_share: int | None = None,
    ) -> None:
        self.engine = engine
        self.metrics = metrics
        self.fair_share_choices = fair_share_choices
        self.client_fair_share = client_fair_share
        self.in_flight: dict[str, int] = {}  # unfinished requests per known client
        self.jobs: set[Call] = set()  # calls with requests in the engine
        self.shutting_down = False  # the drain time is over: open streams end with an error

    def yields(self, job: Call) -> bool:
        """Whether the call's next request runs one priority lower (past a fair share)."""
        if len(job.rids) >= self.fair_share_choices:  # a wide call yields
            return True
        share = self.client_fair_share
        return (
            share is not None
            and job.client is not None
            and self.in_flight.get(job.client, 0) >= share
        )

    def release(self, job: Call, count: int | None = None) -> None:
        """``count`` of the call's requests (all that are counted: ``None``) finished."""
        client = job.client
        count = job.counted if count is None else min(count, job.counted)
        if client is None or count <= 0:
            return
        job.counted -= count
        left = self.in_flight.get(client, 0) - count
        if left > 0:
            self.in_flight[client] = left
        else:
            self.in_flight.pop(client, None)  # the table holds active clients only

    def end_streams(self) -> None:
        """The drain time is over: cancel what still runs; streams send a final error event."""
        self.shutting_down = True
        for job in list(self.jobs):
            self.cancel(job)

    async def run(self, job: Call, request: Request) -> Any:
        """Start the call's requests; stream them, or gather them into one response."""
        self.start(job)
        if job.stream:
            return self.stream_response(job)
        finals = await self.collect(job, request)
        return job.shape.response(finals, job.usage())

    def start(self, job: Call) -> None:
        """Add one engine request per choice and attach their stream (all or nothing)."""
        engine = self.engine
        work = job.work
        try:
            for prompt, base in zip(work.prompts, work.params, strict=True):
                for sample in fan_out(job.id, dataclasses.replace(base, n=job.n)):
                    if self.yields(job):
                        sample = dataclasses.replace(sample, priority=sample.priority + 1)
                    rid = engine.add_request(
                        prompt,
                        sample,
                        f"{job.id}-{len(job.rids)}",
                        stop=work.stop,
                        timeout=job.timeout,
                        lora=work.lora,
                        **work.text_options,
                    )
                    job.rids.append(rid)
                    if job.client is not None:
                        self.in_flight[job.client] = self.in_flight.get(job.client, 0) + 1
                        job.counted += 1
            job.choices = engine.stream_many_async(job.rids)
        except ValueError as exc:
            self.cancel(job)
            raise APIError(400, strip_request_prefix(str(exc))) from None
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
        job.prompt_tokens = sum(len(p) for p in work.prompts)
        self.metrics.prompt_tokens.inc(job.prompt_tokens)

    def cancel(self, job: Call) -> None:
        self.jobs.discard(job)
        self.release(job)
        if job.choices is not None:
            job.choices.close()  # cancels the requests not finished
        for rid in job.rids:
            self.engine.cancel(rid)

    async def deltas(self, job: Call) -> AsyncIterator[tuple[int, OnlineRequestOutput]]:
        """Every choice's deltas as they come, tagged with the choice index; times tokens."""
        metrics = self.metrics
        shown = not job.work.report.drop_generated  # max_tokens 0: the one token run is not
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
                    if shown:
                        job.completion_tokens += count
                if delta.finished:
                    remaining -= 1
                    self.release(job, 1)
                    metrics.e2e.observe(now - job.t0)
                    metrics.finished.labels(str(delta.finish_reason)).inc()
                yield index, delta
            job.done = remaining == 0
        finally:
            self.jobs.discard(job)
            self.release(job)
            if not job.done:
                self.cancel(job)

    async def collect(self, job: Call, request: Request) -> list[OnlineRequestOutput]:
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
            raise APIError(503, SHUTDOWN_MESSAGE, type="server_error")
        for final in finals:
            if final.finish_reason is FinishReason.ERROR:
                raise APIError(500, f"Generation failed: {final.error}", type="server_error")
            if self.shutting_down and final.finish_reason is FinishReason.ABORTED:
                raise APIError(503, SHUTDOWN_MESSAGE, type="server_error")
        return finals

    async def sse(self, job: Call) -> AsyncIterator[str]:
        """The server-sent events of a streamed call, ending with ``data: [DONE]``."""
        shape = job.shape
        head = shape.chunk_head()
        tail = {"usage": None} if job.include_usage else {}
        try:
            for opening in shape.opening_choices(len(job.rids)):
                yield sse({**head, "choices": [opening], **tail})
            async with contextlib.aclosing(self.deltas(job)) as deltas:
                async for index, delta in deltas:
                    if delta.finish_reason is FinishReason.ERROR:
                        message = f"Generation failed: {delta.error}"
                        yield sse(error_body(message, "server_error"))
                        break
                    if self.shutting_down and delta.finish_reason is FinishReason.ABORTED:
                        yield sse(error_body(SHUTDOWN_MESSAGE, "server_error"))
                        break
                    text, logprobs = delta.new_text or "", None
                    writer = shape.choices
                    if writer is not None:
                        text, logprobs = writer.chunk(index, delta)
                    tokens = writer is not None and writer.shows_tokens and delta.new_token_ids
                    if not text and not tokens and not delta.finished:
                        continue
                    reason = None
                    if delta.finished:
                        reason = finish_reason_name(delta.finish_reason)
                        if writer is not None and writer.report.drop_generated:
                            reason = "length"
                    choice = shape.chunk_choice(index, text, reason, logprobs)
                    if choice is None:
                        continue
                    if delta.finished:
                        choice.update(finish_detail(delta.finish_reason))
                    yield sse({**head, "choices": [choice], **tail})
                else:  # every delta read; not all finished if end_streams() cut it
                    if not job.done and self.shutting_down:
                        yield sse(error_body(SHUTDOWN_MESSAGE, "server_error"))
            if job.include_usage:
                yield sse({**head, "choices": [], "usage": job.usage()})
            yield "data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            self.metrics.disconnects.inc()
            raise
        finally:
            if not job.done:
                self.cancel(job)

    def stream_response(self, job: Call) -> StreamingResponse:
        # The background task also cancels a job whose stream never started (client gone).
        return TimedStreamingResponse(
            self.sse(job),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            background=BackgroundTask(self.cancel, job),
            send_timeout=self.engine.stream_timeout,
        )

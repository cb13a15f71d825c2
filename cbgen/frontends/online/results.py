"""Where the online engine's requests live from ``add_request`` until their result is taken.

``ResultStore`` holds, under one lock, what the API threads and the loop thread share:
every request added and not yet collected (``RequestRecord``: what was published so far,
its final output, the stream and the callers that follow it), the finished results that
nobody claimed (bounded, oldest dropped first), the ``get_result()`` callers waiting for
any result, the queue bounds' counts, and whether the engine is closed or stopped.

The loop thread hands each step's deltas to ``publish``: each request delivers to at
most one stream (a ``cbgen.frontends.online.streams.Sink``; event loops are woken with one
``call_soon_threadsafe`` per loop per step) and to whoever waits for it by id; an
unclaimed finished request goes to the store and wakes one ``get_result()`` waiter.
Nothing scans the requests or polls; a finished request costs O(1).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import TypeVar

from ...core.config import EngineConfig
from ...sampling.logprobs import TokenLogprobs, copy_entries
from ...sampling.params import SamplingParams
from .outputs import EngineClosedError, EngineOverloadedError, OnlineRequestOutput
from .streams import Sink, SinkGroup, resolve_all
from .text import TextProcessor
from .waiters import Waiter

logger = logging.getLogger(__name__)

W = TypeVar("W", bound=Waiter)


class RequestRecord:
    """One request's state. Loop-only fields are touched by the loop thread alone;
    shared fields (``token_ids``, ``pieces``, ``queued``, ``final``, consumers) are
    written only under the lock (by the loop thread, which may read them without it)."""

    __slots__ = (
        "request_id",
        "prompt",
        "params",
        "deadline",
        "text_processor",
        "token_ids",
        "pieces",
        "logprobs",
        "prompt_logprobs",
        "queued",
        "final",
        "sink",
        "waiters",
        "lora",
    )

    def __init__(
        self, request_id: str, prompt: list[int], params: SamplingParams, deadline: float | None
    ) -> None:
        self.request_id = request_id
        self.lora: str | None = None  # the LoRA adapter it runs under (None: the base)
        self.prompt = prompt
        self.params = params
        self.deadline = deadline  # time.monotonic() past which it finishes with "timeout"
        self.text_processor: TextProcessor | None = None  # loop only
        self.token_ids: list[int] = []  # published so far
        self.pieces: list[str] | None = None  # the text published so far, in pieces
        # The logprobs published so far, when the params ask for them.
        self.logprobs: list[TokenLogprobs] | None = None if params.logprobs is None else []
        self.prompt_logprobs: list[TokenLogprobs | None] | None = None
        self.queued = True  # added, no token published yet (counts against the queue bounds)
        self.final: OnlineRequestOutput | None = None
        # The stream that follows it. A finished request leaves the registry, so no
        # second stream can attach to it once this is cleared.
        self.sink: Sink | None = None
        self.waiters: list[Waiter] = []  # get_result(request_id) callers

    @property
    def text(self) -> str | None:
        return None if self.pieces is None else "".join(self.pieces)


class ResultStore:
    """The requests, results and waiters the API threads share with the loop thread.

    ``lock`` guards every field; methods named ``*_locked`` expect the caller to hold it,
    the others take it themselves.
    """

    def __init__(
        self,
        config: EngineConfig,
        max_retained_results: int,
        max_unread_tokens: int,
        stream_timeout: float | None,
    ) -> None:
        self.lock = threading.Lock()
        self.config = config
        self.max_retained_results = max_retained_results
        self.max_unread_tokens = max_unread_tokens
        self.stream_timeout = stream_timeout
        self.num_dropped_results = 0
        self.num_rejected = 0  # add_request calls refused by the queue bounds
        self.queued_requests = 0  # added, no token yet
        self.queued_tokens = 0
        self.registry: dict[str, RequestRecord] = {}  # added, not yet collected or dropped
        self.unclaimed: OrderedDict[str, OnlineRequestOutput] = OrderedDict()
        self.any_waiters: OrderedDict[Waiter, None] = OrderedDict()  # get_result() callers
        self.closed = False  # no new requests
        self.stopped = False  # the loop has ended; every request is settled
        self.loop_error: BaseException | None = None

    def closed_reason(self) -> str:
        if self.loop_error is not None:
            if isinstance(self.loop_error, CoreFailed):
                return str(self.loop_error)
            return f"the engine loop died: {self.loop_error!r}"
        return "the engine is closed"

    # -- adding -------------------------------------------------------------------------

    def add_locked(self, request: RequestRecord, next_id: Callable[[], str] | None) -> str:
        """Register ``request`` within the queue bounds; a taken id raises ``ValueError``,
        or is replaced by ``next_id()`` for an id the engine chose."""
        if self.closed:
            raise EngineClosedError(self.closed_reason())
        self._check_bounds_locked(len(request.prompt))
        rid = request.request_id
        while rid in self.registry:
            if next_id is None:
                raise ValueError(f"request {rid!r}: this id is already in use")
            rid = request.request_id = next_id()
        self.registry[rid] = request
        self.queued_requests += 1
        self.queued_tokens += len(request.prompt)
        return rid

    def _check_bounds_locked(self, prompt_tokens: int) -> None:
        config = self.config
        limit = config.max_waiting_requests
        if limit is not None and self.queued_requests >= limit:
            self.num_rejected += 1
            raise EngineOverloadedError(
                f"{self.queued_requests} requests are waiting to start "
                f"(max_waiting_requests={limit}); retry later"
            )
        limit = config.max_queued_tokens
        if (
            limit is not None
            and self.queued_requests
            and self.queued_tokens + prompt_tokens > limit
        ):
            self.num_rejected += 1
            raise EngineOverloadedError(
                f"{self.queued_tokens} prompt tokens are waiting to start and this request "
                f"adds {prompt_tokens} (max_queued_tokens={limit}); retry later"
            )

    def _unqueue_locked(self, request: RequestRecord) -> None:
        if request.queued:
            request.queued = False
            self.queued_requests -= 1
            self.queued_tokens -= len(request.prompt)

    # -- taking results -----------------------------------------------------------------

    def lookup_locked(self, request_id: str) -> RequestRecord:
        request = self.registry.get(request_id)
        if request is None:
            raise KeyError(
                f"unknown request {request_id!r}: never added, already collected, streamed, "
                "or dropped from the bounded result store"
            )
        return request

    def _collect_locked(self, request: RequestRecord) -> OnlineRequestOutput:
        self.unclaimed.pop(request.request_id, None)
        self.registry.pop(request.request_id, None)
        assert request.final is not None
        return request.final

    def result_or_wait(
        self, request_id: str, new_waiter: Callable[[], W]
    ) -> OnlineRequestOutput | tuple[RequestRecord, W]:
        """The final output of ``request_id`` if it has one, else a waiter (from
        ``new_waiter``) that its settling will wake, to pass to ``result_after_wait``."""
        with self.lock:
            request = self.lookup_locked(request_id)
            if request.final is not None:
                return self._collect_locked(request)
            waiter = new_waiter()
            request.waiters.append(waiter)
        return request, waiter

    def result_after_wait(self, request: RequestRecord, waiter: Waiter) -> OnlineRequestOutput:
        """The final output once ``waiter`` was woken or timed out; ``TimeoutError`` if none."""
        with self.lock:
            if request.final is not None:
                return self._collect_locked(request)
            request.waiters.remove(waiter)
        raise TimeoutError(f"request {request.request_id!r} did not finish in time")

    def forget_waiter(self, request: RequestRecord, waiter: Waiter) -> None:
        """A caller waiting on ``request`` left (cancelled)."""
        with self.lock:
            if request.final is None:
                request.waiters.remove(waiter)

    def next_or_wait(
        self,
        previous: Waiter | None,
        deadline: float | None,
        clock: Callable[[], float],
        new_waiter: Callable[[], W],
    ) -> OnlineRequestOutput | W:
        """The oldest unclaimed result, or a waiter (from ``new_waiter``) the next one will
        wake. ``previous`` is the caller's last waiter, if it was not woken; ``deadline``
        is on ``clock``'s time, past it this raises ``TimeoutError``."""
        with self.lock:
            if previous is not None and not previous.woken:
                self.any_waiters.pop(previous, None)
            if self.unclaimed:
                request_id, output = self.unclaimed.popitem(last=False)
                self.registry.pop(request_id, None)
                return output
            if self.stopped:
                raise EngineClosedError(self.closed_reason())
            if deadline is not None and deadline - clock() <= 0:
                raise TimeoutError("no request finished in time")
            waiter = new_waiter()
            self.any_waiters[waiter] = None
        return waiter

    def leave_any(self, waiter: Waiter) -> None:
        """A ``get_result()`` caller left (cancelled): a wake it got goes to the next one."""
        with self.lock:
            if not waiter.woken:
                self.any_waiters.pop(waiter, None)
            elif self.unclaimed:
                self._wake_any_locked()  # pass on the wake this task will not use

    def _wake_any_locked(self) -> None:
        while self.any_waiters:
            waiter, _ = self.any_waiters.popitem(last=False)
            if waiter.wake():
                return

    def attach(self, request_ids: Sequence[str], group: SinkGroup) -> None:
        """Give each request a sink of ``group``, holding what it produced so far."""
        with self.lock:
            requests = [self.lookup_locked(rid) for rid in request_ids]
            for request in requests:
                if request.sink is not None:
                    raise ValueError(f"request {request.request_id!r} is already being streamed")
            if len({id(r) for r in requests}) != len(requests):
                raise ValueError("a request can be streamed only once")
            wakes: list[SinkGroup] = []
            for request in requests:
                sink = group.add(request)
                final = request.final
                if final is not None:  # finished, unclaimed: the stream gets it all at once
                    self._collect_locked(request)
                    catch_up = dataclasses.replace(
                        final,
                        new_token_ids=list(final.token_ids),
                        new_text=final.text,
                        new_logprobs=None if final.logprobs is None else list(final.logprobs),
                    )
                    sink.offer(catch_up, wakes)
                    continue
                request.sink = sink
                if request.token_ids or request.pieces:
                    sink.offer(
                        OnlineRequestOutput(
                            request_id=request.request_id,
                            prompt_token_ids=request.prompt,
                            token_ids=list(request.token_ids),
                            finished=False,
                            new_token_ids=list(request.token_ids),
                            new_text=request.text,
                            new_logprobs=copy_entries(request.logprobs),
                            prompt_logprobs=request.prompt_logprobs,
                        ),
                        wakes,
                    )

    # -- publishing (the loop thread) ---------------------------------------------------

    def publish(
        self, deltas: list[OnlineRequestOutput]
    ) -> tuple[list[RequestRecord], list[RequestRecord]]:
        """Hand a step's deltas to their consumers (one lock, one wake-up per event loop).

        Returns the unfinished requests whose stream's consumer is too far behind
        (``max_unread_tokens`` / ``stream_timeout``), for the loop to abort, and those
        whose consumer's event loop is gone, for the loop to abandon.
        """
        wakes: list[SinkGroup] = []
        behind: list[RequestRecord] = []
        gone: list[RequestRecord] = []
        max_unread, timeout = self.max_unread_tokens, self.stream_timeout
        futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
        with self.lock:
            registry = self.registry
            now = time.monotonic()
            for delta in deltas:
                request = registry.get(delta.request_id)
                if request is None or request.final is not None:
                    continue
                if request.queued:
                    self._unqueue_locked(request)
                request.token_ids.extend(delta.new_token_ids)
                if delta.new_text and request.pieces is not None:
                    request.pieces.append(delta.new_text)
                if delta.new_logprobs and request.logprobs is not None:
                    request.logprobs.extend(delta.new_logprobs)
                if delta.prompt_logprobs is not None:
                    request.prompt_logprobs = delta.prompt_logprobs
                sink = request.sink
                if sink is not None:
                    sink.offer(delta, wakes)
                    if not delta.finished and (
                        sink.unread_tokens > max_unread
                        or (timeout is not None and now - sink.since > timeout)
                    ):
                        behind.append(request)
                if delta.finished:
                    self._settle_locked(request, delta)
            for group in wakes:
                group.wake(futures)
        for loop, items in futures.items():
            try:
                loop.call_soon_threadsafe(resolve_all, items)
            except RuntimeError:  # the consumer's event loop is gone: stop its requests
                with self.lock:
                    gone += [
                        s.request
                        for g in wakes
                        if g.loop is loop
                        for s in g.sinks
                        if not s.done and s.request.final is None
                    ]
        return behind, gone

    def _settle_locked(self, request: RequestRecord, final: OnlineRequestOutput) -> None:
        request.final = final
        self._unqueue_locked(request)
        streamed = request.sink is not None
        request.sink = None
        waiters = request.waiters
        if waiters or streamed:  # claimed: its consumers have it, nothing is retained
            self.registry.pop(request.request_id, None)
            request.waiters = []
            for waiter in waiters:
                waiter.wake()
            return
        self.unclaimed[request.request_id] = final
        while len(self.unclaimed) > self.max_retained_results:
            dropped, _ = self.unclaimed.popitem(last=False)
            self.registry.pop(dropped, None)
            self.num_dropped_results += 1
            if self.num_dropped_results == 1:
                logger.warning(
                    "cbgen: dropping finished results nobody collected (max_retained_results=%d)",
                    self.max_retained_results,
                )
        if self.unclaimed:
            self._wake_any_locked()

    def open_requests(self) -> list[RequestRecord]:
        """The requests without a final output yet."""
        with self.lock:
            return [r for r in self.registry.values() if r.final is None]

    def stop(self) -> None:
        """Every request is settled and no more will come: wake every ``get_result()``."""
        with self.lock:
            self.stopped = True
            waiters = list(self.any_waiters)
            self.any_waiters.clear()
        for waiter in waiters:
            waiter.wake()


class CoreFailed(Exception):
    """The core can run no more steps (``EngineCore.failure``): the loop ends with it."""

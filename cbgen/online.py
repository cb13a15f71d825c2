"""The online engine: a background step loop, thread-safe and asyncio-friendly.

``Engine`` wraps the synchronous core (``cbgen.engine.EngineCore``) for servers
and interactive use: requests arrive from any thread (or coroutine) at any time,
their tokens stream back as ``OnlineRequestOutput`` deltas with incremental text,
and finished results can be collected by id or in completion order.

Design:

* One background thread owns the core; nothing else touches it. Public methods
  talk to it through a ``queue.SimpleQueue`` of commands (add, abort, close) that
  the loop drains between steps; when there is no work the loop blocks on that
  queue (no busy-wait). ``SimpleQueue.put`` is reentrant, so even a finalizer of an
  abandoned stream can post a cancel.
* Every step's deltas are published under one lock: each request delivers to at
  most one stream (a bounded ``cbgen.streams.Sink`` that merges what its consumer has
  not read yet; event loops are woken with one ``call_soon_threadsafe`` per loop per
  step) and to the threads or tasks waiting on that request; an unclaimed finished
  request goes to a bounded completion store (oldest dropped first) and wakes one
  ``get_result()`` waiter. Nothing scans the requests or polls; a finished request
  costs O(1). A stream whose consumer leaves more than ``max_unread_tokens`` unread,
  or leaves a delta unread for ``stream_timeout`` seconds, has its request aborted.
* Bounds: ``EngineConfig.max_waiting_requests`` / ``max_queued_tokens`` cap the
  requests (and their prompt tokens) added but not yet started; past them
  ``add_request`` raises ``EngineOverloadedError``. A request's ``timeout`` finishes
  it with ``"timeout"`` once that many seconds have passed since it was added.
* Text: with a tokenizer, every request gets an ``IncrementalDetokenizer`` and,
  when asked, a ``StopStringMatcher``; a matched stop string truncates the text,
  finishes the request with ``"stop"`` and aborts it in the core (blocks freed).
* Failures: an exception from ``core.step()`` finishes the requests that were in
  it (the running ones) with ``"error"`` and the message, aborts them in the core,
  and the loop goes on. ``close()`` (or leaving the ``with`` block) aborts what is
  left, wakes every waiter with an ``"aborted"`` output, joins the loop and gives
  the model its attention implementation back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, StopStringMatcher, make_decoder
from .engine import EngineCore
from .openmp import release_thread_team
from .request import FinishReason, RequestOutput, RequestStatus
from .sampling import SamplingParams
from .streams import (
    AsyncRequestStream,
    AsyncStreamGroup,
    RequestStream,
    Sink,
    SinkGroup,
    resolve_all,
)
from .waiters import AsyncWaiter, ThreadWaiter, Waiter, wait

logger = logging.getLogger(__name__)

_ADD, _ABORT, _ABANDON, _BARRIER, _CLOSE = range(5)


class EngineClosedError(RuntimeError):
    """The engine is closed (or its loop died): it takes no new requests and has no result."""


class EngineOverloadedError(RuntimeError):
    """Too many requests are waiting to start (``EngineConfig.max_waiting_requests`` or
    ``max_queued_tokens``); try again later. ``retry_after`` is a hint in seconds."""

    def __init__(self, message: str, retry_after: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


@dataclass
class OnlineRequestOutput(RequestOutput):
    """A ``RequestOutput`` with text.

    As a stream delta, ``new_token_ids`` / ``new_text`` are what this delta adds
    (everything the stream had not read yet, when its consumer fell behind).
    ``token_ids`` is every token so far; ``text``, the whole text, is set only on
    the last delta of a request (``finished=True``, also what ``get_result``
    returns), so that streaming stays linear in the output length. ``text`` and
    ``new_text`` are ``None`` when the engine has no tokenizer. With a stop string,
    ``text`` ends right before it while ``token_ids`` keep every generated token.
    """

    text: str | None = None
    new_text: str | None = None


@dataclass(frozen=True)
class EngineSnapshot:
    """The engine's state as its loop thread last published it (after every step), so
    that other threads (a metrics scrape) never read the scheduler while it changes."""

    running: int = 0
    waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0  # truly free plus evictable cached blocks
    num_evictable_blocks: int = 0
    preemptions: int = 0
    cached_tokens: int = 0
    queued_requests: int = 0
    queued_tokens: int = 0
    unread_aborts: int = 0
    rejected: int = 0


class _Request:
    """One request's state. Loop-only fields are touched by the loop thread alone;
    shared fields (``token_ids``, ``pieces``, ``queued``, ``final``, consumers) are
    written only under the lock (by the loop thread, which may read them without it)."""

    __slots__ = (
        "request_id",
        "prompt",
        "params",
        "deadline",
        "detok",
        "stops",
        "token_ids",
        "pieces",
        "queued",
        "final",
        "sink",
        "waiters",
    )

    def __init__(
        self, request_id: str, prompt: list[int], params: SamplingParams, deadline: float | None
    ) -> None:
        self.request_id = request_id
        self.prompt = prompt
        self.params = params
        self.deadline = deadline  # time.monotonic() past which it finishes with "timeout"
        self.detok: IncrementalDetokenizer | None = None  # loop only
        self.stops: StopStringMatcher | None = None  # loop only
        self.token_ids: list[int] = []  # published so far
        self.pieces: list[str] | None = None  # the text published so far, in pieces
        self.queued = True  # added, no token published yet (counts against the queue bounds)
        self.final: OnlineRequestOutput | None = None
        # The stream that follows it. A finished request leaves the registry, so no
        # second stream can attach to it once this is cleared.
        self.sink: Sink | None = None
        self.waiters: list[Waiter] = []  # get_result(request_id) callers

    @property
    def text(self) -> str | None:
        return None if self.pieces is None else "".join(self.pieces)


class Engine:
    """Continuous batching behind a background thread; every public method is thread-safe.

    ``tokenizer`` is optional: it is needed for text (``new_text``/``text``), stop
    strings and string prompts. ``max_retained_results`` bounds how many finished,
    never-collected results are kept for ``get_result`` (the oldest are dropped);
    streamed requests are never retained. A stream whose consumer leaves more than
    ``max_unread_tokens`` tokens unread, or a delta unread for ``stream_timeout``
    seconds (``None``: no limit), has its request aborted (``num_unread_aborts``
    counts them) so that a consumer that stopped reading costs neither memory nor
    compute. Use it as a context manager, or call ``start()`` / ``close()``;
    ``add_request`` starts the loop if needed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer: Any = None,
        config: EngineConfig | None = None,
        *,
        max_retained_results: int = 4096,
        skip_special_tokens: bool = True,
        max_unread_tokens: int = 4096,
        stream_timeout: float | None = 60.0,
    ) -> None:
        if max_retained_results < 0:
            raise ValueError(f"max_retained_results must be >= 0, got {max_retained_results}")
        if max_unread_tokens < 1:
            raise ValueError(f"max_unread_tokens must be >= 1, got {max_unread_tokens}")
        if stream_timeout is not None and not stream_timeout > 0:
            raise ValueError(f"stream_timeout must be positive or None, got {stream_timeout}")
        self.core = EngineCore(model, config)
        self.config = self.core.config
        self.tokenizer = tokenizer
        self.max_retained_results = max_retained_results
        self.max_unread_tokens = max_unread_tokens
        self.stream_timeout = stream_timeout
        self.num_dropped_results = 0
        self.num_unread_aborts = 0  # streams aborted because their consumer stopped reading
        self.num_rejected = 0  # add_request calls refused by the queue bounds
        self._queued_requests = 0  # added, no token yet (under the lock)
        self._queued_tokens = 0
        self._decode = (
            make_decoder(tokenizer, skip_special_tokens) if tokenizer is not None else None
        )
        self._lock = threading.Lock()
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._registry: dict[str, _Request] = {}  # added, not yet collected or dropped
        self._store: OrderedDict[str, OnlineRequestOutput] = OrderedDict()  # unclaimed results
        self._any_waiters: OrderedDict[Waiter, None] = OrderedDict()  # get_result() callers
        self._active: dict[str, _Request] = {}  # loop only: requests inside the core
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._closed = False  # no new requests
        self._stopped = False  # the loop has ended; every request is settled
        self._loop_error: BaseException | None = None
        self._core_closed = False
        self._snapshot = EngineSnapshot()
        self._publish_snapshot()

    # -- lifetime -----------------------------------------------------------------------

    def start(self) -> Engine:
        with self._lock:
            if self._closed:
                raise EngineClosedError("the engine is closed")
            self._start_locked()
        return self

    def _start_locked(self) -> None:
        if self._thread is None:
            # The loop thread runs the forward passes; the caller's idle OpenMP team
            # would make libgomp throttle the loop's team (cbgen.openmp).
            release_thread_team()
            self._thread = threading.Thread(target=self._run, name="cbgen-online", daemon=True)
            self._thread.start()

    def close(self) -> None:
        """Abort unfinished requests, wake every waiter, stop the loop, restore the model."""
        with self._lock:
            if not self._closed:
                self._closed = True
                self._start_locked()  # a loop that never ran still settles queued requests
                self._commands.put((_CLOSE, None))
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if not self._core_closed and (thread is None or not thread.is_alive()):
            self._core_closed = True
            self.core.close()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_running(self) -> bool:
        return self._thread is not None and not self._stopped

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stop: Sequence[str] | str | None = None,
        timeout: float | None = None,
    ) -> str:
        """Queue a request and return its id; an invalid one raises ``ValueError`` here.

        ``prompt`` is token ids (or a string, encoded with the tokenizer). ``stop``
        lists stop strings, matched on the decoded text (needs a tokenizer).
        ``timeout``: seconds from now after which the request finishes with
        ``"timeout"`` (and what it generated so far). Raises ``EngineOverloadedError``
        when the queue bounds of ``EngineConfig`` are reached.
        """
        params = params if params is not None else SamplingParams()
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        auto_id = request_id is None
        rid = f"req-{next(self._ids)}" if auto_id else request_id
        if not isinstance(rid, str):
            raise ValueError(f"request id must be a string, got {rid!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer")
            prompt = self.tokenizer.encode(prompt)
        stops = self._stop_matcher(rid, stop)
        prompt_ids = self._validate(rid, prompt, params)
        deadline = None if timeout is None else time.monotonic() + timeout
        request = _Request(rid, prompt_ids, params, deadline)
        if self._decode is not None:
            request.detok = IncrementalDetokenizer(None, prompt_ids, decode=self._decode)
            request.pieces = []
        request.stops = stops
        with self._lock:
            if self._closed:
                raise EngineClosedError(self._closed_reason())
            self._check_bounds_locked(len(prompt_ids))
            while rid in self._registry:
                if not auto_id:
                    raise ValueError(f"request {rid!r}: this id is already in use")
                rid = request.request_id = f"req-{next(self._ids)}"
            self._registry[rid] = request
            self._queued_requests += 1
            self._queued_tokens += len(prompt_ids)
            self._commands.put((_ADD, request))
            self._start_locked()
        return rid

    def _check_bounds_locked(self, prompt_tokens: int) -> None:
        config = self.config
        limit = config.max_waiting_requests
        if limit is not None and self._queued_requests >= limit:
            self.num_rejected += 1
            raise EngineOverloadedError(
                f"{self._queued_requests} requests are waiting to start "
                f"(max_waiting_requests={limit}); retry later"
            )
        limit = config.max_queued_tokens
        if (
            limit is not None
            and self._queued_requests
            and self._queued_tokens + prompt_tokens > limit
        ):
            self.num_rejected += 1
            raise EngineOverloadedError(
                f"{self._queued_tokens} prompt tokens are waiting to start and this request "
                f"adds {prompt_tokens} (max_queued_tokens={limit}); retry later"
            )

    def _unqueue_locked(self, request: _Request) -> None:
        if request.queued:
            request.queued = False
            self._queued_requests -= 1
            self._queued_tokens -= len(request.prompt)

    @property
    def num_queued(self) -> tuple[int, int]:
        """Requests added and not started yet (no token published), and their prompt tokens."""
        with self._lock:
            return self._queued_requests, self._queued_tokens

    def _stop_matcher(self, rid: str, stop: Sequence[str] | str | None) -> StopStringMatcher | None:
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else list(stop)
        if not stops:
            return None
        if self.tokenizer is None:
            raise ValueError(f"request {rid!r}: stop strings need a tokenizer")
        try:
            return StopStringMatcher(stops)
        except ValueError as exc:
            raise ValueError(f"request {rid!r}: {exc}") from None

    def _validate(self, rid: str, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        # The core's own rules; they read only immutable settings, so any thread may run them.
        prompt_ids = self.core.input_processor.validate(rid, prompt, params)
        if params.n != 1:
            raise ValueError(
                f"request {rid!r}: n={params.n} samples are not supported online; "
                "add one request per sample"
            )
        return prompt_ids

    def cancel(self, request_id: str) -> bool:
        """Abort a request; its blocks come back before the next step.

        Returns False when the request is unknown or already finished. Its
        consumers get a final output with ``finish_reason == "aborted"``.
        """
        with self._lock:
            request = self._registry.get(request_id)
            if request is None or request.final is not None or self._stopped:
                return False
            self._commands.put((_ABORT, request))
        return True

    def _abandon(self, requests: list[_Request]) -> None:
        """A stream's consumer left: cancel what it followed (reentrant, any thread)."""
        for request in requests:
            self._commands.put((_ABANDON, request))

    abort = cancel

    def sync(self, timeout: float | None = None) -> None:
        """Return once the loop has applied every add and cancel issued before this call.

        Cancelled and abandoned requests have given their blocks back by then.
        """
        done = threading.Event()
        with self._lock:
            if self._stopped:
                return
            self._start_locked()
            self._commands.put((_BARRIER, done))
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not catch up in time")

    # -- results ------------------------------------------------------------------------

    def get_result(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> OnlineRequestOutput:
        """The final output of ``request_id``, or of the next request to finish.

        Without ``request_id`` it returns finished requests that nobody streams or
        waits for by id, oldest first. Raises ``TimeoutError`` after ``timeout``
        seconds, ``KeyError`` for an unknown (or already collected, or streamed)
        id, and ``EngineClosedError`` when the engine has stopped and nothing is left.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        if request_id is not None:
            return self._get_one(request_id, deadline)
        waiter: ThreadWaiter | None = None
        while True:
            with self._lock:
                if waiter is not None and not waiter.woken:
                    self._any_waiters.pop(waiter, None)
                if self._store:
                    return self._pop_oldest()
                if self._stopped:
                    raise EngineClosedError(self._closed_reason())
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    raise TimeoutError("no request finished in time")
                waiter = ThreadWaiter()
                self._any_waiters[waiter] = None
            waiter.event.wait(remaining)

    def _get_one(self, request_id: str, deadline: float | None) -> OnlineRequestOutput:
        with self._lock:
            request = self._lookup(request_id)
            if request.final is not None:
                return self._collect(request)
            waiter = ThreadWaiter()
            request.waiters.append(waiter)
        remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
        waiter.event.wait(remaining)
        with self._lock:
            if request.final is not None:
                return self._collect(request)
            request.waiters.remove(waiter)
        raise TimeoutError(f"request {request_id!r} did not finish in time")

    async def get_result_async(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> OnlineRequestOutput:
        """``get_result`` for coroutines: waits on an asyncio future, never blocks the loop."""
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout
        if request_id is not None:
            with self._lock:
                request = self._lookup(request_id)
                if request.final is not None:
                    return self._collect(request)
                waiter = AsyncWaiter(loop)
                request.waiters.append(waiter)
            try:
                await wait(waiter.future, deadline, loop)
            except TimeoutError:
                pass
            except BaseException:
                with self._lock:
                    if request.final is None:
                        request.waiters.remove(waiter)
                raise
            with self._lock:
                if request.final is not None:
                    return self._collect(request)
                request.waiters.remove(waiter)
            raise TimeoutError(f"request {request_id!r} did not finish in time")
        any_waiter: AsyncWaiter | None = None
        while True:
            with self._lock:
                if any_waiter is not None and not any_waiter.woken:
                    self._any_waiters.pop(any_waiter, None)
                if self._store:
                    return self._pop_oldest()
                if self._stopped:
                    raise EngineClosedError(self._closed_reason())
                if deadline is not None and deadline <= loop.time():
                    raise TimeoutError("no request finished in time")
                any_waiter = AsyncWaiter(loop)
                self._any_waiters[any_waiter] = None
            try:
                await wait(any_waiter.future, deadline, loop)
            except TimeoutError:
                continue
            except BaseException:
                with self._lock:
                    if not any_waiter.woken:
                        self._any_waiters.pop(any_waiter, None)
                    elif self._store:
                        self._wake_any_locked()  # pass on the wake this task will not use
                raise

    def stream(self, request_id: str) -> RequestStream:
        """Iterate over the request's deltas; the last one has ``finished=True``.

        Deltas produced before this call come first, folded into one, and so do
        deltas produced while the consumer was busy. Abandoning the iterator before
        the end (``close()``, ``break`` and dropping it, or garbage collection)
        cancels the request.
        """
        group = SinkGroup()
        self._attach([request_id], group)
        stream = RequestStream(self._lock, group, self._abandon)
        stream.request_id = request_id
        return stream

    def stream_async(self, request_id: str) -> AsyncRequestStream:
        """``stream`` for coroutines: ``async for delta in engine.stream_async(rid)``."""
        group = SinkGroup(asyncio.get_running_loop())
        self._attach([request_id], group)
        stream = AsyncRequestStream(self._lock, group, self._abandon)
        stream.request_id = request_id
        return stream

    def stream_many_async(self, request_ids: Sequence[str]) -> AsyncStreamGroup:
        """The deltas of several requests as ``(index, delta)`` in the order they come,
        read by one coroutine (the ``n`` choices of one API call); abandoning it cancels
        the requests not finished yet."""
        group = SinkGroup(asyncio.get_running_loop())
        self._attach(request_ids, group)
        return AsyncStreamGroup(self._lock, group, self._abandon)

    def _attach(self, request_ids: Sequence[str], group: SinkGroup) -> None:
        """Give each request a sink of ``group``, holding what it produced so far."""
        with self._lock:
            requests = [self._lookup(rid) for rid in request_ids]
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
                    self._collect(request)
                    catch_up = dataclasses.replace(
                        final, new_token_ids=list(final.token_ids), new_text=final.text
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
                        ),
                        wakes,
                    )

    def _lookup(self, request_id: str) -> _Request:
        request = self._registry.get(request_id)
        if request is None:
            raise KeyError(
                f"unknown request {request_id!r}: never added, already collected, streamed, "
                "or dropped from the bounded result store"
            )
        return request

    def _collect(self, request: _Request) -> OnlineRequestOutput:
        self._store.pop(request.request_id, None)
        self._registry.pop(request.request_id, None)
        assert request.final is not None
        return request.final

    def _pop_oldest(self) -> OnlineRequestOutput:
        request_id, output = self._store.popitem(last=False)
        self._registry.pop(request_id, None)
        return output

    def _wake_any_locked(self) -> None:
        while self._any_waiters:
            waiter, _ = self._any_waiters.popitem(last=False)
            if waiter.wake():
                return

    def _closed_reason(self) -> str:
        if self._loop_error is not None:
            return f"the engine loop died: {self._loop_error!r}"
        return "the engine is closed"

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished (approximate while the loop runs)."""
        with self._lock:
            return len(self._registry) - len(self._store)

    # -- the loop thread ----------------------------------------------------------------

    def _run(self) -> None:
        commands = self._commands
        closing = False
        try:
            while not closing:
                if not self._active:  # nothing to step: sleep until a command arrives
                    closing = self._apply(commands.get())
                while not closing:
                    try:
                        command = commands.get_nowait()
                    except queue.Empty:
                        break
                    closing = self._apply(command)
                if not closing and self._active:
                    self._expire()
                if not closing and self._active:
                    self._step()
                self._publish_snapshot()
        except BaseException as exc:  # a bug in this layer: fail everything, stay closable
            logger.exception("cbgen online engine loop died")
            self._loop_error = exc
            with self._lock:
                self._closed = True
            self._shutdown(FinishReason.ERROR, f"engine loop died: {exc!r}")
            return
        self._shutdown(FinishReason.ABORTED, None)

    def snapshot(self) -> EngineSnapshot:
        """Queue lengths and KV blocks as of the last step, the queue bounds' counts as of
        now (any thread)."""
        with self._lock:
            return dataclasses.replace(
                self._snapshot,
                queued_requests=self._queued_requests,
                queued_tokens=self._queued_tokens,
                rejected=self.num_rejected,
            )

    def _publish_snapshot(self) -> None:
        core = self.core
        scheduler, allocator = core.scheduler, core.allocator
        self._snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(scheduler.swapped),
            num_blocks=allocator.num_blocks,
            num_free_blocks=allocator.num_free,
            num_evictable_blocks=allocator.num_evictable,
            preemptions=core.stats.get("preemptions", 0),
            cached_tokens=core.stats.get("cached_tokens", 0),
            unread_aborts=self.num_unread_aborts,
        )

    def _apply(self, command: tuple[int, Any]) -> bool:
        kind, arg = command
        if kind == _ADD:
            request: _Request = arg
            try:
                self.core.add_request(request.prompt, request.params, request.request_id)
            except Exception as exc:  # the core has a rule the caller's check did not
                self._publish([self._final(request, FinishReason.ERROR, str(exc))])
                return False
            self._active[request.request_id] = request
        elif kind == _ABORT or kind == _ABANDON:
            self._end(arg, FinishReason.ABORTED, None)
        elif kind == _BARRIER:
            arg.set()
        elif kind == _CLOSE:
            return True
        return False

    def _end(self, request: _Request, reason: FinishReason, error: str | None) -> None:
        """Finish a request that is still in the core (the very object: a command for an
        earlier request with the same id does nothing)."""
        if self._active.get(request.request_id) is not request:
            return
        del self._active[request.request_id]
        self.core.abort(request.request_id)
        self._publish([self._final(request, reason, error)])

    def _expire(self) -> None:
        """Finish the requests whose ``timeout`` has passed."""
        now = time.monotonic()
        expired = [r for r in self._active.values() if r.deadline is not None and r.deadline <= now]
        for request in expired:
            self._end(request, FinishReason.TIMEOUT, "the request's timeout passed")

    def _step(self) -> None:
        core = self.core
        try:
            outputs = core.step()
        except Exception as exc:
            self._fail_step(exc)
            return
        deltas = []
        active = self._active
        for out in outputs:
            request = active.get(out.request_id)
            if request is None:
                continue
            try:
                deltas.append(self._delta(request, out))
            except Exception as exc:  # e.g. the tokenizer choked on this request's ids
                logger.exception("cbgen: request %r failed after the step", out.request_id)
                active.pop(out.request_id, None)
                core.abort(out.request_id)
                deltas.append(self._final(request, FinishReason.ERROR, f"{exc!r}"))
        if deltas:
            for request in self._publish(deltas):
                self.num_unread_aborts += 1
                self._end(
                    request,
                    FinishReason.ABORTED,
                    "the stream's consumer stopped reading "
                    f"(max_unread_tokens={self.max_unread_tokens}, "
                    f"stream_timeout={self.stream_timeout})",
                )

    def _delta(self, request: _Request, out: RequestOutput) -> OnlineRequestOutput:
        finished = out.finished
        reason = out.finish_reason
        new_text = text = None
        if request.detok is not None:
            new_text = request.detok.push(out.new_token_ids)
            if finished:
                new_text += request.detok.flush()
            if request.stops is not None:
                new_text, matched = request.stops.feed(new_text, final=finished)
                if matched:
                    if not finished:
                        self.core.abort(request.request_id)
                    finished, reason = True, FinishReason.STOP
            if finished:
                text = request.text + new_text  # pieces change only on this thread
        if finished:
            del self._active[request.request_id]
        return OnlineRequestOutput(
            request_id=request.request_id,
            prompt_token_ids=out.prompt_token_ids,
            token_ids=out.token_ids,
            finished=finished,
            finish_reason=reason,
            new_token_ids=out.new_token_ids,
            error=out.error,
            num_cached_tokens=out.num_cached_tokens,
            text=text,
            new_text=new_text,
        )

    def _final(
        self, request: _Request, reason: FinishReason, error: str | None
    ) -> OnlineRequestOutput:
        """A closing delta for a request that ends without a new token."""
        new_text = None
        if request.detok is not None:
            new_text = request.detok.flush()
            if request.stops is not None:
                new_text, _ = request.stops.feed(new_text, final=True)
        return OnlineRequestOutput(
            request_id=request.request_id,
            prompt_token_ids=request.prompt,
            token_ids=list(request.token_ids),
            finished=True,
            finish_reason=reason,
            new_token_ids=[],
            error=error,
            text=None if new_text is None else (request.text or "") + new_text,
            new_text=new_text,
        )

    def _fail_step(self, exc: Exception) -> None:
        """``core.step()`` raised: finish the requests that were in the step with ``error``."""
        logger.exception("cbgen: a step failed; its requests finish with 'error'")
        message = f"{type(exc).__name__}: {exc}"
        core = self.core
        failed = [
            r
            for rid, r in self._active.items()
            if core.request_status(rid) in (RequestStatus.RUNNING, None)
        ]
        if not failed:  # the failure happened before anything ran: fail the lot, to make progress
            failed = list(self._active.values())
        for request in failed:
            self._end(request, FinishReason.ERROR, message)

    def _publish(self, deltas: list[OnlineRequestOutput]) -> list[_Request]:
        """Hand a step's deltas to their consumers (one lock, one wake-up per event loop).

        Returns the unfinished requests whose stream's consumer is too far behind
        (``max_unread_tokens`` / ``stream_timeout``), for the loop to abort.
        """
        wakes: list[SinkGroup] = []
        behind: list[_Request] = []
        max_unread, timeout = self.max_unread_tokens, self.stream_timeout
        futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
        with self._lock:
            registry = self._registry
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
                with self._lock:
                    gone = [
                        s.request
                        for g in wakes
                        if g.loop is loop
                        for s in g.sinks
                        if not s.done and s.request.final is None
                    ]
                self._abandon(gone)
        return behind

    def _settle_locked(self, request: _Request, final: OnlineRequestOutput) -> None:
        request.final = final
        self._unqueue_locked(request)
        streamed = request.sink is not None
        request.sink = None
        waiters = request.waiters
        if waiters or streamed:  # claimed: its consumers have it, nothing is retained
            self._registry.pop(request.request_id, None)
            request.waiters = []
            for waiter in waiters:
                waiter.wake()
            return
        self._store[request.request_id] = final
        while len(self._store) > self.max_retained_results:
            dropped, _ = self._store.popitem(last=False)
            self._registry.pop(dropped, None)
            self.num_dropped_results += 1
            if self.num_dropped_results == 1:
                logger.warning(
                    "cbgen: dropping finished results nobody collected (max_retained_results=%d)",
                    self.max_retained_results,
                )
        if self._store:
            self._wake_any_locked()

    def _shutdown(self, reason: FinishReason, error: str | None) -> None:
        """Settle every request still open, then wake everyone (runs on the loop thread)."""
        for request_id in list(self._active):
            try:
                self.core.abort(request_id)
            except Exception:  # a broken core must not keep the waiters asleep
                logger.exception("cbgen: could not abort %r at shutdown", request_id)
        self._active.clear()
        with self._lock:
            open_requests = [r for r in self._registry.values() if r.final is None]
        self._publish([self._final(r, reason, error) for r in open_requests])
        with self._lock:
            self._stopped = True
            waiters = list(self._any_waiters)
            self._any_waiters.clear()
        for waiter in waiters:
            waiter.wake()
        while True:  # release sync() callers queued behind the close
            try:
                kind, arg = self._commands.get_nowait()
            except queue.Empty:
                break
            if kind == _BARRIER:
                arg.set()
        with contextlib.suppress(Exception):  # a broken core keeps its last snapshot
            self._publish_snapshot()

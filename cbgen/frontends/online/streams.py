"""Bounded delivery of a request's deltas to the thread or coroutine that streams it.

A stream never holds a queue of deltas. Each streamed request has one ``Sink``: what
its consumer has not read yet, merged into a single delta (the new token ids appended,
the new text pieces kept in a list and joined when read). A consumer that keeps up
reads one step's delta at a time; one that falls behind gets everything it missed in
one delta, and memory stays linear in what is unread. The online engine bounds that
(``max_unread_tokens``, ``stream_timeout``) and aborts a request whose consumer stopped
reading. One ``SinkGroup`` (a consumer: a thread or an event loop's task) can follow
several sinks, which is how the server reads the ``n`` choices of one call without a
task per choice.

Every field is guarded by the engine's lock; the engine's loop thread writes (``offer``)
and the consumer takes (``take``). A stream's ``close()`` posts an abandon command for
each request it still follows; commands carry the request object, so a stale stream
never cancels a newer request that reuses its id.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator
from typing import TYPE_CHECKING, Any

from .waiters import resolve

if TYPE_CHECKING:
    from .outputs import OnlineRequestOutput


class Sink:
    """The unread part of one request's stream, merged into one delta."""

    __slots__ = (
        "group",
        "index",
        "request",
        "tokens",
        "texts",
        "logprobs",
        "last",
        "since",
        "done",
    )

    def __init__(self, group: SinkGroup, index: int, request: Any) -> None:
        self.group = group
        self.index = index
        self.request = request  # the engine's record, for abandoning it
        self.tokens: list[int] = []
        self.texts: list[str] = []
        self.logprobs: list[dict[int, float]] = []  # per unread token, when asked for
        self.last: OnlineRequestOutput | None = None  # the newest unread delta
        self.since = 0.0  # when the oldest unread delta arrived
        self.done = False  # the consumer has taken the final delta

    @property
    def unread_tokens(self) -> int:
        return len(self.tokens)

    def offer(self, delta: OnlineRequestOutput, wakes: list[SinkGroup]) -> None:
        """Merge ``delta`` into the unread part (under the engine's lock)."""
        if self.last is None:
            self.since = time.monotonic()
            self.group.ready.append(self.index)
            wakes.append(self.group)
        self.tokens.extend(delta.new_token_ids)
        if delta.new_text:
            self.texts.append(delta.new_text)
        if delta.new_logprobs:
            self.logprobs.extend(delta.new_logprobs)
        self.last = delta

    def take(self) -> OnlineRequestOutput:
        """Everything unread as one delta (under the engine's lock)."""
        last = self.last
        assert last is not None
        merged = dataclasses.replace(
            last,
            new_token_ids=self.tokens,
            new_text=None if last.new_text is None else "".join(self.texts),
            new_logprobs=None if last.new_logprobs is None else self.logprobs,
        )
        self.tokens, self.texts, self.logprobs, self.last = [], [], [], None
        if merged.finished:
            self.done = True
        return merged


class SinkGroup:
    """One consumer's sinks, the order they became readable in, and how to wake it.

    A thread waits on ``event``; a coroutine on ``future``, resolved on its event loop.
    """

    __slots__ = ("sinks", "ready", "event", "loop", "future")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.sinks: list[Sink] = []
        self.ready: deque[int] = deque()
        self.loop = loop
        self.event = threading.Event() if loop is None else None
        self.future: asyncio.Future | None = None

    def add(self, request: Any) -> Sink:
        sink = Sink(self, len(self.sinks), request)
        self.sinks.append(sink)
        return sink

    def wake(self, futures: dict[asyncio.AbstractEventLoop, list[asyncio.Future]]) -> None:
        """Wake the consumer (under the engine's lock); an event loop's futures are
        collected so each loop gets one ``call_soon_threadsafe`` per step."""
        if self.event is not None:
            self.event.set()
        elif self.future is not None and not self.future.done():
            assert self.loop is not None
            futures.setdefault(self.loop, []).append(self.future)
            self.future = None

    @property
    def finished(self) -> bool:
        return all(s.done for s in self.sinks)


def resolve_all(futures: list[asyncio.Future]) -> None:
    """Resolve a step's futures of one event loop in one callback."""
    for future in futures:
        resolve(future)


class _StreamBase:
    """What every stream face shares: taking the next delta and cancel-on-abandon."""

    def __init__(
        self, lock: threading.Lock, group: SinkGroup, abandon: Callable[[list[Any]], None]
    ) -> None:
        self._lock = lock
        self._group = group
        self._abandon = abandon
        self._closed = False

    def _take_locked(self) -> tuple[int, OnlineRequestOutput] | None:
        group = self._group
        if not group.ready:
            return None
        index = group.ready.popleft()
        return index, group.sinks[index].take()

    def close(self) -> None:
        """Stop listening; every request not finished yet is cancelled."""
        if self._closed:
            return
        self._closed = True
        group = self._group
        with self._lock:
            open_requests = [s.request for s in group.sinks if not s.done]
            future = group.future
        if open_requests:
            self._abandon(open_requests)
        if future is not None and not future.done():  # a waiting coroutine ends its loop
            assert group.loop is not None
            try:
                group.loop.call_soon_threadsafe(resolve_all, [future])
            except RuntimeError:  # its event loop is closed: nobody waits any more
                pass

    def __del__(self) -> None:
        # No lock here: a finalizer can run inside any thread's critical section (the
        # cycle collector), even one holding the engine's lock. Abandoning a request that
        # has finished meanwhile is a no-op for the loop, so reading ``done`` unlocked is safe.
        if not getattr(self, "_closed", True):
            self._closed = True
            open_requests = [s.request for s in self._group.sinks if not s.done]
            if open_requests:
                self._abandon(open_requests)


class RequestStream(_StreamBase, Iterator["OnlineRequestOutput"]):
    """The deltas of one request (from ``Engine.stream``); cancels it if abandoned."""

    request_id: str

    def __iter__(self) -> RequestStream:
        return self

    def __next__(self) -> OnlineRequestOutput:
        group = self._group
        while True:
            with self._lock:
                if group.finished or self._closed:
                    raise StopIteration
                item = self._take_locked()
                if item is None:
                    assert group.event is not None
                    group.event.clear()
            if item is not None:
                return item[1]
            group.event.wait()


class AsyncStreamGroup(_StreamBase, AsyncIterator[tuple[int, "OnlineRequestOutput"]]):
    """The deltas of several requests as ``(index, delta)``, in the order they come
    (from ``Engine.stream_many_async``); cancels the unfinished ones if abandoned."""

    def __aiter__(self) -> AsyncStreamGroup:
        return self

    async def __anext__(self) -> tuple[int, OnlineRequestOutput]:
        group = self._group
        while True:
            with self._lock:
                if group.finished or self._closed:
                    raise StopAsyncIteration
                item = self._take_locked()
                if item is None:
                    assert group.loop is not None
                    future = group.future = group.loop.create_future()
            if item is not None:
                return item
            await future

    async def aclose(self) -> None:
        self.close()


class AsyncRequestStream(AsyncStreamGroup):
    """The deltas of one request (from ``Engine.stream_async``); cancels it if abandoned."""

    request_id: str

    def __aiter__(self) -> AsyncRequestStream:
        return self

    async def __anext__(self) -> OnlineRequestOutput:  # type: ignore[override]
        return (await super().__anext__())[1]

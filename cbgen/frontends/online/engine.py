"""``Engine``: the online engine's public face, thread-safe and asyncio-friendly.

It checks and queues requests for the loop thread (``cbgen.frontends.online.loop``), hands out
results (``cbgen.frontends.online.results``) and streams (``cbgen.frontends.online.streams``), each method
with a blocking face for threads and an ``async`` one for coroutines.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from typing import Any

import torch

from ...core.config import EngineConfig
from ...core.engine_core import EngineCore
from ...core.loras import LoraInfo
from ...core.weights import NamedTensors
from ...sampling.params import SamplingParams
from .loop import ABORT, ADD, BARRIER, CALL, CLOSE, EngineLoop
from .outputs import EngineClosedError, EngineSnapshot, OnlineRequestOutput
from .results import RequestRecord, ResultStore
from .streams import AsyncRequestStream, AsyncStreamGroup, RequestStream, SinkGroup
from .text import Decoders, TextOptions, stop_matcher
from .waiters import AsyncWaiter, ThreadWaiter, Waiter, wait


class _Part:
    """An attribute of the engine that lives on one of its parts (read and written there)."""

    def __init__(self, part: str) -> None:
        self.part = part
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, engine: Any, owner: type | None = None) -> Any:
        return self if engine is None else getattr(getattr(engine, self.part), self.name)

    def __set__(self, engine: Any, value: Any) -> None:
        setattr(getattr(engine, self.part), self.name, value)


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

    max_retained_results = _Part("_results")
    max_unread_tokens = _Part("_results")
    stream_timeout = _Part("_results")
    num_dropped_results = _Part("_results")
    num_rejected = _Part("_results")  # add_request calls refused by the queue bounds
    num_unread_aborts = _Part("_loop")  # streams aborted because their consumer stopped reading

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
        # The core's grammars (structured output) need the tokenizer; its text does not:
        # this layer detokenizes and matches stop strings itself (per-request options),
        # which would otherwise be done twice for every token.
        self.core = EngineCore(model, config, tokenizer, detokenize=False)
        self.config = self.core.config
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens  # the default of add_request
        self._decoders = Decoders(tokenizer) if tokenizer is not None else None
        self._results = ResultStore(
            self.config, max_retained_results, max_unread_tokens, stream_timeout
        )
        self._lock = self._results.lock
        self._registry = self._results.registry  # added, not yet collected or dropped
        self._loop = EngineLoop(self.core, self._results)
        self._ids = itertools.count()

    # -- lifetime -----------------------------------------------------------------------

    def start(self) -> Engine:
        """Start the engine's loop thread (``with Engine(...)`` does it); requests added
        before it wait in the queue. Raises ``EngineClosedError`` after ``close()``."""
        with self._lock:
            if self._results.closed:
                raise EngineClosedError("the engine is closed")
            self._loop.start_locked()
        return self

    def close(self) -> None:
        """Abort unfinished requests, wake every waiter, stop the loop, restore the model."""
        with self._lock:
            if not self._results.closed:
                self._results.closed = True
                self._loop.start_locked()  # a loop that never ran still settles queued requests
                self._loop.post(CLOSE, None)
        self._loop.join()

    def __enter__(self) -> Engine:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def is_running(self) -> bool:
        """Whether the loop thread is started and has not stopped (closed or failed)."""
        return self._loop.thread is not None and not self._results.stopped

    @property
    def failure(self) -> str | None:
        """Why the engine stopped on its own (a tensor-parallel rank died, or the loop
        failed), or None."""
        if self._results.loop_error is None:
            return None
        return self._results.closed_reason()

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt: Sequence[int] | str,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        stop: Sequence[str] | str | None = None,
        timeout: float | None = None,
        skip_special_tokens: bool | None = None,
        spaces_between_special_tokens: bool = True,
        lora: str | None = None,
    ) -> str:
        """Queue a request and return its id; an invalid one raises ``ValueError`` here.

        ``prompt`` is token ids (or a string, encoded with the tokenizer). ``stop``
        lists stop strings, matched on the decoded text (needs a tokenizer), on top of
        ``params.stop``; the online engine matches them in its text layer (the core
        gets the params without them), with ``params.include_stop_str_in_output``.
        ``timeout``: seconds from now after which the request finishes with
        ``"timeout"`` (and what it generated so far). ``skip_special_tokens``
        (default: the engine's) and ``spaces_between_special_tokens`` shape this
        request's text (``cbgen.frontends.online.text.TextOptions``). With ``params.logprobs``
        / ``params.prompt_logprobs`` the outputs carry them (``OnlineRequestOutput``).
        Raises ``EngineOverloadedError`` when the queue bounds of ``EngineConfig`` are
        reached. ``lora`` names an adapter ``add_lora`` loaded (None: the base model).
        """
        params = params if params is not None else SamplingParams()
        if timeout is not None and not (
            isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and timeout > 0
        ):
            raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")
        auto_id = request_id is None
        rid = self._next_id() if auto_id else request_id
        if not isinstance(rid, str):
            raise ValueError(f"request id must be a string, got {rid!r}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"request {rid!r}: a text prompt needs a tokenizer")
            prompt = self.tokenizer.encode(prompt)
        if params.stop:  # matched here, on the text, like the ``stop`` argument
            stop = params.stop_strings + ([] if stop is None else _as_list(stop))
            params = dataclasses.replace(params, stop=None)
        stops = stop_matcher(rid, stop, self.tokenizer, params.include_stop_str_in_output)
        prompt_ids = self._validate(rid, prompt, params)
        if lora is not None and lora not in self.core.lora_names:  # the loop checks it again
            known = ", ".join(sorted(self.core.lora_names)) or "none"
            raise ValueError(f"request {rid!r}: unknown LoRA adapter {lora!r} (loaded: {known})")
        deadline = None if timeout is None else time.monotonic() + timeout
        request = RequestRecord(rid, prompt_ids, params, deadline)
        request.lora = lora
        if self._decoders is not None:
            skip = self.skip_special_tokens if skip_special_tokens is None else skip_special_tokens
            options = TextOptions(bool(skip), bool(spaces_between_special_tokens))
            request.text_processor = self._decoders.processor(prompt_ids, options, stops)
            request.pieces = []
        with self._lock:
            rid = self._results.add_locked(request, self._next_id if auto_id else None)
            self._loop.post(ADD, request)
            self._loop.start_locked()
        return rid

    def _next_id(self) -> str:
        return f"req-{next(self._ids)}"

    def _validate(self, rid: str, prompt: Sequence[int], params: SamplingParams) -> list[int]:
        # The core's own rules; they read only immutable settings, so any thread may run
        # them. A grammar is compiled here too (cached), so a bad one fails add_request.
        processor = self.core.input_processor
        ids = processor.validate(
            rid, prompt, params, one_sample="are not supported online; add one request per sample"
        )
        processor.check_structured(rid, params)
        return ids

    def check_structured_output(self, params: SamplingParams) -> None:
        """Compile ``params.structured_output`` for this model now, on the caller's thread
        (``ValueError`` saying what is wrong with it). ``add_request`` does the same; a
        server calls this first off its event loop, so a large schema never stalls it."""
        self.core.input_processor.check_structured("check", params)

    @property
    def num_queued(self) -> tuple[int, int]:
        """Requests added and not started yet (no token published), and their prompt tokens."""
        with self._lock:
            return self._results.queued_requests, self._results.queued_tokens

    @property
    def num_unfinished(self) -> int:
        """Requests added and not yet finished (approximate while the loop runs)."""
        with self._lock:
            return len(self._registry) - len(self._results.unclaimed)

    def cancel(self, request_id: str) -> bool:
        """Abort a request; its blocks come back before the next step.

        Returns False when the request is unknown or already finished. Its
        consumers get a final output with ``finish_reason == "aborted"``.
        """
        with self._lock:
            request = self._registry.get(request_id)
            if request is None or request.final is not None or self._results.stopped:
                return False
            self._loop.post(ABORT, request)
        return True

    abort = cancel

    def sync(self, timeout: float | None = None) -> None:
        """Return once the loop has applied every add and cancel issued before this call.

        Cancelled and abandoned requests have given their blocks back by then.
        """
        done = threading.Event()
        with self._lock:
            if self._results.stopped:
                return
            self._loop.start_locked()
            self._loop.post(BARRIER, done)
        if not done.wait(timeout):
            raise TimeoutError("the engine loop did not catch up in time")

    # -- weights and memory (RL): the core's methods, run on the loop thread -------------

    def update_weights(self, weights: NamedTensors) -> int:
        """``EngineCore.update_weights`` between two steps: every token after it comes
        from ``weights``; requests in flight go on (their K/V computed again)."""
        return int(self._call(lambda core: core.update_weights(weights)))

    def refresh(self) -> None:
        """``EngineCore.refresh`` between two steps (after changing weights in place)."""
        self._call(EngineCore.refresh)

    def pause(self, *, keep_weights: bool = False) -> None:
        """``EngineCore.pause``: the loop stops stepping (requests wait, new ones queue) and
        the model gets its own forward back, until ``resume()``. ``keep_weights`` keeps
        the packed copies for a quick ``resume()`` (LoRA training: a frozen base)."""
        self._call(lambda core: core.pause(keep_weights=keep_weights))

    def resume(self) -> None:
        """``EngineCore.resume``: the loop steps again, from the weights as they are now."""
        self._call(EngineCore.resume)

    def sleep(self) -> None:
        """``EngineCore.sleep``: paused, with the KV cache and packed weights freed."""
        self._call(EngineCore.sleep)

    def wake(self) -> None:
        """``EngineCore.wake``: the KV cache back and the loop stepping again."""
        self._call(EngineCore.wake)

    # -- LoRA adapters: the core's methods, run on the loop thread --------------------------

    def add_lora(self, name: str, source: Any, *, adapter_name: str | None = None) -> None:
        """``EngineCore.add_lora`` between two steps."""
        self._call(lambda core: core.add_lora(name, source, adapter_name=adapter_name))

    def remove_lora(self, name: str) -> None:
        """``EngineCore.remove_lora`` between two steps."""
        self._call(lambda core: core.remove_lora(name))

    def list_loras(self) -> list[LoraInfo]:
        """``EngineCore.list_loras``, read between two steps."""
        return list(self._call(EngineCore.list_loras))

    def update_lora(self, name: str, tensors: Any) -> int:
        """``EngineCore.update_lora`` between two steps: every token after it comes from
        the new adapter weights (the base executor is not rebuilt)."""
        return int(self._call(lambda core: core.update_lora(name, tensors)))

    def _call(self, method: Callable[[EngineCore], Any]) -> Any:
        future: futures.Future[Any] = futures.Future()
        with self._lock:
            if self._results.stopped:
                raise EngineClosedError("the engine is closed")
            self._loop.start_locked()
            self._loop.post(CALL, (method, future))
        return future.result()

    def snapshot(self) -> EngineSnapshot:
        """Queue lengths and KV blocks as of the last step, the queue bounds' counts as of
        now (any thread)."""
        results = self._results
        with self._lock:
            return dataclasses.replace(
                self._loop.snapshot,
                queued_requests=results.queued_requests,
                queued_tokens=results.queued_tokens,
                rejected=results.num_rejected,
            )

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
        results = self._results
        deadline = None if timeout is None else time.monotonic() + timeout
        if request_id is not None:
            claim = results.result_or_wait(request_id, ThreadWaiter)
            if isinstance(claim, OnlineRequestOutput):
                return claim
            request, waiter = claim
            waiter.event.wait(_remaining(deadline))
            return results.result_after_wait(request, waiter)
        waiter: ThreadWaiter | None = None
        while True:
            got = results.next_or_wait(waiter, deadline, time.monotonic, ThreadWaiter)
            if not isinstance(got, Waiter):
                return got
            waiter = got
            waiter.event.wait(_remaining(deadline))

    async def get_result_async(
        self, request_id: str | None = None, timeout: float | None = None
    ) -> OnlineRequestOutput:
        """``get_result`` for coroutines: waits on an asyncio future, never blocks the loop."""
        results = self._results
        loop = asyncio.get_running_loop()
        deadline = None if timeout is None else loop.time() + timeout

        def new_waiter() -> AsyncWaiter:
            return AsyncWaiter(loop)

        if request_id is not None:
            claim = results.result_or_wait(request_id, new_waiter)
            if isinstance(claim, OnlineRequestOutput):
                return claim
            request, waiter = claim
            try:
                await wait(waiter.future, deadline, loop)
            except TimeoutError:
                pass
            except BaseException:
                results.forget_waiter(request, waiter)
                raise
            return results.result_after_wait(request, waiter)
        any_waiter: AsyncWaiter | None = None
        while True:
            got = results.next_or_wait(any_waiter, deadline, loop.time, new_waiter)
            if not isinstance(got, Waiter):
                return got
            any_waiter = got
            try:
                await wait(any_waiter.future, deadline, loop)
            except TimeoutError:
                continue
            except BaseException:
                results.leave_any(any_waiter)
                raise

    def stream(self, request_id: str) -> RequestStream:
        """Iterate over the request's deltas; the last one has ``finished=True``.

        Deltas produced before this call come first, folded into one, and so do
        deltas produced while the consumer was busy. Abandoning the iterator before
        the end (``close()``, ``break`` and dropping it, or garbage collection)
        cancels the request.
        """
        group = SinkGroup()
        self._results.attach([request_id], group)
        stream = RequestStream(self._lock, group, self._loop.abandon)
        stream.request_id = request_id
        return stream

    def stream_async(self, request_id: str) -> AsyncRequestStream:
        """``stream`` for coroutines: ``async for delta in engine.stream_async(rid)``."""
        group = SinkGroup(asyncio.get_running_loop())
        self._results.attach([request_id], group)
        stream = AsyncRequestStream(self._lock, group, self._loop.abandon)
        stream.request_id = request_id
        return stream

    def stream_many_async(self, request_ids: Sequence[str]) -> AsyncStreamGroup:
        """The deltas of several requests as ``(index, delta)`` in the order they come,
        read by one coroutine (the ``n`` choices of one API call); abandoning it cancels
        the requests not finished yet."""
        group = SinkGroup(asyncio.get_running_loop())
        self._results.attach(request_ids, group)
        return AsyncStreamGroup(self._lock, group, self._loop.abandon)


def _as_list(stop: Sequence[str] | str) -> list[str]:
    return [stop] if isinstance(stop, str) else list(stop)


def _remaining(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())

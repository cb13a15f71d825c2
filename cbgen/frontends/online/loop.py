"""The online engine's loop thread: the one thread that drives ``EngineCore``.

Public methods talk to it through a ``queue.SimpleQueue`` of commands (add, abort,
abandon, barrier, close, and calls of the core's weight and memory methods) that it
drains between steps; while the core is paused it steps nothing; when there is no work it blocks
on that queue (no busy-wait). ``SimpleQueue.put`` is reentrant, so even a finalizer of
an abandoned stream can post a cancel. After each step it turns the core's outputs into
``OnlineRequestOutput`` deltas (with text, ``cbgen.frontends.online.text``), hands them to the
``ResultStore``, aborts the requests whose stream's consumer stopped reading and
publishes an ``EngineSnapshot``.

Failures: an exception from ``core.step()`` finishes the requests that were in it (the
running ones) with ``"error"`` and the message, aborts them in the core, and the loop
goes on, unless the core says it can run no more steps (``EngineCore.failure``: a
tensor-parallel rank died): then every request finishes with that error, the engine
refuses new ones, and the loop ends. On close it aborts what is left and settles every request with ``"aborted"``.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from typing import Any

from ...core.engine_core import EngineCore
from ...executor.cpu.openmp import release_thread_team
from ...requests.request import FinishReason, RequestOutput, RequestStatus
from ...sampling.logprobs import copy_entries
from .outputs import EngineSnapshot, OnlineRequestOutput
from .results import CoreFailed, RequestRecord, ResultStore

logger = logging.getLogger(__name__)

ADD, ABORT, ABANDON, BARRIER, CLOSE, CALL = range(6)


class EngineLoop:
    """The loop thread and what only it touches: the core and the requests inside it."""

    def __init__(self, core: EngineCore, results: ResultStore) -> None:
        self.core = core
        self.results = results
        self.commands: queue.SimpleQueue = queue.SimpleQueue()
        self.active: dict[str, RequestRecord] = {}  # loop only: requests inside the core
        self.thread: threading.Thread | None = None
        self.num_unread_aborts = 0  # streams aborted because their consumer stopped reading
        self.core_closed = False
        self.snapshot = EngineSnapshot()
        self.publish_snapshot()

    # -- from any thread ----------------------------------------------------------------

    def start_locked(self) -> None:
        """Start the thread if it is not running (under the results' lock)."""
        if self.thread is None:
            # The loop thread runs the forward passes; the caller's idle OpenMP team
            # would make libgomp throttle the loop's team (cbgen.executor.cpu.openmp).
            release_thread_team()
            self.thread = threading.Thread(target=self.run, name="cbgen-online", daemon=True)
            self.thread.start()

    def post(self, kind: int, arg: Any) -> None:
        self.commands.put((kind, arg))

    def abandon(self, requests: list[RequestRecord]) -> None:
        """A stream's consumer left: cancel what it followed (reentrant, any thread)."""
        for request in requests:
            self.commands.put((ABANDON, request))

    def join(self) -> None:
        """Wait for the thread to end (unless called on it), then give the model its
        attention implementation back."""
        thread = self.thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()
        if not self.core_closed and (thread is None or not thread.is_alive()):
            self.core_closed = True
            self.core.close()

    # -- the loop thread ----------------------------------------------------------------

    def run(self) -> None:
        commands = self.commands
        closing = False
        try:
            while not closing:
                if not self.active or self.core.is_paused:  # nothing to step: sleep until
                    closing = self._apply(commands.get())  # a command arrives
                while not closing:
                    try:
                        command = commands.get_nowait()
                    except queue.Empty:
                        break
                    closing = self._apply(command)
                if not closing and self.active:
                    self._expire()
                if not closing and self.active and not self.core.is_paused:
                    self._step()
                self.publish_snapshot()
        except BaseException as exc:  # the core failed for good, or a bug in this layer:
            if isinstance(exc, CoreFailed):  # fail everything, say why, stay closable
                message = str(exc)
            else:
                logger.exception("cbgen online engine loop died")
                message = f"engine loop died: {exc!r}"
            self.results.loop_error = exc
            with self.results.lock:
                self.results.closed = True
            self._shutdown(FinishReason.ERROR, message)
            return
        self._shutdown(FinishReason.ABORTED, None)

    def publish_snapshot(self) -> None:
        core = self.core
        scheduler, allocator = core.scheduler, core.allocator
        self.snapshot = EngineSnapshot(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting) + len(scheduler.swapped),
            num_blocks=allocator.num_blocks,
            num_free_blocks=allocator.num_free,
            num_evictable_blocks=allocator.num_evictable,
            preemptions=core.stats.get("preemptions", 0),
            cached_tokens=core.stats.get("cached_tokens", 0),
            unread_aborts=self.num_unread_aborts,
            spec_proposed_tokens=int(core.stats.get("spec_proposed_tokens", 0)),
            spec_accepted_tokens=int(core.stats.get("spec_accepted_tokens", 0)),
            spec_verifications=int(core.stats.get("spec_verifications", 0)),
        )

    def _apply(self, command: tuple[int, Any]) -> bool:
        kind, arg = command
        if kind == ADD:
            request: RequestRecord = arg
            try:
                self.core.add_request(
                    request.prompt, request.params, request.request_id, lora=request.lora
                )
            except Exception as exc:  # the core has a rule the caller's check did not
                self._publish([self._final(request, FinishReason.ERROR, str(exc))])
                return False
            self.active[request.request_id] = request
        elif kind == ABORT or kind == ABANDON:
            self._end(arg, FinishReason.ABORTED, None)
        elif kind == BARRIER:
            arg.set()
        elif kind == CALL:  # a core method the caller waits for (weights, pause, sleep)
            method, future = arg
            try:
                future.set_result(method(self.core))
            except BaseException as exc:
                future.set_exception(exc)
        elif kind == CLOSE:
            return True
        return False

    def _end(self, request: RequestRecord, reason: FinishReason, error: str | None) -> None:
        """Finish a request that is still in the core (the very object: a command for an
        earlier request with the same id does nothing)."""
        if self.active.get(request.request_id) is not request:
            return
        del self.active[request.request_id]
        self.core.abort(request.request_id)
        self._publish([self._final(request, reason, error)])

    def _expire(self) -> None:
        """Finish the requests whose ``timeout`` has passed."""
        now = time.monotonic()
        expired = [r for r in self.active.values() if r.deadline is not None and r.deadline <= now]
        for request in expired:
            self._end(request, FinishReason.TIMEOUT, "the request's timeout passed")

    def _step(self) -> None:
        core = self.core
        try:
            outputs = core.step()
        except Exception as exc:
            if core.failure is not None:
                logger.error("cbgen: the engine failed: %s", core.failure)
                raise CoreFailed(f"the engine failed: {core.failure}") from exc
            self._fail_step(exc)
            return
        deltas = []
        active = self.active
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
                    f"(max_unread_tokens={self.results.max_unread_tokens}, "
                    f"stream_timeout={self.results.stream_timeout})",
                )

    def _delta(self, request: RequestRecord, out: RequestOutput) -> OnlineRequestOutput:
        finished = out.finished
        reason = out.finish_reason
        new_text = text = None
        if request.text_processor is not None:
            new_text, matched = request.text_processor.push(out.new_token_ids, finished)
            if matched:
                if not finished:
                    self.core.abort(request.request_id)
                finished, reason = True, FinishReason.STOP
            if finished:
                text = request.text + new_text  # pieces change only on this thread
        if finished:
            del self.active[request.request_id]
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
            logprobs=out.logprobs if finished else None,  # whole, like text, on the last delta
            new_logprobs=out.new_logprobs,
            prompt_logprobs=out.prompt_logprobs,
        )

    def _final(
        self, request: RequestRecord, reason: FinishReason, error: str | None
    ) -> OnlineRequestOutput:
        """A closing delta for a request that ends without a new token."""
        new_text = None
        if request.text_processor is not None:
            new_text = request.text_processor.flush()
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
            logprobs=copy_entries(request.logprobs),
            new_logprobs=None if request.logprobs is None else [],
            prompt_logprobs=request.prompt_logprobs,
        )

    def _fail_step(self, exc: Exception) -> None:
        """``core.step()`` raised: finish the requests that were in the step with ``error``."""
        logger.exception("cbgen: a step failed; its requests finish with 'error'")
        message = f"{type(exc).__name__}: {exc}"
        core = self.core
        failed = [
            r
            for rid, r in self.active.items()
            if core.request_status(rid) in (RequestStatus.RUNNING, None)
        ]
        if not failed:  # the failure happened before anything ran: fail the lot, to make progress
            failed = list(self.active.values())
        for request in failed:
            self._end(request, FinishReason.ERROR, message)

    def _publish(self, deltas: list[OnlineRequestOutput]) -> list[RequestRecord]:
        """Publish deltas; abandon the requests whose consumer's event loop is gone and
        return those whose stream's consumer is too far behind."""
        behind, gone = self.results.publish(deltas)
        if gone:
            self.abandon(gone)
        return behind

    def _shutdown(self, reason: FinishReason, error: str | None) -> None:
        """Settle every request still open, then wake everyone."""
        for request_id in list(self.active):
            try:
                self.core.abort(request_id)
            except Exception:  # a broken core must not keep the waiters asleep
                logger.exception("cbgen: could not abort %r at shutdown", request_id)
        self.active.clear()
        open_requests = self.results.open_requests()
        self._publish([self._final(r, reason, error) for r in open_requests])
        self.results.stop()
        while True:  # release sync() callers queued behind the close
            try:
                kind, arg = self.commands.get_nowait()
            except queue.Empty:
                break
            if kind == BARRIER:
                arg.set()
        with contextlib.suppress(Exception):  # a broken core keeps its last snapshot
            self.publish_snapshot()

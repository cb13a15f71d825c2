"""The online engine: a background step loop, thread-safe and asyncio-friendly.

``Engine`` wraps the synchronous core (``cbgen.core.engine_core.EngineCore``) for servers and
interactive use: requests arrive from any thread (or coroutine) at any time, their
tokens stream back as ``OnlineRequestOutput`` deltas with incremental text, and
finished results can be collected by id or in completion order.

One concept per module:

* ``engine``: ``Engine``, the public face; it checks requests, queues them for the
  loop and hands out results and streams, with a blocking and an ``async`` face.
* ``loop``: the one thread that owns the core. Public methods talk to it through a
  queue of commands (add, abort, close) that it drains between steps; with no work
  it blocks on that queue (no busy-wait). An exception from ``core.step()`` finishes
  the requests that were in it with ``"error"`` and the loop goes on; ``close()``
  aborts what is left, wakes every waiter with an ``"aborted"`` output, joins the
  loop and gives the model its attention implementation back.
* ``results``: every request from ``add_request`` until its result is taken, under
  one lock: each step's deltas go to at most one stream per request and to whoever
  waits for it; an unclaimed finished request goes to a bounded store (oldest
  dropped first) and wakes one ``get_result()`` waiter. Nothing scans or polls; a
  finished request costs O(1). ``EngineConfig.max_waiting_requests`` /
  ``max_queued_tokens`` bound the requests (and prompt tokens) added but not yet
  started (``EngineOverloadedError``).
* ``streams``: a stream's unread deltas merged into one, bounded; a consumer that
  leaves more than ``max_unread_tokens`` unread, or a delta unread for
  ``stream_timeout`` seconds, has its request aborted. ``waiters``: how a waiting
  thread or coroutine is woken.
* ``text``: with a tokenizer, incremental detokenization and stop strings; a matched
  stop string truncates the text, finishes the request with ``"stop"`` and aborts it
  in the core (blocks freed).
* ``outputs``: ``OnlineRequestOutput``, ``EngineSnapshot`` and the errors.
"""

from .engine import Engine
from .outputs import EngineClosedError, EngineOverloadedError, EngineSnapshot, OnlineRequestOutput
from .streams import AsyncRequestStream, AsyncStreamGroup, RequestStream

__all__ = [
    "AsyncRequestStream",
    "AsyncStreamGroup",
    "Engine",
    "EngineClosedError",
    "EngineOverloadedError",
    "EngineSnapshot",
    "OnlineRequestOutput",
    "RequestStream",
]

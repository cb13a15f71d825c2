"""Keeping a long-running server's resident memory flat: the KV cache, native caches,
the C heap.

A server sees batches of every shape, and its memory grows in layers that Python's own
objects do not show (``tracemalloc`` over 2,500 calls: +2 MiB, the bounded token-text
cache):

* the KV cache's host pages are committed as blocks are first written
  (``cbgen.cache.paged_cache``), so RSS climbs for as long as new blocks get used: up to
  the whole cache (750 MiB for SmolLM2 at 1,024 blocks of 16). ``cbgen serve
  --commit-kv-cache`` commits it at start (``EngineCore.commit_cache_memory``): the
  memory is held from the first call, and a machine without it fails at start rather
  than hours later (not the default: the default cache is 40% of free memory, up to
  8 GiB, more than most runs touch);
* oneDNN keeps a compiled primitive per GEMM shape, up to 1,024 of them
  (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``); every new batch shape adds one;
* freed heap memory goes back to the OS only from the heap's top, unless trimmed.

``bench/server_soak.py`` on a tiny Llama (3,000 varied calls; RSS after 500 calls and at
the end; wall time): default 862 -> 1,251 MiB in 50 s; primitive cache 0: 772 -> 940 MiB
in 65 s; a fixed 64 KiB glibc ``mmap`` threshold as well: 730 -> 839 MiB but 94 s, too
slow to be a default; the settings here (a cache of 128 primitives, the heap trimmed)
with a 32 MiB threshold: 848 -> 1,036 MiB in 56 s. Growth stops at ~2,000 calls in each.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

from ...sysmem import trim_heap

__all__ = [
    "DEFAULT_PRIMITIVE_CACHE",
    "HeapTrimmer",
    "bound_native_memory",
]

logger = logging.getLogger(__name__)

DEFAULT_PRIMITIVE_CACHE = 128
"""oneDNN primitives kept (its default is 1,024): the decode shapes a server meets most
stay compiled; rarer prefill shapes are compiled again when they recur."""


def bound_native_memory(primitive_cache: int = DEFAULT_PRIMITIVE_CACHE) -> dict[str, object]:
    """Cap oneDNN's primitive cache (unless ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` is set:
    the user's value wins). Call before the model
    runs: oneDNN reads the capacity at its first primitive. Returns what was set."""
    applied: dict[str, object] = {}
    if "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in os.environ:
        os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(primitive_cache)
        applied["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = primitive_cache
    return applied


class HeapTrimmer:
    """A thread that returns the free heap to the OS each time the engine goes idle
    (``busy`` false after being true), checking every ``interval`` seconds, and at least
    every ``every`` seconds under constant load. A trim holds the allocator for a few
    milliseconds, which an idle moment does not feel."""

    def __init__(
        self, busy: Callable[[], bool], interval: float = 2.0, every: float = 10.0
    ) -> None:
        if interval <= 0 or every <= 0:
            raise ValueError(f"interval and every must be positive, got {interval}, {every}")
        self.busy = busy
        self.interval = interval
        self.every = every
        self.trims = 0
        self._since = 0.0  # seconds busy since the last trim
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cbgen-heap-trim", daemon=True)

    def start(self) -> HeapTrimmer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(self.interval + 5)

    def check(self, was_busy: bool) -> bool:
        """One look: trim if the engine went idle since the last one, or the last trim is
        ``every`` seconds old. Returns ``busy``."""
        busy = bool(self.busy())
        self._since = self._since + self.interval if busy else 0.0
        if (was_busy and not busy) or (busy and self._since >= self.every):
            trim_heap()
            self.trims += 1
            self._since = 0.0
        return busy

    def _run(self) -> None:
        was_busy = False
        while not self._stop.wait(self.interval):
            try:
                was_busy = self.check(was_busy)
            except Exception:  # never take the server down over a trim
                logger.exception("cbgen server: heap trim failed")

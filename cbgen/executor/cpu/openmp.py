"""One OpenMP thread team at a time, owned by the thread that runs the forward pass.

PyTorch's CPU builds parallelise ops with GNU OpenMP (libgomp). libgomp gives every
thread that runs a parallel region a team of worker threads of its own and keeps the
team after the region ends. Once the teams of all threads together hold more threads
than the machine has cores, libgomp throttles: a worker waiting for the next region
spins about 100 times instead of about 300,000 before it sleeps on a futex. A forward
pass is about a thousand small parallel regions, so each one then pays a futex wake-up.

That is exactly the situation when the forward pass runs on another thread than the
one that loaded the model (the online engine's loop thread, the async worker): the
loading thread's idle team counts as managed threads. On a 2-core machine it cost a
quarter of the throughput (the online engine on short64: about 290 tok/s with the
caller's team alive, 350-370 with it released; async scheduling 284 → 376).

``release_thread_team()`` frees the calling thread's team with the OpenMP 5.0
``omp_pause_resource_all``: its workers exit, and the thread's next parallel region
(if it ever runs one) builds a fresh team. Threads that hand their forward pass to
another thread call it, so the forward thread's team is the only one left.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable

from ...sysmem import loaded_library

logger = logging.getLogger(__name__)

_OMP_PAUSE_SOFT = 1  # omp_pause_soft: free the threads, keep nothing an op relies on


@functools.cache
def _pause_function() -> Callable[[int], int] | None:
    """``omp_pause_resource_all`` of the libgomp torch loaded, or None where there is none
    (LLVM/Intel OpenMP, macOS, Windows, or a libgomp older than OpenMP 5.0)."""
    import torch  # noqa: F401  (loads the OpenMP runtime this looks for)

    path = loaded_library("libgomp")
    if path is None:
        return None
    try:
        function = ctypes.CDLL(path).omp_pause_resource_all
    except (OSError, AttributeError):
        logger.debug("cbgen: %s has no omp_pause_resource_all; OpenMP teams are left alone", path)
        return None
    function.argtypes = [ctypes.c_int]
    function.restype = ctypes.c_int
    return function


def release_thread_team() -> bool:
    """Free the calling thread's OpenMP worker threads; True if the runtime allowed it.

    Cheap when the thread has no team (a function call). Harmless to correctness: the
    next parallel op on this thread builds a new team.
    """
    function = _pause_function()
    if function is None:
        return False
    return function(_OMP_PAUSE_SOFT) == 0

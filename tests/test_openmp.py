"""The OpenMP team release that keeps the forward thread's team the only one."""

from __future__ import annotations

import os
import threading

import pytest
import torch

from cbgen.executor.cpu.openmp import _pause_function, release_thread_team


def _thread_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


def _parallel_op() -> None:
    # Far above ATen's grain size, so it runs as an OpenMP parallel region.
    (torch.ones(1 << 20) * 2).sum()


@pytest.mark.skipif(_pause_function() is None, reason="torch does not use GNU OpenMP here")
def test_release_ends_the_calling_threads_workers_and_ops_still_run() -> None:
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    seen: dict[str, object] = {}

    def body() -> None:
        before = _thread_ids()
        _parallel_op()
        seen["workers"] = _thread_ids() - before
        seen["released"] = release_thread_team()
        seen["left"] = seen["workers"] & _thread_ids()
        seen["again"] = float((torch.ones(1 << 20) * 3).sum())  # a new team, same result
        seen["released_again"] = release_thread_team()

    try:
        thread = threading.Thread(target=body)
        thread.start()
        thread.join()
    finally:
        torch.set_num_threads(previous)
    assert len(seen["workers"]) == 1  # two threads: the caller and one worker
    assert seen["released"] is True and seen["released_again"] is True
    assert seen["left"] == set()
    assert seen["again"] == 3 * (1 << 20)


def test_release_without_a_team_is_harmless() -> None:
    seen: dict[str, object] = {}

    def body() -> None:
        before = _thread_ids()
        seen["first"] = release_thread_team()  # this thread never ran a parallel region
        seen["second"] = release_thread_team()
        seen["spawned"] = _thread_ids() - before - {str(threading.get_native_id())}
        seen["sum"] = float((torch.ones(1 << 20) * 2).sum())  # a parallel op still works

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    expected = _pause_function() is not None  # False: no libgomp to ask, nothing done
    assert seen["first"] is expected and seen["second"] is expected
    assert seen["spawned"] == set()  # releasing started no thread
    assert seen["sum"] == 2 * (1 << 20)

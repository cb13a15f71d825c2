"""Run one benchmark process under supervision: pinned to cores, its own peak RSS polled
from ``/proc``, killed past a time or memory limit."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from ..sysmem import proc_status_kib


@dataclass
class ProcessOutcome:
    returncode: int | None
    peak_rss_kib: int | None
    wall_s: float
    killed: str | None = None
    timed_out_unix: float | None = None  # when it was stopped for its time limit (time.time())


def run_process(
    command: list[str],
    *,
    env: dict[str, str],
    cpus: list[int],
    log_path: Path,
    timeout: float,
    max_rss_kib: int | None,
) -> ProcessOutcome:
    """Run ``command`` pinned to ``cpus``; return its exit code and its own peak RSS.

    The peak is the child's ``VmHWM`` (its resident high-water mark, which starts afresh at
    ``exec``), polled from ``/proc`` while it runs; the worker also reports its final
    ``VmHWM`` itself. (``wait4``'s ``ru_maxrss`` would not do: it keeps the RSS the child
    inherited at ``fork``, i.e. this harness's own.) The process is killed if it outlives
    ``timeout`` or its RSS passes ``max_rss_kib``, so one runaway system cannot take the
    machine down.
    """

    def pin() -> None:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=pin,
            start_new_session=True,
        )
    killed = None
    timed_out_unix = None
    peak = None
    while True:
        pid, status = os.waitpid(process.pid, os.WNOHANG)
        if pid == process.pid:
            break
        hwm = proc_status_kib("VmHWM", process.pid)
        if hwm is not None:
            peak = max(peak or 0, hwm)
        rss = proc_status_kib("VmRSS", process.pid)
        elapsed = time.perf_counter() - started
        if killed is None and elapsed > timeout:
            killed = f"timed out after {timeout:.0f} s"
            timed_out_unix = time.time()
        elif killed is None and max_rss_kib and rss and rss > max_rss_kib:
            killed = f"RSS passed the limit of {max_rss_kib / 2**20:.1f} GiB"
        if killed is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    process.returncode = os.waitstatus_to_exitcode(status)
    return ProcessOutcome(
        process.returncode, peak, time.perf_counter() - started, killed, timed_out_unix
    )


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""

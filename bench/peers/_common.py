"""Shared by the peers' runners; standard library only (each peer has its own venv).

A runner is started as ``<peer venv>/bin/python bench/peers/<peer>_runner.py SPEC RESULT``
by ``python -m cbgen bench --peers ...``, already pinned to the benchmark's cores. It reads
the spec (see ``cbgen/bench/worker.py``), runs each workload (warm-up, then the repeats)
and writes the same result as cbgen's worker, so the harness reports it like any system.

While a timed repeat runs, the runner also keeps ``spec["progress_path"]`` (when the spec
names one) up to date with the tokens made so far. A peer that outlives the harness's time
limit is killed before it writes a result; that file is what lets the harness still say
something true about it: it had not made all its tokens by then, so its rate was below
tokens / elapsed (see ``cbgen.bench.harness.unfinished_run``).
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

WARMUP_PROMPTS = 4
WARMUP_TOKENS = 8

PROGRESS_EVERY_S = 2.0

# run_once(prompts, max_new_tokens, progress) -> (wall_s, token_times, token ids per request);
# it calls progress(tokens made so far, all requests together) as it goes
Progress = Callable[[int], None]
RunOnce = Callable[
    [list[list[int]], int, Progress], tuple[float, list[list[float]], list[list[int]]]
]


def no_progress(tokens: int) -> None:
    """The progress of a run nobody watches (the warm-up)."""


class ProgressFile:
    """A timed repeat's tokens so far, rewritten (atomically) at most every ``every_s``
    seconds: wall-clock times, so the harness, another process, can compare them with
    when it stopped the runner.

    The first call (a runner makes it, with 0, as its run's clock starts) writes the file
    and its ``started_unix``: never before the runner's own clock, so a bound taken from it
    errs on the peer's side."""

    def __init__(
        self,
        path: Path,
        record: dict[str, Any],
        every_s: float | None = None,
    ) -> None:
        self.path = path
        self.record = dict(record)
        self.every_s = PROGRESS_EVERY_S if every_s is None else every_s
        self.last: float | None = None

    def __call__(self, tokens: int) -> None:
        self.record["tokens_done"] = tokens
        if self.last is None:
            self.record["started_unix"] = time.time()
            self.write()
        elif time.monotonic() - self.last >= self.every_s:
            self.write()

    def write(self) -> None:
        self.last = time.monotonic()
        self.record["updated_unix"] = time.time()
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.record), encoding="utf-8")
        tmp.replace(self.path)


def proc_status_kib(field: str) -> int | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def read_spec() -> tuple[dict[str, Any], Path]:
    if len(sys.argv) != 3:
        print(f"usage: {sys.argv[0]} SPEC.json RESULT.json", file=sys.stderr)
        sys.exit(2)
    return json.loads(Path(sys.argv[1]).read_text(encoding="utf-8")), Path(sys.argv[2])


def cpu_list(spec: dict[str, Any]) -> str:
    """The cores as ``0-1`` / ``0,2`` text (what vLLM's and taskset's options take)."""
    cpus = spec.get("cpus") or sorted(os.sched_getaffinity(0))
    return ",".join(str(c) for c in cpus)


def spread(items: list[Any], count: int) -> list[Any]:
    if count >= len(items):
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


def run_workloads(spec: dict[str, Any], run_once: RunOnce, result: dict[str, Any]) -> None:
    repeats = int(spec.get("repeats", 3))
    progress_path = Path(spec["progress_path"]) if spec.get("progress_path") else None
    result.setdefault("workloads", {})
    for workload in spec["workloads"]:
        name, prompts, max_new = workload["name"], workload["prompts"], workload["max_new_tokens"]
        entry: dict[str, Any] = {"runs": [], "warmup_s": None, "error": None}
        result["workloads"][name] = entry
        try:
            if spec.get("warmup", True):
                started = time.perf_counter()
                run_once(
                    spread(prompts, min(WARMUP_PROMPTS, len(prompts))),
                    min(max_new, WARMUP_TOKENS),
                    no_progress,
                )
                entry["warmup_s"] = time.perf_counter() - started
            for repeat in range(repeats):
                progress: Progress = no_progress
                if progress_path is not None:
                    record = {
                        "workload": name,
                        "repeat": repeat + 1,
                        "tokens_total": max_new * len(prompts),
                        "load_s": result.get("load_s"),
                    }
                    progress = ProgressFile(progress_path, record)
                wall, times, ids = run_once(prompts, max_new, progress)
                entry["runs"].append(
                    {
                        "wall_s": wall,
                        "prompt_tokens": [len(p) for p in prompts],
                        "output_tokens": [len(t) for t in ids],
                        "token_times": times,
                    }
                )
                if repeat == 0:
                    entry["output_ids"] = ids
                print(f"{name} repeat {repeat + 1}/{repeats}: {wall:.2f} s", flush=True)
        except Exception as exc:
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
            print(entry["traceback"], file=sys.stderr, flush=True)


def write_result(path: Path, result: dict[str, Any]) -> None:
    result["peak_rss_kib"] = proc_status_kib("VmHWM")
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(path)

"""Shared by the peers' runners; standard library only (each peer has its own venv).

A runner is started as ``<peer venv>/bin/python bench/peers/<peer>_runner.py SPEC RESULT``
by ``python -m cbgen bench --peers ...``, already pinned to the benchmark's cores. It reads
the spec (see ``cbgen/bench/worker.py``), runs each workload (warm-up, then the repeats)
and writes the same result as cbgen's worker, so the harness reports it like any system.
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

# run_once(prompts, max_new_tokens) -> (wall_s, token_times per request, token ids per request)
RunOnce = Callable[[list[list[int]], int], tuple[float, list[list[float]], list[list[int]]]]


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
    result.setdefault("workloads", {})
    for workload in spec["workloads"]:
        name, prompts, max_new = workload["name"], workload["prompts"], workload["max_new_tokens"]
        entry: dict[str, Any] = {"runs": [], "warmup_s": None, "error": None}
        result["workloads"][name] = entry
        try:
            if spec.get("warmup", True):
                started = time.perf_counter()
                run_once(
                    spread(prompts, min(WARMUP_PROMPTS, len(prompts))), min(max_new, WARMUP_TOKENS)
                )
                entry["warmup_s"] = time.perf_counter() - started
            for repeat in range(repeats):
                wall, times, ids = run_once(prompts, max_new)
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

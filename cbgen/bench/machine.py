"""Facts about the machine a benchmark runs on: the cores to pin to, the software versions."""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
from pathlib import Path

from .args import parse_cpus


def choose_cpus(args: argparse.Namespace) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.cpus:
        return parse_cpus(args.cpus)
    if not allowed:
        return []
    return allowed[: max(1, min(args.threads, len(allowed)))]


def process_env(threads: int) -> dict[str, str]:
    """The environment of a benchmark process: ``threads`` for every thread pool, offline."""
    env = dict(os.environ)
    count = str(threads)
    env.update(
        OMP_NUM_THREADS=count,
        MKL_NUM_THREADS=count,
        OPENBLAS_NUM_THREADS=count,
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_VERBOSITY="error",
        PYTHONUNBUFFERED="1",
    )
    return env


def versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("cbgen", "torch", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        if commit:
            found["git"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return found

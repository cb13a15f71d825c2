"""The tensor-parallel flags every command shares: ``--tensor-parallel-size`` and
``--threads-per-rank`` (``EngineConfig.tensor_parallel_size`` / ``threads_per_rank``)."""

from __future__ import annotations

import argparse
from typing import Any


def add_parallel_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("tensor parallelism (see docs/parallel.md)")
    group.add_argument(
        "--tensor-parallel-size",
        type=int,
        default=1,
        metavar="N",
        help="split the model over N processes (default 1: this process alone)",
    )
    group.add_argument(
        "--threads-per-rank",
        type=int,
        default=None,
        metavar="T",
        help="threads (and cores) of each rank (default: a NUMA node each when there are "
        "as many nodes as ranks, else an equal share of the cores)",
    )


def parallel_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The ``EngineConfig`` fields the flags set."""
    return {
        "tensor_parallel_size": args.tensor_parallel_size,
        "threads_per_rank": args.threads_per_rank,
    }

"""Which CPU cores each tensor-parallel rank runs on, and with how many threads.

With as many ranks as NUMA nodes, rank ``r`` runs on node ``r``'s cores (each rank then
reads its own socket's memory); otherwise the usable cores are dealt out in equal runs.
"""

from __future__ import annotations

import os
from pathlib import Path

NODES = Path("/sys/devices/system/node")


def usable_cpus() -> list[int]:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def numa_nodes(root: Path | None = None) -> list[list[int]]:
    """Each NUMA node's cores (one list per node; one node on a machine without any)."""
    root = root if root is not None else NODES
    nodes = []
    for path in sorted(root.glob("node[0-9]*"), key=lambda p: int(p.name[4:])):
        try:
            nodes.append(parse_cpulist((path / "cpulist").read_text()))
        except (OSError, ValueError):
            continue
    return [n for n in nodes if n] or [usable_cpus()]


def parse_cpulist(text: str) -> list[int]:
    """``"0-3,8,10-11"`` as ``[0, 1, 2, 3, 8, 10, 11]``."""
    cpus: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        cpus.extend(range(int(lo), int(hi or lo) + 1))
    return cpus


def rank_cpus(world: int, threads_per_rank: int | None = None) -> list[list[int]]:
    """The cores of each of ``world`` ranks: a NUMA node each when ``world`` equals the
    node count (and ``threads_per_rank`` is unset), else equal runs of the usable cores,
    ``threads_per_rank`` long (default: all of them shared out, at least one each)."""
    usable = usable_cpus()
    nodes = [[c for c in node if c in usable] for node in numa_nodes()]
    if threads_per_rank is None and len(nodes) == world and all(nodes):
        return nodes
    per_rank = threads_per_rank or max(1, len(usable) // world)
    return [
        [usable[(rank * per_rank + i) % len(usable)] for i in range(per_rank)]
        for rank in range(world)
    ]

"""The ranks' communication: a process group of its own, not torch.distributed's default.

CPU ranks sum through shared memory (``shm_reduce``) when the tensor fits its slots, and
through the gloo group otherwise.

Each engine makes a ``TCPStore`` (the driver listens on a free loopback port) and a gloo
(CPU) or NCCL (CUDA) group over it, held by the engine and passed to whoever needs it.
No global ``init_process_group``: several engines, and a program that uses
torch.distributed for its own ends, can live in one process.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .shm_reduce import ShmAllReduce

# How long one collective may wait for a peer before it fails. A peer that dies closes
# its sockets and fails the collective at once; this bounds a peer that hangs.
DEFAULT_TIMEOUT_S = 300.0


class RankGroup:
    """One rank's end of the engine's process group, and its all-reduce timing."""

    def __init__(
        self,
        rank: int,
        world: int,
        port: int,
        device: torch.device,
        *,
        store: dist.TCPStore | None = None,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        shm: ShmAllReduce | None = None,
    ) -> None:
        self.rank, self.world = rank, world
        timeout = timedelta(seconds=timeout_s)
        self.store = store or dist.TCPStore(
            "127.0.0.1", port, world, is_master=False, timeout=timeout
        )
        self.group: Any
        if device.type == "cuda":
            c10d: Any = dist  # only CUDA builds of torch have ProcessGroupNCCL
            self.group = c10d.ProcessGroupNCCL(self.store, rank, world)
        else:
            self.group = dist.ProcessGroupGloo(self.store, rank, world, timeout)
        self.shm = shm  # CPU ranks on this machine: the shared-memory path, gloo past it
        self.reduce_seconds = 0.0  # time spent in all-reduce (the step's TP overhead)
        self.reduces = 0

    @staticmethod
    def listen(world: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> dist.TCPStore:
        """The driver's store on a free loopback port (``.port``), before the workers start."""
        return dist.TCPStore(
            "127.0.0.1",
            0,
            world,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )

    def close(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sum ``tensor`` (contiguous) over the ranks, in place."""
        started = time.perf_counter()
        if self.shm is not None and self.shm.fits(tensor):
            self.shm(tensor)
        else:
            self.group.allreduce([tensor]).wait()
        self.reduce_seconds += time.perf_counter() - started
        self.reduces += 1

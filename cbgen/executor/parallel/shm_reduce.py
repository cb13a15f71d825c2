"""An all-reduce through shared memory, for CPU ranks on one machine.

gloo's all-reduce goes through loopback TCP: on this project's 2-core machine it took
1.3-1.4 ms whatever the size (2 KiB to 144 KiB), and a SmolLM2 step makes 60 of them.
Here each rank copies its partial sum into its own slot of a shared mapping, publishes a
sequence number, waits (spinning, yielding the core) until every rank has published the
same number, and adds the slots up in rank order, so every rank gets the same bits.

Two sets of slots alternate: a rank writes call ``s + 2``'s slot only after every rank
published ``s + 1``, which each does only after it finished reading call ``s``. The
sequence numbers are 8-byte aligned stores, published after the slot's data: x86's
total store order makes a rank that sees the number see the data, so this path is used
on x86-64 only (elsewhere gloo serves).

Sums in float32 for 16-bit tensors (rounded once at the end). A tensor larger than a
slot goes through gloo. A peer that dies is noticed within a millisecond (``alive``);
one that never arrives fails the call after ``timeout_s``.
"""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import time
from collections.abc import Callable

import numpy as np
import torch

DISABLE_ENV = "CBGEN_TP_NO_SHM"
_STRIDE = 16  # int64s between two ranks' sequence numbers: one 128-byte line each
_CHECK_EVERY = 2048  # spins between liveness and deadline checks


def shm_supported() -> bool:
    """Whether this machine and environment use the shared-memory path."""
    return platform.machine() in ("x86_64", "AMD64") and os.environ.get(DISABLE_ENV) != "1"


def create_file(world: int, capacity: int) -> str | None:
    """A new backing file for the mapping, its space reserved (so a full ``/dev/shm``
    fails here, not with SIGBUS mid-step); None where that is not possible."""
    folder = "/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir()
    fd, path = tempfile.mkstemp(prefix="cbgen-tp-", dir=folder)
    try:
        os.posix_fallocate(fd, 0, _size(world, capacity))
    except (OSError, AttributeError):
        os.close(fd)
        os.unlink(path)
        return None
    os.close(fd)
    return path


def _size(world: int, capacity: int) -> int:
    return _header(world) + 2 * world * capacity


def _header(world: int) -> int:
    return world * _STRIDE * 8


class ShmAllReduce:
    """One rank's end of the shared mapping at ``path`` (see the module's docstring)."""

    def __init__(
        self,
        path: str,
        rank: int,
        world: int,
        capacity: int,
        alive: Callable[[], bool],
        timeout_s: float,
    ) -> None:
        self.rank, self.world, self.capacity = rank, world, capacity
        self._alive, self._timeout_s = alive, timeout_s
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, _size(world, capacity))
        finally:
            os.close(fd)
        self._seqs = np.frombuffer(self._map, dtype=np.int64, count=world * _STRIDE)
        self._slots = torch.frombuffer(
            self._map, dtype=torch.uint8, offset=_header(world), count=2 * world * capacity
        ).view(2, world, capacity)
        self._mine = rank * _STRIDE
        self._seq = 0

    def fits(self, tensor: torch.Tensor) -> bool:
        return tensor.numel() * tensor.element_size() <= self.capacity

    def __call__(self, tensor: torch.Tensor) -> None:
        """Sum contiguous ``tensor`` over the ranks, in place (``fits`` must hold)."""
        self._seq += 1
        seq = self._seq
        size = tensor.numel() * tensor.element_size()
        slots = self._slots[seq & 1, :, :size]
        flat = tensor.view(-1)
        slots[self.rank].copy_(flat.view(torch.uint8))
        self._seqs[self._mine] = seq
        self._wait(seq)
        parts = [slots[r].view(tensor.dtype) for r in range(self.world)]
        if tensor.dtype in (torch.bfloat16, torch.float16):
            total = parts[0].float()
            for part in parts[1:]:
                total.add_(part)
            flat.copy_(total)
        else:
            torch.add(parts[0], parts[1], out=flat)
            for part in parts[2:]:
                flat.add_(part)

    def _wait(self, seq: int) -> None:
        seqs, stride, world = self._seqs, _STRIDE, self.world
        spins = 0
        deadline = None
        while True:
            if all(seqs[r * stride] >= seq for r in range(world)):
                return
            spins += 1
            if spins % _CHECK_EVERY == 0:
                now = time.monotonic()
                deadline = deadline or now + self._timeout_s
                if not self._alive():
                    raise RuntimeError("a tensor-parallel peer process is gone")
                if now > deadline:
                    raise TimeoutError(
                        f"a tensor-parallel peer did not reach the all-reduce in "
                        f"{self._timeout_s:.0f} s"
                    )
            os.sched_yield()

    def close(self) -> None:
        self._slots = self._seqs = None  # type: ignore[assignment]
        try:
            self._map.close()
        except BufferError:  # a view is still alive somewhere; the mapping goes with it
            pass

"""Host memory for preempted requests' K/V blocks (``preemption_mode="swap"``).

Preemption by recompute throws a request's K/V away and prefills it again later;
swap copies its computed blocks to host memory instead and copies them back when
the request resumes, trading a memory copy for the recompute. The scheduler
decides (it owns a host ``BlockAllocator`` of ``num_blocks`` ids); this module
only moves bytes. On CUDA the host side is pinned so the copies can overlap; on
CPU it is another lazily committed buffer (its pages cost memory only once used).

A host block mirrors a device block exactly: the same slice of every physical
cache tensor (``PagedKVCache.block_tensors``), so a block of any cache group
moves with one copy per tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch

from ..requests.scheduler_output import BlockMove
from .paged_cache import PagedKVCache, _zeros

logger = logging.getLogger(__name__)


class SwapSpace:
    """``num_blocks`` host blocks shaped like the device cache's blocks."""

    def __init__(self, cache: PagedKVCache, num_blocks: int) -> None:
        if num_blocks <= 0:
            raise ValueError(f"a swap space needs at least one block, got {num_blocks}")
        self.cache = cache
        self.num_blocks = num_blocks
        pin = cache.device.type == "cuda"
        self.host_tensors: list[torch.Tensor] = []
        for device_tensor in cache.block_tensors:
            shape = (device_tensor.shape[0], num_blocks, *device_tensor.shape[2:])
            if pin:
                host = torch.zeros(shape, dtype=device_tensor.dtype, pin_memory=True)
            else:
                host = _zeros(shape, device_tensor.dtype, torch.device("cpu"))
            self.host_tensors.append(host)

    @staticmethod
    def blocks_for_budget(cache: PagedKVCache, budget_bytes: int) -> int:
        """How many blocks ``budget_bytes`` of host memory holds."""
        return budget_bytes // cache.bytes_per_block

    def copy_out(self, device_blocks: Sequence[int], host_blocks: Sequence[int]) -> None:
        """Copy device blocks to host blocks (pairwise, in order)."""
        if not device_blocks:
            return
        device = self.cache.device
        src = torch.tensor(device_blocks, dtype=torch.long, device=device)
        dst = torch.tensor(host_blocks, dtype=torch.long)
        for device_tensor, host_tensor in zip(
            self.cache.block_tensors, self.host_tensors, strict=True
        ):
            host_tensor.index_copy_(1, dst, device_tensor.index_select(1, src).cpu())

    def copy_in(self, host_blocks: Sequence[int], device_blocks: Sequence[int]) -> None:
        """Copy host blocks back into device blocks (pairwise, in order)."""
        if not host_blocks:
            return
        device = self.cache.device
        src = torch.tensor(host_blocks, dtype=torch.long)
        dst = torch.tensor(device_blocks, dtype=torch.long, device=device)
        for device_tensor, host_tensor in zip(
            self.cache.block_tensors, self.host_tensors, strict=True
        ):
            moved = host_tensor.index_select(1, src).to(device, non_blocking=True)
            device_tensor.index_copy_(1, dst, moved)

    def run_moves(
        self, swap_out: Sequence[BlockMove], swap_in: Sequence[BlockMove]
    ) -> list[BlockMove]:
        """Run a step's swap copies, outs before ins (a swap-in may reuse a block a
        swap-out reads); return the moves whose copy failed, each costing only its own
        request (the scheduler recomputes it)."""
        copies: list[tuple[BlockMove, Callable[[list[int], list[int]], None], list[int], list[int]]]
        copies = [(m, self.copy_out, m.device_blocks, m.host_blocks) for m in swap_out]
        copies += [(m, self.copy_in, m.host_blocks, m.device_blocks) for m in swap_in]
        failed = []
        for move, copy, src, dst in copies:
            try:
                copy(src, dst)
            except Exception:
                logger.exception(
                    "cbgen: a swap copy of request %r failed; it will be recomputed",
                    move.request_id,
                )
                failed.append(move)
        return failed

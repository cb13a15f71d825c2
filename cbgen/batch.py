"""Translate a scheduler decision into the flat tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from .attention import AttentionMetadata, PrefillSpan
from .cache.paged_cache import PagedKVCache
from .scheduler import ScheduledChunk, SchedulerOutput


@dataclass
class StepBatch:
    """Everything ``ModelRunner`` needs for one step, already on the device."""

    input_ids: torch.Tensor  # [1, tokens]
    position_ids: torch.Tensor  # [1, tokens]
    logits_indices: torch.Tensor  # [samples] rows whose logits are sampled
    attention: AttentionMetadata
    sampled_chunks: list[ScheduledChunk]  # one per logits row, same order


class BatchBuilder:
    """Packs the scheduled chunks into one sequence; decisions stay with the scheduler.

    All index arithmetic happens on host lists and each tensor crosses to the
    device once.
    """

    def __init__(
        self, cache: PagedKVCache, layer_of_module: dict[int, int], decode_kernel: Any = None
    ) -> None:
        self.cache = cache
        self.layer_of_module = layer_of_module
        self.decode_kernel = decode_kernel
        self.block_size = cache.block_size
        self.device = cache.device

    def build(self, scheduled: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledChunk] = []
        decode_rows: list[int] = []
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_specs: list[tuple[int, int, int, list[int] | None]] = []

        for chunk in scheduled.chunks:
            request = chunk.request
            start, count = chunk.start, chunk.num_tokens
            row = len(input_ids)
            input_ids.extend(request.token_ids[start : start + count])
            positions.extend(range(start, start + count))
            blocks = request.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in range(start, start + count))
            context_len = start + count
            if count == 1 and start > 0:
                decode_rows.append(row)
                decode_tables.append(blocks[: -(-context_len // bs)])
                decode_lens.append(context_len)
            else:
                cached = blocks[: -(-context_len // bs)] if start > 0 else None
                prefill_specs.append((row, count, context_len, cached))
            if chunk.completes_sequence:
                logits_indices.append(row + count - 1)
                sampled.append(chunk)

        device = self.device
        metadata = AttentionMetadata(
            cache=self.cache,
            layer_of_module=self.layer_of_module,
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            decode_kernel=self.decode_kernel,
        )
        if decode_rows:
            self._add_decode(metadata, decode_rows, decode_tables, decode_lens)
        metadata.decode_only = not prefill_specs
        for row, count, context_len, cached in prefill_specs:
            metadata.prefills.append(self._prefill_span(row, count, context_len, cached))

        return StepBatch(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            logits_indices=torch.tensor(logits_indices, dtype=torch.long, device=device),
            attention=metadata,
            sampled_chunks=sampled,
        )

    def _add_decode(
        self,
        metadata: AttentionMetadata,
        rows: list[int],
        tables: list[list[int]],
        lens: list[int],
    ) -> None:
        width = max(len(t) for t in tables)
        padded = [t + [0] * (width - len(t)) for t in tables]
        device = self.device
        context_lens = torch.tensor(lens, dtype=torch.long, device=device)
        metadata.decode_rows = torch.tensor(rows, dtype=torch.long, device=device)
        metadata.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        metadata.decode_context_lens = context_lens
        if self.decode_kernel is not None:
            return  # the kernel stops at each context length: no padding mask needed
        key_positions = torch.arange(width * self.block_size, device=device)
        padding = torch.zeros(len(rows), width * self.block_size, device=device)
        padding.masked_fill_(key_positions.unsqueeze(0) >= context_lens.unsqueeze(1), float("-inf"))
        metadata.decode_padding_mask = padding.view(1, len(rows), 1, -1)

    def _prefill_span(
        self, row: int, count: int, context_len: int, cached: list[int] | None
    ) -> PrefillSpan:
        if cached is None:
            return PrefillSpan(row, count, context_len, None, None)
        device = self.device
        q_pos = torch.arange(context_len - count, context_len, device=device)
        k_pos = torch.arange(context_len, device=device)
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        block_ids = torch.tensor(cached, dtype=torch.long, device=device)
        return PrefillSpan(row, count, context_len, block_ids, mask)

"""Translate a scheduler decision into the flat tensors of one forward pass."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ..cache.groups import FULL_GROUP, CacheGroup
from ..cache.paged_cache import PagedKVCache
from ..cache.state import StateCache
from ..requests.scheduler_output import ScheduledRequest, SchedulerOutput
from .attention import TorchReferenceAttention
from .base import AttentionBackend
from .lora import LoraRows
from .metadata import (
    AttentionMetadata,
    GroupTables,
    PrefillSpan,
    SlotSet,
    StateChunk,
    StateSegments,
)


@dataclass
class StepBatch:
    """Everything the executor (``Executor``) needs for one step, already on the device."""

    input_ids: torch.Tensor  # [1, tokens]
    position_ids: torch.Tensor  # [1, tokens]
    # Rows whose logits the executor returns: the sampled rows (``len(sampled)``), then
    # the rows that score prompt tokens (``prompt_scores``).
    logits_indices: torch.Tensor
    attention: AttentionMetadata
    sampled: list[ScheduledRequest]  # one per sampled row, same order (repeated per draft)
    # Per sampled row: the position of the token it samples.
    sample_positions: list[int] = field(default_factory=list)
    # Per request with prompt logprobs this step: the request, the first prompt
    # position its rows score and the tokens there (rows in this order after the samples).
    prompt_scores: list[ScheduledRequest] = field(default_factory=list)
    # Async scheduling: input rows holding a placeholder, and the row of the previous
    # step's samples whose token goes there (filled on the device before the forward).
    carry_rows: torch.Tensor | None = None
    carry_sources: torch.Tensor | None = None
    # The rows of each LoRA adapter slot (None: every row runs the base model).
    lora: LoraRows | None = None


class _GroupLists:
    """Host-side tables of one cache group while a step is packed."""

    __slots__ = ("group", "slots", "decode_tables", "decode_lens", "prefill_blocks", "row_chunks")

    def __init__(self, group: CacheGroup) -> None:
        self.group = group
        self.slots: list[int] = []
        self.decode_tables: list[list[int]] = []
        self.decode_lens: list[int] = []
        self.prefill_blocks: list[tuple[list[int] | None, int]] = []
        # Every chunk's table from its first needed block, the context that table
        # holds before the chunk, and its rows (``row_block_tables``).
        self.row_chunks: list[tuple[list[int], int, int]] = []


class BatchBuilder:
    """Packs the scheduled chunks into one sequence; decisions stay with the scheduler.

    All index arithmetic happens on host lists and each tensor crosses to the
    device once. Every cache group gets its own slot mapping and block tables;
    a windowed group's tables start at the first block its window reads. The
    optional tables (per-row tables, decode padding masks) are built for the
    attention backend that reads them (default: the torch reference).
    """

    def __init__(
        self,
        cache: PagedKVCache,
        layer_of_module: dict[int, int],
        attention: AttentionBackend | None = None,
        groups: Sequence[CacheGroup] | None = None,
        state_cache: StateCache | None = None,
    ) -> None:
        self.cache = cache
        self.state_cache = state_cache
        self.layer_of_module = layer_of_module
        self.attention: AttentionBackend = attention or TorchReferenceAttention()
        self.block_size = cache.block_size
        self.device = cache.device
        self.groups: tuple[CacheGroup, ...] = tuple(groups) if groups else (FULL_GROUP,)
        self.layer_group = [0] * cache.num_layers
        for group in self.groups:
            for layer in group.layers:
                self.layer_group[layer] = group.index

    def build(self, scheduled: SchedulerOutput) -> StepBatch:
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        logits_indices: list[int] = []
        sampled: list[ScheduledRequest] = []
        sample_positions: list[int] = []
        prompt_indices: list[int] = []
        prompt_scores: list[ScheduledRequest] = []
        decode_rows: list[int] = []
        carry: list[tuple[int, int]] = []
        prefill_spans: list[tuple[int, int, int]] = []
        state_decodes: list[tuple[int, int]] = []  # (row, slot) of single tokens going on
        state_chunks: list[StateChunk] = []
        lora_segments: list[tuple[int, int, int]] = []  # (first row, rows, adapter slot)
        lists = [_GroupLists(group) for group in self.groups]
        # Per-row tables, for a backend that attends every row in one call.
        row_tables = self.attention.row_tables

        for chunk in scheduled.scheduled:
            start, count = chunk.start, chunk.num_tokens
            row = len(input_ids)
            input_ids.extend(chunk.token_ids)
            if chunk.lora_slot >= 0:
                lora_segments.append((row, count, chunk.lora_slot))
            if chunk.carry is not None:
                offset, source = chunk.carry
                carry.append((row + offset, source))
            positions.extend(range(start, start + count))
            tables = chunk.block_tables
            context_len = start + count
            num_blocks = -(-context_len // bs)
            decode = count == 1 and start > 0
            for group_lists, blocks in zip(lists, tables, strict=True):
                group = group_lists.group
                group_lists.slots.extend(
                    blocks[p // bs] * bs + p % bs for p in range(start, context_len)
                )
                first = group.first_needed_block(start, bs)
                table = blocks[first:num_blocks]
                if row_tables:
                    group_lists.row_chunks.append((table, start - first * bs, count))
                if decode:
                    group_lists.decode_tables.append(table)
                    group_lists.decode_lens.append(context_len - first * bs)
                elif start > 0:
                    group_lists.prefill_blocks.append((table, first * bs))
                else:
                    group_lists.prefill_blocks.append((None, 0))
            if decode:
                decode_rows.append(row)
            else:
                prefill_spans.append((row, count, context_len))
            if chunk.state_slot >= 0:
                if decode and chunk.state_load < 0:
                    state_decodes.append((row, chunk.state_slot))
                else:
                    save_at, save_slot = chunk.state_save or (0, -1)
                    state_chunks.append(
                        StateChunk(
                            row,
                            count,
                            chunk.state_slot,
                            SlotSet.of([chunk.state_slot], self.device),
                            continues=start > 0,
                            # Rows past the prompt: tokens generated before a preemption.
                            replay=max(0, chunk.num_prompt_tokens - start),
                            load=chunk.state_load,
                            save_at=save_at,
                            save_slot=save_slot,
                        )
                    )
            if chunk.sample:
                num_rows = chunk.num_sampled  # the last token, and one per draft before it
                logits_indices.extend(range(row + count - num_rows, row + count))
                sampled.extend([chunk] * num_rows)
                sample_positions.extend(range(start + count - num_rows + 1, start + count + 1))
            if chunk.prompt_targets:
                first = row + chunk.prompt_start - 1 - start  # the row before the position
                prompt_indices.extend(range(first, first + len(chunk.prompt_targets)))
                prompt_scores.append(chunk)

        device = self.device
        row_tables = row_tables and bool(prefill_spans)
        metadata = AttentionMetadata(
            cache=self.cache,
            layer_of_module=self.layer_of_module,
            groups=[self._group_tables(group_lists, row_tables) for group_lists in lists],
            layer_group=self.layer_group,
            backend=self.attention,
        )
        if decode_rows:
            metadata.decode_rows = torch.tensor(decode_rows, dtype=torch.long, device=device)
        metadata.decode_only = not prefill_spans
        for row, count, context_len in prefill_spans:
            metadata.prefills.append(self._prefill_span(row, count, context_len))
        if self.state_cache is not None:
            metadata.state = self._state_segments(state_decodes, state_chunks, len(input_ids))

        batch = StepBatch(
            input_ids=torch.tensor([input_ids], dtype=torch.long, device=device),
            position_ids=torch.tensor([positions], dtype=torch.long, device=device),
            logits_indices=torch.tensor(
                logits_indices + prompt_indices, dtype=torch.long, device=device
            ),
            attention=metadata,
            sampled=sampled,
            sample_positions=sample_positions,
            prompt_scores=prompt_scores,
        )
        if lora_segments:
            batch.lora = LoraRows.of(lora_segments, len(input_ids), device)
        if carry:
            rows, sources = zip(*carry, strict=True)
            batch.carry_rows = torch.tensor(rows, dtype=torch.long, device=device)
            batch.carry_sources = torch.tensor(sources, dtype=torch.long, device=device)
        return batch

    def _group_tables(self, lists: _GroupLists, row_tables: bool) -> GroupTables:
        device = self.device
        tables = GroupTables(
            slot_mapping=torch.tensor(lists.slots, dtype=torch.long, device=device)
        )
        tables.prefill_blocks = [
            (None if blocks is None else torch.tensor(blocks, dtype=torch.long, device=device), k0)
            for blocks, k0 in lists.prefill_blocks
        ]
        if lists.decode_tables:
            self._add_decode(tables, lists.decode_tables, lists.decode_lens)
        if row_tables:
            self._add_row_tables(tables, lists.row_chunks)
        return tables

    def _add_decode(self, tables: GroupTables, blocks: list[list[int]], lens: list[int]) -> None:
        width = max(len(t) for t in blocks)
        padded = [t + [0] * (width - len(t)) for t in blocks]
        device = self.device
        context_lens = torch.tensor(lens, dtype=torch.long, device=device)
        tables.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=device)
        tables.decode_context_lens = context_lens
        if not self.attention.padding_mask:
            return  # the kernel stops at each context length: no padding mask needed
        key_positions = torch.arange(width * self.block_size, device=device)
        padding = torch.zeros(len(blocks), width * self.block_size, device=device)
        padding.masked_fill_(key_positions.unsqueeze(0) >= context_lens.unsqueeze(1), float("-inf"))
        tables.decode_padding_mask = padding.view(1, len(blocks), 1, -1)

    def _add_row_tables(
        self, group_tables: GroupTables, chunks: list[tuple[list[int], int, int]]
    ) -> None:
        """A block table and context length for every row, prefill rows included (the
        kernel then attends the whole step in one call: see ``GroupTables``)."""
        width = max(len(blocks) for blocks, _, _ in chunks)
        padded = [blocks + [0] * (width - len(blocks)) for blocks, _, _ in chunks]
        lens: list[int] = []
        for _, before, count in chunks:
            lens.extend(range(before + 1, before + count + 1))
        device = self.device
        counts = torch.tensor([count for _, _, count in chunks], dtype=torch.long, device=device)
        tables = torch.tensor(padded, dtype=torch.long, device=device)
        group_tables.row_block_tables = tables.repeat_interleave(counts, dim=0)
        group_tables.row_context_lens = torch.tensor(lens, dtype=torch.long, device=device)

    def _state_segments(
        self,
        decodes: list[tuple[int, int]],
        chunks: list[StateChunk],
        num_rows: int,
    ) -> StateSegments:
        assert self.state_cache is not None
        segments = StateSegments(self.state_cache, chunks=chunks)
        if decodes:
            rows, slots = zip(*decodes, strict=True)
            device = self.device
            segments.decode_rows = torch.tensor(rows, dtype=torch.long, device=device)
            segments.decode_slots = SlotSet.of(slots, device)
            segments.decode_only = not chunks and len(rows) == num_rows
        return segments

    def _prefill_span(self, row: int, count: int, context_len: int) -> PrefillSpan:
        if context_len == count:
            return PrefillSpan(row, count, context_len, None)
        device = self.device
        q_pos = torch.arange(context_len - count, context_len, device=device)
        k_pos = torch.arange(context_len, device=device)
        mask = k_pos.unsqueeze(0) <= q_pos.unsqueeze(1)
        return PrefillSpan(row, count, context_len, mask)

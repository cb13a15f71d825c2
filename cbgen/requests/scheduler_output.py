"""What the scheduler hands the executor for one step: plain values, no live ``Request``.

The executor (batch builder, runner, sampler) sees, per scheduled request, the ids of the
tokens to run, where they start, the blocks that hold them in every cache group and how
to sample; it never reads or writes a ``Request``. That keeps one writer per request
field (the scheduler for status and computed tokens, the output processor for tokens)
and lets a step be built, launched and sampled while the core plans the next one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..sampling.params import SamplingParams
from .request import Request


@dataclass
class BlockMove:
    """A swap copy of request ``request_id``: ``device_blocks[i]`` <-> ``host_blocks[i]``."""

    request_id: str
    device_blocks: list[int]
    host_blocks: list[int]


@dataclass(frozen=True)
class ScheduledRequest:
    """``len(token_ids)`` new tokens of one request, at positions ``start ..``.

    The count is the scheduler's decision: a prompt chunk, 1 for a plain decode, or
    1 + k when k proposed tokens are verified (the last ``num_drafts`` of
    ``token_ids``); nothing above the attention backend tells these apart.
    ``sample``: the chunk reaches the request's last known token, so the logits of its
    last ``1 + num_drafts`` tokens are sampled. ``prompt_targets``: the prompt tokens at
    positions ``prompt_start ..`` whose logprobs this chunk's logits give (a request
    with ``prompt_logprobs``; the row of position ``p - 1`` scores the token at ``p``).
    ``carry``: with async scheduling
    the token at ``token_ids[offset]`` is a placeholder for row ``row`` of the
    previous step's samples, filled on the device before the forward pass.
    """

    request_id: str
    token_ids: list[int]
    start: int
    block_tables: list[list[int]]  # per cache group, enough blocks for these tokens
    sample: bool
    params: SamplingParams
    generator: torch.Generator | None = None
    history: list[int] | None = None  # every token so far, when sampling reads it
    num_prompt_tokens: int = 0
    prompt_start: int = 0
    prompt_targets: list[int] = field(default_factory=list)
    carry: tuple[int, int] | None = None  # (offset in token_ids, row of previous samples)
    num_drafts: int = 0
    state_slot: int = -1  # the request's slot in the state cache (-1: the model keeps none)
    state_load: int = -1  # a prefix-cache hit: the checkpoint slot its state starts from
    # Save the state after this many tokens into that checkpoint slot (a block boundary).
    state_save: tuple[int, int] | None = None
    lora_slot: int = -1  # the request's LoRA adapter slot (-1: the base model)

    @property
    def num_sampled(self) -> int:
        """Logits rows this request samples: one per draft, plus the token after them."""
        return 1 + self.num_drafts if self.sample else 0

    @classmethod
    def of(
        cls,
        request: Request,
        start: int,
        count: int,
        block_tables: list[list[int]],
        block_size: int,
        state_slot: int = -1,
        state_load: int = -1,
        state_save: tuple[int, int] | None = None,
    ) -> ScheduledRequest:
        """``count`` tokens of ``request`` from position ``start``: its known tokens, then
        as many of its proposed ones as the count reaches past them."""
        end = start + count
        known = min(end, request.num_tokens)
        drafts = request.draft_token_ids[: end - known]
        pending = request.pending_index
        carry = None
        if pending is not None and start <= pending < end:
            carry = (pending - start, request.pending_row)
        num_blocks = -(-end // block_size)
        params = request.params
        prompt_start, prompt_targets = 0, []
        scored = request.prompt_logprobs
        if scored is not None and len(scored) < request.num_prompt_tokens:
            # Positions not scored yet (a recomputed prompt is not scored twice).
            prompt_start = max(start + 1, len(scored))
            prompt_targets = request.prompt_token_ids[prompt_start : end + 1]
        return cls(
            request.request_id,
            request.token_ids[start:known] + drafts,
            start,
            [table[:num_blocks] for table in block_tables],
            sample=known == request.num_tokens,
            params=params,
            generator=request.generator,
            history=list(request.token_ids) if params.needs_history else None,
            num_prompt_tokens=request.num_prompt_tokens,
            prompt_start=prompt_start,
            prompt_targets=prompt_targets,
            carry=carry,
            num_drafts=len(drafts),
            state_slot=state_slot,
            state_load=state_load,
            state_save=state_save,
            lora_slot=request.lora_slot,
        )

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def end(self) -> int:
        """The position after the last of these tokens (the context length they attend)."""
        return self.start + len(self.token_ids)


@dataclass
class SchedulerOutput:
    """One step's decisions. The block copies must run before the step's forward pass:
    every ``swap_out`` first (they read blocks this step may hand to others), then
    every ``swap_in``. ``preempted``: ids of requests preempted while planning it."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    swap_out: list[BlockMove] = field(default_factory=list)
    swap_in: list[BlockMove] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def sampled(self) -> list[ScheduledRequest]:
        """The requests that get tokens from this step, in logits-row order."""
        return [s for s in self.scheduled if s.sample]

    def drop(self, request_ids: set[str]) -> None:
        """Forget the parts of the plan of requests that finished before it ran."""
        if request_ids:
            self.scheduled = [s for s in self.scheduled if s.request_id not in request_ids]
            self.swap_out = [m for m in self.swap_out if m.request_id not in request_ids]
            self.swap_in = [m for m in self.swap_in if m.request_id not in request_ids]

"""Per-request sampling settings and their validation."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing logits by a smaller value overflows them
to infinities (1e-40 made every row NaN and every token id 0), and the distribution is
already a point mass long before (vLLM draws the same line)."""

SEED_RANGE = 1 << 64
"""Seeds are unsigned 64-bit values, what ``torch.Generator.manual_seed`` takes."""

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""``processor(token_ids, logits) -> logits``: ``token_ids`` are the request's prompt and
generated tokens so far, ``logits`` its float32 row ``[vocab]`` for the next token."""


@dataclass
class SamplingParams:
    """How one request picks its tokens and when it stops.

    ``temperature == 0`` means greedy decoding (the default, and the mode whose
    output is token-identical to ``model.generate()``); so does any temperature
    below ``GREEDY_TEMPERATURE`` (1e-5). ``top_k == 0`` and
    ``top_p == 1.0`` disable those filters. ``eos_token_ids`` are stop ids on
    top of the model's own EOS ids; ``ignore_eos`` turns every stop id off so a
    request produces exactly ``max_new_tokens`` (what benchmarks want).

    ``n`` asks ``generate_batch`` for that many samples of the prompt (they share
    its cached prefix blocks; sample ``i`` is seeded with ``seed + i``); it is
    meant with ``temperature > 0``, since greedy samples are all the same.
    ``priority`` orders the scheduler's queue: lower values are served first,
    ties by arrival, and under memory pressure the highest value (then the
    newest request) is preempted first.

    ``logits_processors`` run in order on the request's logits row before it is
    sampled (greedy included), each getting the token ids so far (see
    ``LogitsProcessor``). One that raises, or returns a tensor of another shape,
    finishes only its own request, with finish reason ``"error"`` and the message.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    eos_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    n: int = 1
    priority: int = 0
    logits_processors: Sequence[LogitsProcessor] = field(default_factory=tuple)

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    def validate(self) -> None:
        """Raise ``ValueError`` describing the first invalid setting."""
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int):
            raise ValueError(f"max_new_tokens must be an int, got {self.max_new_tokens!r}")
        if self.max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if not isinstance(self.temperature, (int, float)) or not math.isfinite(self.temperature):
            raise ValueError(f"temperature must be a finite number, got {self.temperature!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not isinstance(self.top_p, (int, float)) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool)
            or not isinstance(self.seed, int)
            or not 0 <= self.seed < SEED_RANGE
        ):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {self.seed!r}")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an int >= 1, got {self.n!r}")
        if isinstance(self.priority, bool) or not isinstance(self.priority, int):
            raise ValueError(f"priority must be an int (lower runs first), got {self.priority!r}")
        for processor in self.logits_processors:
            if not callable(processor):
                raise ValueError(f"logits_processors must hold callables, got {processor!r}")
        for token_id in self.eos_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(f"eos_token_ids must hold non-negative ints, got {token_id!r}")

    @classmethod
    def from_generation_config(cls, generation_config: Any) -> SamplingParams:
        """Translate the subset of a ``transformers.GenerationConfig`` that cbgen honours."""
        gc = generation_config
        max_new_tokens = gc.max_new_tokens if gc.max_new_tokens is not None else 20
        eos = gc.eos_token_id
        eos_ids: tuple[int, ...] = (
            () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)
        )
        n = getattr(gc, "num_return_sequences", None) or 1
        if not gc.do_sample:
            return cls(max_new_tokens=max_new_tokens, eos_token_ids=eos_ids, n=n)
        return cls(
            max_new_tokens=max_new_tokens,
            n=n,
            temperature=1.0 if gc.temperature is None else float(gc.temperature),
            top_k=0 if gc.top_k is None else int(gc.top_k),
            top_p=1.0 if gc.top_p is None else float(gc.top_p),
            eos_token_ids=eos_ids,
        )


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request with ``n`` samples: ``seed + index``,
    wrapped into the 64-bit seed range so a seed near the top still gives valid seeds."""
    return None if seed is None else (seed + index) % SEED_RANGE

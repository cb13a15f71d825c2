"""The executor's backend roles and what every backend answers when it is chosen.

A backend serves one role of a step (attention, linear maps, fused layer ops, the
greedy argmax, the model adapter that runs the forward). It is chosen once, when
the engine is built, by ``supports(model, dtype, device)``: ``None`` when it can
serve, otherwise a sentence saying why not. The registry (``cbgen.executor.registry``)
asks each role's candidates in order and keeps the first that accepts, with the
refusals of the ones before it; nothing in the step loop checks again.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

if TYPE_CHECKING:
    from .batch import StepBatch
    from .metadata import AttentionMetadata, GroupTables


class Backend(ABC):
    """One way to serve one role; ``name`` is what logs and ``describe()`` show."""

    role: ClassVar[str]
    name: ClassVar[str]

    @abstractmethod
    def supports(self, model: nn.Module, dtype: torch.dtype, device: torch.device) -> str | None:
        """``None`` when this backend can serve ``model`` (``dtype`` on ``device``),
        otherwise why it cannot. Called once, when the executor is built."""

    def apply(self, model: nn.Module) -> None:  # noqa: B027 (optional hook)
        """Called once the backend is chosen, before later roles are: change the model
        for the executor's lifetime if serving needs it (most backends change nothing)."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """Undo what ``apply`` did (idempotent)."""


class AttentionBackend(Backend):
    """Stores a layer's new K/V in the paged cache and attends over each request's cache.

    The metadata it reads is built by ``cbgen.executor.batch.BatchBuilder`` in one shape for
    one or many cache groups; ``row_tables`` and ``padding_mask`` tell the builder
    which optional tables this backend reads.
    """

    role = "attention"
    row_tables: ClassVar[bool] = False  # a block table per row, prefill rows included
    padding_mask: ClassVar[bool] = False  # an additive mask hiding keys past a decode's context

    @abstractmethod
    def attend(
        self,
        metadata: AttentionMetadata,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        store: bool = True,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store layer ``layer``'s new K/V (unless the caller did: ``store=False``), then
        attend. ``q`` is ``[heads, tokens, dim]``, ``k``/``v`` ``[kv_heads, tokens, dim]``
        (views of any layout); returns ``[tokens, heads, value_dim]``. ``sinks``
        (``[heads]``, GPT-OSS's ``s_aux``): one more logit per head in every softmax,
        with no value (it only takes its share of the weight)."""

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        tables: GroupTables,
        scale: float,
        sliding_window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query row per request of ``tables``' decode tables: ``q`` is ``[heads, rows,
        dim]``; returns ``[heads, rows, value_dim]``. What the backend oracle test compares."""


class LinearBackend(Backend):
    """How the model's ``nn.Linear`` maps run. ``apply`` switches the model over for the
    executor's lifetime; ``close`` switches it back."""

    role = "linear"

    @property
    def modules_served(self) -> int:
        """How many ``nn.Linear`` modules run on this backend's own weights."""
        return 0


class LayerOps(Backend):
    """Fused per-layer operations of the decoder fast path."""

    role = "layer_ops"
    # RMSNorm of ``residual + delta`` (the sum written back into ``residual``).
    add_rms_norm: Callable[..., torch.Tensor]
    # Rotary embedding of a fused q/k/v projection, storing the new K/V in the cache.
    rope_qkv: Callable[..., torch.Tensor]
    # ``silu(gate) * up`` of a fused bfloat16 gate/up projection, or None (then torch's).
    silu_mul: Callable[[torch.Tensor, int], torch.Tensor] | None = None


class GreedyBackend(Backend):
    """``torch.argmax(logits, dim=-1)`` over the float32 ``[rows, vocab]`` logits the
    executor returns (on the model's device)."""

    role = "greedy"
    argmax: Callable[[torch.Tensor], torch.Tensor]


class ModelAdapter(Backend):
    """Runs the model's forward over a ``StepBatch`` to the sampled rows' float32 logits."""

    role = "model"

    @abstractmethod
    def forward(self, batch: StepBatch) -> torch.Tensor:
        """``[samples, vocab]`` float32 logits of ``batch.logits_indices``' rows."""


def model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def model_dtype(model: nn.Module) -> torch.dtype:
    """The dtype of the model's first parameter (float32 for a model without any)."""
    try:
        return next(model.parameters()).dtype
    except StopIteration:
        return torch.float32

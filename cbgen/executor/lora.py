"""LoRA adapters applied per row group, over a base model whose linear maps stay shared.

A step may mix rows of several adapters and base rows. The base GEMM runs once for every
row (prepacked, quantized, or the module's own ``F.linear``); each adapted map then adds
``scale * B(A(x))`` to the rows of each adapter. Adapters live in slots: for every module
an adapter targets, ``ModuleLora`` stacks the ``A`` and ``B`` of every slot
(``[slots, rank, in]`` and ``[slots, out, rank]``, ranks padded with zeros, the scale
folded into ``B``), so a step's adapters are one gather of the input rows, two batched
matrix products and one gather-and-add back per map, whatever the number of adapters or
requests: no Python loop per request or per adapter.

The rows of each adapter come from the step (``LoraRows``, built by the batch builder from
each scheduled request's slot) and reach the maps through a context variable set around
the forward pass (``lora_rows``), as the attention metadata does: the maps themselves are
the same objects whatever the step. A map outside a step (the probe, a draft model's
forward) adds nothing.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import nn

_ROWS: contextvars.ContextVar[LoraRows | None] = contextvars.ContextVar("cbgen_lora_rows")


@dataclass
class LoraRows:
    """Which rows of a step belong to which adapter slot.

    ``slots``: the slots with rows, ascending (``slot_index`` on the device). For the
    batched path, ``gather`` ``[len(slots) * width]`` lists each slot's rows padded to
    ``width`` with row 0, and ``mask`` ``[len(slots), width, 1]`` is 1 on real rows and
    0 on padding, so a padded position's product is exactly zero. ``scatter``
    ``[num_rows]`` is where each row's product sits in that padded layout (a base row:
    a padded position), so the products come back to the rows with one contiguous
    gather. ``whole``: one slot holds every row in order (no gather, no scatter).
    """

    num_rows: int
    slots: list[int]
    slot_index: torch.Tensor
    gather: torch.Tensor | None
    mask: torch.Tensor | None
    width: int
    whole: bool
    scatter: torch.Tensor | None = None

    @classmethod
    def of(
        cls, segments: Sequence[tuple[int, int, int]], num_rows: int, device: torch.device
    ) -> LoraRows | None:
        """From ``(first row, row count, slot)`` per request (slot < 0: base rows); None
        when no row has an adapter."""
        by_slot: dict[int, list[int]] = {}
        for row, count, slot in segments:
            if slot >= 0 and count > 0:
                by_slot.setdefault(slot, []).extend(range(row, row + count))
        if not by_slot:
            return None
        slots = sorted(by_slot)
        slot_index = torch.tensor(slots, dtype=torch.long, device=device)
        first = by_slot[slots[0]]
        if len(slots) == 1 and len(first) == num_rows:
            return cls(num_rows, slots, slot_index, None, None, num_rows, whole=True)
        sizes = [len(by_slot[slot]) for slot in slots]
        width = max(sizes)
        if sum(sizes) < num_rows and min(sizes) == width:
            width += 1  # base rows need a padded position to read their zero from
        zero = sizes.index(min(sizes)) * width + width - 1  # a padded position
        gather: list[int] = []
        mask: list[float] = []
        scatter = [zero] * num_rows
        for index, slot in enumerate(slots):
            rows = by_slot[slot]
            pad = width - len(rows)
            for offset, row in enumerate(rows):
                scatter[row] = index * width + offset
            gather += rows + [0] * pad
            mask += [1.0] * len(rows) + [0.0] * pad
        return cls(
            num_rows,
            slots,
            slot_index,
            torch.tensor(gather, dtype=torch.long, device=device),
            torch.tensor(mask, device=device).view(len(slots), width, 1),
            width,
            whole=False,
            scatter=torch.tensor(scatter, dtype=torch.long, device=device),
        )


@contextlib.contextmanager
def lora_rows(rows: LoraRows | None) -> Iterator[None]:
    """The adapter rows of the forward pass run inside (None: every row is the base's)."""
    token = _ROWS.set(rows)
    try:
        yield
    finally:
        _ROWS.reset(token)


def current_rows() -> LoraRows | None:
    """The adapter rows of the forward pass this thread is in, if any."""
    return _ROWS.get(None)


class ModuleLora:
    """The ``A`` and ``B`` of every slot for one linear module (zeros where a slot's
    adapter does not target it), in the dtype of the module's inputs. They keep PEFT's
    layouts (``[slots, rank, in]`` and ``[slots, out, rank]``): loading is a plain copy
    and the products read them transposed."""

    def __init__(
        self, name: str, in_features: int, out_features: int, num_slots: int, dtype: torch.dtype
    ) -> None:
        self.name = name
        self.in_features = in_features
        self.out_features = out_features
        self.num_slots = num_slots
        self.dtype = dtype
        self.rank = 0
        self.a = torch.zeros(num_slots, 0, in_features, dtype=dtype)
        self.b = torch.zeros(num_slots, out_features, 0, dtype=dtype)
        self.version = 0  # bumped by every change, for the stacks fused maps combine

    def to(self, device: torch.device) -> None:
        self.a, self.b = self.a.to(device), self.b.to(device)

    def _grow(self, rank: int) -> None:
        if rank <= self.rank:
            return
        a = self.a.new_zeros(self.num_slots, rank, self.in_features)
        b = self.b.new_zeros(self.num_slots, self.out_features, rank)
        a[:, : self.rank, :] = self.a
        b[:, :, : self.rank] = self.b
        self.a, self.b, self.rank = a, b, rank

    def load(self, slot: int, a: torch.Tensor, b: torch.Tensor, scale: float) -> None:
        """Slot ``slot`` becomes ``a`` ``[rank, in]`` and ``b`` ``[out, rank]`` (PEFT's
        layouts), ``scale`` folded into ``b``."""
        rank = int(a.shape[0])
        self._grow(rank)
        self.version += 1
        with torch.no_grad():
            if rank < self.rank:  # the padding past this adapter's rank must be zeros
                self.a[slot, rank:, :].zero_()
                self.b[slot, :, rank:].zero_()
            self.a[slot, :rank, :].copy_(a.detach())
            b_slot = self.b[slot, :, :rank]
            if b.dtype == self.dtype:
                b_slot.copy_(b.detach()).mul_(scale)
            else:  # scaled before it is rounded to the stack's dtype
                b_slot.copy_(b.detach().to(torch.float32) * scale)

    def clear(self, slot: int) -> None:
        self.version += 1
        with torch.no_grad():
            self.a[slot].zero_()
            self.b[slot].zero_()

    def add_to(self, x: torch.Tensor, out: torch.Tensor, rows: LoraRows) -> None:
        """``out[r] += scale * B(A(x[r]))`` for every row ``r`` of an adapter, in place
        (see ``add_products``)."""
        if self.rank:
            add_products(self.a, self.b, x, out, rows)


def add_products(
    a: torch.Tensor, b: torch.Tensor, x: torch.Tensor, out: torch.Tensor, rows: LoraRows
) -> None:
    """``out[r] += B_s(A_s(x[r]))`` for every row ``r`` of slot ``s``, in place, from the
    stacks ``a`` ``[slots, rank, in]`` and ``b`` ``[slots, out, rank]`` (scale in ``b``);
    ``x`` ``[rows, in]`` in the stacks' dtype, ``out`` ``[rows, out]`` (a column view is
    fine)."""
    if rows.whole:
        hidden = x @ a[rows.slots[0]].t()
    else:
        hidden = _hidden(a, x, rows)
    _add_b(b, hidden, out, rows)


def _hidden(a: torch.Tensor, x: torch.Tensor, rows: LoraRows) -> torch.Tensor:
    """``A_s(x[r])`` in the padded layout ``[slots, width, rank]``, zero on padding."""
    assert rows.gather is not None and rows.mask is not None
    if len(rows.slots) != a.shape[0]:
        a = a.index_select(0, rows.slot_index)
    picked = x.index_select(0, rows.gather).view(len(rows.slots), rows.width, -1)
    hidden = torch.bmm(picked, a.transpose(1, 2))
    mask = rows.mask if rows.mask.dtype == a.dtype else rows.mask.to(a.dtype)
    return hidden.mul_(mask)


def _add_b(b: torch.Tensor, hidden: torch.Tensor, out: torch.Tensor, rows: LoraRows) -> None:
    """``out[r] += B_s(hidden)`` for ``hidden`` from ``_hidden`` (or ``[rows, rank]`` when
    one slot holds every row)."""
    if rows.whole:
        b_slot = b[rows.slots[0]].t()
        if out.dtype == b.dtype:
            out.addmm_(hidden, b_slot)
        else:
            out.add_(hidden @ b_slot)
        return
    assert rows.scatter is not None
    if len(rows.slots) != b.shape[0]:
        b = b.index_select(0, rows.slot_index)
    delta = torch.bmm(hidden, b.transpose(1, 2)).view(-1, b.shape[1])
    # A contiguous gather back to the rows, then an add (into a fused output's column
    # view too): index_add_ into such a view runs element by element.
    out.add_(delta.index_select(0, rows.scatter))


class MapLora:
    """The adapters of one linear map: one module's, or those of fused siblings (q/k/v,
    gate/up) whose outputs sit side by side (``columns``).

    Fused siblings share the first half: their ``A`` stacks side by side along the rank
    make one gather and one batched product for all of them; each then runs its own
    ``B`` product into its columns. (A block-diagonal ``B`` over the whole output would
    be one product fewer, but reading its zero blocks costs more than the call saves: at
    decode the adapters' cost is the bytes of their stacks.) The combined ``A`` is made
    again when a sibling's stacks change."""

    def __init__(self, members: Sequence[tuple[slice, ModuleLora]]) -> None:
        self.members = tuple(members)
        self._versions: tuple[int, ...] = ()
        self._a: torch.Tensor | None = None

    def __call__(self, x: torch.Tensor, out: torch.Tensor) -> None:
        rows = _ROWS.get(None)
        if rows is None:
            return
        x2 = x.reshape(-1, x.shape[-1])
        out2 = out.view(-1, out.shape[-1])
        if x2.shape[0] != rows.num_rows:
            name = self.members[0][1].name
            raise RuntimeError(
                f"cbgen LoRA: {name} was called on {x2.shape[0]} rows in a step of "
                f"{rows.num_rows}; adapters on this module are not supported"
            )
        first = self.members[0][1]
        if x2.dtype != first.dtype:
            x2 = x2.to(first.dtype)
        if len(self.members) == 1:
            columns, module = self.members[0]
            if module.rank:
                add_products(module.a, module.b, x2, out2[:, columns], rows)
            return
        a = self._combined_a()
        if not a.shape[1]:
            return
        if rows.whole:
            hidden = x2 @ a[rows.slots[0]].t()
        else:
            hidden = _hidden(a, x2, rows)
        start = 0
        for columns, module in self.members:
            end = start + module.rank
            if end > start:
                _add_b(module.b, hidden[..., start:end], out2[:, columns], rows)
            start = end

    def _combined_a(self) -> torch.Tensor:
        versions = tuple(module.version for _, module in self.members)
        if versions != self._versions or self._a is None:
            self._a = torch.cat([module.a for _, module in self.members], dim=1)
            self._versions = versions
        return self._a


def wrap_module_forward(module: nn.Module, lora: MapLora) -> None:
    """``module``'s forward (its own, or one a backend put in place) followed by ``lora``;
    ``unwrap_module_forward`` undoes it."""
    inner = module.forward

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = inner(x)
        if _ROWS.get(None) is not None:
            lora(x, out)
        return out

    forward.__cbgen_lora_inner__ = inner  # type: ignore[attr-defined]
    module.forward = forward  # type: ignore[method-assign]


def unwrap_module_forward(module: nn.Module) -> None:
    forward = module.__dict__.get("forward")
    inner = getattr(forward, "__cbgen_lora_inner__", None)
    if inner is None:
        return
    if getattr(inner, "__self__", None) is module and inner.__func__ is type(module).forward:
        del module.__dict__["forward"]  # it was the class's own
    else:
        module.forward = inner  # type: ignore[method-assign]

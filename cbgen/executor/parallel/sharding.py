"""Which of a model's weights each tensor-parallel rank holds, and the rank's model.

The plan comes from transformers' own ``base_model_tp_plan`` (``colwise`` / ``rowwise``
per module pattern), read block by block: a block is sharded only when it is one cbgen
knows how to split exactly, and is otherwise kept whole on every rank (replicated: the
same arithmetic, only not divided). The blocks:

- attention: ``q/k/v`` column-wise by heads, ``o`` row-wise. K/V heads are split when
  the ranks divide them; with fewer K/V heads than ranks each rank keeps the one K/V head
  its query heads read (GQA replication).
- a gated or plain MLP: its column-wise maps split by rows, its one row-wise map by
  columns.
- MoE experts stored as 3D tensors (``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``):
  every expert's intermediate dimension is split.

A row-wise block's output on one rank is a partial sum; a forward hook all-reduces it
over the group (and adds the map's bias once, after the sum). That is one all-reduce per
attention block and one per MLP block. Embeddings, norms, routers and the LM head are
replicated.

The rank's model is a ``copy.deepcopy`` of the caller's whose replicated tensors are the
caller's own (no copy) and whose sharded ones are the rank's slices: the caller's model
is left as it was.
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

ATTENTION = "attention"
MLP = "mlp"
EXPERTS = "experts"

# The hook's marker: ``fast_forward`` accepts modules whose only hooks are these.
REDUCE_HOOK_ATTR = "_cbgen_tp_reduce"


@dataclass(frozen=True)
class ShardedBlock:
    """One block split over the ranks: its kind, module path and what the split needs."""

    kind: str
    path: str  # the block's module path in the model (``model.layers.3.self_attn``)
    column: tuple[str, ...]  # child names split by output rows (experts: the 3D params)
    row: str  # the child whose input columns are split (its output is all-reduced)
    heads: int = 0  # attention: query heads and K/V heads in the whole model
    kv_heads: int = 0
    head_dim: int = 0


@dataclass
class ShardPlan:
    """The blocks split over ``world`` ranks, and the ones kept whole with the reason."""

    world: int
    blocks: list[ShardedBlock] = field(default_factory=list)
    replicated: dict[str, str] = field(default_factory=dict)

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for block in self.blocks:
            kinds[block.kind] = kinds.get(block.kind, 0) + 1
        split = ", ".join(f"{n} {kind}" for kind, n in sorted(kinds.items())) or "nothing"
        text = f"tensor parallel over {self.world} ranks: split {split} blocks"
        if self.replicated:
            path, why = next(iter(self.replicated.items()))
            text += f"; {len(self.replicated)} kept whole (e.g. {path}: {why})"
        return text


def plan_shards(model: nn.Module, world: int) -> ShardPlan:
    """The ``ShardPlan`` of ``model`` over ``world`` ranks; ``ValueError`` naming what is
    missing when nothing of it can be split (no ``tp_plan``, heads that do not divide)."""
    config: Any = getattr(model, "config", None)
    tp_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    name = type(model).__name__
    if not tp_plan:
        raise ValueError(
            f"{name} has no tensor-parallel plan (config.base_model_tp_plan), so cbgen "
            "does not know how to split it; run it with tensor_parallel_size=1"
        )
    prefix = getattr(model, "base_model_prefix", "model")
    base = getattr(model, prefix, None)
    if not isinstance(base, nn.Module):
        raise ValueError(f"{name} has no base model at .{prefix}")
    styles = _styles_by_parent(base, tp_plan)
    plan = ShardPlan(world)
    for parent_path, children in styles.items():
        module = base.get_submodule(parent_path)
        path = f"{prefix}.{parent_path}"
        try:
            plan.blocks.append(_block(module, path, children, world, config))
        except _KeepWhole as reason:
            plan.replicated[path] = str(reason)
    if not plan.blocks:
        reasons = "; ".join(f"{p}: {r}" for p, r in list(plan.replicated.items())[:3])
        raise ValueError(f"cbgen cannot split any block of {name} over {world} ranks ({reasons})")
    return plan


class _KeepWhole(Exception):
    """Why a block stays whole on every rank."""


def _styles_by_parent(base: nn.Module, tp_plan: dict[str, str]) -> dict[str, dict[str, str]]:
    """``{parent path: {child name: style}}`` for every module the plan names."""
    patterns = [
        (re.compile("^" + re.escape(key).replace(r"\*", r"\d+") + "$"), style)
        for key, style in tp_plan.items()
    ]
    found: dict[str, dict[str, str]] = {}
    for path, _ in base.named_modules():
        for pattern, style in patterns:
            if pattern.match(path):
                parent, _, child = path.rpartition(".")
                found.setdefault(parent, {})[child] = style
    # Parameters named by the plan (MoE experts' 3D weights).
    for path, _ in base.named_parameters():
        for pattern, style in patterns:
            if pattern.match(path):
                parent, _, child = path.rpartition(".")
                found.setdefault(parent, {})[child] = style
    # A block named as a whole (``moe_tp_experts``) is described by its parameters.
    for path in list(found):
        parent, _, child = path.rpartition(".")
        if parent in found and found[parent].get(child) == "moe_tp_experts":
            del found[parent][child]
            if not found[parent]:
                del found[parent]
    return found


def _block(
    module: nn.Module, path: str, children: dict[str, str], world: int, config: Any
) -> ShardedBlock:
    # Replicated children (Qwen3's per-head norms) are the same on every rank.
    children = {c: s for c, s in children.items() if not s.startswith("replicated")}
    column = tuple(sorted(c for c, s in children.items() if s in ("colwise", "packed_colwise")))
    row = [c for c, s in children.items() if s == "rowwise"]
    others = {c: s for c, s in children.items() if c not in column and c not in row}
    if others:
        raise _KeepWhole(f"tp_plan styles cbgen does not split: {sorted(set(others.values()))}")
    if len(row) != 1 or not column:
        raise _KeepWhole("not one row-wise map fed by column-wise maps")
    if {"q_proj", "k_proj", "v_proj"} <= set(column):
        return _attention_block(module, path, column, row[0], world, config)
    if children.get("gate_up_proj") == "packed_colwise":
        return _experts_block(module, path, row[0], world)
    return _mlp_block(module, path, column, row[0], world)


def _attention_block(
    module: Any, path: str, column: tuple[str, ...], row: str, world: int, config: Any
) -> ShardedBlock:
    if column != ("k_proj", "q_proj", "v_proj"):
        raise _KeepWhole(f"attention with column-wise maps {column}")
    linears = [getattr(module, name, None) for name in (*column, row)]
    if not all(isinstance(m, nn.Linear) for m in linears):
        raise _KeepWhole("q/k/v/o are not all nn.Linear")
    head_dim = int(getattr(module, "head_dim", 0) or 0)
    q, k = module.q_proj, module.k_proj
    if head_dim <= 0 or q.out_features % head_dim or k.out_features % head_dim:
        raise _KeepWhole("no head_dim that divides q and k")
    heads, kv_heads = q.out_features // head_dim, k.out_features // head_dim
    if heads % world:
        raise _KeepWhole(f"{heads} query heads do not split over {world} ranks")
    if kv_heads % world and world % kv_heads:
        raise _KeepWhole(f"{kv_heads} K/V heads neither split over nor replicate to {world} ranks")
    if heads % kv_heads:
        raise _KeepWhole(f"{heads} query heads are not groups of {kv_heads} K/V heads")
    # Per-head weights (Qwen3's q/k RMSNorms) are the same on every rank; anything sized by
    # the heads themselves (attention sinks, a norm over all heads) would need a split.
    for name, param in _other_parameters(module, (*column, row)):
        if param.numel() != head_dim:
            raise _KeepWhole(f"its parameter {name} {tuple(param.shape)} is not per head")
    return ShardedBlock(ATTENTION, path, column, row, heads, kv_heads, head_dim)


def _mlp_block(
    module: Any, path: str, column: tuple[str, ...], row: str, world: int
) -> ShardedBlock:
    maps = [getattr(module, name, None) for name in (*column, row)]
    if not all(isinstance(m, nn.Linear) for m in maps):
        raise _KeepWhole("its maps are not all nn.Linear")
    width = maps[-1].in_features  # type: ignore[union-attr]
    if any(m.out_features != width for m in maps[:-1]):  # type: ignore[union-attr]
        raise _KeepWhole("the column-wise maps' widths differ from the row-wise map's input")
    if width % world:
        raise _KeepWhole(f"an intermediate width of {width} does not split over {world} ranks")
    for name, _ in _other_parameters(module, (*column, row)):
        raise _KeepWhole(f"it has another parameter, {name}")
    return ShardedBlock(MLP, path, column, row)


def _other_parameters(module: Any, maps: tuple[str, ...]) -> list[tuple[str, torch.Tensor]]:
    """The block's parameters outside its split maps."""
    return [(n, p) for n, p in module.named_parameters() if n.split(".")[0] not in maps]


def _experts_block(module: Any, path: str, row: str, world: int) -> ShardedBlock:
    names = {name for name, _ in module.named_parameters()}
    if names != {"gate_up_proj", "down_proj"} or row != "down_proj":
        raise _KeepWhole(f"experts with parameters {sorted(names)} (biases are not split)")
    gate_up, down = module.gate_up_proj, module.down_proj
    if gate_up.dim() != 3 or down.dim() != 3:
        raise _KeepWhole("expert weights are not 3D")
    inter = down.shape[2]
    if gate_up.shape[1] != 2 * inter or gate_up.shape[2] != down.shape[1]:
        raise _KeepWhole("expert weights are not [E, 2I, H] and [E, H, I]")
    if inter % world:
        raise _KeepWhole(f"an expert width of {inter} does not split over {world} ranks")
    return ShardedBlock(EXPERTS, path, ("gate_up_proj",), row)


# -- the rank's model ---------------------------------------------------------------------


Reduce = Callable[[torch.Tensor], None]


def shard_model(model: nn.Module, plan: ShardPlan, rank: int, reduce: Reduce) -> nn.Module:
    """Rank ``rank``'s model: a copy of ``model`` holding its slices of ``plan``'s blocks
    (``reduce`` sums a tensor over the ranks in place), sharing every other tensor."""
    slices: dict[int, torch.Tensor] = {}
    for block in plan.blocks:
        module = model.get_submodule(block.path)
        for name, tensor in _block_slices(module, block, plan.world, rank).items():
            slices[id(_tensor(module, name))] = tensor
    memo: dict[int, Any] = {}
    for tensor in [*model.parameters(), *model.buffers()]:
        if id(tensor) in slices:
            memo[id(tensor)] = nn.Parameter(slices[id(tensor)], requires_grad=False)
        else:
            memo[id(tensor)] = tensor
    shard = copy.deepcopy(model, memo)
    for module in shard.modules():
        # Another engine's executor may have put its own forward on the caller's modules
        # (prepacked weights): the copy runs the classes' code on its own tensors.
        module.__dict__.pop("forward", None)
    for block in plan.blocks:
        _rebind(shard.get_submodule(block.path), block, plan.world, reduce)
    return shard


def _tensor(module: nn.Module, name: str) -> torch.Tensor:
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr)


def _rows(t: torch.Tensor, start: int, stop: int, dim: int = 0) -> torch.Tensor:
    return t.narrow(dim, start, stop - start).clone(memory_format=torch.contiguous_format)


def _block_slices(
    module: Any, block: ShardedBlock, world: int, rank: int
) -> dict[str, torch.Tensor]:
    """``{parameter name in the block: the rank's slice}``."""
    out: dict[str, torch.Tensor] = {}
    if block.kind == EXPERTS:
        gate_up, down = module.gate_up_proj, module.down_proj
        inter = down.shape[2]
        part = inter // world
        lo, hi = rank * part, (rank + 1) * part
        out["gate_up_proj"] = torch.cat(
            [_rows(gate_up, lo, hi, 1), _rows(gate_up, inter + lo, inter + hi, 1)], dim=1
        )
        out["down_proj"] = _rows(down, lo, hi, 2)
        return out
    if block.kind == ATTENTION:
        spans = _head_spans(block, world, rank)
    else:
        width = getattr(module, block.row).in_features
        part = width // world
        spans = {name: (rank * part, (rank + 1) * part) for name in (*block.column, block.row)}
    for name in block.column:
        linear = getattr(module, name)
        lo, hi = spans[name]
        out[f"{name}.weight"] = _rows(linear.weight, lo, hi)
        if linear.bias is not None:
            out[f"{name}.bias"] = _rows(linear.bias, lo, hi)
    lo, hi = spans[block.row]
    out[f"{block.row}.weight"] = _rows(getattr(module, block.row).weight, lo, hi, 1)
    return out


def _head_spans(block: ShardedBlock, world: int, rank: int) -> dict[str, tuple[int, int]]:
    d = block.head_dim
    per_rank = block.heads // world
    q = (rank * per_rank * d, (rank + 1) * per_rank * d)
    if block.kv_heads % world == 0:
        kv_per_rank = block.kv_heads // world
        kv = (rank * kv_per_rank * d, (rank + 1) * kv_per_rank * d)
    else:  # fewer K/V heads than ranks: the one this rank's query heads read
        head = rank * per_rank // (block.heads // block.kv_heads)
        kv = (head * d, (head + 1) * d)
    return {"q_proj": q, "k_proj": kv, "v_proj": kv, "o_proj": q}


def local_heads(block: ShardedBlock, world: int) -> tuple[int, int]:
    """Query and K/V heads one rank holds of an attention block."""
    kv = block.kv_heads // world if block.kv_heads % world == 0 else 1
    return block.heads // world, kv


def _rebind(module: Any, block: ShardedBlock, world: int, reduce: Reduce) -> None:
    """Fix the copied modules' sizes to their slices and hook the all-reduce on."""
    for name in block.column:
        linear = getattr(module, name)
        if isinstance(linear, nn.Linear):
            linear.out_features = linear.weight.shape[0]
    row = getattr(module, block.row)
    bias: torch.Tensor | None = None
    target = module if block.kind == EXPERTS else row
    if isinstance(row, nn.Linear):
        row.in_features = row.weight.shape[1]
        bias = row.bias
        row.register_parameter("bias", None)  # added once, after the sum
    if block.kind == ATTENTION:
        heads, kv_heads = local_heads(block, world)
        if hasattr(module, "num_key_value_groups"):
            module.num_key_value_groups = heads // kv_heads
        for attr, value in (("num_heads", heads), ("num_key_value_heads", kv_heads)):
            if isinstance(getattr(module, attr, None), int):
                setattr(module, attr, value)
    if block.kind == EXPERTS and hasattr(module, "intermediate_dim"):
        module.intermediate_dim = module.down_proj.shape[2]
    target.register_forward_hook(RowReduce(reduce, bias))


class RowReduce:
    """The forward hook of a row-wise block: sums the ranks' partial outputs, then adds
    the map's bias once. ``apply`` is the same for a caller without modules (the fast
    decoder, which finds it on the module through ``REDUCE_HOOK_ATTR``)."""

    def __init__(self, reduce: Reduce, bias: torch.Tensor | None) -> None:
        self.reduce, self.bias = reduce, bias
        setattr(self, REDUCE_HOOK_ATTR, True)

    def __call__(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor:
        return self.apply(output)

    def apply(self, output: torch.Tensor) -> torch.Tensor:
        if not output.is_contiguous():
            output = output.contiguous()
        self.reduce(output)
        return output if self.bias is None else output + self.bias

"""The adapter slots of an executor: which modules take adapters, their stacked weights,
and where the adapted maps hook into whatever serves each module.

Adapters outlive runners: a refresh builds new prepacked maps from the base weights and
``attach`` hooks the same stacks onto them again, so an adapter is never loaded twice and
an adapter update (``load`` into a used slot) is a copy of a few MB, not a rebuild.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import NamedTuple

import torch
from torch import nn

from .cpu.prepack import LinearMap, PackedLinears, plain_linear
from .cpu.quantization import QuantizedLinear
from .lora import MapLora, ModuleLora, unwrap_module_forward, wrap_module_forward


class LoraWeights(NamedTuple):
    """One module's adapter: ``a`` ``[rank, in]``, ``b`` ``[out, rank]`` (PEFT's
    ``lora_A``/``lora_B`` weights) and the scale PEFT multiplies their product by."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


class LoraSlots:
    """``num_slots`` adapter slots over ``model``'s linear modules.

    ``state_modules``: names of modules that run per request on state slots (their
    inner maps see a part of a step's rows, so they take no adapter).
    """

    def __init__(
        self,
        model: nn.Module,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        state_modules: list[str],
    ) -> None:
        self.model = model
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self._named = dict(model.named_modules())
        self._state_modules = tuple(state_modules)
        output_embeddings = getattr(model, "get_output_embeddings", None)
        self._output = output_embeddings() if callable(output_embeddings) else None
        self.modules: dict[str, ModuleLora] = {}
        self._wrapped: list[nn.Module] = []

    # -- checks ---------------------------------------------------------------------------

    def target(self, name: str) -> nn.Module:
        """The module ``name`` if an adapter may target it; else ``ValueError`` saying why."""
        if ".experts." in f".{name}.":
            raise ValueError(f"{name}: LoRA on mixture-of-experts experts is not supported")
        module = self._named.get(name)
        if module is None:
            raise ValueError(f"the base model has no module {name!r}")
        if module is self._output:
            raise ValueError(f"{name}: LoRA on the LM head is not supported")
        if not (plain_linear(module) or isinstance(module, QuantizedLinear)):
            raise ValueError(
                f"{name} is a {type(module).__name__}; cbgen applies LoRA to linear maps "
                "(nn.Linear) only"
            )
        for state in self._state_modules:
            if name.startswith(state + "."):
                raise ValueError(f"{name}: LoRA inside a state layer ({state}) is not supported")
        return module

    def check(self, weights: Mapping[str, LoraWeights]) -> None:
        """Every module ``weights`` names takes an adapter of that shape; ``ValueError``
        naming the first that does not. Nothing is written."""
        if not weights:
            raise ValueError("the adapter has no LoRA weights")
        for name, (a, b, _) in weights.items():
            module = self.target(name)
            rank = int(a.shape[0]) if a.dim() == 2 else -1
            if rank > self.max_rank:
                raise ValueError(
                    f"{name}: rank {rank} is over max_lora_rank={self.max_rank} "
                    "(EngineConfig.max_lora_rank)"
                )
            in_features = int(module.in_features)  # type: ignore[arg-type]
            out_features = int(module.out_features)  # type: ignore[arg-type]
            if a.dim() != 2 or b.dim() != 2 or tuple(a.shape) != (rank, in_features):
                raise ValueError(
                    f"{name}: lora_A has shape {tuple(a.shape)}, the module takes "
                    f"[rank, {in_features}]"
                )
            if tuple(b.shape) != (out_features, rank):
                raise ValueError(
                    f"{name}: lora_B has shape {tuple(b.shape)}, expected [{out_features}, {rank}]"
                )

    # -- slots ----------------------------------------------------------------------------

    def load(self, slot: int, weights: Mapping[str, LoraWeights], clear: bool = True) -> None:
        """Slot ``slot`` holds ``weights`` (checked first); with ``clear``, every module
        they do not name holds nothing in that slot."""
        self.check(weights)
        if clear:
            self.clear(slot)
        new = False
        for name, (a, b, scale) in weights.items():
            module_lora = self.modules.get(name)
            if module_lora is None:
                module = self._named[name]
                module_lora = ModuleLora(
                    name,
                    int(module.in_features),  # type: ignore[arg-type]
                    int(module.out_features),  # type: ignore[arg-type]
                    self.num_slots,
                    self.dtype,
                )
                module_lora.to(self.device)
                self.modules[name] = module_lora
                new = True
            module_lora.load(slot, a.to(self.device), b.to(self.device), scale)
        if new:
            self._needs_attach = True

    def clear(self, slot: int) -> None:
        for module_lora in self.modules.values():
            module_lora.clear(slot)

    # -- hooks ----------------------------------------------------------------------------

    _needs_attach = False

    @property
    def needs_attach(self) -> bool:
        """A module took its first adapter since the last ``attach``."""
        return self._needs_attach

    def attach(self, packed: PackedLinears | None) -> None:
        """Hook every adapted module onto what serves it now: the prepacked (or quantized)
        map in ``packed``, shared by fused siblings, else the module's forward."""
        self.detach()
        groups: dict[int, tuple[LinearMap, list[tuple[slice, ModuleLora]]]] = {}
        for name, module_lora in self.modules.items():
            module = self._named[name]
            served = packed.serving(module) if packed is not None else None
            if served is None:
                wrap_module_forward(module, MapLora([(slice(None), module_lora)]))
                self._wrapped.append(module)
                continue
            linear_map, columns = served
            entry = groups.setdefault(id(linear_map), (linear_map, []))
            entry[1].append((columns, module_lora))
        for linear_map, members in groups.values():
            linear_map.lora = MapLora(members)
        self._needs_attach = False

    def detach(self) -> None:
        """The module forwards wrapped by ``attach`` back as they were (maps die with
        their runner)."""
        for module in self._wrapped:
            unwrap_module_forward(module)
        self._wrapped = []

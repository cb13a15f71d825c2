"""A ``peft`` model lent to a cbgen engine: its LoRA wrappers stepped aside for the
engine's lifetime, the adapter served from cbgen's LoRA slots.

Why the swap: ``peft`` adapts a model by putting a wrapper module
(``peft.tuners.lora.Linear``) where each target ``nn.Linear`` was; the wrapper calls the
original (its ``base_layer``) and adds its LoRA product. cbgen packs plain ``nn.Linear``
maps once and adds adapters from its slots to them (one batched product per map, the
fast decoder included), and refuses an adapter on anything but a plain linear module. So
while an engine runs on the model, each wrapper's ``base_layer`` takes the wrapper's
place in the module tree: the engine, built on ``get_base_model()``, sees and packs the
base; the adapter's ``lora_A``/``lora_B`` are read from the wrappers (``PeftLayers``,
whatever the tree holds at the time) into a slot. Between rollouts, and after an error,
the wrappers are back where they were and every module has its training flag again, so
the trainer's forward and backward are peft's own. The adapter's tensors are the
wrappers' parameters themselves (never copies), so an optimizer step in place is seen by
their version counters.
"""

from __future__ import annotations

import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..core.config import EngineConfig


def is_peft_model(model: object) -> bool:
    """Whether ``model`` holds ``peft`` tuner layers (a ``PeftModel``, or a model that
    ``peft`` injected adapters into). False without even importing ``peft`` if no one
    has."""
    if "peft" not in sys.modules or not isinstance(model, nn.Module):
        return False
    from peft.tuners.tuners_utils import BaseTunerLayer

    return any(isinstance(m, BaseTunerLayer) for m in model.modules())


class PeftTarget:
    """``model``'s LoRA wrappers, and ``lent()`` to swap their base layers in.

    ``base`` is the model an engine runs on (``get_base_model()``); ``adapter`` is what
    ``EngineCore.add_lora`` / ``update_lora`` read the adapter from; ``adapter_name``
    the one active adapter; ``rank`` its largest rank. ``ValueError`` for what cbgen
    cannot serve exactly: a tuner other than LoRA, several active adapters, an adapter
    merged into the base or disabled."""

    def __init__(self, model: nn.Module) -> None:
        from peft.tuners.lora import LoraLayer
        from peft.tuners.tuners_utils import BaseTunerLayer

        get_base = getattr(model, "get_base_model", None)
        self.model = model
        self.base: nn.Module = get_base() if callable(get_base) else model
        self._places: list[tuple[str, nn.Module, str, Any]] = []
        parents = dict(self.base.named_modules())
        for name, module in self.base.named_modules():
            if self._places and name.startswith(self._places[-1][0] + "."):
                continue  # inside a wrapper (its base layer, its lora_A/lora_B)
            if type(module).__module__.startswith("peft.") and not isinstance(
                module, BaseTunerLayer
            ):
                raise ValueError(
                    f"{name} is a peft {type(module).__name__}; cbgen serves LoRA layers only "
                    "(no modules_to_save, no trainable tokens)"
                )
            if not isinstance(module, BaseTunerLayer):
                continue
            if not isinstance(module, LoraLayer):
                raise ValueError(
                    f"{name} is a peft {type(module).__name__}; cbgen serves LoRA only"
                )
            parent_name, _, attr = name.rpartition(".")
            self._places.append((name, parents[parent_name], attr, module))
        if not self._places:
            raise ValueError(f"{type(model).__name__} holds no peft LoRA layer")
        self.adapter_name: str = self._active_adapter()
        self.rank = max(int(w.r.get(self.adapter_name, 0)) for *_, w in self._places)
        self.adapter = PeftLayers(self)
        self._swapped = False

    def _active_adapter(self) -> str:
        """The one adapter the wrappers apply now; ``ValueError`` if they apply none,
        several, or one merged into the base."""
        for name, _, _, wrapper in self._places:
            if wrapper.merged:
                raise ValueError(f"{name}: the adapter is merged into the base; unmerge it first")
            if wrapper.disable_adapters:
                raise ValueError(f"{name}: the adapters are disabled; enable them first")
        active = {tuple(wrapper.active_adapters) for *_, wrapper in self._places}
        if len(active) != 1 or len(next(iter(active))) != 1:
            raise ValueError(
                f"the peft model has active adapters {sorted(active)}; cbgen serves one "
                "(set_adapter it)"
            )
        return str(next(iter(active))[0])

    def layers(self) -> Iterator[tuple[str, nn.Module]]:
        """Every LoRA wrapper by its name in ``base``, wherever it sits now."""
        for name, _, _, wrapper in self._places:
            yield name, wrapper

    @contextlib.contextmanager
    def lent(self) -> Iterator[nn.Module]:
        """``base`` with every wrapper's ``base_layer`` in the wrapper's place (and no
        input-embedding grad hook), for the block; then the wrappers (and the hook) back
        and every module's training flag as it was (an engine puts its model in eval
        mode), also when the block raises."""
        if self._swapped:
            raise RuntimeError("the peft model is already lent to an engine")
        if self._active_adapter() != self.adapter_name:
            raise ValueError(
                f"the peft model's active adapter is no longer {self.adapter_name!r}; "
                "an engine serves the adapter it was built with"
            )
        flags = [(module, module.training) for module in self.model.modules()]
        # Gradient checkpointing with peft hooks the input embeddings so that their
        # output requires grad (``enable_input_require_grads``): nothing generation needs
        # (it runs under inference mode), and a hook keeps cbgen's fast decoder off.
        base: Any = self.base
        input_grads = bool(getattr(base, "_require_grads_hooks", None))
        if input_grads:
            base.disable_input_require_grads()
        for _, parent, attr, wrapper in self._places:
            setattr(parent, attr, wrapper.base_layer)
        self._swapped = True
        try:
            yield self.base
        finally:
            for _, parent, attr, wrapper in self._places:
                setattr(parent, attr, wrapper)
            self._swapped = False
            for module, training in flags:
                module.training = training
            if input_grads:
                base.enable_input_require_grads()


class PeftLayers(nn.Module):
    """A ``PeftTarget``'s LoRA wrappers as ``cbgen.core.lora_source`` reads a live peft
    model (``named_modules``, ``active_adapters``, ``peft_config``), whether or not they
    are in the module tree at the moment. Holds no module of its own."""

    _target: PeftTarget

    def __init__(self, target: PeftTarget) -> None:
        super().__init__()
        self._target = target  # not a module: nothing of it is moved, saved or registered

    def get_base_model(self) -> nn.Module:
        """Itself: its ``named_modules`` are the wrappers, named as in the base model."""
        return self

    def named_modules(
        self,
        memo: set[nn.Module] | None = None,
        prefix: str = "",
        remove_duplicate: bool = True,
    ) -> Iterator[tuple[str, nn.Module]]:
        """The wrappers, by their names in the base model."""
        return self._target.layers()

    @property
    def active_adapters(self) -> list[str]:
        """The one adapter served."""
        return [self._target.adapter_name]

    @property
    def peft_config(self) -> dict[str, Any]:
        """The peft model's adapter configs."""
        return dict(getattr(self._target.model, "peft_config", {}) or {})

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise RuntimeError("PeftLayers only describes an adapter; it runs nothing")


# The name a lent peft model's adapter has in the engine it is lent to.
POLICY = "policy"


def engine_config(config: EngineConfig | None, target: PeftTarget) -> EngineConfig:
    """``config`` (default ``EngineConfig()``) with room for ``target``'s adapter: at
    least one LoRA slot, of its rank."""
    config = config or EngineConfig()
    return dataclasses.replace(
        config,
        max_loras=max(config.max_loras, 1),
        max_lora_rank=max(config.max_lora_rank, target.rank),
    )

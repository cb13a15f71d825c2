"""LoRA adapters of an engine by name: added, listed, updated in place, removed.

A mixin of ``EngineCore``, as ``Lifecycle`` is: these methods run between steps. Each
adapter holds one of the executor's ``max_loras`` slots; a request names its adapter
(``add_request(..., lora=name)``) and carries the slot to the executor and a salt to the
prefix cache (K/V computed under one adapter, or under an adapter's older weights, is
never reused for another). An adapter read from a live ``peft`` model is watched: when a
trainer changes its weights in place, the next step loads them first.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..executor.lora_slots import LoraWeights
from ..executor.model_executor import ModelExecutor
from ..requests.request import Request, RequestOutput
from .config import EngineConfig
from .lora_source import AdapterSource, pair_tensors, read_adapter
from .scheduler import Scheduler

logger = logging.getLogger(__name__)

_GENERATIONS = itertools.count(1)


@dataclass
class LoraInfo:
    """An adapter an engine holds, as ``list_loras()`` reports it."""

    name: str
    rank: int
    modules: int  # how many linear maps it adapts
    source: str
    requests: int = 0  # unfinished requests running under it


@dataclass
class _Loaded:
    name: str
    slot: int
    source: AdapterSource
    salt: bytes
    requests: set[Request] = field(default_factory=set)
    versions: list[int] = field(default_factory=list)

    def mark(self) -> None:
        self.versions = [t._version for t in self.source.watched]

    def changed(self) -> bool:
        return any(t._version != v for t, v in zip(self.source.watched, self.versions, strict=True))


def _salt(name: str) -> bytes:
    return f"lora:{name}:{next(_GENERATIONS)}".encode()


class Loras:
    """Adapters of an ``EngineCore`` (see the module's docstring)."""

    config: EngineConfig
    executor: ModelExecutor
    scheduler: Scheduler
    _loras: dict[str, _Loaded]
    _held: list[RequestOutput]
    _in_flight: Any
    _settle_in_flight: Callable[[], list[RequestOutput]]

    def add_lora(self, name: str, source: Any, *, adapter_name: str | None = None) -> None:
        """Hold adapter ``source`` (a PEFT adapter folder, or a ``peft`` model whose
        adapter ``adapter_name``, default its active one, is read) under ``name`` for
        requests to name. ``ValueError`` if the name is taken, every slot is used
        (``EngineConfig.max_loras``), or the adapter does not fit the base model (a
        module it lacks, a shape, a rank over ``max_lora_rank``), naming which."""
        if not isinstance(name, str) or not name:
            raise ValueError(f"a LoRA adapter's name is a non-empty string, got {name!r}")
        if name in self._loras:
            raise ValueError(f"LoRA adapter {name!r} is already loaded (remove_lora it first)")
        if self.config.max_loras == 0:
            raise ValueError("LoRA is off in this engine (EngineConfig.max_loras=0)")
        used = {loaded.slot for loaded in self._loras.values()}
        free = [slot for slot in range(self.config.max_loras) if slot not in used]
        if not free:
            raise ValueError(
                f"every LoRA slot is in use (EngineConfig.max_loras={self.config.max_loras}): "
                f"remove one of {sorted(self._loras)} first"
            )
        adapter = read_adapter(source, adapter_name)
        try:
            self.executor.load_lora(free[0], adapter.weights)
        except ValueError as exc:
            raise ValueError(f"LoRA adapter {name!r}: {exc}") from None
        loaded = _Loaded(name, free[0], adapter, _salt(name))
        loaded.mark()
        self._loras[name] = loaded

    def remove_lora(self, name: str) -> None:
        """Forget adapter ``name``; ``ValueError`` if unknown or if unfinished requests
        still run under it (abort them first)."""
        loaded = self._lora(name)
        if loaded.requests:
            raise ValueError(
                f"LoRA adapter {name!r} is in use by {len(loaded.requests)} unfinished "
                "requests; abort them or let them finish first"
            )
        self.executor.clear_lora(loaded.slot)
        del self._loras[name]

    def list_loras(self) -> list[LoraInfo]:
        """The adapters held, in the order they were added."""
        return [
            LoraInfo(
                loaded.name,
                loaded.source.rank,
                len(loaded.source.weights),
                loaded.source.description,
                len(loaded.requests),
            )
            for loaded in self._loras.values()
        ]

    @property
    def lora_names(self) -> frozenset[str]:
        """The names of the adapters held (any thread may read it)."""
        return frozenset(self._loras)

    def update_lora(
        self,
        name: str,
        tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]] | Any,
    ) -> int:
        """New weights for adapter ``name``, in place (the base executor is not rebuilt);
        return how many modules changed. ``tensors``: PEFT-named ``lora_A``/``lora_B``
        weights (``get_peft_model_state_dict`` or a trainer's ``named_parameters``, any
        subset of the adapter's modules, both halves of each), or a ``peft`` model to read
        the whole adapter from. Ranks and modules stay the adapter's. Requests running under
        it compute their K/V again; its prefix-cache entries are not reused."""
        loaded = self._lora(name)
        if isinstance(tensors, torch.nn.Module):
            fresh = read_adapter(tensors, loaded.source.adapter_name)
            weights = fresh.weights
            loaded.source.watched = fresh.watched
        else:
            items = tensors.items() if isinstance(tensors, Mapping) else tensors
            pairs = pair_tensors(
                ((k, v) for k, v in items if "lora_" in k), where=f"LoRA adapter {name!r}"
            )
            weights = {}
            for module, (a, b) in pairs.items():
                old = loaded.source.weights.get(module)
                if old is None:
                    raise ValueError(f"LoRA adapter {name!r} does not adapt {module}")
                weights[module] = LoraWeights(a, b, old.scale)
        for module, new in weights.items():
            old = loaded.source.weights.get(module)
            if old is None:
                raise ValueError(f"LoRA adapter {name!r} does not adapt {module}")
            if new.a.shape != old.a.shape or new.b.shape != old.b.shape:
                raise ValueError(
                    f"LoRA adapter {name!r}: {module} has shapes {tuple(new.a.shape)} and "
                    f"{tuple(new.b.shape)}, the adapter's are {tuple(old.a.shape)} and "
                    f"{tuple(old.b.shape)}"
                )
        if self._in_flight is not None:
            self._held += self._settle_in_flight()  # that step read the old weights
        self.executor.load_lora(loaded.slot, weights, clear=False)
        loaded.source.weights.update({m: w for m, w in weights.items()})
        loaded.mark()
        self._renew(loaded)
        return len(weights)

    def _renew(self, loaded: _Loaded) -> None:
        """New weights for ``loaded``: a new salt, and its requests start over."""
        loaded.salt = _salt(loaded.name)
        if not loaded.requests:
            return
        self.scheduler.recompute_all(only=loaded.requests)
        for request in loaded.requests:
            request.cache_salt = loaded.salt
            request.block_hashes = []

    def _lora(self, name: str) -> _Loaded:
        loaded = self._loras.get(name)
        if loaded is None:
            known = ", ".join(sorted(self._loras)) or "none"
            raise ValueError(f"unknown LoRA adapter {name!r} (loaded: {known})")
        return loaded

    def _bind_lora(self, request: Request, name: str | None) -> None:
        """``request`` runs under adapter ``name`` (None: the base model)."""
        if name is None:
            return
        loaded = self._lora(name)
        request.lora = name
        request.lora_slot = loaded.slot
        request.cache_salt = loaded.salt
        loaded.requests.add(request)

    def _unbind_lora(self, request: Request) -> None:
        if request.lora is not None:
            loaded = self._loras.get(request.lora)
            if loaded is not None:
                loaded.requests.discard(request)

    def _sync_watched_loras(self) -> None:
        """Adapters read from a live ``peft`` model whose weights changed in place (an
        optimizer step) are loaded again before the step: no token from stale weights."""
        for loaded in self._loras.values():
            if loaded.source.model is not None and loaded.changed():
                logger.warning(
                    "cbgen: LoRA adapter %r changed without update_lora(); loading its "
                    "weights before this step",
                    loaded.name,
                )
                self.update_lora(loaded.name, loaded.source.model)

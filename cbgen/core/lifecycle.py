"""The engine's weights and memory over its life: new weights from a trainer, pause and
resume around a training step, sleep and wake to give the KV cache's memory back.

A mixin of ``EngineCore``: these are its methods, kept apart from the step loop because
they run between steps, never inside one, and own the executor's and the cache's
rebuilding.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from ..executor.model_executor import ModelExecutor
from ..requests.request import RequestOutput
from ..spec.draft import DraftModelProposer
from ..spec.speculative import Proposer
from ..sysmem import trim_heap
from .cache_plan import CachePlan
from .config import EngineConfig
from .scheduler import Scheduler
from .weights import NamedTensors, WeightVersions, load_named_weights

if TYPE_CHECKING:
    from .engine_core import _InFlight

logger = logging.getLogger(__name__)


class Lifecycle:
    """Weights and memory of an ``EngineCore`` (see the module's docstring)."""

    model: torch.nn.Module
    config: EngineConfig
    plan: CachePlan
    executor: ModelExecutor
    proposer: Proposer | None
    scheduler: Scheduler
    _weights: WeightVersions
    _paused: bool
    _asleep: bool
    # Paused by ``pause(keep_weights=True)``: the executor's copies are kept, detached.
    _weights_kept: bool = False
    _held: list[RequestOutput]
    _in_flight: _InFlight | None
    _settle_in_flight: Callable[[], list[RequestOutput]]

    def update_weights(self, weights: NamedTensors) -> int:
        """Load ``weights`` (``{name: tensor}`` or ``(name, tensor)`` pairs, names as in
        ``model.state_dict()``) into the model and ``refresh()``; return how many were
        loaded. A quantized map takes float weights and quantizes them again. Paused or
        asleep, the weights are loaded and the refresh happens on ``resume``/``wake``."""
        if self._in_flight is not None:
            self._held += self._settle_in_flight()  # that step read the old weights
        count = load_named_weights(self.model, weights)
        if not self._paused:
            self.refresh()
        return count

    def refresh(self) -> None:
        """Generate from the model's current weights from the next step on (call it after
        changing them in place, e.g. an optimizer step): every copy made from the old
        ones is made again (prepacked and fused weights, quantized kernels, embedding
        rows, a layer-skip draft's), the prefix cache is emptied, and every unfinished
        request computes its K/V again (its tokens so far are kept)."""
        if self._in_flight is not None:
            self._held += self._settle_in_flight()
        self._forget_kv()
        if not self._paused:
            self._rebuild_executor()
        self._drop_kept_weights()  # copies of the old weights: resume() builds afresh
        self._weights.mark()

    def pause(self, *, keep_weights: bool = False) -> None:
        """Give the model its own forward and attention back (to train it, or call it),
        keeping the KV cache; requests wait. ``step()`` raises until ``resume()``.

        The packed weight copies are freed, unless ``keep_weights``: then they stay (the
        memory of a second copy of the weights while paused) and ``resume()`` only puts
        cbgen's forwards back, in milliseconds rather than a rebuild, if the weights did
        not change meanwhile. That is the pause of LoRA training, whose base is frozen
        and whose adapter ``update_lora`` syncs; a base weight that changed anyway is
        still noticed and the executor rebuilt."""
        if self._paused:
            if not keep_weights:
                self._drop_kept_weights()
            return
        if self._in_flight is not None:
            self._held += self._settle_in_flight()
        if self.proposer is not None:
            self.proposer.pause()
        if keep_weights:
            self.executor.detach_weights()
            self._weights_kept = True
        else:
            self.executor.release_weights()
        self._paused = True

    def resume(self) -> None:
        """Back to generating after ``pause()`` (or ``sleep()``): the executor is built
        again from the weights as they are now (after ``pause(keep_weights=True)``, its
        kept copies serve again if the weights did not change); if they changed, the K/V
        of every request is computed again and the prefix cache starts empty."""
        if not self._paused:
            return
        stale = self._weights.changed()
        if self._weights_kept and not stale:
            self._attach_kept_weights()
        else:
            self._drop_kept_weights()
            self._rebuild_executor()
        if self._asleep:
            self._allocate_memory()
            self._asleep = False
        if stale:
            self._forget_kv()
        self._weights.mark()
        self._paused = False

    def sleep(self) -> None:
        """``pause()`` and free the KV cache (and swap space) too, for a training step
        that needs the memory; unfinished requests compute their K/V again after
        ``wake()``."""
        self.pause()  # frees copies a pause(keep_weights=True) kept, too
        if self._asleep:
            return
        self._forget_kv()
        if self.proposer is not None:
            self.proposer.release_cache()
        self.executor.free()
        trim_heap()  # the packed weights' memory back to the OS, not kept for reuse
        self._asleep = True

    def wake(self) -> None:
        """The KV cache back and generating again, after ``sleep()`` (as ``resume()``)."""
        self.resume()

    def commit_cache_memory(self) -> int:
        """Make the whole KV cache (and state slots) resident in memory now, rather than
        page by page as blocks are first used: a long-running server then holds the
        memory it will use from its start, and its RSS stays flat (or it fails now, not
        hours later, when the memory is not there). Not while the engine steps on
        another thread. Returns the bytes written (0 while asleep)."""
        if self._asleep:
            return 0
        return self.executor.commit_cache()

    @property
    def is_paused(self) -> bool:
        """Between ``pause()`` (or ``sleep()``) and ``resume()`` (or ``wake()``)."""
        return self._paused

    def _forget_kv(self) -> None:
        """Every K/V computed so far is stale: requests compute theirs again, the prefix
        cache and a draft's cache start empty."""
        self.scheduler.recompute_all()
        self.scheduler.kv.reset_prefix_cache()
        if self.proposer is not None:
            self.proposer.reset()

    def _attach_kept_weights(self) -> None:
        """The executor kept by ``pause(keep_weights=True)`` serves again (its adapters
        hooked back on), and the draft's runner is built again."""
        self.executor.attach_weights()
        if self.proposer is not None:
            self.proposer.resume()
        self._weights_kept = False

    def _drop_kept_weights(self) -> None:
        """The copies ``pause(keep_weights=True)`` kept are freed (their weights changed,
        or the caller wants the memory): ``resume()`` builds the executor again."""
        if self._weights_kept:
            self.executor.release_weights()
            self._weights_kept = False

    def _rebuild_executor(self) -> None:
        """A new runner from the model's current weights (the old one closed)."""
        self.executor.rebuild()
        if self.proposer is not None:
            self.proposer.resume()

    def _allocate_memory(self) -> None:
        """The KV cache (and the swap space, the batch builder that reads the cache, and a
        draft model's cache), ``plan.num_blocks`` blocks: at build and after ``sleep()``."""
        config, plan = self.config, self.plan
        self.executor.allocate(
            plan.layers,
            plan.num_blocks,
            config.block_size,
            plan.groups,
            plan.state_specs,
            config.max_num_seqs + plan.num_checkpoints,
            config.swap_space if config.preemption_mode == "swap" else None,
        )
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.allocate_cache(self.plan.num_blocks, config.block_size)

"""The engine's one seam to the device: what it asks of the model, the cache and the
sampler, whatever runs them.

``EngineCore`` plans (scheduler, KV-cache manager, output processor) and hands this
object the values of a step: a ``SchedulerOutput`` to run, block moves to copy. It gets
back the step's samples. It never touches the runner's probe, attention backends or
device, the cache tensors or the sampler: they live here, built from the model when the
engine starts, sized by the engine's plan, rebuilt when the weights change and freed
when it sleeps. A CUDA executor is another implementation of these methods.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from concurrent import futures
from typing import Any, NamedTuple

import torch

from ..cache.groups import CacheGroup, LayerSpec
from ..cache.paged_cache import PagedKVCache
from ..cache.state import StateCache, StateSpec
from ..cache.swap import SwapSpace
from ..requests.scheduler_output import BlockMove, SchedulerOutput
from ..sampling.logits import default_processors
from ..sampling.sampler import Sampler, SamplerOutput
from .batch import BatchBuilder, StepBatch
from .lora import lora_rows
from .lora_slots import LoraSlots, LoraWeights
from .runner import Executor
from .step_sampling import Bitmask, sample_step

logger = logging.getLogger(__name__)


class CacheSpec(NamedTuple):
    """What the model stores, as its probe observed: per attention layer per token, and
    per request for each state layer. The engine sizes its cache plan from it."""

    layers: list[LayerSpec]
    state_layers: list[StateSpec]


class ModelExecutor:
    """The model's runner, its cache tensors and its sampler (see the module's docstring)."""

    # Why the executor can run no more steps (a tensor-parallel rank died); None: it can.
    failure: str | None = None

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        use_native_kernels: bool,
        prepack_linear: bool | None,
        eos_token_ids: set[int],
        max_loras: int = 0,
        max_lora_rank: int = 0,
    ) -> None:
        self.model = model
        self._use_native_kernels = use_native_kernels
        self._prepack_linear = prepack_linear
        self._eos_token_ids = eos_token_ids
        # The backends of every role are chosen here, once (``runner.describe()``).
        self.runner = self._new_runner()
        self.sampler = self._new_sampler()
        self.cache: PagedKVCache | None = None
        self.state_cache: StateCache | None = None
        self.swap_space: SwapSpace | None = None
        self.batch_builder: BatchBuilder | None = None
        # Adapter slots over the base model's linear maps (None: LoRA off).
        self.loras: LoraSlots | None = None
        if max_loras > 0:
            mixers = self.runner.state_mixers
            self.loras = LoraSlots(
                model,
                max_loras,
                max_lora_rank,
                # On CPU in float32 whatever the weights: the adapters' products are
                # small next to the base GEMM, and bfloat16 rounding of a strong
                # adapter's delta moved logprobs by ~0.3 on a tiny model.
                torch.float32 if self.device.type == "cpu" else self.runner.dtype,
                self.device,
                list(mixers.names) if mixers is not None else [],
            )

    # -- what the engine plans with ------------------------------------------------------

    @property
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(self.runner.probe.layers, self.runner.probe.state_layers)

    @property
    def device(self) -> torch.device:
        return self.runner.device

    @property
    def vocab_size(self) -> int:
        return self.runner.vocab_size

    @property
    def kernels(self) -> Any:
        return self.runner.kernels

    # -- memory ---------------------------------------------------------------------------

    def allocate(
        self,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int,
        groups: Sequence[CacheGroup],
        state_specs: Sequence[StateSpec],
        num_state_slots: int,
        swap_bytes: int | None,
    ) -> None:
        """The cache tensors the engine's plan sizes: ``num_blocks`` K/V blocks per
        physical tensor, ``num_state_slots`` state slots, and a host swap space of up to
        ``swap_bytes`` (None: preemption recomputes)."""
        self.cache = PagedKVCache(layers, num_blocks, block_size, self.device, groups)
        self.state_cache = (
            StateCache(state_specs, num_state_slots, self.device) if state_specs else None
        )
        self.swap_space = None
        if swap_bytes is not None and state_specs:
            logger.info("cbgen: preemption recomputes: swap does not hold the state layers' slots")
        elif swap_bytes is not None:
            swap_blocks = SwapSpace.blocks_for_budget(self.cache, swap_bytes)
            if swap_blocks > 0:
                self.swap_space = SwapSpace(self.cache, swap_blocks)
        self.batch_builder = BatchBuilder(
            self.cache,
            self.runner.probe.layer_of_module,
            self.runner.attention,
            groups,
            self.state_cache,
        )

    def commit_cache(self) -> int:
        """Make the K/V blocks' and state slots' host pages resident now (they are
        otherwise committed as first used); returns the bytes written."""
        total = 0
        if self.cache is not None:
            total += self.cache.commit()
        if self.state_cache is not None:
            total += self.state_cache.commit()
        return total

    def free(self) -> None:
        """Give the cache tensors' memory back (``EngineCore.sleep``); ``allocate`` again
        before the next step."""
        self.cache = self.state_cache = self.swap_space = self.batch_builder = None

    # -- a step ---------------------------------------------------------------------------

    def prepare(self, scheduled: SchedulerOutput) -> StepBatch:
        """The step's inputs on the device, built on the engine's thread."""
        assert self.batch_builder is not None, "the executor's memory is freed (sleep)"
        return self.batch_builder.build(scheduled)

    def forward(
        self, batch: StepBatch, previous: futures.Future[SamplerOutput] | None
    ) -> torch.Tensor:
        """The forward pass of ``batch``; under async scheduling the tokens the previous
        step samples are copied into the rows that carry them first."""
        if batch.carry_rows is not None:
            assert previous is not None and batch.carry_sources is not None
            tokens = previous.result().token_tensor
            assert tokens is not None
            batch.input_ids[0].index_copy_(
                0, batch.carry_rows, tokens.index_select(0, batch.carry_sources)
            )
        with lora_rows(batch.lora):
            return self.runner.execute(batch)

    def sample(
        self, batch: StepBatch, logits: torch.Tensor, bitmask: Bitmask | None
    ) -> SamplerOutput:
        """The step's samples and logprobs from its logits (grammar rows masked)."""
        return sample_step(self.sampler, batch, logits, bitmask)

    def copy_blocks(
        self, swap_out: Sequence[BlockMove], swap_in: Sequence[BlockMove]
    ) -> list[BlockMove]:
        """Run the step's swap copies; return the moves whose copy failed."""
        assert self.swap_space is not None
        return self.swap_space.run_moves(swap_out, swap_in)

    # -- adapters -------------------------------------------------------------------------

    def check_lora(self, weights: Mapping[str, LoraWeights]) -> None:
        """``ValueError`` naming the first module of ``weights`` that cannot take it."""
        self._slots().check(weights)

    def load_lora(self, slot: int, weights: Mapping[str, LoraWeights], clear: bool = True) -> None:
        """Adapter slot ``slot`` holds ``weights`` from the next step on (``clear``: and
        nothing else)."""
        slots = self._slots()
        slots.load(slot, weights, clear)
        if slots.needs_attach:
            slots.attach(self.runner.packed_linears)

    def clear_lora(self, slot: int) -> None:
        """Adapter slot ``slot`` holds nothing."""
        self._slots().clear(slot)

    def _slots(self) -> LoraSlots:
        if self.loras is None:
            raise ValueError("LoRA is off in this engine (EngineConfig.max_loras=0)")
        return self.loras

    # -- weights --------------------------------------------------------------------------

    def release_weights(self) -> None:
        """Give the model its own forward and attention back; the packed copies go."""
        if self.loras is not None:
            self.loras.detach()
        self.runner.close()

    def detach_weights(self) -> None:
        """Give the model its own forward and attention back, keeping the packed copies
        and the adapters' slots for ``attach_weights`` (valid while the weights do not
        change: the caller checks)."""
        if self.loras is not None:
            self.loras.detach()
        self.runner.detach()

    def attach_weights(self) -> None:
        """Serve again from the copies ``detach_weights`` kept, adapters hooked back on."""
        self.runner.attach()
        if self.loras is not None and self.loras.modules:
            self.loras.attach(self.runner.packed_linears)

    def rebuild(self) -> None:
        """A new runner and sampler from the model's weights as they are now (the old
        runner closed); the cache tensors and the adapters are kept."""
        if self.loras is not None:
            self.loras.detach()
        self.runner.close()
        self.runner = self._new_runner()
        if self.loras is not None and self.loras.modules:
            self.loras.attach(self.runner.packed_linears)
        if self.batch_builder is not None:
            self.batch_builder.attention = self.runner.attention
        self.sampler = self._new_sampler()

    def close(self) -> None:
        if self.loras is not None:
            self.loras.detach()
        self.runner.close()

    def _new_runner(self) -> Executor:
        return Executor(
            self.model,
            use_native_kernels=self._use_native_kernels,
            prepack_linear=self._prepack_linear,
        )

    def _new_sampler(self) -> Sampler:
        return Sampler(
            argmax=self.runner.greedy.argmax, processors=default_processors(self._eos_token_ids)
        )

"""The step loop: scheduler -> batch builder -> runner -> sampler -> output processor."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any

import torch

from ..cache.allocator import BlockAllocator
from ..executor.batch import StepBatch
from ..executor.cpu.openmp import release_thread_team
from ..executor.model_executor import ModelExecutor
from ..executor.parallel.executor import TensorParallelExecutor
from ..executor.step_sampling import grammar_bitmask
from ..requests.detokenizer import make_decoder
from ..requests.request import FinishReason, Request, RequestOutput, RequestStatus
from ..sampling.params import SamplingParams
from ..sampling.sampler import SamplerOutput
from ..spec.build import draft_model_for, make_proposer
from ..spec.draft import DraftModelProposer
from ..spec.speculative import Proposer
from .cache_plan import plan_cache
from .config import EngineConfig
from .input_processor import InputProcessor
from .lifecycle import Lifecycle
from .loras import Loras, _Loaded
from .model_facts import model_eos_ids
from .output_processor import OutputProcessor, PendingSamples
from .scheduler import Scheduler, make_scheduler
from .weights import WeightVersions

logger = logging.getLogger(__name__)


class EngineCore(Lifecycle, Loras):
    """Continuous batching over a paged KV cache for one ``transformers`` causal LM.

    Synchronous: the caller adds requests and calls ``step()`` until
    ``has_unfinished()`` is False. The model's attention implementation is
    switched to cbgen's while the engine lives; use the engine as a context
    manager (or call ``close()``) to switch it back.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        config: EngineConfig | None = None,
        tokenizer: Any = None,
        *,
        skip_special_tokens: bool = True,
        detokenize: bool = True,
    ) -> None:
        """``tokenizer`` (optional) compiles grammars (``SamplingParams.structured_output``)
        and, with ``detokenize``, gives outputs their text and requests their stop
        strings (``SamplingParams.stop``). The online engine detokenizes and matches stop
        strings on its own and passes ``detokenize=False``."""
        self.config = config or EngineConfig()
        self.tokenizer = tokenizer
        self._decode = (
            make_decoder(tokenizer, skip_special_tokens)
            if tokenizer is not None and detokenize
            else None
        )
        model.eval()
        self.model = model
        # Before the target's executor changes its modules: a layer-skip draft copies them.
        draft_model = draft_model_for(self.config.speculative, model)
        # The runner's backends are chosen here, once (``engine.executor.runner.describe()``).
        self.eos_token_ids = model_eos_ids(model)  # the sampler's, grammars' and stop rule's
        self.executor = _make_executor(model, self.config, self.eos_token_ids)
        self._loras: dict[str, _Loaded] = {}  # LoRA adapters by name (``add_lora``)
        self.proposer: Proposer | None = None  # None: no speculation
        try:
            self._build(model, draft_model)
        except BaseException:
            if self.proposer is not None:
                self.proposer.close()
            self.executor.close()
            raise

    def _build(self, model: torch.nn.Module, draft_model: torch.nn.Module | None) -> None:
        config = self.config
        cache_spec = self.executor.cache_spec
        state_specs = cache_spec.state_layers
        spec = config.speculative
        if spec is not None and state_specs:
            raise ValueError(
                f"speculative decoding is not supported for {type(model).__name__}: its "
                f"{len(state_specs)} state layers (e.g. {state_specs[0].module}) "
                "would need their state before every rejected guess; leave speculative unset"
            )
        if spec is not None:
            self.proposer = make_proposer(
                spec,
                draft_model,
                vocab_size=self.executor.vocab_size,
                max_batch_tokens=config.max_batch_tokens,
                use_native_kernels=config.use_native_kernels,
                prepack_linear=config.prepack_linear,
            )
        draft = self.proposer if isinstance(self.proposer, DraftModelProposer) else None
        plan = plan_cache(
            config,
            model,
            cache_spec.layers,
            state_specs,
            self.executor.device,
            draft.bytes_per_token if draft is not None else 0,
        )
        self.plan = plan
        self.cache_groups = plan.groups
        self.state_specs = plan.state_specs
        self._allocate_memory()
        if (
            self.executor.swap_space is None
            and config.preemption_mode == "swap"
            and not self.state_specs
        ):
            logger.warning("cbgen: swap_space holds no block; preemption will recompute")
        self.allocator = BlockAllocator(plan.num_blocks)
        self.prefix_caching = plan.prefix_caching
        if config.enable_prefix_caching and not plan.prefix_caching:
            logger.info("cbgen: prefix caching off: %s", plan.prefix_caching_off)
        self.scheduler: Scheduler = make_scheduler(
            config.scheduler_policy,
            self.allocator,
            config.block_size,
            config.max_batch_tokens,
            config.max_num_seqs,
            enable_prefix_caching=self.prefix_caching,
            groups=self.cache_groups,
            swap_blocks=self.executor.swap_space.num_blocks if self.executor.swap_space else 0,
            admission=config.admission,
            state_slots=config.max_num_seqs if self.state_specs else 0,
            state_checkpoints=plan.num_checkpoints,
        )
        self.stats = self.scheduler.stats  # prefill/decode/cached tokens, preemptions, spec_*
        self._weights = WeightVersions(model)  # the weights the executor's copies hold
        self._paused = False  # pause() / sleep(): the model has its own modules back
        self._asleep = False  # sleep(): no KV cache, no packed weights
        self._held: list[RequestOutput] = []  # outputs of a step settled outside step()
        self.max_model_len = plan.max_model_len
        self.output_processor = OutputProcessor(self.eos_token_ids, self.max_model_len)
        self.scheduler.max_model_len = self.max_model_len
        self.vocab_size = self.executor.vocab_size
        self.input_processor = InputProcessor(
            self.vocab_size,
            self.max_model_len,
            tokenizer=self.tokenizer,
            decode=self._decode,
            device=self.executor.device,
            eos_token_ids=self.eos_token_ids,
        )
        self._requests: dict[str, Request] = {}
        self._num_with_history = 0  # unfinished requests whose sampling reads their tokens
        self._in_flight: _InFlight | None = None  # async scheduling: the launched step
        self._executor: futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        plan.log(config)

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora: str | None = None,
    ) -> str:
        """Queue a request (under LoRA adapter ``lora``, one ``add_lora`` loaded; None: the
        base model); raise ``ValueError`` naming it if it cannot run."""
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r}: this id is already in use")
        request = self.input_processor.make_request(
            request_id, prompt_token_ids, params, next(self._arrivals)
        )
        try:
            self._bind_lora(request, lora)
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None
        self._requests[request_id] = request
        if params.needs_history:
            self._num_with_history += 1
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> bool:
        """Cancel a request; its blocks come back at once. False if it is unknown or done."""
        request = self._requests.get(request_id)
        if request is None or request.is_finished:
            self._requests.pop(request_id, None)
            return False
        self._retire(request, FinishReason.ABORTED)
        return True

    def _retire(self, request: Request, reason: FinishReason) -> None:
        """Finish ``request`` in the scheduler (its blocks come back) and forget it."""
        self.scheduler.finish(request, reason)
        self._unbind_lora(request)
        if self.proposer is not None:
            self.proposer.finish(request)
        self._requests.pop(request.request_id, None)
        if request.params.needs_history:
            self._num_with_history -= 1

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix block, so later requests compute their prompts afresh
        (as after a restart, without rebuilding the engine: the benchmark resets between
        repeats, as it does vLLM's). Blocks running requests hold stay theirs."""
        self.scheduler.kv.reset_prefix_cache()

    def has_unfinished(self) -> bool:
        """Whether any request is waiting, running or in a launched step: call ``step()``
        until this is False."""
        return self._in_flight is not None or self.scheduler.has_unfinished()

    @property
    def failure(self) -> str | None:
        """Why this engine can run no more steps (a tensor-parallel rank failed), or None.
        Once set, every ``step()`` raises; ``close()`` still works."""
        return self.executor.failure

    @property
    def num_unfinished(self) -> int:
        """Requests waiting or running (not counting a step in flight)."""
        return self.scheduler.num_unfinished

    # -- the step -----------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one forward pass; return an output for every request that got a token.

        With ``async_scheduling`` the step launches its forward pass on the
        engine's worker thread and returns the outputs of the previous step, so
        this step's scheduling and the caller's handling of the outputs overlap
        the next forward pass.

        Before planning, a change of the model's weights that ``update_weights`` or
        ``refresh`` did not announce (an optimizer step in place) is noticed and the
        engine refreshes itself, with a warning: no token comes from stale weights.
        """
        if self._paused:
            raise RuntimeError(
                "the engine is paused (pause() or sleep()): call resume() or wake() first"
            )
        if self._weights.changed():
            logger.warning(
                "cbgen: the model's weights changed without update_weights() or refresh(); "
                "refreshing the engine (packed weights, K/V, prefix cache) before this step"
            )
            self.refresh()
        if self._loras:
            self._sync_watched_loras()
        outputs = self._step()
        if self._held:
            outputs, self._held = self._held + outputs, []
        return outputs

    def _step(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        in_flight = self._in_flight
        if in_flight is not None and (
            self._num_with_history or self._proposing() or in_flight.pending.drafts is not None
        ):
            # Processors and penalties read every token so far, and a proposer guesses
            # from them; guesses in flight are not known to hold: settle before planning.
            outputs = self._settle_in_flight()
            in_flight = None
        if self.proposer is not None:
            self._propose()
        scheduled = self.scheduler.schedule()
        if scheduled.swap_out or scheduled.swap_in:
            if in_flight is not None:  # the copies read K/V the step in flight writes
                futures.wait([in_flight.future])
            for move in self.executor.copy_blocks(scheduled.swap_out, scheduled.swap_in):
                self.scheduler.swap_failed(move, scheduled)
        if scheduled.is_empty:
            return self._settle_in_flight() if in_flight is not None else outputs
        batch = self.executor.prepare(scheduled)
        bitmask = None
        if self.input_processor.grammars is not None:
            bitmask = grammar_bitmask(batch.sampled, self._requests, self.vocab_size)
        pending = self.output_processor.advance(scheduled, self._requests)
        if not self.config.async_scheduling:
            return self._settle(pending, self._forward(batch, None, bitmask))
        previous = in_flight.future if in_flight is not None else None
        release_thread_team()  # the worker's OpenMP team must be the only one (cbgen.executor.cpu.openmp)
        future = self._worker().submit(self._forward, batch, previous, bitmask)
        self._in_flight = _InFlight(pending, future)
        if in_flight is not None:
            outputs = self._settle(in_flight.pending, self._result(in_flight, self._in_flight))
        return outputs

    def _proposing(self) -> bool:
        """Whether this step makes proposals: a running request takes them
        (``SamplingParams.speculative``) and the batch is small enough."""
        return (
            self.proposer is not None
            and self._speculation_pays()
            and any(r.params.speculative for r in self.scheduler.running)
        )

    def _speculation_pays(self) -> bool:
        """Fewer requests run than ``SpeculativeConfig.disable_batch_size``: past it a
        step is bound by compute, and verifying guesses costs more than it saves."""
        spec = self.config.speculative
        limit = spec.batch_limit if spec is not None else None
        return limit is None or len(self.scheduler.running) < limit

    def _propose(self) -> None:
        assert self.proposer is not None
        running = self.scheduler.running
        if self._speculation_pays():
            self.proposer.propose(running)
        else:
            for request in running:
                request.draft_token_ids = []

    def _settle_in_flight(self) -> list[RequestOutput]:
        in_flight = self._in_flight
        assert in_flight is not None
        self._in_flight = None
        return self._settle(in_flight.pending, self._result(in_flight, None))

    def _result(self, in_flight: _InFlight, successor: _InFlight | None) -> SamplerOutput:
        """The sampled tokens of a launched step.

        If the step failed, its requests and those of the step launched after it
        (which reads its tokens) can never learn their pending token: they finish
        with ``"error"`` before the exception goes up.
        """
        try:
            return in_flight.future.result()
        except BaseException as exc:
            self._in_flight = None
            steps = [in_flight]
            if successor is not None:
                futures.wait([successor.future])
                steps.append(successor)
            for step in steps:
                for request in step.pending.requests:
                    if not request.is_finished:
                        self._retire(request, FinishReason.ERROR)
            raise exc

    def _forward(
        self,
        batch: StepBatch,
        previous: futures.Future[SamplerOutput] | None,
        bitmask: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> SamplerOutput:
        """The device half of a step: carried tokens in, forward pass, sampling, and the
        logprobs of the prompt tokens the step scores."""
        if self.proposer is None:
            return self.executor.sample(batch, self.executor.forward(batch, previous), bitmask)
        started = time.perf_counter()
        logits = self.executor.forward(batch, previous)
        # Only a decoding step measures one: every input token is a sampled row (the
        # last token and each guess), no prompt chunk in it.
        if batch.input_ids.shape[1] == len(batch.sampled):
            guesses = len(batch.sampled) - len({s.request_id for s in batch.sampled})
            self.proposer.observe_step(time.perf_counter() - started, guesses)
        return self.executor.sample(batch, logits, bitmask)

    def _settle(self, pending: PendingSamples, sampled: SamplerOutput) -> list[RequestOutput]:
        outputs, finished = self.output_processor.resolve(
            pending, sampled.tokens, sampled.errors, sampled.logprobs, sampled.prompt_logprobs
        )
        for request, reason in finished:
            self._retire(request, reason)
        self.scheduler.update_from_output(pending.requests)
        self.stats.update(self.output_processor.speculation.stats())
        return outputs

    def _worker(self) -> futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix="cbgen-forward")
        return self._executor

    # -- lifetime -----------------------------------------------------------------------

    def close(self) -> None:
        """Abort what is left and give the model its own attention implementation back."""
        if self._in_flight is not None:
            futures.wait([self._in_flight.future])
            self._in_flight = None
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        for request_id in list(self._requests):
            self.abort(request_id)
        if self.proposer is not None:
            self.proposer.close()
        self.executor.close()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_status(self, request_id: str) -> RequestStatus | None:
        """Where a request is (waiting, running, preempted, finished); None once it is
        finished and forgotten, or if the id is unknown."""
        request = self._requests.get(request_id)
        return request.status if request is not None else None


def _make_executor(
    model: torch.nn.Module, config: EngineConfig, eos_token_ids: set[int]
) -> ModelExecutor:
    """This process's executor, or the driver of ``config.tensor_parallel_size`` ranks."""
    if config.tensor_parallel_size > 1:
        return TensorParallelExecutor(
            model,
            tensor_parallel_size=config.tensor_parallel_size,
            threads_per_rank=config.threads_per_rank,
            use_native_kernels=config.use_native_kernels,
            prepack_linear=config.prepack_linear,
            eos_token_ids=eos_token_ids,
        )
    return ModelExecutor(
        model,
        use_native_kernels=config.use_native_kernels,
        prepack_linear=config.prepack_linear,
        eos_token_ids=eos_token_ids,
        max_loras=config.max_loras,
        max_lora_rank=config.max_lora_rank,
    )


@dataclass
class _InFlight:
    """A launched step (async scheduling): what it samples for, and its result to come."""

    pending: PendingSamples
    future: futures.Future[SamplerOutput]

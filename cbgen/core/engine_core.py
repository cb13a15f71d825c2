"""The step loop: scheduler -> batch builder -> runner -> sampler -> output processor."""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..cache.allocator import BlockAllocator
from ..cache.groups import build_groups, max_request_tokens, tensor_layout
from ..cache.paged_cache import PagedKVCache, bytes_per_token, default_cache_budget
from ..cache.prefix_cache import prefix_caching_unsupported_reason
from ..cache.state import StateCache, state_bytes_per_request
from ..cache.swap import SwapSpace
from ..executor.batch import BatchBuilder, StepBatch
from ..executor.cpu.openmp import release_thread_team
from ..executor.runner import Executor
from ..executor.step_sampling import grammar_bitmask, sample_step
from ..requests.detokenizer import make_decoder
from ..requests.request import FinishReason, Request, RequestOutput, RequestStatus
from ..requests.text import RequestText
from ..sampling.logits import default_processors
from ..sampling.params import SamplingParams
from ..sampling.sampler import Sampler, SamplerOutput
from ..sampling.structured import GrammarCompiler
from ..spec.draft import DraftModelProposer, layer_skip_model
from ..spec.speculative import NgramProposer, Proposer
from ..sysmem import trim_heap
from .config import EngineConfig, resolve_kv_cache_dtype
from .input_processor import InputProcessor
from .output_processor import OutputProcessor, PendingSamples
from .scheduler import BlockMove, Scheduler, SchedulerOutput, make_scheduler
from .weights import NamedTensors, WeightVersions, load_named_weights

logger = logging.getLogger(__name__)


class EngineCore:
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
        self._grammars: GrammarCompiler | None = None  # built for the first grammar
        self._decode = (
            make_decoder(tokenizer, skip_special_tokens)
            if tokenizer is not None and detokenize
            else None
        )
        model.eval()
        self.model = model
        # Before the target's executor changes its modules: a layer-skip draft copies them.
        draft_model = _draft_model(self.config, model)
        # The backends of every role are chosen here, once (``runner.describe()``).
        self.runner = Executor(
            model,
            use_native_kernels=self.config.use_native_kernels,
            prepack_linear=self.config.prepack_linear,
        )
        self.kernels = self.runner.kernels
        self.proposer: Proposer | None = None  # None: no speculation
        try:
            self._build(model, draft_model)
        except BaseException:
            if self.proposer is not None:
                self.proposer.close()
            self.runner.close()
            raise

    def _build(self, model: torch.nn.Module, draft_model: torch.nn.Module | None) -> None:
        config = self.config
        layers = self.runner.probe.layers
        kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype)
        if kv_dtype is not None:  # the cache's dtype, not the model's
            layers = [replace(spec, dtype=kv_dtype) for spec in layers]
        self.cache_groups = build_groups(layers)
        per_token = bytes_per_token(tensor_layout(layers, self.cache_groups)[1])
        self.state_specs = self.runner.probe.state_layers
        state_per_request = state_bytes_per_request(self.state_specs)
        prefix_reason = prefix_caching_unsupported_reason(model.config, self.cache_groups)
        # A prefix-cache hit of a state model starts from the state saved after its last
        # cached block: as many such checkpoints as requests run at once.
        caching = config.enable_prefix_caching and prefix_reason is None
        self._num_checkpoints = config.max_num_seqs if self.state_specs and caching else 0
        spec = config.speculative
        if spec is not None and self.state_specs:
            raise ValueError(
                f"speculative decoding is not supported for {type(model).__name__}: its "
                f"{len(self.state_specs)} state layers (e.g. {self.state_specs[0].module}) "
                "would need their state before every rejected guess; leave speculative unset"
            )
        draft: DraftModelProposer | None = None
        if spec is not None:
            if draft_model is None:
                self.proposer = NgramProposer(spec.num_tokens, adaptive=spec.adaptive)
            else:
                self.proposer = draft = DraftModelProposer(
                    draft_model,
                    spec.num_tokens,
                    vocab_size=self.runner.vocab_size,
                    max_batch_tokens=config.max_batch_tokens,
                    use_native_kernels=config.use_native_kernels,
                    prepack_linear=config.prepack_linear,
                    adaptive=spec.adaptive,
                )
        if config.num_blocks is not None:
            num_blocks = config.num_blocks
        elif per_token == 0:
            # State layers only: blocks are bookkeeping and cost nothing.
            context = min(config.max_model_len or _model_context_limit(model) or 1 << 15, 1 << 15)
            num_blocks = config.max_num_seqs * -(-context // config.block_size)
        else:
            # A draft's cache holds as many blocks as the target's, from the same budget.
            budget = config.kv_cache_memory or default_cache_budget(self.runner.device)
            # The state slots (running requests' and checkpoints) come first.
            states = state_per_request * (config.max_num_seqs + self._num_checkpoints)
            both = per_token + (draft.bytes_per_token if draft is not None else 0)
            num_blocks = (budget - states) // (both * config.block_size)
            if num_blocks < 1:
                held = f" after {states} bytes of state slots" if states else ""
                raise ValueError(
                    f"KV cache budget of {budget} bytes holds no block{held}"
                    + (" (fewer max_num_seqs need fewer slots)" if states else "")
                )
        self._layers = layers
        self._num_blocks = num_blocks
        self._allocate_memory()
        if self.swap_space is None and config.preemption_mode == "swap" and not self.state_specs:
            logger.warning("cbgen: swap_space holds no block; preemption will recompute")
        self.allocator = BlockAllocator(num_blocks)
        self.prefix_caching = config.enable_prefix_caching
        if self.prefix_caching and prefix_reason is not None:
            self.prefix_caching = False
            logger.info("cbgen: prefix caching off: %s", prefix_reason)
        self.scheduler: Scheduler = make_scheduler(
            config.scheduler_policy,
            self.allocator,
            config.block_size,
            config.max_batch_tokens,
            config.max_num_seqs,
            enable_prefix_caching=self.prefix_caching,
            groups=self.cache_groups,
            swap_blocks=self.swap_space.num_blocks if self.swap_space is not None else 0,
            admission=config.admission,
            state_slots=config.max_num_seqs if self.state_specs else 0,
            state_checkpoints=self._num_checkpoints,
        )
        self.stats = self.scheduler.stats  # prefill/decode/cached tokens, preemptions, spec_*
        self.sampler = self._make_sampler()
        self._weights = WeightVersions(model)  # the weights the executor's copies hold
        self._paused = False  # pause() / sleep(): the model has its own modules back
        self._asleep = False  # sleep(): no KV cache, no packed weights
        self._held: list[RequestOutput] = []  # outputs of a step settled outside step()
        # The longest request that fits alone (None: windowed layers only, any length fits).
        cache_limit = max_request_tokens(
            self.cache_groups, num_blocks, config.block_size, config.max_batch_tokens
        )
        model_limit = config.max_model_len or _model_context_limit(model) or cache_limit
        if model_limit is None:
            model_limit = 1 << 62
        self.max_model_len = model_limit if cache_limit is None else min(model_limit, cache_limit)
        self.output_processor = OutputProcessor(_model_eos_ids(model), self.max_model_len)
        self.scheduler.max_model_len = self.max_model_len
        self.vocab_size = self.runner.vocab_size
        self.input_processor = InputProcessor(self.vocab_size, self.max_model_len)
        self._requests: dict[str, Request] = {}
        self._num_with_history = 0  # unfinished requests whose sampling reads their tokens
        self._in_flight: _InFlight | None = None  # async scheduling: the launched step
        self._executor: futures.ThreadPoolExecutor | None = None
        self._ids = itertools.count()
        self._arrivals = itertools.count()
        logger.info(
            "cbgen: %d KV blocks of %d tokens (%.1f MiB, %d bytes/token), context limit %d, "
            "cache groups: %s",
            num_blocks,
            config.block_size,
            num_blocks * config.block_size * per_token / 2**20,
            per_token,
            self.max_model_len,
            "; ".join(g.describe() for g in self.cache_groups),
        )
        if self.state_specs:
            logger.info(
                "cbgen: %d state layers, %d bytes per request, %d slots (max_num_seqs) and "
                "%d prefix-cache checkpoints: %s",
                len(self.state_specs),
                state_per_request,
                config.max_num_seqs,
                self._num_checkpoints,
                "; ".join(s.describe() for s in self.state_specs),
            )

    def _allocate_memory(self) -> None:
        """The KV cache (and the swap space, the batch builder that reads the cache, and a
        draft model's cache), ``_num_blocks`` blocks: at build and after ``sleep()``."""
        config = self.config
        self.cache = PagedKVCache(
            self._layers, self._num_blocks, config.block_size, self.runner.device, self.cache_groups
        )
        self.state_cache = (
            StateCache(
                self.state_specs, config.max_num_seqs + self._num_checkpoints, self.runner.device
            )
            if self.state_specs
            else None
        )
        self.swap_space: SwapSpace | None = None
        if config.preemption_mode == "swap" and self.state_specs:
            logger.info("cbgen: preemption recomputes: swap does not hold the state layers' slots")
        elif config.preemption_mode == "swap":
            swap_blocks = SwapSpace.blocks_for_budget(self.cache, config.swap_space)
            if swap_blocks > 0:
                self.swap_space = SwapSpace(self.cache, swap_blocks)
        self.batch_builder = BatchBuilder(
            self.cache,
            self.runner.probe.layer_of_module,
            self.runner.attention,
            self.cache_groups,
            self.state_cache,
        )
        if isinstance(self.proposer, DraftModelProposer):
            self.proposer.allocate_cache(self._num_blocks, config.block_size)

    def _make_sampler(self) -> Sampler:
        eos = _model_eos_ids(self.model)
        return Sampler(argmax=self.runner.greedy.argmax, processors=default_processors(eos))

    # -- requests -----------------------------------------------------------------------

    def add_request(
        self,
        prompt_token_ids: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
    ) -> str:
        """Queue a request; raise ``ValueError`` naming it if it cannot run."""
        params = params if params is not None else SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r}: this id is already in use")
        prompt = self.input_processor.validate(
            request_id,
            prompt_token_ids,
            params,
            one_sample="need cbgen.generate_batch; EngineCore.add_request runs one sample "
            "(add one request per sample)",
        )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                f"request {request_id!r}: stop strings need a tokenizer "
                "(EngineCore(model, config, tokenizer) or generate_batch(..., tokenizer=))"
            )
        grammar = None
        if params.structured_output is not None:
            try:
                grammar = self._grammar_compiler().matcher(params.structured_output)
            except ValueError as exc:
                raise ValueError(f"request {request_id!r}: {exc}") from None
        request = Request(request_id, prompt, params, next(self._arrivals))
        request.grammar = grammar
        if self._decode is not None:
            request.text = RequestText(
                prompt, self._decode, params.stop_strings, params.include_stop_str_in_output
            )
        if params.seed is not None:
            request.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        self._requests[request_id] = request
        if params.needs_history:
            self._num_with_history += 1
        self.scheduler.add(request)
        return request_id

    def _grammar_compiler(self) -> GrammarCompiler:
        if self._grammars is None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured output needs a tokenizer "
                    "(EngineCore(model, config, tokenizer) or generate_batch(..., tokenizer=))"
                )
            eos = sorted(_model_eos_ids(self.model)) or None
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos_token_ids=eos)
        return self._grammars

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
        return self._in_flight is not None or self.scheduler.has_unfinished()

    @property
    def num_unfinished(self) -> int:
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
            self._move_blocks(scheduled)
        if scheduled.is_empty:
            return self._settle_in_flight() if in_flight is not None else outputs
        batch = self.batch_builder.build(scheduled)
        bitmask = None
        if self._grammars is not None:
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
        if batch.carry_rows is not None:
            assert previous is not None and batch.carry_sources is not None
            tokens = previous.result().token_tensor
            assert tokens is not None
            batch.input_ids[0].index_copy_(
                0, batch.carry_rows, tokens.index_select(0, batch.carry_sources)
            )
        if self.proposer is None:
            return sample_step(self.sampler, batch, self.runner.execute(batch), bitmask)
        started = time.perf_counter()
        logits = self.runner.execute(batch)
        # Only a decoding step measures one: every input token is a sampled row (the
        # last token and each guess), no prompt chunk in it.
        if batch.input_ids.shape[1] == len(batch.sampled):
            guesses = len(batch.sampled) - len({s.request_id for s in batch.sampled})
            self.proposer.observe_step(time.perf_counter() - started, guesses)
        return sample_step(self.sampler, batch, logits, bitmask)

    def _settle(self, pending: PendingSamples, sampled: SamplerOutput) -> list[RequestOutput]:
        outputs, finished = self.output_processor.resolve(
            pending, sampled.tokens, sampled.errors, sampled.logprobs, sampled.prompt_logprobs
        )
        for request, reason in finished:
            self._retire(request, reason)
        self.stats.update(self.output_processor.speculation.stats())
        return outputs

    def _worker(self) -> futures.ThreadPoolExecutor:
        if self._executor is None:
            self._executor = futures.ThreadPoolExecutor(1, thread_name_prefix="cbgen-forward")
        return self._executor

    def _move_blocks(self, scheduled: SchedulerOutput) -> None:
        """Run the step's swap copies, outs before ins (a swap-in may reuse a block
        a swap-out reads). A failed copy costs only its own request: it is recomputed."""
        swap = self.swap_space
        assert swap is not None
        copies: list[tuple[BlockMove, Callable[[list[int], list[int]], None], list[int], list[int]]]
        copies = [(m, swap.copy_out, m.device_blocks, m.host_blocks) for m in scheduled.swap_out]
        copies += [(m, swap.copy_in, m.host_blocks, m.device_blocks) for m in scheduled.swap_in]
        for move, copy, src, dst in copies:
            try:
                copy(src, dst)
            except Exception:
                logger.exception(
                    "cbgen: a swap copy of request %r failed; it will be recomputed",
                    move.request_id,
                )
                self.scheduler.swap_failed(move, scheduled)

    # -- weights and memory: training and generating with one model ---------------------

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
        self._weights.mark()

    def pause(self) -> None:
        """Give the model its own forward and attention back (to train it, or call it),
        keeping the KV cache; requests wait. ``step()`` raises until ``resume()``.
        The packed weight copies are freed."""
        if self._paused:
            return
        if self._in_flight is not None:
            self._held += self._settle_in_flight()
        if self.proposer is not None:
            self.proposer.pause()
        self.runner.close()
        self._paused = True

    def resume(self) -> None:
        """Back to generating after ``pause()`` (or ``sleep()``): the executor is built
        again from the weights as they are now; if they changed, the K/V of every request
        is computed again and the prefix cache starts empty."""
        if not self._paused:
            return
        stale = self._weights.changed()
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
        self.pause()
        if self._asleep:
            return
        self._forget_kv()
        if self.proposer is not None:
            self.proposer.release_cache()
        del self.cache, self.swap_space, self.batch_builder, self.state_cache
        trim_heap()  # the packed weights' memory back to the OS, not kept for reuse
        self._asleep = True

    def wake(self) -> None:
        """The KV cache back and generating again, after ``sleep()`` (as ``resume()``)."""
        self.resume()

    @property
    def is_paused(self) -> bool:
        return self._paused

    def _forget_kv(self) -> None:
        """Every K/V computed so far is stale: requests compute theirs again, the prefix
        cache and a draft's cache start empty."""
        self.scheduler.recompute_all()
        self.scheduler.kv.reset_prefix_cache()
        if self.proposer is not None:
            self.proposer.reset()

    def _rebuild_executor(self) -> None:
        """A new executor from the model's current weights (the old one closed)."""
        self.runner.close()
        self.runner = Executor(
            self.model,
            use_native_kernels=self.config.use_native_kernels,
            prepack_linear=self.config.prepack_linear,
        )
        self.kernels = self.runner.kernels
        if not self._asleep:
            self.batch_builder.attention = self.runner.attention
        self.sampler = self._make_sampler()
        if self.proposer is not None:
            self.proposer.resume()

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
        self.runner.close()

    def __enter__(self) -> EngineCore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def request_status(self, request_id: str) -> RequestStatus | None:
        request = self._requests.get(request_id)
        return request.status if request is not None else None


@dataclass
class _InFlight:
    """A launched step (async scheduling): what it samples for, and its result to come."""

    pending: PendingSamples
    future: futures.Future[SamplerOutput]


def _draft_model(config: EngineConfig, model: torch.nn.Module) -> torch.nn.Module | None:
    """The draft model ``config.speculative`` names: none for prompt lookup, the user's
    for ``"draft"``, the target's first layers for ``"layer_skip"``."""
    spec = config.speculative
    if spec is None or spec.method == "ngram":
        return None
    if spec.method == "layer_skip":
        return layer_skip_model(model, spec.num_layers)
    draft: torch.nn.Module = spec.draft_model
    if draft is model:
        raise ValueError("draft_model is the target itself; use method='layer_skip'")
    target_device = next(model.parameters()).device
    draft_device = next(draft.parameters()).device
    if draft_device != target_device:
        raise ValueError(
            f"draft_model is on {draft_device} and the target on {target_device}; "
            "put them on the same device"
        )
    return draft


def _model_context_limit(model: torch.nn.Module) -> int | None:
    config = model.config
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _model_eos_ids(model: torch.nn.Module) -> set[int]:
    """The ids ``model.generate()`` stops on: the generation config's, else the model config's."""
    generation_config = getattr(model, "generation_config", None)
    eos = getattr(generation_config, "eos_token_id", None)
    if eos is None:
        eos = getattr(model.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)

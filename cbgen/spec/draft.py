"""Draft-model proposers: a smaller model guesses each request's next k tokens.

The draft runs on its own executor and its own paged KV cache, whose blocks the same
``KVCacheManager`` class hands out as the target's. Per request the draft keeps a
sequence of its own (a ``Request`` whose ``num_computed_tokens`` counts the draft's
K/V, not the target's): each step it first catches up on the tokens the target
accepted since (the whole prompt the first time), then decodes greedily k - 1 more
times, every proposing request in one packed forward pass per token. Its K/V of
rejected guesses is rolled back at the next step, by comparing what it computed with
what the target kept.

Greedy guesses make the proposal a point mass, for which the engine's rule (keep a
draft while it equals the token the target samples there) is the standard
accept/resample rule: the target's distribution is kept exactly whatever the draft is.

``layer_skip_model`` makes the draft that needs no second checkpoint: the target's
first layers with its own embedding, final norm and LM head (its weights shared, not
copied).
"""

from __future__ import annotations

import copy
import logging
import time
from collections.abc import Iterable
from typing import Any, cast

from torch import nn

from ..cache.allocator import BlockAllocator
from ..cache.groups import build_groups, tensor_layout
from ..cache.kv_cache_manager import KVCacheManager
from ..cache.paged_cache import PagedKVCache, bytes_per_token
from ..executor.batch import BatchBuilder
from ..executor.runner import Executor
from ..requests.acceptance import DraftAcceptance
from ..requests.request import Request, RequestStatus
from ..requests.scheduler_output import ScheduledRequest, SchedulerOutput
from .speculative import VERIFY_COST, Proposer, eligible, guess_cost

logger = logging.getLogger(__name__)


def decoder_layers(model: nn.Module) -> tuple[nn.Module, str, nn.ModuleList]:
    """The parent, attribute name and ``ModuleList`` of the model's decoder layers: the
    first list with ``config.num_hidden_layers`` entries (``model.layers``,
    ``transformer.h``, ``gpt_neox.layers``, ``model.decoder.layers``, ...)."""
    count = model.config.num_hidden_layers  # type: ignore[union-attr]
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.ModuleList) and len(child) == count:
                return parent, name, child
    raise ValueError(f"{type(model).__name__}: found no list of {count} decoder layers")


def layer_skip_model(model: nn.Module, num_layers: int | None = None) -> nn.Module:
    """The target's first ``num_layers`` decoder layers as a model of its own class (the
    embedding, final norm and LM head kept): every weight tensor is the target's, every
    module and the config are new, so the draft's executor prepacks and switches its own
    modules without touching the target's. ``None``: a quarter of the layers (at least one).

    Build it before an executor changes the target's modules (``EngineCore`` does).
    """
    total: int = cast(Any, model).config.num_hidden_layers
    if num_layers is None:
        num_layers = max(1, total // 4)
    if isinstance(num_layers, bool) or not isinstance(num_layers, int):
        raise ValueError(f"num_layers must be an int, got {num_layers!r}")
    if not 1 <= num_layers < total:
        raise ValueError(
            f"layer_skip needs 1 <= num_layers < {total} (the target's layers), got {num_layers}"
        )
    # Tensors are shared: deepcopy finds every parameter and buffer in its memo.
    memo: dict[int, Any] = {id(t): t for t in model.parameters()}
    memo.update({id(t): t for t in model.buffers()})
    draft: Any = copy.deepcopy(model, memo)
    parent, name, layers = decoder_layers(draft)
    setattr(parent, name, nn.ModuleList(list(layers)[:num_layers]))
    config = draft.config
    config.num_hidden_layers = num_layers
    layer_types = getattr(config, "layer_types", None)
    if isinstance(layer_types, list):
        config.layer_types = layer_types[:num_layers]
    return draft  # type: ignore[no-any-return]


class DraftModelProposer(Proposer):
    """Proposals from ``draft_model`` (sharing the target's tokenizer), decoded greedily.

    Built in two steps because the engine splits one KV budget between the target's cache
    and the draft's: construction builds the draft's executor (and learns its bytes per
    token, ``bytes_per_token``), ``allocate_cache`` then gives it ``num_blocks`` blocks.
    A request the draft's cache cannot hold this step gets no proposal (it decodes
    plainly); ``max_batch_tokens`` bounds the tokens the draft catches up on per step.

    How many guesses to make is one decision per step for every request
    (``acceptance``, over all of them): how often a draft is right is mostly the draft's
    own quality, and a draft that is switched off for everyone (a probe now and then)
    costs no forward pass at all, where one request probing at a time would cost one
    nearly every step.
    """

    def __init__(
        self,
        draft_model: nn.Module,
        num_tokens: int,
        *,
        vocab_size: int,
        max_batch_tokens: int = 512,
        use_native_kernels: bool = True,
        prepack_linear: bool | None = None,
        adaptive: bool = True,
    ) -> None:
        draft_model.eval()
        self.adaptive = adaptive
        self.model = draft_model
        self.num_tokens = num_tokens
        self.vocab_size = vocab_size  # the target's: a larger draft id is never proposed
        self.max_batch_tokens = max_batch_tokens
        self._use_native_kernels = use_native_kernels
        self._prepack_linear = prepack_linear
        self.runner = self._executor()
        if self.runner.probe.state_layers:
            self.runner.close()
            raise ValueError(
                f"draft model {type(draft_model).__name__} keeps a per-request state "
                f"({self.runner.probe.state_layers[0].module}); a draft must keep K/V only"
            )
        self.layers = self.runner.probe.layers
        self.groups = build_groups(self.layers)
        self.bytes_per_token = bytes_per_token(tensor_layout(self.layers, self.groups)[1])
        self.kv: KVCacheManager | None = None
        self._builder: BatchBuilder | None = None
        self._sequences: dict[str, Request] = {}  # the draft's view of each request
        # Per request: its length when last proposed for; every token before it is real.
        self._known: dict[str, int] = {}
        # The draft's kept fraction over every request: k is chosen per step, for all.
        self.acceptance = DraftAcceptance()
        self._proposed: dict[str, tuple[int, list[int]]] = {}  # last step's guesses
        self._abandoned: set[str] = set()  # requests the draft fell too far behind on
        # Running averages: the draft's seconds per guess (a forward pass for every
        # request at once) and a plain target step's seconds.
        self._round_seconds: float | None = None
        self._step_seconds: float | None = None

    def _executor(self) -> Executor:
        return Executor(
            self.model,
            use_native_kernels=self._use_native_kernels,
            prepack_linear=self._prepack_linear,
        )

    def guess_cost(self, batch_size: int) -> float:
        """``cbgen.spec.speculative.guess_cost`` with the draft's forward pass as measured
        against the target's step (before any measurement: a third of a step)."""
        if self._round_seconds is None or not self._step_seconds:
            return guess_cost(batch_size, 0.3)
        return guess_cost(batch_size, self._round_seconds / self._step_seconds)

    def observe_step(self, seconds: float, guesses: int) -> None:
        # What the step would have taken without its guesses: those are the cost that
        # ``guess_cost`` adds on its own, and a kept guess saves a plain step's share.
        plain = seconds / (1.0 + VERIFY_COST * guesses)
        self._step_seconds = _average(self._step_seconds, plain)

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        device = self.runner.device
        cache = PagedKVCache(self.layers, num_blocks, block_size, device, self.groups)
        self.kv = KVCacheManager(
            BlockAllocator(num_blocks), block_size, self.groups, enable_prefix_caching=False
        )
        self._builder = BatchBuilder(
            cache, self.runner.probe.layer_of_module, self.runner.attention, self.groups
        )

    @property
    def allocator(self) -> BlockAllocator:
        assert self.kv is not None, "allocate_cache first"
        return self.kv.allocator

    # -- proposing --------------------------------------------------------------------

    def propose(self, requests: Iterable[Request]) -> None:
        kv = self.kv
        assert kv is not None, "allocate_cache first"
        requests = list(requests)
        live = {r.request_id for r in requests}
        for request_id in [r for r in self._sequences if r not in live]:
            self._forget(request_id)
        self._record_verified(requests)
        budget = self.max_batch_tokens
        catch_up: list[tuple[Request, int, bool]] = []  # (sequence, tokens, samples)
        wants: dict[str, int] = {}
        for request in requests:
            request.draft_token_ids = []
        chances = [r for r in requests if eligible(r)]
        # This step's k for every request, from the draft's kept fraction and cost.
        length = self.num_tokens
        if chances and self.adaptive:
            cost = self.guess_cost(len(chances))
            length = self.acceptance.draft_length(self.num_tokens, cost)
        for request in chances:
            if budget == 0:
                break
            want = min(length, _room(request, self.num_tokens))
            if want == 0 or self._fell_behind(request):
                continue
            sequence = self._sync(request)
            count = sequence.num_tokens - sequence.num_computed_tokens
            samples = count <= budget
            count = min(count, budget)
            # Room for the catch-up and the k - 1 guesses computed after it.
            extra = count + want - 1 if samples else count
            if kv.blocks_needed(sequence, extra) > kv.num_free:
                continue
            if sequence.status is RequestStatus.WAITING:
                kv.admit(sequence, [], extra)
                sequence.status = RequestStatus.RUNNING
            else:
                kv.allocate_slots(sequence, extra)
            budget -= count
            catch_up.append((sequence, count, samples))
            if samples:
                wants[request.request_id] = want
        if not catch_up:
            return
        proposals: dict[str, list[int]] = {}
        started = time.perf_counter()
        guesses = self._forward(catch_up)
        rounds = 1
        while guesses:
            for sequence, token in guesses:
                proposals.setdefault(sequence.request_id, []).append(token)
            # Guess on from each guess while the request wants more and it is a real token.
            decoding = [
                (sequence, 1, True)
                for sequence, token in guesses
                if token < self.vocab_size
                and len(proposals[sequence.request_id]) < wants[sequence.request_id]
            ]
            if not decoding:
                break
            guesses = self._forward(decoding)
            rounds += 1
        # A guess's cost: the forward passes of the step per guess made, the catch-up on
        # the tokens kept since the last step included (not a first prompt's: once only).
        if all(count <= self.num_tokens + 1 for _, count, _ in catch_up):
            seconds = (time.perf_counter() - started) / rounds
            self._round_seconds = _average(self._round_seconds, seconds)
        by_id = {r.request_id: r for r in requests}
        for request_id, tokens in proposals.items():
            valid = next((i for i, t in enumerate(tokens) if t >= self.vocab_size), len(tokens))
            request = by_id[request_id]
            request.draft_token_ids = tokens[:valid]
            self._proposed[request_id] = (request.num_tokens, request.draft_token_ids)

    def _fell_behind(self, request: Request) -> bool:
        """Whether the draft has more of ``request`` to catch up on than guessing for it
        can win back: past ``4 k + 1`` tokens since it last computed (or generated
        tokens, for a request it never saw: one that ran while proposals were off), the
        request decodes plainly to its end and its draft blocks go back. A new request's
        prompt is prefilled once, a price paid at its start."""
        request_id = request.request_id
        if request_id in self._abandoned:
            return True
        sequence = self._sequences.get(request_id)
        behind = (
            request.num_output_tokens
            if sequence is None
            else request.num_tokens - sequence.num_computed_tokens
        )
        if behind <= 4 * self.num_tokens + 1:
            return False
        self._abandoned.add(request_id)
        if sequence is not None:
            self._forget(request_id)
        return True

    def _record_verified(self, requests: list[Request]) -> None:
        """Count how many of last step's guesses the target kept (a request that did not
        advance was not verified: it counts for nothing)."""
        for request in requests:
            proposed = self._proposed.pop(request.request_id, None)
            if proposed is None or request.num_tokens <= proposed[0]:
                continue
            known, guesses = proposed
            new = request.token_ids[known:]
            kept = 0
            while kept < min(len(guesses), len(new) - 1) and guesses[kept] == new[kept]:
                kept += 1
            self.acceptance.record(min(len(guesses), len(new)), kept)

    def _sync(self, request: Request) -> Request:
        """The draft's sequence for ``request``, its tokens now the request's, the K/V it
        computed for guesses the target did not keep rolled back."""
        kv = self.kv
        assert kv is not None
        request_id = request.request_id
        sequence = self._sequences.get(request_id)
        if sequence is None:
            sequence = Request(request_id, list(request.prompt_token_ids), request.params, 0)
            self._sequences[request_id] = sequence
        # Tokens before ``known`` were the request's own; past it the draft's guesses,
        # kept while the target kept them. The last token is left to compute: its
        # logits give the first guess.
        known = self._known.get(request_id, 0)
        computed = min(sequence.num_computed_tokens, request.num_tokens - 1)
        keep = min(known, computed)
        while keep < computed and sequence.token_ids[keep] == request.token_ids[keep]:
            keep += 1
        if keep < sequence.num_computed_tokens:
            sequence.num_computed_tokens = keep
            kv.rollback(sequence, keep)
        if kv.has_windows:  # only now: a rollback may need blocks a guess's window left
            kv.drop_out_of_window(sequence)
        del sequence.token_ids[known:]  # the guesses; the request's tokens before them
        sequence.token_ids.extend(request.token_ids[known:])
        self._known[request_id] = request.num_tokens
        return sequence

    def _forward(self, chunks: list[tuple[Request, int, bool]]) -> list[tuple[Request, int]]:
        """Run ``count`` tokens of each sequence from its computed ones; return the greedy
        guess of each sequence that samples, appended to its tokens."""
        kv, builder = self.kv, self._builder
        assert kv is not None and builder is not None
        plan = SchedulerOutput()
        for sequence, count, samples in chunks:
            start = sequence.num_computed_tokens
            plan.scheduled.append(
                ScheduledRequest(
                    sequence.request_id,
                    sequence.token_ids[start : start + count],
                    start,
                    [list(t) for t in kv.block_tables(sequence)],
                    sample=samples,
                    params=sequence.params,
                )
            )
        logits = self.runner.execute(builder.build(plan))
        tokens = logits.argmax(dim=-1).tolist() if logits.numel() else []
        guesses: list[tuple[Request, int]] = []
        row = 0
        for sequence, count, samples in chunks:
            sequence.num_computed_tokens += count
            if samples:
                token = int(tokens[row])
                row += 1
                sequence.token_ids.append(token)
                guesses.append((sequence, token))
        return guesses

    def finish(self, request: Request) -> None:
        self._abandoned.discard(request.request_id)
        if request.request_id in self._sequences:
            self._forget(request.request_id)

    def reset(self) -> None:
        for request_id in list(self._sequences):
            self._forget(request_id)
        self._abandoned.clear()  # every request computes its K/V again from the start

    def pause(self) -> None:
        self.reset()
        self.runner.close()

    def resume(self) -> None:
        self.runner.close()
        self.runner = self._executor()
        if self._builder is not None:
            self._builder.attention = self.runner.attention

    def release_cache(self) -> None:
        self.reset()
        self.kv = None
        self._builder = None

    def _forget(self, request_id: str) -> None:
        sequence = self._sequences.pop(request_id)
        self._known.pop(request_id, None)
        self._proposed.pop(request_id, None)
        assert self.kv is not None
        self.kv.free(sequence)

    def close(self) -> None:
        """Give every draft block back and the draft model its own modules (idempotent)."""
        if self.kv is not None:
            self.reset()
        self.runner.close()


def _average(mean: float | None, value: float, weight: float = 0.2) -> float:
    return value if mean is None else mean + weight * (value - mean)


def _room(request: Request, num_tokens: int) -> int:
    """Guesses worth making for ``request``: at most k, and fewer near its end (the
    scheduler verifies none past ``max_new_tokens``)."""
    left = request.params.max_new_tokens - request.num_output_tokens - 1
    return max(0, min(num_tokens, left))

"""Layers that keep a per-request state instead of a KV cache, run on cbgen's state slots.

Mamba/Mamba2 mixers, gated-delta-rule layers (Qwen3-Next, Kimi-Linear, OLMo-hybrid),
short convolutions (LFM2) and lightning attention (MiniMax) do not go through
transformers' attention interface: they keep a convolution window and a recurrent
state in the ``Cache`` they are handed (``get_conv_state`` / ``update_conv_state`` /
``get_recurrent_state`` / ``update_recurrent_state``, or the cache layer's
``conv_states`` / ``recurrent_states`` on older transformers; MiniMax:
``get_linear_cache`` / ``set_linear_cache``). cbgen packs every request of a step
into one sequence, which such a layer would read as one long request: wrong from the
first token. So the executor swaps each of these modules' ``forward`` while it lives
for one that splits the packed rows by request and runs the module's own code
(transformers' torch implementations, exact) once per prefill chunk and once for all
single-token rows together, each time with a ``Cache`` whose one
``LinearAttentionLayer`` holds those requests' states, read from their slots
(``cbgen.cache.state.StateCache``) and written back after the call. Arguments with a
value per token (position ids, rotary tables) are split along with the rows.

The probe forward runs the swapped modules on a fresh cache and records what each
keeps (``StateSpec``): shapes, dtypes, how many states; then checks that each carries
its state across calls (``_check_continuation``). A module that keeps state some other
way (DeepSeek-V4's compressors) is refused by name when the executor is built: cbgen
never runs a model it cannot run exactly. What one call is handed (the states in and
out, the per-token arguments cut to its rows) is ``cbgen.executor.state_handles``.
"""

from __future__ import annotations

import functools
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..cache.state import StateSpec
from .metadata import ProbeRecord, SlotSet, StateChunk, StateSegments
from .state_handles import (
    ProbeState,
    SlotState,
    first_output,
    holds_tensor,
    like_module_output,
    one_layer_cache,
    per_token,
    rows_of,
    split_rows,
)

# How a module's code reads and writes the state API of transformers' Cache.
_STATE_API = re.compile(
    r"\.(get_conv_state|update_conv_state|get_recurrent_state|update_recurrent_state)\("
    r"|\.(conv_states|recurrent_states)\["
)
# MiniMax's lightning attention: one ``[heads, dim, dim]`` state through a cache of its own.
_LINEAR_CACHE_API = re.compile(r"\.get_linear_cache\(")
# State kept some other way: named in the refusal.
_OTHER_STATE = {
    "update_compressor_states": "compressed attention entries (update_compressor_states)",
    "update_indexer": "an indexer key cache (update_indexer)",
}
# Arguments that describe how the rows are packed: a call over one request's rows gets none.
_PACKING_KWARGS = {"seq_idx", "cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
_CACHE_ARGS = ("cache_params", "past_key_values")


# ``config.layer_types`` entries of layers that keep a per-request state (transformers
# names Mamba layers "linear_attention" too; "hybrid": a Mamba mixer beside attention).
STATE_LAYER_TYPES = frozenset(
    {"linear_attention", "conv", "hybrid", "hybrid_sliding", "mamba", "recurrent"}
)


def declared_state_layers(config: Any) -> int:
    """How many layers the model's config says keep a per-request state."""
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    layer_types = getattr(text, "layer_types", None) or []
    return sum(1 for kind in layer_types if kind in STATE_LAYER_TYPES)


class UnsupportedStateLayer(ValueError):
    """A layer keeps per-request state cbgen cannot hold exactly."""


@functools.cache
def _state_usage(cls: type) -> tuple[str | None, str | None]:
    """How a module class keeps its state: ``"cache"`` (the Cache state API),
    ``"linear"`` (``get_linear_cache``) or None; and another kind of state it keeps that
    cbgen cannot hold (None: none). Read from its source once per class (the executor is
    built again on every weight refresh)."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        source = ""
    other = next((why for name, why in _OTHER_STATE.items() if name in source), None)
    protocol = None
    if _STATE_API.search(source):
        protocol = "cache"
    elif _LINEAR_CACHE_API.search(source):
        protocol = "linear"
    return protocol, other


def _cache_argument(forward: Callable[..., Any]) -> str | None:
    try:
        params = inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return None
    return next((name for name in _CACHE_ARGS if name in params), None)


class StateMixers:
    """The model's state-keeping modules, swapped to run on cbgen's state slots.

    Built with the model: finds them (refusing any it cannot run) and swaps their
    ``forward``; ``specs`` is filled by the probe forward; ``restore`` gives every
    module its own ``forward`` back.
    """

    def __init__(self, model: nn.Module) -> None:
        self.modules: list[nn.Module] = []
        self.names: list[str] = []
        self._originals: list[Callable[..., Any]] = []
        self._protocols: list[str] = []  # "cache" or "linear" (see ``_state_usage``)
        self._cache_args: list[str] = []
        self._layer_idx: list[int] = []  # each module's index in transformers' Cache
        self.specs: list[StateSpec | None] = []
        refused: list[str] = []
        for name, module in model.named_modules():
            protocol, other = _state_usage(type(module))  # type: ignore[arg-type]
            if other is not None:
                refused.append(f"{name} ({type(module).__name__}) keeps {other}")
                continue
            if protocol is None:
                continue
            cache_arg = _cache_argument(module.forward)
            layer_idx = getattr(module, "layer_idx", None)
            if cache_arg is None or not isinstance(layer_idx, int):
                refused.append(
                    f"{name} ({type(module).__name__}) keeps a recurrent or convolution "
                    "state but takes no cache argument (or layer index) cbgen can hand it"
                )
                continue
            self.modules.append(module)
            self.names.append(name)
            self._originals.append(module.forward)
            self._protocols.append(protocol)
            self._cache_args.append(cache_arg)
            self._layer_idx.append(layer_idx)
            self.specs.append(None)
        # Per module: whether a chunk of several tokens may start from a kept state
        # (else it runs a token at a time; see ``_check_continuation``).
        self.chunks_continue: list[bool] = [True] * len(self.modules)
        if refused:
            raise UnsupportedStateLayer(
                f"{type(model).__name__} cannot run exactly in cbgen: "
                + "; ".join(refused)
                + ". cbgen refuses it rather than give wrong tokens"
            )
        for index, module in enumerate(self.modules):
            module.forward = self._make_forward(index)

    def __len__(self) -> int:
        return len(self.modules)

    def restore(self) -> None:
        """Give every swapped module its own ``forward`` back (idempotent)."""
        for module in self.modules:
            if "forward" in module.__dict__:
                del module.forward
        self.modules = []

    def recorded_specs(self) -> list[StateSpec]:
        """Every swapped module's ``StateSpec`` after the probe (raises for one that ran no
        state: then the model does something cbgen cannot see)."""
        missing = [self.names[i] for i, spec in enumerate(self.specs) if spec is None]
        if missing:
            raise UnsupportedStateLayer(
                f"state layers {missing} did not run in the probe forward (or kept no state); "
                "cbgen cannot tell what they keep"
            )
        return [spec for spec in self.specs if spec is not None]

    # -- the swapped forward ----------------------------------------------------------

    def _make_forward(self, index: int) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._forward(index, args, kwargs)

        return forward

    def _forward(self, index: int, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        from .attention_hook import current_metadata

        if args:
            hidden, rest = args[0], args[1:]
            if rest:
                raise TypeError(
                    f"{self.names[index]}: cbgen passes state layers their arguments by "
                    "name; got extra positional arguments"
                )
        else:
            hidden = kwargs.pop("hidden_states")
        kwargs.pop(self._cache_args[index], None)
        kwargs.pop("attention_mask", None)  # no padding: every split call is one request
        for name in _PACKING_KWARGS:
            kwargs.pop(name, None)
        metadata = current_metadata()
        if isinstance(metadata, ProbeRecord):
            return self._probe(index, hidden, kwargs)
        state = getattr(metadata, "state", None)
        if state is None:
            raise RuntimeError(
                f"{self.names[index]} runs on cbgen's state slots only inside an engine step"
            )
        return self._run(index, hidden, kwargs, state)

    def _probe(self, index: int, hidden: torch.Tensor, kwargs: dict[str, Any]) -> Any:
        rows = hidden.shape[1]
        bad = sorted(k for k, v in kwargs.items() if holds_tensor(v) and not per_token(v, rows))
        if bad:
            raise UnsupportedStateLayer(
                f"{self.names[index]} ({type(self.modules[index]).__name__}) takes tensors "
                f"{bad} that are not per token, which cbgen cannot split by request"
            )
        probe = ProbeState()
        result = self._call(index, hidden, kwargs, probe.handle(self._protocols[index]))
        if not isinstance(first_output(result), torch.Tensor):
            raise UnsupportedStateLayer(
                f"{self.names[index]} returns {type(result).__name__}, not a tensor"
            )
        tensors = probe.specs()
        if tensors:
            module = self.modules[index]
            spec = StateSpec(self._layer_idx[index], type(module).__name__, tuple(tensors))
            self.specs[index] = spec
            self.chunks_continue[index] = self._check_continuation(index, hidden, kwargs, spec)
        return result

    def _check_continuation(
        self, index: int, hidden: torch.Tensor, kwargs: dict[str, Any], spec: StateSpec
    ) -> bool:
        """Whether the module carries its state into a call of several tokens.

        First, on 8 tokens of random input: 4 tokens then one token at a time from the
        kept state must give what one call over the 8 gives (the decode path; else the
        module is refused). Then, from that state with its recurrent part made 64 times
        larger (so what it is worth stands well above rounding), 4 tokens in one call
        must give what 4 single tokens give; where they do not (Mamba's torch scan starts
        from zeros whatever state it is handed), a continuing chunk runs one token at a
        time. Returns whether chunks may continue.
        """
        generator = torch.Generator(device="cpu").manual_seed(0)
        x = torch.randn(1, 8, hidden.shape[-1], generator=generator).to(hidden)
        x = x * hidden.float().std().clamp(min=1e-3).to(hidden.dtype)
        # Per-token arguments of the probe's rows, repeated to 8 rows.
        repeat = torch.arange(8, device=hidden.device) % hidden.shape[1]
        kwargs = split_rows(kwargs, hidden.shape[1], lambda t: t.index_select(1, repeat))
        tensors = [
            torch.zeros((1, *t.shape), dtype=t.dtype, device=hidden.device) for t in spec.tensors
        ]
        slot = SlotSet.of([0], hidden.device)

        def run(first: int, last: int, continues: bool) -> torch.Tensor:
            part = split_rows(kwargs, 8, lambda t: t[:, first:last])
            return self._run_slots(index, x[:, first:last], part, spec, tensors, slot, continues)

        def from_prefix(scale: float) -> None:
            # The state after 4 tokens, its recurrent part scaled (a convolution window
            # scaled would swamp the comparison through the activation after it).
            run(0, 4, False)
            for t, tensor in zip(spec.tensors, tensors, strict=True):
                if t.kind != "conv":
                    tensor.mul_(scale)

        def stepwise() -> torch.Tensor:
            return torch.cat([run(i, i + 1, True) for i in range(4, 8)], dim=1).float()

        def error(got: torch.Tensor, want: torch.Tensor, without: torch.Tensor) -> float:
            # Against what the kept state is worth: the output's change without it.
            worth = float((without - want).abs().max()) + 1e-30
            return float((got.float() - want).abs().max()) / worth

        # Measured: rounding stays under 2e-4 of the worth in float32 and 2e-2 in
        # bfloat16; an ignored recurrent state (Mamba's scan) costs 0.1 to 0.9 of it.
        limit = 0.01 if hidden.dtype in (torch.float32, torch.float64) else 0.05
        whole = run(0, 8, False)[:, 4:].float()
        fresh = run(4, 8, False).float()
        from_prefix(1.0)
        if error(stepwise(), whole, fresh) > limit:
            raise UnsupportedStateLayer(
                f"{self.names[index]} ({spec.module}): one token at a time from its kept "
                "state does not give what one call over the whole sequence gives"
            )
        from_prefix(64.0)
        stepped = stepwise()
        from_prefix(64.0)
        chunked = run(4, 8, True)
        return error(chunked, stepped, fresh) <= limit

    def _run(
        self, index: int, hidden: torch.Tensor, kwargs: dict[str, Any], state: StateSegments
    ) -> Any:
        spec = self.specs[index]
        assert spec is not None
        tensors = state.cache.tensors[index]
        rows = hidden.shape[1]
        out: torch.Tensor | None = None
        if state.decode_rows is not None:
            assert state.decode_slots is not None
            if state.decode_only:

                def pick(t: torch.Tensor) -> torch.Tensor:
                    return t.transpose(0, 1)  # [1, rows, ...] -> [rows, 1, ...]
            else:
                decode_rows = state.decode_rows

                def pick(t: torch.Tensor) -> torch.Tensor:
                    return t[0].index_select(0, decode_rows).unsqueeze(1)

            y = self._run_slots(
                index,
                pick(hidden),
                split_rows(kwargs, rows, pick),
                spec,
                tensors,
                state.decode_slots,
                True,
            )
            if state.decode_only:
                return like_module_output(y.transpose(0, 1), self._protocols[index])
            out = y.new_empty(1, rows, y.shape[-1])
            out[0].index_copy_(0, state.decode_rows, y[:, 0])
        for chunk in state.chunks:
            if chunk.load >= 0:  # a prefix-cache hit: its state from the checkpoint
                for tensor in tensors:
                    tensor[chunk.slot].copy_(tensor[chunk.load])
            for start, length in self._pieces(index, chunk):
                continues = chunk.continues or chunk.load >= 0 or start > chunk.row
                part = split_rows(kwargs, rows, rows_of(start, length))
                y = self._run_slots(
                    index,
                    hidden[:, start : start + length],
                    part,
                    spec,
                    tensors,
                    chunk.slots,
                    continues,
                )
                if out is None:
                    out = y.new_empty(1, rows, y.shape[-1])
                out[:, start : start + length] = y
                if chunk.save_slot >= 0 and start + length == chunk.row + chunk.save_at:
                    for tensor in tensors:
                        tensor[chunk.save_slot].copy_(tensor[chunk.slot])
        assert out is not None
        return like_module_output(out, self._protocols[index])

    def _pieces(self, index: int, chunk: StateChunk) -> list[tuple[int, int]]:
        """The calls ``chunk`` takes, as ``(first row, rows)``: the prompt's rows at once
        (a token at a time where the module cannot continue a chunk), the replayed ones a
        token at a time, and a cut where a checkpoint is saved."""
        row, count = chunk.row, chunk.count
        prompt = min(count, chunk.replay)
        pieces = [(row, prompt)] if prompt else []
        pieces += [(row + i, 1) for i in range(prompt, count)]
        cut = row + chunk.save_at
        if chunk.save_slot >= 0:
            pieces = [
                part
                for start, length in pieces
                for part in (
                    [(start, cut - start), (cut, start + length - cut)]
                    if start < cut < start + length
                    else [(start, length)]
                )
            ]
        if self.chunks_continue[index]:
            return pieces
        fresh = not (chunk.continues or chunk.load >= 0)
        return [
            part
            for start, length in pieces
            for part in (
                [(start, length)]
                if length == 1 or (fresh and start == row)
                else [(start + i, 1) for i in range(length)]
            )
        ]

    def _run_slots(
        self,
        index: int,
        hidden: torch.Tensor,
        kwargs: dict[str, Any],
        spec: StateSpec,
        tensors: list[torch.Tensor],
        slots: SlotSet,
        continues: bool,
    ) -> torch.Tensor:
        """One call of the module over ``hidden`` (``[requests, tokens, dim]``) with the
        states of ``slots``: read from them when the requests ``continue``, written back
        after. Returns the module's output tensor."""
        held = SlotState(spec, tensors, slots, continues)
        out = first_output(self._call(index, hidden, kwargs, held.handle(self._protocols[index])))
        held.write_back(self.names[index])
        return out

    def _call(self, index: int, hidden: torch.Tensor, kwargs: dict[str, Any], cache: Any) -> Any:
        arguments = {self._cache_args[index]: cache, "attention_mask": None, **kwargs}
        if self._protocols[index] == "cache":
            arguments[self._cache_args[index]] = one_layer_cache(self._layer_idx[index], cache)
        return self._originals[index](hidden, **arguments)

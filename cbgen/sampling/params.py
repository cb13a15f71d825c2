"""Per-request sampling settings and their validation."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from .structured import StructuredOutput

GREEDY_TEMPERATURE = 1e-5
"""Temperatures below this are greedy: dividing logits by a smaller value overflows them
to infinities (1e-40 made every row NaN and every token id 0), and the distribution is
already a point mass long before (vLLM draws the same line)."""

SEED_RANGE = 1 << 64
"""Seeds are unsigned 64-bit values, what ``torch.Generator.manual_seed`` takes."""

LogitsProcessor = Callable[[list[int], torch.Tensor], torch.Tensor]
"""``processor(token_ids, logits) -> logits``: ``token_ids`` are the request's prompt and
generated tokens so far, ``logits`` its float32 row ``[vocab]`` for the next token."""


@dataclass
class SamplingParams:
    """How one request picks its tokens, what it reports and when it stops.

    ``temperature == 0`` means greedy decoding (the default, and the mode whose
    output is token-identical to ``model.generate()``); so does any temperature
    below ``GREEDY_TEMPERATURE`` (1e-5). ``top_k == 0``, ``top_p == 1.0`` and
    ``min_p == 0.0`` disable those filters. ``eos_token_ids`` and ``stop_token_ids``
    are stop ids on top of the model's own EOS ids (finish reason ``"stop"``);
    ``ignore_eos`` turns every stop id off so a request produces exactly
    ``max_new_tokens`` (what benchmarks want). ``stop`` lists stop strings: the
    request ends with ``"stop"`` at the token that completes one, its text cut right
    before it (or after it, with ``include_stop_str_in_output``); they need a tokenizer.

    Penalties and biases (``cbgen.sampling.logits``, applied to the whole batch in tensor
    passes, in this order, before temperature): ``logit_bias`` adds a value to a
    token's logit; ``bad_words`` (token-id sequences) bans a sequence's last token
    where the tokens before it would complete it; ``min_tokens`` bans every stop id
    until that many tokens were generated; ``repetition_penalty`` divides the
    positive logits (multiplies the negative ones) of every token in the prompt and
    output, transformers' definition; ``presence_penalty`` and ``frequency_penalty``
    subtract a constant and a per-occurrence amount from the logits of tokens the
    output already holds, OpenAI's definition. ``min_p`` (after temperature) drops the
    tokens less likely than ``min_p`` times the most likely one.

    ``logprobs=N`` reports, per generated token, its logprob and the ``N`` most likely
    tokens' (``RequestOutput.logprobs``); ``prompt_logprobs=N`` does the same for every
    prompt token after the first (``RequestOutput.prompt_logprobs``; the prompt is then
    computed, never read from the prefix cache). Both are taken from the model's raw
    logits, before any processor, penalty or temperature (vLLM's default).

    ``structured_output`` (``cbgen.StructuredOutput``: a JSON schema, a regex, a grammar
    or any JSON object) restricts every token to those the grammar allows (a token
    bitmask applied to the batch's logits in one pass, after the penalties); the model's
    EOS is allowed once the output is complete. It needs a tokenizer. An output the
    grammar cannot finish within ``max_new_tokens`` ends with ``"length"``.

    ``n`` asks ``generate_batch`` for that many samples of the prompt (they share
    its cached prefix blocks; sample ``i`` is seeded with ``seed + i``); it is
    meant with ``temperature > 0``, since greedy samples are all the same.
    ``priority`` orders the scheduler's queue: lower values are served first,
    ties by arrival, and under memory pressure the highest value (then the
    newest request) is preempted first.

    ``logits_processors`` run in order on the request's logits row before it is
    sampled (greedy included), each getting the token ids so far (see
    ``LogitsProcessor``); they are the slow path, one Python call per row and step.
    One that raises, or returns a tensor of another shape, finishes only its own
    request, with finish reason ``"error"`` and the message.

    ``speculative=False`` opts the request out of speculative decoding when the engine
    has it on (``EngineConfig.speculative``): no tokens are proposed for it. Output is the
    same either way; the opt-out saves the verification compute where proposals miss.
    """

    max_new_tokens: int = 128
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    eos_token_ids: Sequence[int] = field(default_factory=tuple)
    stop_token_ids: Sequence[int] = field(default_factory=tuple)
    ignore_eos: bool = False
    min_tokens: int = 0
    stop: Sequence[str] | None = None
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Mapping[int, float] | None = None
    bad_words: Sequence[Sequence[int]] = field(default_factory=tuple)
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured_output: StructuredOutput | None = None
    n: int = 1
    priority: int = 0
    logits_processors: Sequence[LogitsProcessor] = field(default_factory=tuple)
    speculative: bool = True

    @property
    def greedy(self) -> bool:
        """Whether the request takes the most likely token (``temperature`` near 0)."""
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The request's own stop ids (``eos_token_ids`` and ``stop_token_ids``)."""
        return tuple(self.eos_token_ids) + tuple(self.stop_token_ids)

    @property
    def has_penalties(self) -> bool:
        """Whether a penalty reads the tokens so far."""
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or any(len(words) > 1 for words in self.bad_words)
        )

    @property
    def needs_history(self) -> bool:
        """Whether sampling reads the request's tokens so far (so its last token must be
        known before its next step is planned, and proposals are not verified for it)."""
        return (
            bool(self.logits_processors) or self.has_penalties or self.structured_output is not None
        )

    def validate(self) -> None:
        """Raise ``ValueError`` describing the first invalid setting."""
        _check_int("max_new_tokens", self.max_new_tokens, minimum=1)
        _check_number("temperature", self.temperature, minimum=0.0, hint=" (0 = greedy)")
        _check_int("top_k", self.top_k, minimum=0, hint=" (0 = off)")
        if not _is_number(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _is_number(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < SEED_RANGE):
            raise ValueError(f"seed must be an int in [0, 2**64) or None, got {self.seed!r}")
        _check_int("n", self.n, minimum=1)
        if not isinstance(self.speculative, bool):
            raise ValueError(f"speculative must be a bool, got {self.speculative!r}")
        _check_int("priority", self.priority, hint=" (lower runs first)")
        _check_int("min_tokens", self.min_tokens, minimum=0)
        if self.min_tokens > self.max_new_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must not exceed max_new_tokens "
                f"({self.max_new_tokens})"
            )
        for processor in self.logits_processors:
            if not callable(processor):
                raise ValueError(f"logits_processors must hold callables, got {processor!r}")
        _check_token_ids("eos_token_ids", self.eos_token_ids)
        _check_token_ids("stop_token_ids", self.stop_token_ids)
        _check_number("repetition_penalty", self.repetition_penalty, minimum=0.0, strict=True)
        _check_number("presence_penalty", self.presence_penalty)
        _check_number("frequency_penalty", self.frequency_penalty)
        if self.logit_bias is not None:
            if not isinstance(self.logit_bias, Mapping):
                raise ValueError(
                    f"logit_bias must map token ids to numbers, got {self.logit_bias!r}"
                )
            _check_token_ids("logit_bias", list(self.logit_bias))
            for value in self.logit_bias.values():
                if not _is_number(value) or math.isnan(value):
                    raise ValueError(f"logit_bias values must be numbers, got {value!r}")
        if isinstance(self.bad_words, (str, bytes)) or not isinstance(self.bad_words, Sequence):
            raise ValueError(f"bad_words must be a list of token-id lists, got {self.bad_words!r}")
        for words in self.bad_words:
            if isinstance(words, (str, bytes)) or not isinstance(words, Sequence) or not words:
                raise ValueError(f"bad_words must hold non-empty token-id lists, got {words!r}")
            _check_token_ids("bad_words", words)
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                _check_int(name, value, minimum=0, hint=" (None = off)")
        if self.structured_output is not None:
            if not isinstance(self.structured_output, StructuredOutput):
                raise ValueError(
                    "structured_output must be a cbgen.StructuredOutput, got "
                    f"{type(self.structured_output).__name__}"
                )
            self.structured_output.validate()
        if self.stop is not None:
            stops = [self.stop] if isinstance(self.stop, str) else self.stop
            if not isinstance(stops, Sequence) or not all(isinstance(s, str) for s in stops):
                raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
            if any(not s for s in stops):
                raise ValueError("stop strings must not be empty")

    @property
    def stop_strings(self) -> list[str]:
        """``stop`` as a list (a single string is one stop string)."""
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @classmethod
    def from_generation_config(cls, generation_config: Any) -> SamplingParams:
        """Translate a ``transformers.GenerationConfig``; a setting cbgen cannot honour
        (beam search, contrastive search, ...) raises ``ValueError`` naming it rather
        than being dropped."""
        from .generation_config import sampling_kwargs

        return cls(**sampling_kwargs(generation_config))


def sample_seed(seed: int | None, index: int) -> int | None:
    """The seed of sample ``index`` of a request with ``n`` samples: ``seed + index``,
    wrapped into the 64-bit seed range so a seed near the top still gives valid seeds."""
    return None if seed is None else (seed + index) % SEED_RANGE


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any, minimum: int | None = None, hint: str = "") -> None:
    if not _is_int(value) or (minimum is not None and value < minimum):
        bound = "" if minimum is None else f" >= {minimum}"
        raise ValueError(f"{name} must be an int{bound}{hint}, got {value!r}")


def _check_number(
    name: str, value: Any, minimum: float | None = None, strict: bool = False, hint: str = ""
) -> None:
    if not _is_number(value) or not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number{hint}, got {value!r}")
    if minimum is not None and (value <= minimum if strict else value < minimum):
        raise ValueError(f"{name} must be {'>' if strict else '>='} {minimum}{hint}, got {value}")


def _check_token_ids(name: str, token_ids: Any) -> None:
    for token_id in token_ids:
        if not _is_int(token_id) or token_id < 0:
            raise ValueError(f"{name} must hold non-negative token ids, got {token_id!r}")

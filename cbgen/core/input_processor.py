"""What every front end checks before a request reaches the core, and the n-sample fan-out.

``generate_batch``, the online engine and the server all go through one
``InputProcessor`` (the core builds it, with its vocabulary size and context limit), so
a rule is written once and a bad request is refused the same way everywhere: with a
``ValueError`` that names the request, before it costs anything.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Callable
from typing import Any

import torch

from ..requests.request import Request
from ..requests.text import RequestText
from ..sampling.grammar import GrammarCompiler
from ..sampling.params import SamplingParams, sample_seed


class InputProcessor:
    """Validation against the model (vocabulary, context) and the sampling rules, and
    the ``Request`` an engine schedules: its grammar matcher, its text (stop strings)
    and its seeded generator. Grammars are compiled here, when the request is added, so
    a bad spec fails its own ``add_request`` and never a step."""

    def __init__(
        self,
        vocab_size: int,
        max_model_len: int,
        *,
        tokenizer: Any = None,
        decode: Callable[[list[int]], str] | None = None,
        device: torch.device | None = None,
        eos_token_ids: set[int] | None = None,
    ) -> None:
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.tokenizer = tokenizer
        self.decode = decode  # None: requests carry no text (the online engine has its own)
        self.device = device or torch.device("cpu")
        self.eos_token_ids = eos_token_ids or set()
        self.grammars: GrammarCompiler | None = None  # built for the first grammar
        self._grammar_lock = threading.Lock()

    def make_request(
        self, request_id: str, prompt_token_ids: Any, params: SamplingParams, arrival: int
    ) -> Request:
        """The request to schedule; ``ValueError`` naming ``request_id`` if it cannot run."""
        prompt = self.validate(
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
            grammar = self._grammar_compiler().matcher(self.check_structured(request_id, params))
        request = Request(request_id, prompt, params, arrival)
        request.grammar = grammar
        if self.decode is not None:
            request.text = RequestText(
                prompt, self.decode, params.stop_strings, params.include_stop_str_in_output
            )
        if params.seed is not None:
            request.generator = torch.Generator(device=self.device).manual_seed(params.seed)
        return request

    def check_structured(self, request_id: str, params: SamplingParams) -> Any:
        """Compile ``params.structured_output`` now (``ValueError`` naming ``request_id``
        if it cannot be), so a front end refuses a bad schema, regex or grammar when the
        request is added, never in a step. Compiled grammars are cached: the request's
        own matcher later starts from this one. Returns the spec (``None``: none)."""
        spec = params.structured_output
        if spec is None:
            return None
        try:
            self._grammar_compiler().compile(spec)
        except ValueError as exc:
            raise ValueError(f"request {request_id!r}: {exc}") from None
        except RecursionError:
            raise ValueError(
                f"request {request_id!r}: the structure is nested too deeply"
            ) from None
        return spec

    def _grammar_compiler(self) -> GrammarCompiler:
        with self._grammar_lock:  # front ends check requests on their own threads
            return self._grammar_compiler_locked()

    def _grammar_compiler_locked(self) -> GrammarCompiler:
        if self.grammars is None:
            if self.tokenizer is None:
                raise ValueError(
                    "structured output needs a tokenizer "
                    "(EngineCore(model, config, tokenizer) or generate_batch(..., tokenizer=))"
                )
            eos = sorted(self.eos_token_ids) or None
            self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size, eos_token_ids=eos)
        return self.grammars

    def validate(
        self,
        request_id: str,
        prompt_token_ids: Any,
        params: Any,
        *,
        one_sample: str | None = None,
    ) -> list[int]:
        """The prompt as a list of ids; ``ValueError`` naming ``request_id`` if it cannot run.

        ``one_sample``: this front end runs one sample per request, and the message says
        where ``n > 1`` belongs. Reads only settings fixed at construction, so any thread
        may call it.
        """

        def fail(message: str) -> ValueError:
            return ValueError(f"request {request_id!r}: {message}")

        if not isinstance(params, SamplingParams):
            raise fail(f"params must be SamplingParams, got {type(params).__name__}")
        try:
            params.validate()
        except ValueError as exc:
            raise fail(str(exc)) from None
        if one_sample is not None and params.n != 1:
            raise fail(f"n={params.n} samples {one_sample}")
        if params.top_k > self.vocab_size:
            raise fail(
                f"top_k must be at most the vocabulary size {self.vocab_size}, got {params.top_k}"
            )
        for name, ids in (
            ("eos_token_ids", params.eos_token_ids),
            ("stop_token_ids", params.stop_token_ids),
            ("logit_bias", list(params.logit_bias or ())),
            ("bad_words", [t for words in params.bad_words for t in words]),
        ):
            outside = [t for t in ids if t >= self.vocab_size]
            if outside:
                raise fail(
                    f"{name} holds token id {outside[0]}, outside the vocabulary "
                    f"[0, {self.vocab_size})"
                )
        for name in ("logprobs", "prompt_logprobs"):
            count = getattr(params, name)
            if count is not None and count > self.vocab_size:
                raise fail(
                    f"{name} must be at most the vocabulary size {self.vocab_size}, got {count}"
                )
        if isinstance(prompt_token_ids, torch.Tensor):
            prompt_token_ids = prompt_token_ids.flatten().tolist()
        prompt = list(prompt_token_ids)
        if not prompt:
            raise fail("the prompt is empty")
        for token in prompt:
            if isinstance(token, bool) or not isinstance(token, int):
                raise fail(f"token ids must be ints, got {token!r}")
            if not 0 <= token < self.vocab_size:
                raise fail(f"token id {token} is outside the vocabulary [0, {self.vocab_size})")
        if len(prompt) >= self.max_model_len:
            raise fail(
                f"the prompt has {len(prompt)} tokens but the context limit is "
                f"{self.max_model_len} (room for at least one new token is needed)"
            )
        return prompt


def fan_out(request_id: str, params: Any) -> list[Any]:
    """One ``SamplingParams`` per sample of a request with ``n`` samples (``n = 1`` each,
    sample ``i`` seeded with ``seed + i`` wrapped into the seed range); anything that is
    not a valid ``SamplingParams`` with ``n > 1`` is passed on whole, for ``validate`` to
    name what is wrong."""
    if not isinstance(params, SamplingParams) or params.n == 1:
        return [params]
    try:
        params.validate()
    except ValueError as exc:
        raise ValueError(f"request {request_id!r}: {exc}") from None
    return [
        dataclasses.replace(params, n=1, seed=sample_seed(params.seed, i)) for i in range(params.n)
    ]


def strip_request_prefix(message: str) -> str:
    """The engine's messages start with "request 'id': "; the id means nothing to a
    caller who never chose it (an HTTP client, a batch job's row)."""
    if message.startswith("request '") and "': " in message:
        return message.split("': ", 1)[1]
    return message

"""OpenAI request bodies into engine work: token-id prompts and ``SamplingParams``.

``Translator.completion`` and ``Translator.chat`` check a parsed JSON body in the order
the API answers (the model, unsupported fields, the choice count, stop strings, stream
options, a cheap length bound), tokenize on a small thread pool (so one huge prompt
never stalls the event loop) and build one ``SamplingParams`` per prompt. Every refusal
is an ``APIError`` in OpenAI's shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Callable, Collection
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ...core.input_processor import strip_request_prefix
from ...sampling.params import SamplingParams
from ...sampling.structured import StructuredOutput
from .chat_prompt import chat_prompt, check_template_kwargs
from .fields import check_count, penalties, structured_output, structured_spec
from .logprobs import Report
from .messages import MessagePlan
from .protocol import (
    CHAT_NEUTRAL,
    COMPLETION_NEUTRAL,
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_messages,
    check_unsupported,
    parse,
)
from .reasoning import ReasoningParser
from .tool_parsers import ToolParser
from .tools import ToolPlan, parameter_specs, plan_tools

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
MAX_STOP_STRINGS = 16
MAX_PRIORITY = 1 << 31  # |priority| bound: an ordering key, not a number to compute with


def max_token_chars(tokenizer: Any) -> int:
    """The most characters one token can stand for (an upper bound, from the vocabulary's
    token strings: byte-level and SentencePiece pieces are at least as long as their text),
    so a text of ``c`` characters has at least ``c / max_token_chars`` tokens."""
    try:
        vocab = tokenizer.get_vocab()
    except Exception:  # no vocabulary to read: no cheap bound
        return 1 << 30
    return max((len(token) for token in vocab), default=1) or 1


@dataclass
class Translated:
    """One API call, translated: ``n`` choices of every prompt, each with its params."""

    chat: bool
    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    stop: list[str] | None
    stream: bool
    include_usage: bool
    timeout: float | None
    report: Report
    text_options: dict[str, bool]  # ``Engine.add_request``'s special-token keywords
    model: str = ""  # the model the call named (the base's, or a LoRA adapter's)
    lora: str | None = None  # the LoRA adapter it runs under (None: the base)
    messages: MessagePlan | None = None  # a chat answer's reasoning and tool calls
    client: str | None = None  # who sent it, for the per-client fair share (None: unknown)


class Translator:
    """Checks and translates the calls for one model; owns the tokenizer's thread pool.

    ``max_choices`` bounds prompts × ``n`` per call; ``max_tokens_limit`` bounds
    ``max_tokens`` (and caps the default)."""

    def __init__(
        self,
        tokenizer: Any,
        model_name: str,
        max_model_len: int,
        max_choices: int,
        max_tokens_limit: int | None,
        tokenizer_threads: int,
    ) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        # The LoRA adapters' names, read per call (adapters may come and go at run time).
        self.adapters: Callable[[], Collection[str]] = frozenset
        # Compiles a call's grammar for the engine (``Engine.check_structured_output``), on
        # the tokenizer pool, so a spec that cannot compile is a 400 before the call runs.
        self.compile_structured: Callable[[SamplingParams], None] | None = None
        # The server's --tool-call-parser and --reasoning-parser (None: not set).
        self.tool_parser: type[ToolParser] | None = None
        self.reasoning_parser: type[ReasoningParser] | None = None
        self.max_model_len = max_model_len
        self.max_choices = max_choices
        self.max_tokens_limit = max_tokens_limit
        self.max_prompt_chars = max_model_len * max_token_chars(tokenizer)
        self.tokenize_pool = ThreadPoolExecutor(tokenizer_threads, "cbgen-tokenize")

    def close(self) -> None:
        self.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    # -- the two endpoints ----------------------------------------------------------------

    async def completion(self, body: Any) -> Translated:
        """A ``/v1/completions`` body: one or several prompts, text or token ids."""
        req: CompletionRequest = parse(CompletionRequest, body)
        lora = self.check_model(req.model)
        check_unsupported(req, COMPLETION_NEUTRAL, best_of_ok=req.n or 1)
        n = self.num_choices(req, self.num_prompts(req.prompt))
        stop = self.stops(req)
        include_usage = self.include_usage(req)
        report = Report(
            logprobs=check_count("logprobs", req.logprobs),
            echo=req.echo,
            prompt_logprobs=self.prompt_logprobs(req),
        )
        max_tokens = req.max_tokens
        if max_tokens == 0 and req.echo:  # the prompt alone: run one token, show none
            report.drop_generated, max_tokens = True, 1
        prompts = await self.off_loop(self.completion_prompts, req.prompt)
        if req.echo:
            report.echo_texts = await self.off_loop(
                self.echo_texts, req.prompt, prompts, req.skip_special_tokens
            )
        constraint = structured_output(req).get("structured_output")
        params = [
            self.sampling(
                req, len(p), max_tokens, DEFAULT_COMPLETION_MAX_TOKENS, report, constraint
            )
            for p in prompts
        ]
        await self.check_structured(req, params[0])
        return Translated(
            False,
            prompts,
            params,
            n,
            stop,
            bool(req.stream),
            include_usage,
            req.timeout,
            report,
            text_options(req),
            req.model,
            lora,
            None,
            client_of(req),
        )

    async def chat(self, body: Any) -> Translated:
        """A ``/v1/chat/completions`` body: one conversation, through the chat template."""
        req: ChatCompletionRequest = parse(ChatCompletionRequest, body)
        lora = self.check_model(req.model)
        check_unsupported(req, CHAT_NEUTRAL)
        messages = chat_messages(req.messages)
        n = self.num_choices(req, 1)
        stop = self.stops(req)
        include_usage = self.include_usage(req)
        parser = None if self.tool_parser is None else self.tool_parser.name
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls, parser)
        template_kwargs = check_template_kwargs(req.chat_template_kwargs)
        self.check_length(sum(len(json.dumps(m, ensure_ascii=False)) for m in messages), "messages")
        prompt, opened = await self.off_loop(
            chat_prompt, self.tokenizer, messages, plan, template_kwargs, self.reasoning_parser
        )
        max_tokens = req.max_completion_tokens
        if max_tokens is None:
            max_tokens = req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true.", "top_logprobs")
        count = check_count("top_logprobs", req.top_logprobs)
        report = Report(
            logprobs=(count or 0) if req.logprobs else None,
            prompt_logprobs=self.prompt_logprobs(req),
        )
        constraint = self.chat_constraint(req, plan, opened)
        params = [self.sampling(req, len(prompt), max_tokens, None, report, constraint)]
        await self.check_structured(req, params[0], plan)
        options = text_options(req)
        if plan is not None and plan.choice == "auto" and self.tool_parser is not None:
            if not self.tool_parser.skip_special_tokens:  # its markers are special tokens
                options["skip_special_tokens"] = False
        messages_plan = None
        if (plan is not None and plan.choice != "none") or self.reasoning_parser is not None:
            messages_plan = MessagePlan(plan, self.tool_parser, self.reasoning_parser, opened)
        return Translated(
            True,
            [prompt],
            params,
            n,
            stop,
            bool(req.stream),
            include_usage,
            req.timeout,
            report,
            options,
            req.model,
            lora,
            messages_plan,
            client_of(req),
        )

    # -- checks ---------------------------------------------------------------------------

    async def check_structured(
        self, req: Any, params: SamplingParams, plan: ToolPlan | None = None
    ) -> None:
        """400 naming the field when the call's structured-output spec, or a tool's
        ``parameters``, does not compile (a schema of a wrong type, a regex or grammar
        that does not parse, a schema past the grammar engine's size or nesting limits)."""
        if self.compile_structured is None:
            return
        checks: list[tuple[str, str, SamplingParams]] = []
        if plan is not None:
            for where, spec in parameter_specs(plan):
                checks.append((where, "tools", SamplingParams(structured_output=spec)))
        if params.structured_output is not None:
            asked = structured_spec(req)
            field = asked[0] if asked is not None else "tool_choice"
            checks.append((field, field, params))
        for where, field, checked in checks:
            try:
                await self.off_loop(self.compile_structured, checked)
            except ValueError as exc:
                message = f"{where}: {strip_request_prefix(str(exc))}"
                raise APIError(400, message, param=field) from None

    def chat_constraint(
        self, req: Any, plan: ToolPlan | None, opened: bool
    ) -> StructuredOutput | None:
        """A chat call's grammar: its structured-output field's or its forced tool
        choice's (not both), starting after the reasoning section with a reasoning parser."""
        constraint = structured_output(req).get("structured_output")
        if plan is not None and plan.structured is not None:
            if constraint is not None:
                raise APIError(
                    400,
                    "tool_choice 'required' or a named function cannot be combined with "
                    "another structured-output constraint.",
                    "tool_choice",
                )
            constraint = plan.structured
        if constraint is not None and self.reasoning_parser is not None:
            section = self.reasoning_parser.section(opened)
            constraint = dataclasses.replace(constraint, after_reasoning=section)
        return constraint

    def check_model(self, model: str) -> str | None:
        """The LoRA adapter ``model`` names (None: the base model); 404 for anything else."""
        if model == self.model_name:
            return None
        adapters = self.adapters()
        if model in adapters:
            return model
        served = ", ".join(repr(name) for name in [self.model_name, *sorted(adapters)])
        raise APIError(
            404,
            f"The model {model!r} does not exist; this server serves {served}.",
            param="model",
            code="model_not_found",
        )

    def prompt_logprobs(self, req: Any) -> int | None:
        count = check_count("prompt_logprobs", req.prompt_logprobs)
        if count is not None and req.stream:
            raise APIError(
                400, "prompt_logprobs are not available with stream: true.", "prompt_logprobs"
            )
        return count

    def sampling(
        self,
        req: Any,
        prompt_len: int,
        max_tokens: int | None,
        default_max: int | None,
        report: Report,
        constraint: StructuredOutput | None = None,
    ) -> SamplingParams:
        limit = self.max_model_len
        room = limit - prompt_len
        if room < 1:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but the prompt has "
                f"{prompt_len} tokens (at least one new token must fit).",
                param="messages" if isinstance(req, ChatCompletionRequest) else "prompt",
                code="context_length_exceeded",
            )
        cap = self.max_tokens_limit
        if max_tokens is None:
            max_tokens = room if default_max is None else min(default_max, room)
            if cap is not None:
                max_tokens = min(max_tokens, cap)
        elif max_tokens < 1:
            raise APIError(
                400,
                f"max_tokens must be at least 1 (0 only with echo), got {max_tokens}.",
                "max_tokens",
            )
        elif cap is not None and max_tokens > cap:
            raise APIError(
                400,
                f"max_tokens must be at most {cap} on this server, got {max_tokens}.",
                "max_tokens",
            )
        elif prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens, but "
                f"{prompt_len + max_tokens} were requested ({prompt_len} in the prompt, "
                f"{max_tokens} for the completion). Reduce the prompt or max_tokens.",
                param="max_tokens",
                code="context_length_exceeded",
            )
        temperature = 1.0 if req.temperature is None else req.temperature
        if not 0.0 <= temperature <= 2.0:
            raise APIError(400, f"temperature must be in [0, 2], got {temperature}.", "temperature")
        top_p = 1.0 if req.top_p is None else req.top_p
        if not 0.0 < top_p <= 1.0:
            raise APIError(400, f"top_p must be in (0, 1], got {top_p}.", param="top_p")
        top_k = 0 if req.top_k is None or req.top_k == -1 else req.top_k
        if top_k < 0:
            raise APIError(400, f"top_k must be >= 0 (0 or -1 = off), got {top_k}.", "top_k")
        priority = req.priority
        if not -MAX_PRIORITY <= priority <= MAX_PRIORITY:
            raise APIError(
                400,
                f"priority must be within +-2**31 (lower runs first), got {priority}.",
                "priority",
            )
        return SamplingParams(
            max_new_tokens=max_tokens,
            temperature=float(temperature),
            top_p=float(top_p),
            top_k=top_k,
            seed=req.seed,
            ignore_eos=req.ignore_eos,
            priority=priority,
            include_stop_str_in_output=req.include_stop_str_in_output,
            logprobs=report.logprobs,
            prompt_logprobs=report.engine_prompt_logprobs,
            structured_output=constraint,
            **penalties(req),
        )

    def num_choices(self, req: Any, num_prompts: int) -> int:
        n = 1 if req.n is None else req.n
        if n < 1 or n * num_prompts > self.max_choices:
            raise APIError(
                400,
                f"n must be between 1 and {self.max_choices // max(num_prompts, 1)} "
                f"(at most {self.max_choices} choices per call), got {n}.",
                param="n",
            )
        return n

    def stops(self, req: Any) -> list[str] | None:
        stop = req.stop
        if stop is None:
            return None
        stops = [stop] if isinstance(stop, str) else list(stop)
        if len(stops) > MAX_STOP_STRINGS or any(not s for s in stops):
            raise APIError(
                400,
                f"stop takes up to {MAX_STOP_STRINGS} non-empty strings.",
                param="stop",
            )
        return stops or None

    def include_usage(self, req: Any) -> bool:
        if req.stream_options is None:
            return False
        if not req.stream:
            raise APIError(
                400, "stream_options is only allowed with stream: true.", "stream_options"
            )
        return req.stream_options.include_usage

    def check_length(self, chars: int, param: str) -> None:
        """A cheap 400 for text that cannot fit, before anything is tokenized."""
        if chars > self.max_prompt_chars:
            raise APIError(
                400,
                f"The prompt has {chars} characters: more than this model's context of "
                f"{self.max_model_len} tokens can hold.",
                param=param,
                code="context_length_exceeded",
            )

    def num_prompts(self, prompt: Any) -> int:
        """Check the prompts' count and lengths before tokenizing; return the count."""
        prompts = prompt_list(prompt)
        if not prompts:
            raise APIError(400, "prompt is empty.", param="prompt")
        if len(prompts) > self.max_choices:
            raise APIError(
                400, f"At most {self.max_choices} prompts per call, got {len(prompts)}.", "prompt"
            )
        self.check_length(sum(len(p) for p in prompts if isinstance(p, str)), "prompt")
        return len(prompts)

    # -- tokenizing (on the tokenizer pool) ------------------------------------------------

    async def off_loop(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run tokenizer work on the tokenizer pool, never on the event loop."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self.tokenize_pool, fn, *args)

    def completion_prompts(self, prompt: Any) -> list[list[int]]:
        """Token ids of every prompt (runs on the tokenizer pool)."""
        out = []
        for p in prompt_list(prompt):
            if isinstance(p, str):
                try:
                    ids = self.tokenizer(p)["input_ids"]
                except (UnicodeError, ValueError, TypeError) as exc:  # e.g. a lone surrogate
                    raise APIError(
                        400, f"The prompt could not be tokenized: {exc}", param="prompt"
                    ) from None
            else:
                ids = list(p)
            if not ids:
                raise APIError(400, "prompt is empty (it encodes to no tokens).", param="prompt")
            out.append(ids)
        return out

    def echo_texts(self, prompt: Any, prompts: list[list[int]], skip_special: bool) -> list[str]:
        """What ``echo`` puts before each completion: a text prompt as given, token ids
        decoded (runs on the tokenizer pool)."""
        return [
            p
            if isinstance(p, str)
            else self.tokenizer.decode(ids, skip_special_tokens=skip_special)
            for p, ids in zip(prompt_list(prompt), prompts, strict=True)
        ]


def client_of(req: Any) -> str | None:
    """The call's ``user`` (OpenAI's end-user id), the client of the per-client share."""
    user = (req.model_extra or {}).get("user")
    return f"user:{user}" if isinstance(user, str) and user else None


def text_options(req: Any) -> dict[str, bool]:
    """vLLM's special-token fields as ``Engine.add_request`` keywords."""
    return {
        "skip_special_tokens": req.skip_special_tokens,
        "spaces_between_special_tokens": req.spaces_between_special_tokens,
    }


def prompt_list(prompt: Any) -> list[Any]:
    """The prompts of a ``prompt`` field: a text, token ids, or a list of either."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)

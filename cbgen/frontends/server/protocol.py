"""The OpenAI request shapes the server accepts, and the checks that give clean 400s.

Requests are parsed with pydantic (``extra="allow"``): fields cbgen implements are
typed here (OpenAI's, and vLLM's extensions with vLLM's meaning); any other field is
looked up in ``_NEUTRAL`` (OpenAI parameters that are accepted at their default, "off"
value, or ignored because they change nothing here) and rejected otherwise, so
``functions`` or ``suffix="x"`` get a 400 that names them rather than being silently dropped.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError


class APIError(Exception):
    """An error answered in OpenAI's shape: ``{"error": {message, type, param, code}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        *,
        type: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(
    message: str, type: str = "invalid_request_error", param: str | None = None, code: Any = None
) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class _Common(BaseModel):
    """Fields shared by both endpoints: OpenAI's sampling fields, then vLLM's extensions
    (``top_k`` .. ``guided_grammar``, with vLLM's meaning), then cbgen's own."""

    model_config = ConfigDict(extra="allow")

    model: str
    temperature: float | None = None
    top_p: float | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    # vLLM's extensions
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: StrictInt = 0
    stop_token_ids: list[StrictInt] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: StrictInt | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    # cbgen's own
    priority: int = 0  # lower runs first; may preempt running requests of higher
    timeout: float | None = Field(default=None, gt=0)  # seconds for the request


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = None
    logprobs: StrictInt | None = None  # top-N per token (0: the sampled token's only)
    echo: bool = False  # the prompt before the completion (and its logprobs)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None  # an assistant's calls (checked by ``template_tool_calls``)
    tool_call_id: str | None = None  # the call a tool message answers
    reasoning_content: str | None = None  # an assistant's reasoning (templates may read it)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: StrictInt | None = None
    tools: list[Any] | None = None  # checked by ``tools.plan_tools``
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM's extension: keywords for the chat template (e.g. Qwen3's enable_thinking)
    chat_template_kwargs: dict[str, Any] | None = None


def _off(*values: Any) -> Callable[[Any], bool]:
    return lambda v: v is None or any(v == x and type(v) is type(x) for x in values)


def _empty(v: Any) -> bool:
    return v is None or v == {} or v == []


def _anything(v: Any) -> bool:
    return True


# OpenAI parameters accepted only where they change nothing (their neutral value).
_COMMON_NEUTRAL: dict[str, Callable[[Any], bool]] = {
    "user": _anything,  # an end-user id for abuse tracking: nothing to track here
}
COMPLETION_NEUTRAL = {
    **_COMMON_NEUTRAL,
    "suffix": _off(""),
    "best_of": _off(1),  # best_of == n is also accepted (checked where n is known)
}
CHAT_NEUTRAL = {
    **_COMMON_NEUTRAL,
    "functions": _empty,  # the deprecated form of tools: send tools
    "function_call": _off("none"),
    "modalities": lambda v: v is None or v == ["text"],
    "audio": _off(),
    "prediction": _off(),
    "web_search_options": _off(),
    "reasoning_effort": _off(),
    "verbosity": _off(),
    "store": _off(False),
    "metadata": _anything,
    "service_tier": _off("auto", "default"),
    "safety_identifier": _anything,
    "prompt_cache_key": _anything,
}


def parse(model_cls: type[BaseModel], data: Any) -> Any:
    """Validate a JSON body; a bad field becomes a 400 naming it."""
    try:
        return model_cls.model_validate(data)
    except ValidationError as exc:
        problems = []
        first_param = None
        for err in exc.errors()[:5]:
            loc = ".".join(str(p) for p in err["loc"])
            first_param = first_param or (str(err["loc"][0]) if err["loc"] else None)
            problems.append(f"{loc}: {err['msg']}" if loc else err["msg"])
        raise APIError(400, "; ".join(problems), param=first_param) from None


def check_unsupported(
    request: BaseModel, neutral: dict[str, Callable[[Any], bool]], best_of_ok: int | None = None
) -> None:
    """400 naming every extra field that is unknown or set to a value cbgen cannot honour."""
    bad = []
    for name, value in (request.model_extra or {}).items():
        if name == "best_of" and best_of_ok is not None and value == best_of_ok:
            continue
        accepts = neutral.get(name)
        if accepts is None or not accepts(value):
            bad.append(name)
    if bad:
        names = ", ".join(sorted(bad))
        raise APIError(
            400,
            f"unsupported parameter{'s' if len(bad) > 1 else ''}: {names} (see the README's "
            "server fields: OpenAI's sampling, logprobs and response_format fields and "
            "vLLM's extensions are served)",
            param=sorted(bad)[0],
            code="unsupported_parameter",
        )


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages for the tokenizer's chat template: text content, an assistant's tool
    calls (arguments as objects) and tool results (``role: "tool"``)."""
    out = []
    for i, message in enumerate(messages):
        role = message.role
        if role == "developer":
            role = "system"
        if role not in ("system", "user", "assistant", "tool"):
            raise APIError(
                400,
                f"messages[{i}].role {message.role!r} is not supported "
                "(system, developer, user, assistant, tool)",
                param=f"messages.{i}.role",
            )
        extra = sorted(k for k, v in (message.model_extra or {}).items() if not _empty(v))
        if message.tool_calls and role != "assistant":
            extra.append("tool_calls")
        if message.tool_call_id is not None and role != "tool":
            extra.append("tool_call_id")
        if extra:
            raise APIError(
                400,
                f"messages[{i}] ({role}): unsupported field{'s' if len(extra) > 1 else ''}: "
                + ", ".join(extra),
                param=f"messages.{i}.{extra[0]}",
                code="unsupported_parameter",
            )
        content = message.content
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400,
                        f"messages[{i}].content[{j}]: only text parts are supported "
                        f"(got type {part.get('type')!r})",
                        param=f"messages.{i}.content",
                    )
                texts.append(part["text"])
            content = "".join(texts)
        entry: dict[str, Any] = {"role": role, "content": content or ""}
        if message.tool_calls:
            entry["tool_calls"] = template_tool_calls(i, message.tool_calls)
        if role == "tool":
            if message.tool_call_id is not None:
                entry["tool_call_id"] = message.tool_call_id
            if message.name is not None:
                entry["name"] = message.name
        if message.reasoning_content and role == "assistant":
            entry["reasoning_content"] = message.reasoning_content
        out.append(entry)
    return out


def template_tool_calls(i: int, calls: Any) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` for the chat template: OpenAI's shape, with
    each call's ``arguments`` decoded into an object (templates write them with
    ``tojson``, as vLLM passes them)."""
    if not isinstance(calls, list):
        raise APIError(400, f"messages[{i}].tool_calls must be a list.", f"messages.{i}.tool_calls")
    out = []
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        arguments = function.get("arguments", "{}") if isinstance(function, dict) else None
        if not isinstance(name, str) or not isinstance(arguments, str | dict):
            raise APIError(
                400,
                f"messages[{i}].tool_calls[{j}] must be {{'id', 'type': 'function', "
                "'function': {'name', 'arguments'}}.",
                f"messages.{i}.tool_calls",
            )
        if isinstance(arguments, str):
            try:
                decoded = json.loads(arguments)
            except (ValueError, RecursionError):
                decoded = arguments
            arguments = decoded if isinstance(decoded, dict) else arguments
        entry = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        out.append(entry)
    return out


_FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "context_limit": "length",
    "timeout": "length",  # cut short by the call's own ``timeout``: see finish_detail
}


def finish_reason_name(reason: Any) -> str:
    """cbgen's ``FinishReason`` as OpenAI's ``finish_reason`` (``"abort"`` when cancelled).

    Only OpenAI's values reach a client that finished normally: strict clients reject
    others. A call cut short by its ``timeout`` is ``"length"`` (it ran out of its
    budget, in time rather than tokens), and ``finish_detail`` says which."""
    return _FINISH.get(str(reason), "abort")


def finish_detail(reason: Any) -> dict[str, str]:
    """cbgen's extension field on a choice whose ``finish_reason`` hides the cause:
    ``{"finish_detail": "timeout"}`` when the call's ``timeout`` passed, else nothing."""
    return {"finish_detail": "timeout"} if str(reason) == "timeout" else {}

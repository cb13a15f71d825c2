"""A chat call's prompt: the conversation (and its tools) through the chat template.

The template is rendered to text, then tokenized as ``apply_chat_template`` would
(no special tokens added), because the text answers two questions the ids cannot: does
the template show the tools to the model at all (``tool_choice: "auto"`` is refused
when it does not: the model could never choose a tool), and does the prompt leave a
reasoning section open (a template that starts the answer with ``<think>``)?
"""

from __future__ import annotations

from typing import Any

from .protocol import APIError
from .reasoning import ReasoningParser
from .tools import ToolPlan

__all__ = ["RESERVED_TEMPLATE_KWARGS", "chat_prompt", "check_template_kwargs"]

RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation", "messages", "tools", "documents", "chat_template",
        "add_generation_prompt", "continue_final_message", "tokenize", "padding",
        "truncation", "max_length", "return_tensors", "return_dict",
        "return_assistant_tokens_mask", "tokenizer_kwargs",
    }
)  # fmt: skip
"""``apply_chat_template``'s own arguments, which ``chat_template_kwargs`` may not set."""


def check_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """vLLM's ``chat_template_kwargs``: extra variables for the chat template (Qwen3's
    ``enable_thinking``, say); 400 for one that is ``apply_chat_template``'s own."""
    kwargs = dict(kwargs or {})
    reserved = sorted(set(kwargs) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise APIError(
            400, f"chat_template_kwargs cannot set {', '.join(reserved)}.", "chat_template_kwargs"
        )
    return kwargs


def chat_prompt(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    plan: ToolPlan | None,
    kwargs: dict[str, Any],
    reasoning: type[ReasoningParser] | None,
) -> tuple[list[int], bool]:
    """The conversation's prompt ids, and whether it leaves a reasoning section open
    (``reasoning``: the server's parser). Runs on the tokenizer pool."""
    if getattr(tokenizer, "chat_template", None) is None:
        raise APIError(400, "This model has no chat template; use /v1/completions.")
    tools = None if plan is None else plan.tools
    text = render(tokenizer, messages, tools, kwargs)
    if plan is not None and plan.choice == "auto":
        if text == render(tokenizer, messages, None, kwargs):
            raise APIError(
                400,
                "This model's chat template does not show tools to the model, so it cannot "
                "choose to call one: serve it with a --chat-template that renders tools, or "
                "force a call with tool_choice 'required' or a named function.",
                param="tools",
            )
    try:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    except (UnicodeError, ValueError, TypeError) as exc:
        raise APIError(400, f"The messages could not be tokenized: {exc}", "messages") from None
    opened = reasoning is not None and reasoning.opened_by(text[-256:])
    return list(ids), opened


def render(
    tokenizer: Any, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any]
) -> str:
    """The chat template's text for ``messages``."""
    try:
        text = tokenizer.apply_chat_template(
            messages, tools=tools, add_generation_prompt=True, tokenize=False, **kwargs
        )
    except Exception as exc:  # the template rejected the conversation (e.g. role order)
        raise APIError(400, f"The chat template failed: {exc}", param="messages") from None
    return str(text)

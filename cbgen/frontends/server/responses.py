"""OpenAI's response shapes, written once for completions and chat: the plain response,
the server-sent event chunks, and the streaming response that gives up on a client that
stopped reading."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi.responses import StreamingResponse

from .choices import ChoiceWriter
from .messages import ChoiceMessage, MessagePlan
from .protocol import finish_detail, finish_reason_name


def sse(payload: dict[str, Any]) -> str:
    """One server-sent event."""
    return f"data: {json.dumps(payload, ensure_ascii=False, separators=(',', ':'))}\n\n"


class ResponseShape:
    """The fields that differ between a completion and a chat completion, in one place."""

    def __init__(
        self,
        chat: bool,
        call_id: str,
        created: int,
        model: str,
        choices: ChoiceWriter | None = None,
        messages: MessagePlan | None = None,
    ) -> None:
        self.chat = chat
        self.call_id = call_id
        self.created = created
        self.model = model
        self.choices = choices  # echo and logprobs, when the call asks for them
        self.messages = messages  # a chat answer's reasoning and tool calls
        self.choice_messages: dict[int, ChoiceMessage] = {}

    @classmethod
    def new(
        cls,
        chat: bool,
        model: str,
        choices: ChoiceWriter | None = None,
        messages: MessagePlan | None = None,
    ) -> ResponseShape:
        """The shape of a new call: a fresh id (``chatcmpl-...`` or ``cmpl-...``), made now."""
        prefix = "chatcmpl" if chat else "cmpl"
        call_id = f"{prefix}-{uuid.uuid4().hex}"
        return cls(chat, call_id, int(time.time()), model, choices, messages)

    def choice_message(self, index: int) -> ChoiceMessage | None:
        """Choice ``index``'s message builder (``None``: its text is the content)."""
        if self.messages is None:
            return None
        message = self.choice_messages.get(index)
        if message is None:
            message = self.choice_messages[index] = self.messages.choice()
        return message

    def chunk_head(self) -> dict[str, Any]:
        head: dict[str, Any] = {
            "id": self.call_id,
            "object": "chat.completion.chunk" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
        }
        if self.chat:
            head["system_fingerprint"] = None
        return head

    def chunk_choice(
        self, index: int, text: str, reason: str | None, logprobs: Any = None
    ) -> dict[str, Any] | None:
        """A streamed choice: what ``text`` adds (and its tokens' ``logprobs``), and the
        finish reason on the last one; ``None`` when it has nothing to show yet (a tool
        call or a reasoning marker still being read)."""
        if not self.chat:
            return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        message = self.choice_message(index)
        if message is None:
            delta = {"content": text} if text else {}
        else:
            delta = message.feed(text)
            if reason is not None:
                for key, value in message.finish().items():
                    delta[key] = delta.get(key, type(value)()) + value
                reason = message.finish_reason(reason)
        if not delta and reason is None and logprobs is None:
            return None
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}

    def role_choice(self, index: int) -> dict[str, Any]:
        """The first chunk of every chat choice, which names the role."""
        return {
            "index": index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }

    def opening_choices(self, n: int) -> list[dict[str, Any]]:
        """What a stream of ``n`` choices sends before any text: one role chunk per chat
        choice; nothing for a completion."""
        return [self.role_choice(index) for index in range(n)] if self.chat else []

    def response(self, finals: list[Any], usage: dict[str, int]) -> dict[str, Any]:
        """The whole answer of a call that was not streamed."""
        choices = []
        prompt_logprobs = None
        for index, final in enumerate(finals):
            reason = finish_reason_name(final.finish_reason)
            extras: dict[str, Any] = {"text": final.text or "", "logprobs": None}
            if self.choices is not None:
                extras = self.choices.whole(index, final)
                if self.choices.report.drop_generated:
                    reason = "length"  # max_tokens: 0
            text = extras.pop("text")
            if self.chat:
                message = {"role": "assistant", "content": text}
                builder = self.choice_message(index)
                if builder is not None:
                    message = builder.whole(text)
                    reason = builder.finish_reason(reason)
                choice = {"index": index, "message": message}
                if "prompt_logprobs" in extras:  # vLLM: on the response, not the choice
                    prompt_logprobs = extras.pop("prompt_logprobs")
            else:
                choice = {"index": index, "text": text}
            detail = finish_detail(final.finish_reason)
            choices.append({**choice, **extras, "finish_reason": reason, **detail})
        body = {
            "id": self.call_id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": choices,
            "usage": usage,
        }
        if prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs
        return body


class TimedStreamingResponse(StreamingResponse):
    """A streaming response whose every write must go through within ``send_timeout``
    seconds: a client that stops reading fills its socket buffers, the write then
    waits, and past the timeout the stream is closed (its requests cancelled, counted
    as a disconnect) instead of holding the connection and its requests forever."""

    def __init__(self, *args: Any, send_timeout: float | None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.send_timeout = send_timeout

    async def stream_response(self, send: Any) -> None:
        if self.send_timeout is None:
            await super().stream_response(send)
            return
        timeout = self.send_timeout

        async def timed_send(message: Any) -> None:
            await asyncio.wait_for(send(message), timeout)

        try:
            await super().stream_response(timed_send)
        except asyncio.TimeoutError:  # the body's GeneratorExit counts the disconnect
            body = self.body_iterator
            if hasattr(body, "aclose"):
                await body.aclose()

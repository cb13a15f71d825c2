"""The request fields past the basics, as ``SamplingParams`` keywords: penalties and
biases (OpenAI's ``presence_penalty``, ``frequency_penalty``, ``logit_bias``; vLLM's
``repetition_penalty``, ``min_p``, ``min_tokens``, ``stop_token_ids``), logprob counts
(bounded by ``MAX_LOGPROBS``, vLLM's default ``max_logprobs``) and structured output
(OpenAI's ``response_format``, vLLM's ``structured_outputs`` and ``guided_*``).

Range checks that OpenAI or vLLM make at the API are made here, so they fail as 400s
naming the field; the rest (token ids inside the vocabulary, ``min_tokens`` within
``max_tokens``) is the engine's ``SamplingParams`` validation, also answered with 400.
"""

from __future__ import annotations

import math
from typing import Any

from ...sampling.structured import StructuredOutput
from .protocol import APIError

MAX_LOGPROBS = 20
"""The most alternatives per token a call may ask for (``logprobs``, ``top_logprobs``,
``prompt_logprobs``): vLLM's default ``max_logprobs``. OpenAI allows 5 on completions
and 20 on chat; lm-eval asks for 1."""

LOGIT_BIAS_LIMIT = 100.0
"""OpenAI clamps ``logit_bias`` values to [-100, 100]."""

_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "grammar": "grammar"}


def check_count(name: str, value: int | None) -> int | None:
    """A logprob count: ``None`` (off) or 0 ..``MAX_LOGPROBS``."""
    if value is not None and not 0 <= value <= MAX_LOGPROBS:
        raise APIError(400, f"{name} must be between 0 and {MAX_LOGPROBS}, got {value}.", name)
    return value


def penalties(req: Any) -> dict[str, Any]:
    """``SamplingParams`` keywords of the penalty, bias and stop-id fields."""
    out: dict[str, Any] = {}
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(req, name)
        if value is None:
            continue
        if not -2.0 <= value <= 2.0:
            raise APIError(400, f"{name} must be in [-2, 2], got {value}.", name)
        out[name] = float(value)
    if req.repetition_penalty is not None:
        if not (math.isfinite(req.repetition_penalty) and req.repetition_penalty > 0):
            raise APIError(
                400,
                f"repetition_penalty must be a positive number, got {req.repetition_penalty}.",
                "repetition_penalty",
            )
        out["repetition_penalty"] = float(req.repetition_penalty)
    if req.min_p is not None:
        if not 0.0 <= req.min_p <= 1.0:
            raise APIError(400, f"min_p must be in [0, 1], got {req.min_p}.", "min_p")
        out["min_p"] = float(req.min_p)
    if req.min_tokens < 0:
        raise APIError(400, f"min_tokens must be >= 0, got {req.min_tokens}.", "min_tokens")
    out["min_tokens"] = req.min_tokens
    if req.stop_token_ids:
        out["stop_token_ids"] = tuple(req.stop_token_ids)
    if req.logit_bias:
        out["logit_bias"] = logit_bias(req.logit_bias)
    return out


def logit_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as strings) with its values clamped to
    [-100, 100]; ids outside the vocabulary are the engine's check."""
    out = {}
    for key, value in bias.items():
        digits = key.strip()
        if not (digits.isascii() and digits.isdigit()):
            raise APIError(
                400, f"logit_bias keys must be token ids, got {key!r}.", param="logit_bias"
            )
        token = int(digits)
        if math.isnan(value):
            raise APIError(400, "logit_bias values must be numbers.", param="logit_bias")
        out[token] = max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, float(value)))
    return out


def structured_spec(req: Any) -> tuple[str, dict[str, Any]] | None:
    """The structured-output constraint a call asks for: the field that asked, and
    ``cbgen.StructuredOutput`` keywords (``None``: no constraint); 400 for a malformed
    or doubled one."""
    asked: list[tuple[str, dict[str, Any]]] = []
    fmt = req.response_format
    if fmt is not None:
        kind = fmt.get("type")
        if kind == "json_object":
            asked.append(("response_format", {"json_object": True}))
        elif kind == "json_schema":
            spec = fmt.get("json_schema")
            schema = spec.get("schema") if isinstance(spec, dict) else None
            if schema is None:
                raise APIError(
                    400,
                    "response_format json_schema needs json_schema.schema.",
                    "response_format",
                )
            asked.append(("response_format", {"json_schema": schema}))
        elif kind != "text":
            raise APIError(
                400,
                f"response_format.type must be text, json_object or json_schema, got {kind!r}.",
                "response_format",
            )
    outputs = req.structured_outputs
    if outputs:
        unknown = sorted(k for k, v in outputs.items() if v is not None and v is not False)
        unknown = [k for k in unknown if k not in _STRUCTURED_KEYS and k != "json_object"]
        if unknown:
            raise APIError(
                400,
                f"structured_outputs: unsupported key{'s' if len(unknown) > 1 else ''}: "
                + ", ".join(unknown)
                + " (json, regex, grammar, json_object are served).",
                "structured_outputs",
                code="unsupported_parameter",
            )
        spec = {_STRUCTURED_KEYS[k]: v for k, v in outputs.items() if k in _STRUCTURED_KEYS}
        spec = {k: v for k, v in spec.items() if v is not None}
        if outputs.get("json_object") is True:
            spec["json_object"] = True
        if spec:
            asked.append(("structured_outputs", spec))
    for name, key in (("guided_json", "json_schema"), ("guided_regex", "regex")):
        value = getattr(req, name)
        if value is not None:
            asked.append((name, {key: value}))
    if req.guided_grammar is not None:
        asked.append(("guided_grammar", {"grammar": req.guided_grammar}))
    if not asked:
        return None
    if len(asked) > 1:
        names = ", ".join(sorted({name for name, _ in asked}))
        raise APIError(400, f"only one structured-output constraint per call, got {names}.")
    return asked[0]


def structured_output(req: Any) -> dict[str, Any]:
    """The ``SamplingParams(structured_output=...)`` keyword of a call (empty without
    one); 400 naming the field when the constraint is invalid."""
    asked = structured_spec(req)
    if asked is None:
        return {}
    name, spec = asked
    constraint = StructuredOutput(**spec)
    try:
        constraint.validate()
    except ValueError as exc:
        raise APIError(400, f"{name}: {exc}", param=name) from None
    return {"structured_output": constraint}

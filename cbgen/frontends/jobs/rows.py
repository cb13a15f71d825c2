"""One input row of a batch job as an engine request, and its result as output fields.

A row is a mapping read from JSONL or Parquet, or a row of a Ray Data batch: ``prompt``
(raw text, tokenized as is) or ``messages`` (chat turns, through the tokenizer's chat
template), and optionally sampling fields named as in ``SamplingParams`` and an output
constraint named as in ``StructuredOutput`` (``json_schema``, ``regex``...). Columnar
sources blur types (a pandas integer column with a missing value turns float, a list
arrives as a NumPy array), so values are brought back to plain Python first; a field
that is missing, ``None`` or NaN takes the job's default.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from ...requests.request import RequestOutput
from ...sampling.params import SamplingParams
from ...sampling.structured import StructuredOutput

INT_FIELDS = ("max_new_tokens", "top_k", "seed", "min_tokens")
FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
)
BOOL_FIELDS = ("ignore_eos", "include_stop_str_in_output")
LIST_FIELDS = ("stop", "stop_token_ids")
SAMPLING_FIELDS = INT_FIELDS + FLOAT_FIELDS + BOOL_FIELDS + LIST_FIELDS
"""The ``SamplingParams`` fields a row (or the job's defaults) may set."""

STRUCTURED_FIELDS = ("json_schema", "regex", "grammar", "json_object")
"""A row's output constraint (``StructuredOutput``'s fields); one replaces the default's."""

OUTPUT_FIELDS = ("text", "token_ids", "finish_reason", "error")
"""What a batch job adds to every row."""


@dataclasses.dataclass(frozen=True)
class RowRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    lora: str | None = None  # the LoRA adapter (one of the job's ``--lora-modules``)


def plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays as Python values and NaN as ``None``."""
    if isinstance(value, float) and math.isnan(value):
        return None
    tolist = getattr(value, "tolist", None)  # NumPy arrays and scalars
    if tolist is not None and not isinstance(value, (str, bytes)):
        return plain(tolist())
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    return value


def sampling_defaults(fields: Mapping[str, Any]) -> SamplingParams:
    """The job's default ``SamplingParams``; a bad default fails the job, not a row."""
    unknown = sorted(set(fields) - set(SAMPLING_FIELDS))
    if unknown:
        raise ValueError(
            f"unknown sampling fields {unknown}; batch jobs take {', '.join(SAMPLING_FIELDS)}"
        )
    params = SamplingParams(**_sampling_values(fields))
    params.validate()
    return params


def row_request(row: Mapping[str, Any], defaults: SamplingParams, tokenizer: Any) -> RowRequest:
    """The request ``row`` asks for; ``ValueError`` naming the field when it cannot run."""
    prompt = plain(row.get("prompt"))
    messages = plain(row.get("messages"))
    if prompt is not None and messages is not None:
        raise ValueError("a row gives either `prompt` or `messages`, not both")
    if prompt is None and messages is None:
        raise ValueError("a row needs `prompt` (raw text) or `messages` (chat turns)")
    n = plain(row.get("n"))
    if n not in (None, 1):
        raise ValueError(f"n={n!r}: a batch job runs one sample per row; repeat the row instead")
    fields = {name: plain(row[name]) for name in SAMPLING_FIELDS if name in row}
    params = dataclasses.replace(
        defaults, **_sampling_values({k: v for k, v in fields.items() if v is not None})
    )
    constraint = {name: plain(row.get(name)) for name in STRUCTURED_FIELDS}
    constraint = {k: v for k, v in constraint.items() if v is not None and v is not False}
    if constraint:
        params = dataclasses.replace(params, structured_output=StructuredOutput(**constraint))
    lora = plain(row.get("lora"))
    if lora is not None and (not isinstance(lora, str) or not lora):
        raise ValueError(f"`lora` must name an adapter of the job (--lora-modules), got {lora!r}")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise ValueError(f"`prompt` must be text, got {type(prompt).__name__}")
        return RowRequest(list(tokenizer(prompt)["input_ids"]), params, lora)
    return RowRequest(_chat_token_ids(tokenizer, messages), params, lora)


def output_fields(output: RequestOutput) -> dict[str, Any]:
    """The fields a finished request adds to its row."""
    reason = output.finish_reason
    return {
        "text": output.text,
        "token_ids": list(output.token_ids),
        "finish_reason": None if reason is None else str(reason),
        "error": output.error,
    }


def error_fields(message: str) -> dict[str, Any]:
    """The fields of a row that could not run: no output, and why."""
    return {"text": None, "token_ids": [], "finish_reason": "error", "error": message}


def _sampling_values(fields: Mapping[str, Any]) -> dict[str, Any]:
    values = dict(fields)
    for name in INT_FIELDS:  # 3.0 from a pandas column with gaps is 3
        value = values.get(name)
        if isinstance(value, float) and value.is_integer():
            values[name] = int(value)
    for name in LIST_FIELDS:
        value = values.get(name)
        if isinstance(value, str) and name == "stop":
            values[name] = [value]
        elif value is not None and not isinstance(value, list):
            raise ValueError(f"{name} must be a list, got {value!r}")
    return values


def _chat_token_ids(tokenizer: Any, messages: Any) -> list[int]:
    if not isinstance(messages, list) or not messages:
        raise ValueError("`messages` must be a non-empty list of {role, content} turns")
    for turn in messages:
        if not (
            isinstance(turn, Mapping)
            and isinstance(turn.get("role"), str)
            and isinstance(turn.get("content"), str)
        ):
            raise ValueError(
                f"every turn of `messages` needs a text role and content, got {turn!r}"
            )
    if getattr(tokenizer, "chat_template", None) is None:
        raise ValueError("the model's tokenizer has no chat template; give `prompt` instead")
    turns = [{"role": t["role"], "content": t["content"]} for t in messages]
    encoded = tokenizer.apply_chat_template(
        turns, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    return list(encoded["input_ids"])

"""What a request's output must match (``SamplingParams.structured_output``): a JSON
schema, a regex, a grammar or any JSON object. The spec is a plain value, validated at
the request's door; ``cbgen.sampling.grammar`` compiles it and masks the logits."""

from __future__ import annotations

import json
from dataclasses import dataclass

__all__ = ["ReasoningSection", "StructuredOutput", "schema_text"]


@dataclass(frozen=True)
class ReasoningSection:
    """A reasoning section before the answer that the grammar does not govern.

    Reasoning models think first (``<think> ... </think>``) and answer after; a grammar
    on the whole output would forbid the thinking. With this on a ``StructuredOutput``,
    the grammar starts right after the tokens of ``end``: until then every token is
    allowed. ``start`` ``None``: the output begins inside the section (the prompt
    opened it, or the model always thinks). Otherwise the output begins inside it only
    if it starts with ``start``: the first token may be that marker's first token or
    one the grammar allows, and once the marker's first token is chosen its other
    tokens follow. Markers match on their tokens as the tokenizer encodes them alone
    (one special token each in Qwen3 and the DeepSeek-R1 distills).
    """

    end: str
    start: str | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` unless the markers are non-empty strings."""
        for name in ("end", "start"):
            value = getattr(self, name)
            if value is None and name == "start":
                continue
            if not isinstance(value, str) or not value:
                raise ValueError(f"ReasoningSection.{name} must be a non-empty str")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: exactly one of these."""

    json_schema: str | dict | None = None  # a JSON schema (dict or JSON text)
    regex: str | None = None
    grammar: str | None = None  # EBNF (GBNF-style) or Lark grammar text
    json_object: bool = False  # any JSON object ("response_format": json_object)
    # The grammar starts after this section (None: at the first token).
    after_reasoning: ReasoningSection | None = None

    def validate(self) -> None:
        """Raise ``ValueError`` unless exactly one constraint of the right type is set.

        Checked at the request's door so a bad spec fails the call, not a step.
        """
        if not isinstance(self.json_object, bool):
            raise ValueError(f"json_object must be a bool, got {type(self.json_object).__name__}")
        chosen = [
            name for name in ("json_schema", "regex", "grammar") if getattr(self, name) is not None
        ]
        if self.json_object:
            chosen.append("json_object")
        if len(chosen) != 1:
            found = ", ".join(chosen) if chosen else "none"
            raise ValueError(
                "StructuredOutput needs exactly one of json_schema, regex, grammar, "
                f"json_object; got {found}"
            )
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a str, got {type(value).__name__}")
        if self.grammar is not None and not self.grammar.strip():
            raise ValueError("grammar is empty")
        if self.json_schema is not None:
            schema_text(self.json_schema)
        if self.after_reasoning is not None:
            if not isinstance(self.after_reasoning, ReasoningSection):
                raise ValueError("after_reasoning must be a ReasoningSection")
            self.after_reasoning.validate()

    @property
    def key(self) -> tuple[str, str]:
        """``(kind, canonical text)``: a schema as a dict or as JSON text shares a cache entry.

        Keys are not sorted: the grammar emits properties in the schema's order, so
        two schemas differing only in key order are different constraints. The
        reasoning section is not part of the key: it changes when the grammar starts,
        not the grammar.
        """
        self.validate()
        if self.json_schema is not None:
            return ("json_schema", schema_text(self.json_schema))
        if self.regex is not None:
            return ("regex", self.regex)
        if self.grammar is not None:
            return ("grammar", self.grammar)
        return ("json_object", "")

    def __hash__(self) -> int:  # a dict schema would make the generated hash raise
        return hash((self.key, self.after_reasoning))


def schema_text(schema: object) -> str:
    """Compact JSON text of a schema given as a dict or as JSON text."""
    try:
        return json.dumps(_schema_dict(schema), separators=(",", ":"), allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None


def _schema_dict(schema: object) -> dict:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object (dict), got {type(schema).__name__}")
    return schema

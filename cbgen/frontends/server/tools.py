"""A chat call's ``tools``, ``tool_choice`` and ``parallel_tool_calls``, checked and planned.

* ``none``: the tools go to the chat template, and the answer is text.
* ``auto`` (the default with tools): the model decides; the server's
  ``--tool-call-parser`` finds its calls in the text (a 400 without one).
* ``required``: one or more calls, enforced by the grammar engine: the answer is a JSON
  list ``[{"name": ..., "arguments": {...}}]`` whose ``name`` is one of the tools and
  whose ``arguments`` follow that tool's ``parameters`` schema (at most one call with
  ``parallel_tool_calls: false``).
* a named function (``{"type": "function", "function": {"name": ...}}``): one call of
  it, the answer being its arguments under its ``parameters`` schema.

Forced calls therefore always parse, with arguments valid for their schema. Each
tool's ``parameters`` is compiled as a JSON schema while the call is checked, so a bad
one is a 400 naming it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from ...sampling.structured import StructuredOutput
from .protocol import APIError

__all__ = ["ToolPlan", "plan_tools", "template_tools"]

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
MAX_TOOLS = 128  # OpenAI's limit
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolPlan:
    """What a call's tools ask of the engine and of the answer's parsing."""

    tools: list[dict[str, Any]]  # as the chat template gets them (OpenAI's shape)
    choice: str  # "none", "auto", "required" or "function"
    function: str | None = None  # the forced function's name
    parallel: bool = True
    structured: StructuredOutput | None = None  # the grammar a forced choice runs under
    schemas: dict[str, dict[str, Any]] = field(default_factory=dict)  # parameters by name


def _fail(message: str, param: str) -> APIError:
    return APIError(400, message, param=param)


def _check_tool(i: int, tool: Any) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """One tool: its name, its parameters schema, and the tool as the template gets it."""
    where = f"tools[{i}]"
    if not isinstance(tool, dict) or tool.get("type") != "function":
        raise _fail(f"{where} must be {{'type': 'function', 'function': {{...}}}}.", "tools")
    function = tool.get("function")
    if not isinstance(function, dict):
        raise _fail(f"{where}.function must be an object.", "tools")
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise _fail(
            f"{where}.function.name must be 1-64 letters, digits, '_' or '-', got {name!r}.",
            "tools",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _fail(f"{where}.function.description must be a string.", "tools")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = EMPTY_PARAMETERS
    if not isinstance(parameters, dict):
        raise _fail(f"{where}.function.parameters must be a JSON schema object.", "tools")
    unknown = sorted(set(function) - {"name", "description", "parameters", "strict"})
    if unknown:
        raise _fail(f"{where}.function: unsupported fields: {', '.join(unknown)}.", "tools")
    shown = {"name": name, "parameters": parameters}
    if description is not None:
        shown = {"name": name, "description": description, "parameters": parameters}
    return name, parameters, {"type": "function", "function": shown}


def plan_tools(
    tools: list[Any] | None,
    tool_choice: Any,
    parallel_tool_calls: bool | None,
    parser: str | None,
) -> ToolPlan | None:
    """The plan of a call's tool fields (``None``: no tools); 400 naming a bad field.
    ``parser`` is the server's ``--tool-call-parser`` (``None``: not set)."""
    if not tools:
        if tool_choice not in (None, "none"):
            raise _fail("tool_choice needs tools.", "tool_choice")
        return None
    if len(tools) > MAX_TOOLS:
        raise _fail(f"At most {MAX_TOOLS} tools per call, got {len(tools)}.", "tools")
    schemas: dict[str, dict[str, Any]] = {}
    shown = []
    for i, tool in enumerate(tools):
        name, parameters, template_tool = _check_tool(i, tool)
        if name in schemas:
            raise _fail(f"tools: the function name {name!r} is given twice.", "tools")
        schemas[name] = parameters
        shown.append(template_tool)
    parallel = True if parallel_tool_calls is None else bool(parallel_tool_calls)
    plan = ToolPlan(shown, "auto", parallel=parallel, schemas=schemas)
    if tool_choice is None or tool_choice == "auto":
        if parser is None:
            raise _fail(
                "tools with tool_choice 'auto' need a server started with --tool-call-parser "
                "(hermes, llama3_json, mistral); tool_choice 'required' or a named function "
                "work without one.",
                "tool_choice",
            )
        return plan
    if tool_choice == "none":
        plan.choice = "none"
        return plan
    if tool_choice == "required":
        plan.choice = "required"
        closed = {name: closed_objects(schema) for name, schema in schemas.items()}
        plan.structured = StructuredOutput(json_schema=required_schema(closed, parallel))
        return plan
    name = _named_choice(tool_choice)
    if name not in schemas:
        raise _fail(f"tool_choice names {name!r}, which is not among the tools.", "tool_choice")
    plan.choice, plan.function = "function", name
    plan.structured = StructuredOutput(json_schema=closed_objects(schemas[name]))
    return plan


_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")


def closed_objects(schema: Any) -> Any:
    """``schema`` with ``additionalProperties: false`` on every object that lists its
    ``properties`` and says nothing of others: what a forced call generates is then
    still valid for the tool's schema, but a model cannot wander into properties the
    tool never named (a small model otherwise fills ``max_tokens`` with them)."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    for key in _SUBSCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed_objects(sub) for name, sub in out[key].items()}
    for key in _SUBSCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed_objects(sub) for sub in out[key]]
    for key in ("items", "additionalProperties", "not", "if", "then", "else"):
        if isinstance(out.get(key), dict):
            out[key] = closed_objects(out[key])
    return out


def _named_choice(tool_choice: Any) -> str:
    name = None
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else None
    if not isinstance(name, str):
        raise _fail(
            "tool_choice must be 'none', 'auto', 'required' or "
            "{'type': 'function', 'function': {'name': ...}}.",
            "tool_choice",
        )
    return name


def required_schema(schemas: dict[str, dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The JSON schema of ``tool_choice: "required"``: a non-empty list of calls, each
    naming one of the tools with arguments under that tool's schema."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": name}, "arguments": parameters},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for name, parameters in schemas.items()
    ]
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
    if not parallel:
        schema["maxItems"] = 1
    return schema


def parameter_specs(plan: ToolPlan) -> list[tuple[str, StructuredOutput]]:
    """Each tool's ``parameters`` as a spec to compile, with the field that gave it."""
    return [
        (f"tools[{i}].function.parameters", StructuredOutput(json_schema=schema))
        for i, schema in enumerate(plan.schemas.values())
    ]


def template_tools(plan: ToolPlan | None) -> list[dict[str, Any]] | None:
    """The ``tools`` argument of ``apply_chat_template``."""
    return None if plan is None else plan.tools

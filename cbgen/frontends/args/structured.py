"""The output-constraint flags of the commands that generate (``generate``, ``batch``)."""

from __future__ import annotations

import argparse

from ...sampling.structured import StructuredOutput


def add_structured_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json-schema", help="a JSON schema file the output must match")
    group.add_argument("--regex", help="a regular expression the output must match")
    group.add_argument("--json-object", action="store_true", help="output any JSON object")


def structured_output(args: argparse.Namespace) -> StructuredOutput | None:
    """The flags' ``StructuredOutput`` (``None`` when none is given)."""
    if args.json_schema:
        with open(args.json_schema, encoding="utf-8") as f:
            return StructuredOutput(json_schema=f.read())
    if args.regex:
        return StructuredOutput(regex=args.regex)
    if args.json_object:
        return StructuredOutput(json_object=True)
    return None

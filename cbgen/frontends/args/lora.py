"""The LoRA flags of the commands that serve adapters (``serve``, ``batch``): vLLM's
``--lora-modules NAME=PATH`` (or its JSON form), ``--max-loras``, ``--max-lora-rank``."""

from __future__ import annotations

import argparse
import json
from typing import Any

from ...core.config import EngineConfig


def add_lora_arguments(parser: argparse.ArgumentParser, runtime_updates: bool = False) -> None:
    group = parser.add_argument_group("LoRA adapters (see docs/lora.md)")
    group.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        type=lora_module,
        metavar="NAME=PATH",
        help='PEFT adapter folders served under NAME (or JSON {"name": ..., "path": ...})',
    )
    group.add_argument(
        "--max-loras",
        type=int,
        default=EngineConfig.max_loras,
        help=f"adapters held at once (default {EngineConfig.max_loras})",
    )
    group.add_argument(
        "--max-lora-rank",
        type=int,
        default=EngineConfig.max_lora_rank,
        help=f"largest adapter rank (default {EngineConfig.max_lora_rank})",
    )
    if runtime_updates:
        group.add_argument(
            "--enable-lora-runtime-updates",
            action="store_true",
            help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (off by default)",
        )


def lora_module(text: str) -> tuple[str, str]:
    """``NAME=PATH`` or ``{"name": NAME, "path": PATH}`` as ``(name, path)``."""
    if text.lstrip().startswith("{"):
        try:
            spec: Any = json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"not JSON: {exc}") from None
        name, path = spec.get("name"), spec.get("path")
    else:
        name, _, path = text.partition("=")
    if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
        raise argparse.ArgumentTypeError(f"expected NAME=PATH, got {text!r}")
    return name, path


def lora_modules(args: argparse.Namespace) -> dict[str, str]:
    """The ``--lora-modules`` as ``{name: path}``; a name given twice is an error."""
    modules: dict[str, str] = {}
    for name, path in args.lora_modules:
        if name in modules:
            raise ValueError(f"--lora-modules names {name!r} twice")
        modules[name] = path
    return modules

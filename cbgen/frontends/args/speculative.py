"""The speculative-decoding flags of the commands that load a model (``generate``,
``serve``), turned into a ``SpeculativeConfig``."""

from __future__ import annotations

import argparse
from typing import Any

from ...executor.cpu.quantization import QUANTIZATION_MODES
from ...spec.speculative import METHODS, SpeculativeConfig


def add_speculative_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculative decoding (see the README)")
    group.add_argument(
        "--speculative",
        choices=METHODS,
        help="guess tokens for the model to verify: ngram (prompt lookup), draft "
        "(--draft-model), layer_skip (the model's first layers); default: off",
    )
    group.add_argument(
        "--num-speculative-tokens", type=int, default=4, help="most guesses per step (default 4)"
    )
    group.add_argument(
        "--speculative-layers", type=int, help="layer_skip: layers of the draft (default: 1/4)"
    )
    group.add_argument(
        "--draft-model", help="draft: bundled name, HF folder or .gguf file (default: --model)"
    )
    group.add_argument(
        "--draft-quantization",
        choices=QUANTIZATION_MODES,
        help="draft: weight-only int8 or 4-bit draft (--draft-model defaulting to the model "
        "itself makes a quantized self-draft)",
    )


def speculative_settings(args: argparse.Namespace) -> dict[str, Any] | None:
    """The flags as JSON-ready settings (None: off), checked: ``build_speculative`` makes
    the ``SpeculativeConfig``, in this process or in a benchmark worker."""
    if args.speculative is None:
        return None
    draft_model = None
    if args.speculative == "draft":
        draft_model = args.draft_model or args.model
        if draft_model == args.model and args.draft_quantization is None:
            raise ValueError(
                "--speculative draft needs --draft-model, or --draft-quantization for a "
                "quantized copy of the model itself"
            )
    settings = {
        "method": args.speculative,
        "num_tokens": args.num_speculative_tokens,
        "num_layers": args.speculative_layers if args.speculative == "layer_skip" else None,
        "draft_model": draft_model,
        "draft_quantization": args.draft_quantization if draft_model else None,
    }
    if draft_model is None:
        build_speculative(settings)  # the config's own checks, now
    return settings


def build_speculative(settings: dict[str, Any] | None) -> SpeculativeConfig | None:
    """The ``SpeculativeConfig`` of ``speculative_settings``; loads the draft model."""
    if settings is None:
        return None
    draft = None
    if settings.get("draft_model"):
        from ...models.loader import load_model

        quantization = settings.get("draft_quantization")
        draft, _ = load_model(settings["draft_model"], quantization=quantization, tokenizer=False)
    return SpeculativeConfig(
        method=settings["method"],
        num_tokens=settings["num_tokens"],
        draft_model=draft,
        num_layers=settings.get("num_layers"),
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The flags' ``SpeculativeConfig`` (None: off); loads the draft model if one is named."""
    return build_speculative(speculative_settings(args))


def describe(settings: dict[str, Any] | None) -> str:
    """One line for a report: the method and its knobs."""
    if settings is None:
        return "off"
    parts = [settings["method"], f"k={settings['num_tokens']}"]
    if settings.get("num_layers"):
        parts.append(f"{settings['num_layers']} layers")
    if settings.get("draft_model"):
        quantization = settings.get("draft_quantization")
        parts.append(
            f"draft {settings['draft_model']}" + (f" {quantization}" if quantization else "")
        )
    return ", ".join(parts)

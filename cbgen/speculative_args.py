"""The speculative-decoding flags of the commands that load a model (``generate``,
``serve``), turned into a ``SpeculativeConfig``."""

from __future__ import annotations

import argparse

from .speculative import METHODS, SpeculativeConfig


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
        choices=["int8", "int4"],
        help="draft: weight-only int8 or 4-bit draft (--draft-model defaulting to the model "
        "itself makes a quantized self-draft)",
    )


def speculative_config(args: argparse.Namespace) -> SpeculativeConfig | None:
    """The flags' ``SpeculativeConfig`` (None: off); loads the draft model if one is named."""
    if args.speculative is None:
        return None
    draft_model = None
    if args.speculative == "draft":
        from .models import load_model

        name = args.draft_model or args.model
        if name == args.model and args.draft_quantization is None:
            raise ValueError(
                "--speculative draft needs --draft-model, or --draft-quantization for a "
                "quantized copy of the model itself"
            )
        draft_model, _ = load_model(name, quantization=args.draft_quantization, tokenizer=False)
    return SpeculativeConfig(
        method=args.speculative,
        num_tokens=args.num_speculative_tokens,
        draft_model=draft_model,
        num_layers=args.speculative_layers if args.speculative == "layer_skip" else None,
    )

"""The precision flags every command that loads a model takes (``generate``, ``serve``)."""

from __future__ import annotations

import argparse
from typing import Any


def add_precision_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        help="weights' dtype (default: float32, bfloat16 with --quantization)",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=["float32", "bfloat16", "float16"],
        help="K/V cache dtype (default: the weights'); bfloat16 halves the cache",
    )
    parser.add_argument(
        "--quantization",
        choices=["int8", "int4"],
        help="weight-only int8 or 4-bit linear maps (see the README for speed and quality)",
    )


def load_model_for(args: argparse.Namespace) -> tuple[Any, Any]:
    """``load_model(args.model, ...)`` with the precision flags."""
    import torch

    from .models import load_model

    return load_model(
        args.model,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        quantization=args.quantization,
    )

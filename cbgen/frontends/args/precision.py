"""The precision flags every command that loads a model takes (``generate``, ``serve``)."""

from __future__ import annotations

import argparse
from typing import Any

from ...executor.cpu.quantization import INT4_GROUP_SIZES, QUANTIZATION_MODES


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
        choices=QUANTIZATION_MODES,
        help="weight-only int8 or 4-bit linear maps, or w4a8: 4-bit weights with int8 "
        "activations on AVX512-VNNI (see the docs for speed and quality)",
    )
    parser.add_argument(
        "--lm-head-quantization",
        choices=QUANTIZATION_MODES,
        help="the LM head's codes under --quantization (default int8; int4 is faster for "
        "a single stream and costs quality: see the README's quality table)",
    )
    parser.add_argument(
        "--quantization-group-size",
        type=int,
        choices=INT4_GROUP_SIZES,
        default=32,
        help="input columns per scale and minimum in the 4-bit modes (default 32; larger "
        "groups read fewer bytes for some quality; w4a8 takes 32 only)",
    )


def load_model_for(args: argparse.Namespace) -> tuple[Any, Any]:
    """``load_model(args.model, ...)`` with the precision flags."""
    return load_worker_model(
        args.model,
        dtype=args.dtype,
        quantization=args.quantization,
        lm_head_quantization=args.lm_head_quantization,
        quantization_group_size=args.quantization_group_size,
    )


def load_worker_model(
    model: str,
    *,
    threads: int | None = None,
    dtype: str | None = None,
    quantization: str | None = None,
    lm_head_quantization: str | None = None,
    quantization_group_size: int = 32,
    device: str = "cpu",
) -> tuple[Any, Any]:
    """``load_model`` for a process that runs one engine (a Ray actor or replica, a job):
    the dtype by name, and ``threads`` (the process's CPUs) set for torch first."""
    import torch

    from ...models.loader import load_model

    if threads is not None:
        if threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        torch.set_num_threads(threads)
    return load_model(
        model,
        dtype=getattr(torch, dtype) if dtype else None,
        quantization=quantization,
        lm_head_quantization=lm_head_quantization,
        quantization_group_size=quantization_group_size,
        device=device,
    )

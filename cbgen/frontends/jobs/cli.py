"""``python -m cbgen batch``: a JSONL or Parquet file of prompts on this machine or on Ray."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ...core.config import EngineConfig
from ..args.lora import add_lora_arguments, lora_modules
from ..args.parallel import add_parallel_arguments, parallel_settings
from ..args.precision import add_precision_arguments
from ..args.structured import add_structured_arguments, structured_output


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="bundled name or HF folder")
    parser.add_argument(
        "--input",
        required=True,
        help="JSONL or Parquet rows with `prompt` (raw text) or `messages` (chat turns), "
        "an optional `id` and optional sampling fields (max_new_tokens, temperature, ...)",
    )
    parser.add_argument(
        "--output",
        required=True,
        help="JSONL or Parquet: each input row plus text, token_ids, finish_reason and error; "
        "rows already there are skipped (resume)",
    )
    parser.add_argument("--max-new-tokens", type=int, default=128, help="default per row")
    parser.add_argument(
        "--temperature", type=float, default=0.0, help="default per row; 0 = greedy"
    )
    add_structured_arguments(parser)  # the default constraint; a row's own replaces it
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        metavar="ADDRESS",
        help="run on Ray: a cluster's address ('auto', 'ray://host:10001'), or none for a "
        "local Ray started for the job",
    )
    parser.add_argument("--actors", type=int, default=1, help="Ray actors, one engine each")
    parser.add_argument(
        "--threads",
        type=int,
        help="torch threads per engine (default: all cores in one process; 1 per Ray actor)",
    )
    parser.add_argument("--gpus-per-actor", type=float, default=0.0, help="GPUs per Ray actor")
    parser.add_argument(
        "--batch-size",
        type=int,
        help="rows an engine takes at a time, Ray's unit of retry (default: --max-num-seqs)",
    )
    add_precision_arguments(parser)
    parser.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    parser.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    add_lora_arguments(parser)
    add_parallel_arguments(parser)


def batch_command(args: argparse.Namespace) -> int:
    from .job import run_batch_job

    if args.ray is None and args.actors != 1:
        print("cbgen batch: --actors needs --ray", file=sys.stderr)
        return 2
    try:
        generator: dict[str, Any] = {
            "model": args.model,
            "max_new_tokens": args.max_new_tokens,
            "temperature": args.temperature,
            "structured_output": structured_output(args),  # reads --json-schema's file
            "threads": args.threads,
            "dtype": args.dtype,
            "quantization": args.quantization,
            "lm_head_quantization": args.lm_head_quantization,
            "quantization_group_size": args.quantization_group_size,
            "config": EngineConfig(
                max_num_seqs=args.max_num_seqs,
                max_batch_tokens=args.max_batch_tokens,
                kv_cache_dtype=args.kv_cache_dtype,
                max_loras=args.max_loras,
                max_lora_rank=args.max_lora_rank,
                **parallel_settings(args),
            ),
            "lora_modules": lora_modules(args),
        }
        report = run_batch_job(
            args.input,
            args.output,
            generator,
            ray=args.ray is not None,
            ray_address=args.ray or None,
            actors=args.actors,
            gpus_per_actor=args.gpus_per_actor,
            batch_size=args.batch_size,
            progress=not args.no_progress,
        )
    except (ValueError, FileNotFoundError, ImportError) as exc:
        print(f"cbgen batch: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(
            f"cbgen batch: interrupted; the rows written are kept in {args.output}, and the "
            "same command resumes with the others",
            file=sys.stderr,
        )
        return 130
    print(report.summary())
    if report.duplicates:
        print(f"cbgen batch: {report.duplicates} repeated results dropped (written once)")
    return 0

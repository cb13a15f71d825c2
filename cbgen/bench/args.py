"""The ``bench`` subcommand's arguments, and the parsers of the values they take."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from ..core.config import EngineConfig
from ..executor.cpu.quantization import INT4_GROUP_SIZES, QUANTIZATION_MODES
from ..frontends.args.parallel import add_parallel_arguments
from ..frontends.args.speculative import add_speculative_arguments
from .peers import PEERS
from .shapes import SHAPES
from .systems import SYSTEMS

DEFAULT_REPEATS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("what to run")
    w.add_argument(
        "--workload",
        action="append",
        dest="workloads",
        metavar="NAME",
        help="a workload of bench/workloads.json (repeatable; default: all)",
    )
    w.add_argument("--list", action="store_true", help="list the workloads and exit")
    w.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, from {','.join(SYSTEMS)} (default: all)",
    )
    w.add_argument(
        "--peers",
        default="",
        help=f"comma-separated, from {','.join(PEERS)}: each needs its venv (bench/peers/)",
    )
    w.add_argument(
        "--model",
        default="smollm2",
        help="bundled name, HF folder, .gguf file, or a random-weight model of a real "
        f"model's shape ({', '.join('shape:' + s for s in SHAPES)}; built once)",
    )
    w.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    w.add_argument(
        "--quantization",
        choices=QUANTIZATION_MODES,
        help="cbgen and transformers run the model with weight-only int8 or 4-bit linear maps "
        "(activations in --dtype) or w4a8 (int8 activations); llama.cpp runs the bundled "
        "Q4_1 file as it is (a shape:NAME model's GGUF quantized to Q4_0)",
    )
    w.add_argument(
        "--lm-head-quantization",
        choices=QUANTIZATION_MODES,
        help="the LM head's codes under --quantization (default int8)",
    )
    w.add_argument(
        "--quantization-group-size",
        type=int,
        choices=INT4_GROUP_SIZES,
        default=32,
        help="input columns per scale and minimum in cbgen's and transformers' 4-bit modes "
        "(default 32)",
    )
    w.add_argument("--quick", action="store_true", help="few prompts, few tokens, 1 repeat")
    w.add_argument("--repeats", type=int, help=f"timed runs per system (default {DEFAULT_REPEATS})")
    w.add_argument("--num-prompts", type=int, help="override every workload's prompt count")
    w.add_argument("--max-new-tokens", type=int, help="override every workload's length")
    w.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")

    m = parser.add_argument_group("machine")
    m.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads per system")
    m.add_argument(
        "--cpus", help="cores to pin every system to, e.g. 0-1 or 2,3 (default: first --threads)"
    )
    m.add_argument(
        "--isolation",
        choices=["workload", "system", "none"],
        default="workload",
        help="a process per workload and system (default), per system, or none (in this "
        "process: no per-system peak RSS)",
    )
    m.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed per process")
    m.add_argument(
        "--peer-timeout",
        type=float,
        help="seconds allowed per peer process (default: --timeout); a peer stopped mid-run "
        "is reported with the bound its progress gives (below N tok/s)",
    )
    m.add_argument(
        "--max-rss-gib",
        type=float,
        help="kill a system whose RSS passes this (default: 90%% of available memory)",
    )

    c = parser.add_argument_group("systems' settings")
    c.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    c.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    c.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    c.add_argument("--num-blocks", type=int, help="cbgen KV cache blocks (default: by memory)")
    c.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another cbgen EngineConfig field, VALUE as JSON (repeatable)",
    )
    c.add_argument("--generate-batch-size", type=int, default=8, help="model.generate batch size")
    c.add_argument(
        "--tuned-page-size", type=int, help="generate_batch_tuned page size (default: --block-size)"
    )
    c.add_argument(
        "--tuned-attn",
        choices=["sdpa", "eager"],
        help="generate_batch_tuned attention: sdpa or eager (paged|eager); default the model's",
    )

    add_speculative_arguments(parser)
    add_parallel_arguments(parser)

    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, help="output folder (default bench/results/<timestamp>/)")
    o.add_argument("--no-roofline", action="store_true", help="skip the matmul roofline")
    o.add_argument("--roofline-m", type=int, default=64, help="rows of the roofline matmuls")


def parse_cpus(text: str) -> list[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-")
            cpus.update(range(int(low), int(high) + 1))
        else:
            cpus.add(int(part))
    return sorted(cpus)


def parse_engine_options(items: list[str]) -> dict[str, Any]:
    """``["enable_prefix_caching=false", "scheduler_policy=fifo"]`` -> a dict; values are
    JSON where they parse as JSON, else strings."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"cbgen bench: --engine-option wants KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def split_list(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]

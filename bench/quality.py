"""How far each precision mode is from float32 on the bundled model: a table.

``python bench/quality.py`` (about 3 minutes on 2 cores; ``--quick`` for a smoke run)

For each mode (float32, float32 weights with a bfloat16 K/V cache, bfloat16, int8 and
4-bit weights, and 4-bit with a 4-bit LM head) it loads SmolLM2-135M-Instruct as a user would
(``cbgen.load_model(..., dtype=, quantization=)``), then through cbgen's engine:

* the perplexity of ``bench/prompts/perplexity.txt`` (an original text of about 3,000
  tokens written for this benchmark), in segments of 256 tokens
  (``cbgen.bench.quality.perplexity``);
* greedy agreement with float32: the mean number of leading tokens, of the first 32,
  that equal float32's output, over the 64 prompts of the ``chat64`` workload.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

import torch

import cbgen
from cbgen import EngineConfig
from cbgen.bench.quality import greedy_agreement, greedy_outputs, perplexity
from cbgen.bench.workloads import build_workload

HERE = Path(__file__).resolve().parent
TEXT = HERE / "prompts" / "perplexity.txt"

# name: (dtype, quantization, kv_cache_dtype, LM head quantization)
MODES: dict[str, tuple[torch.dtype, str | None, torch.dtype | None, str | None]] = {
    "float32": (torch.float32, None, None, None),
    "float32 + bf16 KV": (torch.float32, None, torch.bfloat16, None),
    "bfloat16": (torch.bfloat16, None, None, None),
    "int8 (bf16 activations)": (torch.bfloat16, "int8", None, None),
    "int4 (bf16 activations)": (torch.bfloat16, "int4", None, None),
    "int4 + 4-bit LM head": (torch.bfloat16, "int4", None, "int4"),
    "int4 in groups of 64": (torch.bfloat16, "int4", None, None),
    "w4a8 (int8 activations)": (torch.bfloat16, "w4a8", None, None),
    "w4a8 + w4a8 LM head": (torch.bfloat16, "w4a8", None, "w4a8"),
}


# Modes whose 4-bit groups are not 32 columns (SmolLM2's 576 take 32 or 64).
GROUP_SIZES = {"int4 in groups of 64": 64}


def read_text(path: Path = TEXT) -> str:
    lines = path.read_text().splitlines()
    return "\n".join(line for line in lines if not line.startswith("# ")).strip() + "\n"


def measure(
    name: str,
    text_ids: list[int],
    prompts: list[list[int]],
    tokens: int,
    max_segments: int | None,
) -> dict[str, Any]:
    dtype, quantization, kv_dtype, head = MODES[name]
    model, _ = cbgen.load_model(
        "smollm2",
        dtype=dtype,
        quantization=quantization,
        lm_head_quantization=head,
        quantization_group_size=GROUP_SIZES.get(name, 32),
        tokenizer=False,
    )
    config = EngineConfig(kv_cache_dtype=kv_dtype)
    started = time.perf_counter()
    ppl = perplexity(model, text_ids, 256, config, max_segments=max_segments)
    outputs = greedy_outputs(model, prompts, tokens, config)
    return {
        "mode": name,
        "perplexity": ppl.value,
        "scored_tokens": ppl.tokens,
        "outputs": outputs,
        "seconds": time.perf_counter() - started,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens compared")
    parser.add_argument("--quick", action="store_true", help="8 prompts, 2 text segments")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated")
    parser.add_argument("--out", type=Path, help="write the table's numbers as JSON here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    _, tokenizer = cbgen.load_model("smollm2")
    text_ids = tokenizer(read_text())["input_ids"]
    workload = build_workload("chat64", tokenizer, num_prompts=8 if args.quick else None)
    max_segments = 2 if args.quick else None
    names = args.modes.split(",")
    if names[0] != "float32":
        names.insert(0, "float32")  # the reference
    rows = [measure(n, text_ids, workload.prompts, args.tokens, max_segments) for n in names]
    reference = rows[0]
    print(
        f"\nSmolLM2-135M-Instruct, {len(text_ids)}-token text ({rows[0]['scored_tokens']} scored), "
        f"{len(workload.prompts)} chat64 prompts x {args.tokens} greedy tokens\n"
    )
    print("| mode | perplexity | vs float32 | greedy agreement (of 32) | all 32 equal |")
    print("|---|---:|---:|---:|---:|")
    for row in rows:
        row["agreement"] = greedy_agreement(reference["outputs"], row["outputs"])
        row["all_equal"] = sum(
            a == b for a, b in zip(reference["outputs"], row["outputs"], strict=True)
        ) / len(row["outputs"])
        change = row["perplexity"] / reference["perplexity"] - 1
        print(
            f"| {row['mode']} | {row['perplexity']:.3f} | {change:+.2%} | "
            f"{row['agreement']:.1f} | {row['all_equal']:.0%} |"
        )
    if args.out:
        for row in rows:
            row.pop("outputs")
        args.out.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()

"""Speculative decoding against plain decoding, by batch size, in one run.

    .venv/bin/python bench/speculative.py [--workload grounded] [--repeats 3] [--threads 2]
        [--batch-sizes 1,2,4,8,16,32] [--methods ngram,layer_skip,draft-int4] [--hf]

The bundled SmolLM2 (float32) runs the workload's prompts greedily (up to
``max_new_tokens``, stopping at EOS), ``b`` requests at a time for every batch size ``b``
(at least 8 prompts per size, cycling through the workload), plainly and with each
method: ``ngram`` (prompt lookup, k=4), ``layer_skip`` (the target's first quarter of
layers as the draft) and ``draft-int4`` (the same checkpoint, 4-bit weights, as the
draft). Modes alternate within each repeat, so drift on a noisy machine hits them
alike. It prints each mode's median output tokens per second, its ratio to plain, the
share of guesses kept and the mean accepted length (tokens per verification, the
sampled one included), the first batch size where each method stops paying, and how
many outputs equal plain decoding's (greedy: all, but for near-ties where the
verifying pass's matmul shapes round differently).

``--hf`` adds transformers' own ``model.generate`` at batch 1, plainly and with its
prompt lookup (``prompt_lookup_num_tokens=4``), on the same prompts.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import torch

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams, SpeculativeConfig
from cbgen.bench.workloads import build_workload

METHODS = ("ngram", "layer_skip", "draft-int4")
MIN_PROMPTS = 8


@dataclass
class Run:
    seconds: float = 0.0
    tokens: int = 0
    proposed: int = 0
    accepted: int = 0
    verifications: int = 0
    outputs: list[list[int]] = field(default_factory=list)


def spec_for(method: str, drafts: dict[str, Any]) -> SpeculativeConfig | None:
    if method == "plain":
        return None
    if method == "ngram":
        return SpeculativeConfig(method="ngram", num_tokens=4)
    if method == "layer_skip":
        return SpeculativeConfig(method="layer_skip", num_tokens=4)
    if method == "draft-int4":
        return SpeculativeConfig(method="draft", draft_model=drafts["int4"], num_tokens=4)
    raise ValueError(method)


def run_batches(engine: EngineCore, prompts: list[list[int]], batch: int, max_new: int) -> Run:
    """``prompts`` ``batch`` at a time; only the stepping is timed."""
    run = Run()
    params = SamplingParams(max_new_tokens=max_new)
    before = dict(engine.stats)
    for first in range(0, len(prompts), batch):
        engine.reset_prefix_cache()
        group = prompts[first : first + batch]
        for i, prompt in enumerate(group):
            engine.add_request(prompt, params, f"{first + i}")
        finished: dict[str, list[int]] = {}
        started = time.perf_counter()
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    finished[out.request_id] = out.token_ids
        run.seconds += time.perf_counter() - started
        for i in range(len(group)):
            run.outputs.append(finished[f"{first + i}"])
    run.tokens = sum(len(o) for o in run.outputs)
    stats = engine.stats
    run.proposed = int(stats.get("spec_proposed_tokens", 0) - before.get("spec_proposed_tokens", 0))
    run.accepted = int(stats.get("spec_accepted_tokens", 0) - before.get("spec_accepted_tokens", 0))
    run.verifications = int(
        stats.get("spec_verifications", 0) - before.get("spec_verifications", 0)
    )
    return run


def hf_generate(model: Any, prompts: list[list[int]], max_new: int, lookup: bool) -> Run:
    run = Run()
    extra = {"prompt_lookup_num_tokens": 4} if lookup else {}
    for prompt in prompts:
        ids = torch.tensor([prompt])
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new,
                do_sample=False,
                **extra,
            )
        run.seconds += time.perf_counter() - started
        run.outputs.append(out[0, len(prompt) :].tolist())
    run.tokens = sum(len(o) for o in run.outputs)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="grounded")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--hf", action="store_true", help="add transformers' generate, batch 1")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = cbgen.load_model("smollm2")
    workload = build_workload(args.workload, tokenizer, max_new_tokens=args.max_new_tokens)
    prompts, max_new = workload.prompts, workload.max_new_tokens
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    drafts: dict[str, Any] = {}
    if "draft-int4" in methods:
        drafts["int4"] = cbgen.load_model("smollm2", quantization="int4", tokenizer=False)[0]
    modes = ["plain", *methods]
    runs: dict[tuple[str, int], list[Run]] = {}
    print(
        f"{args.workload}: {len(prompts)} prompts, up to {max_new} new tokens, "
        f"{args.threads} threads, batch sizes {sizes}, {args.repeats} repeats",
        flush=True,
    )
    for repeat in range(args.repeats):
        for mode in modes:
            config = EngineConfig(speculative=spec_for(mode, drafts))
            with EngineCore(model, config) as engine:
                for batch in sizes:
                    count = max(MIN_PROMPTS, batch)
                    chosen = [prompts[i % len(prompts)] for i in range(count)]
                    run = run_batches(engine, chosen, batch, max_new)
                    runs.setdefault((mode, batch), []).append(run)
                    print(
                        f"  repeat {repeat + 1} {mode:>10} b={batch:<3} "
                        f"{run.tokens / run.seconds:7.1f} tok/s",
                        flush=True,
                    )
        if args.hf:
            chosen = [prompts[i % len(prompts)] for i in range(MIN_PROMPTS)]
            for lookup in (False, True):
                name = "hf-lookup" if lookup else "hf-generate"
                run = hf_generate(model, chosen, max_new, lookup)
                runs.setdefault((name, 1), []).append(run)
                print(
                    f"  repeat {repeat + 1} {name:>10} b=1   {run.tokens / run.seconds:7.1f} tok/s"
                )
    report(runs, modes, sizes, args.hf)


def report(runs: dict[tuple[str, int], list[Run]], modes: list[str], sizes: list[int], hf: bool):
    def median_rate(mode: str, batch: int) -> float:
        return statistics.median(r.tokens / r.seconds for r in runs[(mode, batch)])

    print("\nmedian output tok/s (ratio to plain), kept guesses, mean accepted length")
    header = f"{'mode':>12} " + " ".join(f"{'b=' + str(b):>24}" for b in sizes)
    print(header)
    stops: dict[str, int | None] = {}
    for mode in modes:
        cells = []
        for batch in sizes:
            rate = median_rate(mode, batch)
            ratio = rate / median_rate("plain", batch)
            last = runs[(mode, batch)][-1]
            if mode == "plain":
                cells.append(f"{rate:7.1f}")
                continue
            kept = last.accepted / last.proposed if last.proposed else 0.0
            mal = 1 + last.accepted / last.verifications if last.verifications else 1.0
            cells.append(f"{rate:7.1f} ({ratio:4.2f}x) {kept:4.0%} {mal:4.2f}")
            if ratio < 1.0 and mode not in stops:
                stops[mode] = batch
        print(f"{mode:>12} " + " ".join(f"{c:>24}" for c in cells))
    for mode in modes[1:]:
        where = stops.get(mode)
        said = f"b={where}" if where is not None else f"never up to b={sizes[-1]}"
        same = sum(
            a == b
            for batch in sizes
            for a, b in zip(
                runs[(mode, batch)][-1].outputs, runs[("plain", batch)][-1].outputs, strict=True
            )
        )
        total = sum(len(runs[("plain", batch)][-1].outputs) for batch in sizes)
        print(f"{mode}: stops paying at {said}; outputs equal to plain: {same}/{total}")
    if hf:
        plain, lookup = median_rate("hf-generate", 1), median_rate("hf-lookup", 1)
        print(
            f"transformers generate b=1: {plain:.1f} tok/s, with its prompt lookup "
            f"{lookup:.1f} ({lookup / plain:.2f}x); cbgen plain b=1: "
            f"{median_rate('plain', 1) / plain:.2f}x generate"
        )
        if "ngram" in modes:
            print(f"cbgen ngram b=1: {median_rate('ngram', 1) / lookup:.2f}x its prompt lookup")


if __name__ == "__main__":
    main()

"""Synchronous vs async scheduling on the bundled model, interleaved in one process.

    .venv/bin/python bench/async_compare.py [--workload short64] [--num-prompts 64]
        [--max-new-tokens 64] [--rounds 3] [--threads 2]

Each round runs the same workload with ``async_scheduling`` off and on, in
alternating order (so drift on a noisy machine hits both alike), through
``generate_batch`` (the synchronous core's loop) and through the online engine
with every request streamed and detokenized (where the host has the most work to
hide behind the forward pass). Prints output tok/s per round and the medians.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

import cbgen
from cbgen import EngineConfig, SamplingParams
from cbgen.bench.workloads import build_workload


def run_core(model, prompts, params, config) -> float:
    start = time.perf_counter()
    outputs = cbgen.generate_batch(model, prompts, params, config)
    seconds = time.perf_counter() - start
    return sum(len(o.token_ids) for o in outputs) / seconds


def run_online(model, tokenizer, prompts, params, config) -> float:
    with cbgen.Engine(model, tokenizer, config) as engine:
        start = time.perf_counter()
        ids = [engine.add_request(p, params) for p in prompts]
        tokens = 0
        for rid in ids:
            for delta in engine.stream(rid):
                tokens += len(delta.new_token_ids)
        seconds = time.perf_counter() - start
    return tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="short64", help="a workload of bench/workloads.json")
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = cbgen.load_model("smollm2")
    workload = build_workload(args.workload, tokenizer, num_prompts=args.num_prompts)
    prompts = workload.prompts
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    sync = EngineConfig()
    configs = {"sync": sync, "async": dataclasses.replace(sync, async_scheduling=True)}
    runs = {
        "core": lambda c: run_core(model, prompts, params, c),
        "online": lambda c: run_online(model, tokenizer, prompts, params, c),
    }
    run_core(model, prompts[:4], SamplingParams(max_new_tokens=4), sync)  # warm up
    results: dict[tuple[str, str], list[float]] = {}
    for round_index in range(args.rounds):
        order = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for loop, run in runs.items():
            for name in order:
                rate = run(configs[name])
                results.setdefault((loop, name), []).append(rate)
                print(f"round {round_index + 1} {loop:6} {name:5} {rate:7.1f} tok/s", flush=True)
    print(
        f"\n{args.workload}, {args.num_prompts} prompts x {args.max_new_tokens} new tokens, "
        f"{args.threads} threads, medians of {args.rounds}:"
    )
    for loop in runs:
        sync_rate = statistics.median(results[(loop, "sync")])
        async_rate = statistics.median(results[(loop, "async")])
        print(
            f"  {loop:6} sync {sync_rate:7.1f}  async {async_rate:7.1f} tok/s  "
            f"({(async_rate / sync_rate - 1) * 100:+.1f}%)"
        )


if __name__ == "__main__":
    main()

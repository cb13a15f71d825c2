"""Tensor parallelism on the bundled model: TP=1 against TP=2, same run, same prompts.

    .venv/bin/python bench/tensor_parallel.py [--workload short64] [--repeats 3]
        [--threads 2] [--dtype float32|bfloat16] [--max-new-tokens N]

Three engines on SmolLM2, built once each and run in turn within every repeat (so drift
on a noisy machine hits them alike): ``tp1`` (this process, ``--threads`` threads),
``tp2-shm`` (two ranks of ``--threads / 2`` threads, summing through shared memory) and
``tp2-gloo`` (the same over gloo's loopback TCP, ``CBGEN_TP_NO_SHM=1``). Greedy,
``ignore_eos``. It prints each engine's build time, median output tokens per second and
ratio to ``tp1``, and the ranks' all-reduce time per step (the wait for the slower rank
included), and checks that the three give the same tokens.

On a 2-core machine TP cannot win: the same cores run the same GEMMs, now in two halves
that must meet 2 x layers times a step. The figure is TP's overhead.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

import cbgen
from cbgen import EngineConfig, SamplingParams
from cbgen.bench.workloads import build_workload
from cbgen.core.engine_core import EngineCore
from cbgen.executor.parallel.shm_reduce import DISABLE_ENV


def run(engine: EngineCore, prompts: list[list[int]], params: SamplingParams) -> tuple:
    """(seconds, output tokens, steps, every request's tokens)."""
    ids = [engine.add_request(p, params) for p in prompts]
    tokens: dict[str, list[int]] = {}
    steps = 0
    started = time.perf_counter()
    while engine.has_unfinished():
        steps += 1
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(t) for t in tokens.values()), steps, [tokens[i] for i in ids]


def reduce_seconds(engine: EngineCore) -> float:
    stats = getattr(engine.executor, "reduce_stats", None)
    return max(s for s, _ in stats()) if stats is not None else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", default="short64")
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = parser.parse_args()
    per_rank = max(1, args.threads // 2)
    torch.set_num_threads(args.threads)
    model, tokenizer = cbgen.load_model("smollm2", dtype=getattr(torch, args.dtype))
    workload = build_workload(args.workload, tokenizer, max_new_tokens=args.max_new_tokens)
    prompts = workload.prompts
    params = SamplingParams(max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    print(
        f"SmolLM2 {args.dtype}, {args.workload}: {len(prompts)} prompts, "
        f"{workload.max_new_tokens} new tokens; tp1 on {args.threads} threads, "
        f"tp2 on {per_rank} thread per rank"
    )
    engines: dict[str, tuple[EngineCore, int]] = {}
    builds: dict[str, float] = {}
    for name, size, no_shm in (("tp1", 1, False), ("tp2-shm", 2, False), ("tp2-gloo", 2, True)):
        os.environ.pop(DISABLE_ENV, None)
        if no_shm:
            os.environ[DISABLE_ENV] = "1"
        threads = args.threads if size == 1 else per_rank
        torch.set_num_threads(threads)
        started = time.perf_counter()
        config = EngineConfig(
            tensor_parallel_size=size, threads_per_rank=per_rank if size > 1 else None
        )
        engines[name] = (EngineCore(model, config), threads)
        builds[name] = time.perf_counter() - started
    os.environ.pop(DISABLE_ENV, None)
    rates: dict[str, list[float]] = {name: [] for name in engines}
    reduce_ms: dict[str, list[float]] = {name: [] for name in engines}
    outputs: dict[str, list[list[int]]] = {}
    try:
        for engine, threads in engines.values():  # warm-up: kernels, first GEMMs
            torch.set_num_threads(threads)
            run(engine, prompts[:8], params)
        for _ in range(args.repeats):
            for name, (engine, threads) in engines.items():
                torch.set_num_threads(threads)
                before = reduce_seconds(engine)
                elapsed, tokens, steps, outputs[name] = run(engine, prompts, params)
                rates[name].append(tokens / elapsed)
                reduce_ms[name].append(1e3 * (reduce_seconds(engine) - before) / steps)
    finally:
        for engine, _ in engines.values():
            engine.close()
    base = statistics.median(rates["tp1"])
    print(f"{'engine':10} {'build s':>8} {'tok/s':>8} {'vs tp1':>7} {'all-reduce ms/step':>19}")
    for name in engines:
        rate = statistics.median(rates[name])
        print(
            f"{name:10} {builds[name]:8.1f} {rate:8.1f} {rate / base:6.2f}x "
            f"{statistics.median(reduce_ms[name]):19.2f}"
        )
    same = all(outputs[name] == outputs["tp1"] for name in outputs)
    print(f"identical tokens across the three: {same}")


if __name__ == "__main__":
    main()

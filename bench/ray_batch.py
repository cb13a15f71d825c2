"""Batch job throughput: one engine of 2 threads against two engines of 1 thread on Ray.

    .venv/bin/python bench/ray_batch.py [--rows 256] [--max-new-tokens 64] [--batch-size 64]
                                        [--repeats 3]

Every configuration runs ``python -m cbgen batch``'s job (``run_batch_job``) on the same
JSONL input (the short64 chat messages, repeated to ``--rows`` rows), greedy, SmolLM2
float32, ``--batch-size`` rows per batch (an engine holds two batches), into its own
output:

- ``local 1x2``: one engine in this process, 2 torch threads (no Ray);
- ``ray 1x2``: one Ray actor with 2 threads;
- ``ray 2x1``: two Ray actors with 1 thread each.

It prints each one's median rows/s over ``--repeats`` runs, counting the whole job
(Ray actors starting and loading the model included), the median seconds until the
first batch was written, and whether each output file is byte-identical to the first
configuration's (same rows, same order, same tokens). Ray itself (one local instance
for the whole run) is started before any timing.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import ray

from cbgen.bench.workloads import bench_dir, read_lines
from cbgen.frontends.jobs import run_batch_job

CONFIGS = [("local 1x2", False, 1, 2), ("ray 1x2", True, 1, 2), ("ray 2x1", True, 2, 1)]


def write_input(path: Path, rows: int) -> None:
    messages = read_lines(bench_dir() / "prompts" / "short64.txt")
    with path.open("w") as f:
        for i in range(rows):
            turn = {"role": "user", "content": messages[i % len(messages)]}
            f.write(json.dumps({"messages": [turn]}) + "\n")


def run_once(
    input_path: Path,
    output: Path,
    use_ray: bool,
    actors: int,
    threads: int,
    tokens: int,
    batch_size: int,
) -> tuple[float, float]:
    """(rows/s over the whole job, seconds until the first batch was written)."""
    output.unlink(missing_ok=True)
    first: list[float] = []
    started = time.perf_counter()

    def note(written: int) -> None:
        if not first:
            first.append(time.perf_counter() - started)

    report = run_batch_job(
        input_path,
        output,
        {"model": "smollm2", "max_new_tokens": tokens, "threads": threads},
        ray=use_ray,
        actors=actors,
        batch_size=batch_size,
        progress=False,
        on_written=note,
    )
    return report.rows_per_second, first[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        write_input(root / "in.jsonl", args.rows)
        results: dict[str, list[tuple[float, float]]] = {name: [] for name, *_ in CONFIGS}
        outputs: dict[str, bytes] = {}
        for repeat in range(args.repeats):
            for name, use_ray, actors, threads in CONFIGS:
                output = root / f"{name.replace(' ', '_')}.jsonl"
                rates = run_once(
                    root / "in.jsonl",
                    output,
                    use_ray,
                    actors,
                    threads,
                    args.max_new_tokens,
                    args.batch_size,
                )
                results[name].append(rates)
                outputs.setdefault(name, output.read_bytes())
                print(
                    f"  run {repeat + 1} {name}: {rates[0]:.2f} rows/s, first rows at {rates[1]:.1f} s"
                )
    ray.shutdown()
    baseline = CONFIGS[0][0]
    print(
        f"\n{args.rows} rows, {args.max_new_tokens} new tokens, batches of {args.batch_size}, "
        f"SmolLM2 float32, greedy; medians of {args.repeats}"
    )
    print(f"{'config':<10} {'rows/s':>8} {'first rows':>11}  output")
    for name, *_ in CONFIGS:
        rate = statistics.median(r[0] for r in results[name])
        first = statistics.median(r[1] for r in results[name])
        same = "identical" if outputs[name] == outputs[baseline] else f"DIFFERS from {baseline}"
        print(f"{name:<10} {rate:8.2f} {first:9.1f} s  {same}")


if __name__ == "__main__":
    main()

"""What logprobs, penalties and structured output cost against plain decoding, in one run.

    .venv/bin/python bench/sampling_overhead.py [--workload chat64] [--repeats 3] [--threads 2]

Every mode runs the same workload's prompts through ``generate_batch`` on the bundled
SmolLM2 (float32, the default engine), interleaved repeat by repeat so drift on a noisy
machine hits all modes alike; it prints the median output tokens per second of each
and its ratio to ``plain``. ``json-schema`` gives every request a JSON schema (nested
object, enum, array, bounded fields); those outputs end at EOS when the object is
complete, so they are shorter, and ``plain, same lengths`` decodes exactly as many tokens
per request without a grammar: ``json-schema`` against it is the grammar's cost.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import cbgen
from cbgen import EngineConfig, SamplingParams, StructuredOutput
from cbgen.bench.workloads import build_workload

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 40},
        "category": {"enum": ["science", "history", "art", "other"]},
        "points": {"type": "array", "items": {"type": "string", "maxLength": 60}, "maxItems": 4},
        "meta": {
            "type": "object",
            "properties": {"words": {"type": "integer", "minimum": 0, "maximum": 999}},
            "required": ["words"],
            "additionalProperties": False,
        },
    },
    "required": ["title", "category", "points", "meta"],
    "additionalProperties": False,
}


def modes(max_new_tokens: int) -> dict[str, SamplingParams]:
    base = dict(max_new_tokens=max_new_tokens)
    return {
        "plain": SamplingParams(**base, ignore_eos=True),
        "logprobs=5": SamplingParams(**base, ignore_eos=True, logprobs=5),
        "penalties": SamplingParams(
            **base, ignore_eos=True, repetition_penalty=1.1, frequency_penalty=0.2
        ),
        "json-schema": SamplingParams(
            **base, structured_output=StructuredOutput(json_schema=SCHEMA)
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="chat64")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--modes", default=None, help="comma-separated subset of the modes")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = cbgen.load_model("smollm2")
    workload = build_workload(args.workload, tokenizer, max_new_tokens=args.max_new_tokens)
    prompts = workload.prompts
    runs: dict[str, list[float]] = {}
    lengths: dict[str, float] = {}
    config = EngineConfig()
    cbgen.generate_batch(model, prompts[:4], SamplingParams(max_new_tokens=4))  # warm up
    for repeat in range(args.repeats):
        for name, params in modes(workload.max_new_tokens).items():
            if args.modes and name not in args.modes.split(","):
                continue
            started = time.perf_counter()
            outputs = cbgen.generate_batch(model, prompts, params, config, tokenizer=tokenizer)
            elapsed = time.perf_counter() - started
            tokens = sum(len(o.token_ids) for o in outputs)
            runs.setdefault(name, []).append(tokens / elapsed)
            lengths[name] = tokens / len(outputs)
            print(f"repeat {repeat} {name:12s} {tokens / elapsed:8.1f} tok/s", flush=True)
            if name == "json-schema":
                # Plain decoding of exactly as many tokens per request: the same work
                # but the grammar (its outputs are short, so prefill weighs more).
                same = [
                    SamplingParams(max_new_tokens=len(o.token_ids), ignore_eos=True)
                    for o in outputs
                ]
                started = time.perf_counter()
                cbgen.generate_batch(model, prompts, same, config)
                rate = tokens / (time.perf_counter() - started)
                runs.setdefault("plain, same lengths", []).append(rate)
                lengths["plain, same lengths"] = tokens / len(outputs)
                print(f"repeat {repeat} plain, same lengths {rate:8.1f} tok/s", flush=True)
    plain = statistics.median(runs.get("plain") or runs["plain, same lengths"])
    print(f"\n{workload.name}: {len(prompts)} prompts, up to {workload.max_new_tokens} new tokens")
    print(f"{'mode':20s} {'tok/s':>8s} {'vs plain':>9s} {'mean len':>9s}")
    for name, values in runs.items():
        median = statistics.median(values)
        print(f"{name:20s} {median:8.1f} {median / plain:8.2f}x {lengths[name]:9.1f}")


if __name__ == "__main__":
    main()

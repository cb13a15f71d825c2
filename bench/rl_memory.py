"""Resident memory of a train-then-generate loop on one engine, with sleep() or pause().

    .venv/bin/python bench/rl_memory.py [--mode sleep|pause|both] [--steps 2]

The bundled SmolLM2 (float32) runs ``--steps`` rounds of: a rollout (8 prompts x 4
samples, 64 new tokens, temperature 1) on one open ``EngineCore``, then ``sleep()`` (or
``pause()``), one training step (forward and backward over the rollouts, SGD), then
``wake()`` (``resume()``). Each mode runs in its own process, so its peak RSS is its
own; the table gives the RSS after loading, after the first rollout, while asleep or
paused, after the training step, after the last rollout, and the peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.sysmem import proc_status_kib


def mib(key: str = "VmRSS") -> float:
    value = proc_status_kib(key)
    return (value or 0) / 1024


def run(mode: str, steps: int) -> dict[str, float]:
    torch.set_num_threads(2)
    model, tokenizer = cbgen.load_model("smollm2")
    from cbgen.bench.workloads import chat_token_ids

    prompts = [
        chat_token_ids(tokenizer, f"Write a sentence about the number {i}.") for i in range(8)
    ]
    params = SamplingParams(temperature=1.0, max_new_tokens=64, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
    marks = {"loaded": mib()}
    with EngineCore(model, EngineConfig()) as engine:
        for step in range(steps):
            samples = cbgen.rollout(engine, prompts, params, num_samples=4)
            if step == 0:
                marks["after rollout"] = mib()
            engine.sleep() if mode == "sleep" else engine.pause()
            if step == 0:
                marks["asleep/paused"] = mib()
            model.train()
            for prompt, completion in zip(samples.prompt_ids, samples.completion_ids, strict=True):
                ids = torch.tensor([prompt + completion])
                model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            model.eval()
            if step == 0:
                marks["after training step"] = mib()
            engine.wake() if mode == "sleep" else engine.resume()
        cbgen.rollout(engine, prompts, params, num_samples=4)
        marks["after last rollout"] = mib()
    marks["peak"] = mib("VmHWM")
    return marks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["sleep", "pause", "both"], default="both")
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.mode != "both":
        marks = run(args.mode, args.steps)
        print(json.dumps(marks) if args.json else marks)
        return
    results = {}
    for mode in ("sleep", "pause"):
        command = [sys.executable, __file__, "--mode", mode, "--steps", str(args.steps), "--json"]
        out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
        results[mode] = json.loads(out.strip().splitlines()[-1])
    print("| stage | sleep() MiB | pause() MiB |")
    print("|---|---:|---:|")
    labels = ["loaded", "after rollout", "asleep/paused", "after training step"]
    labels += ["after last rollout", "peak"]
    for label in labels:
        row = [results[m][label] for m in ("sleep", "pause")]
        print(f"| {label} | {row[0]:.0f} | {row[1]:.0f} |")


if __name__ == "__main__":
    main()

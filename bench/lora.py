"""Multi-LoRA throughput against the base model, and adapter updates against a refresh.

    .venv/bin/python bench/lora.py [--workload short64] [--adapters 8] [--rank 16]
        [--targets all-linear|q_proj,v_proj] [--repeats 3] [--threads 2]
        [--dtype float32|bfloat16] [--save-adapters DIR] [--peers vllm]

The bundled SmolLM2 runs the workload's prompts (greedy, ``ignore_eos``, the workload's
``max_new_tokens``) on one engine, in three modes that alternate within each repeat, so
drift on a noisy machine hits them alike:

- ``base``: every prompt on the base model;
- ``mixed``: prompt ``i`` under adapter ``i % adapters`` (random rank-``rank`` adapters on
  ``--targets``: every linear map by default, as PEFT's ``all-linear`` targets them; PEFT's
  own default for Llama is ``q_proj,v_proj``): every step mixes all adapters;
- ``single``: every prompt under adapter 0.

It prints each mode's median output tokens per second and its ratio to ``base``. Then
the RL case: ``update_lora`` with a fresh adapter state dict against ``refresh()`` (the
full rebuild of the packed base, what a weight update costs), medians of several.

``--peers vllm`` then runs vLLM's multi-LoRA (its CPU build, ``bench/peers/setup_vllm.sh``)
on the same prompts, weights (the converted SmolLM2 folder) and adapter folders, after
cbgen's runs, and prints cbgen's ratio to it per mode.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import peft
import torch

import cbgen
from cbgen import EngineConfig, SamplingParams, generate_batch
from cbgen.bench.workloads import build_workload
from cbgen.core.engine_core import EngineCore
from cbgen.sysmem import cache_dir


def make_adapters(
    model: torch.nn.Module, count: int, rank: int, folder: Path, targets: str = "all-linear"
) -> list[str]:
    """``count`` random PEFT adapters of rank ``rank`` on ``targets`` (PEFT's
    ``all-linear``, or module names separated by commas), saved."""
    config = peft.LoraConfig(
        r=rank,
        lora_alpha=2 * rank,
        target_modules=targets if targets == "all-linear" else targets.split(","),
        init_lora_weights=False,
    )
    adapted = peft.get_peft_model(copy.deepcopy(model), config)
    paths = []
    for index in range(count):
        torch.manual_seed(1000 + index)
        with torch.no_grad():
            for name, param in adapted.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        path = folder / f"adapter-{index}"
        adapted.save_pretrained(path)
        paths.append(str(path))
    return paths


def timed_run(engine: EngineCore, prompts, params, lora) -> tuple[float, int]:
    engine.reset_prefix_cache()
    started = time.perf_counter()
    outputs = generate_batch(engine, prompts, params, lora=lora)
    elapsed = time.perf_counter() - started
    return elapsed, sum(len(o.token_ids) for o in outputs)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", default="short64")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--max-new-tokens", type=int, default=None)
    parser.add_argument("--save-adapters", type=Path, default=None)
    parser.add_argument(
        "--targets",
        default="all-linear",
        help="the adapters' target modules: all-linear (every map), or names such as "
        "q_proj,v_proj (PEFT's default for Llama)",
    )
    parser.add_argument("--peers", default="", help="vllm: run vLLM's multi-LoRA after cbgen")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    dtype = getattr(torch, args.dtype)
    model, tokenizer = cbgen.load_model("smollm2", dtype=dtype)
    workload = build_workload(args.workload, tokenizer, max_new_tokens=args.max_new_tokens)
    prompts = workload.prompts
    params = SamplingParams(max_new_tokens=workload.max_new_tokens, ignore_eos=True)
    folder = args.save_adapters or Path(tempfile.mkdtemp(prefix="cbgen-lora-bench-"))
    folder.mkdir(parents=True, exist_ok=True)
    adapters = make_adapters(model, args.adapters, args.rank, folder, args.targets)
    print(
        f"SmolLM2 {args.dtype}, {args.workload}: {len(prompts)} prompts, "
        f"{workload.max_new_tokens} new tokens, {args.adapters} adapters of rank {args.rank} "
        f"on {args.targets}, {args.threads} threads"
    )

    config = EngineConfig(max_loras=args.adapters, max_lora_rank=args.rank)
    with EngineCore(model, config) as engine:
        names = [f"adapter-{i}" for i in range(args.adapters)]
        for name, path in zip(names, adapters, strict=True):
            engine.add_lora(name, path)
        modes = {
            "base": None,
            "mixed": [names[i % len(names)] for i in range(len(prompts))],
            "single": names[0],
        }
        timed_run(engine, prompts[:8], params, None)  # warm-up: kernels, first GEMMs
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(args.repeats):
            for mode, lora in modes.items():
                elapsed, tokens = timed_run(engine, prompts, params, lora)
                rates[mode].append(tokens / elapsed)
        report("cbgen", rates)

        targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
        adapted = peft.get_peft_model(
            copy.deepcopy(model),
            peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, target_modules=targets),
        )
        state = peft.get_peft_model_state_dict(adapted)
        updates = []
        for _ in range(20):
            started = time.perf_counter()
            engine.update_lora(names[0], state)
            updates.append(time.perf_counter() - started)
        refreshes = []
        for _ in range(3):
            started = time.perf_counter()
            engine.refresh()
            refreshes.append(time.perf_counter() - started)
        print(
            f"\nupdate_lora ({len(state) // 2} maps, rank {args.rank}): "
            f"{statistics.median(updates) * 1e3:.1f} ms median of {len(updates)}; "
            f"refresh (full rebuild): {statistics.median(refreshes) * 1e3:.0f} ms median of "
            f"{len(refreshes)}"
        )
    if "vllm" in args.peers.split(","):
        spec = {
            "model_folder": str(cache_dir() / "smollm2"),
            "dtype": args.dtype,
            "threads": args.threads,
            "prompts": prompts,
            "max_new_tokens": workload.max_new_tokens,
            "adapters": adapters,
            "rank": args.rank,
            "repeats": args.repeats,
        }
        peer = run_vllm(spec, folder)
        if "error" in peer:
            print(f"\nvLLM multi-LoRA did not run: {peer['error']}")
        else:
            report(peer["engine"], peer["rates"])
            print("\ncbgen / vLLM, medians:")
            for mode, values in rates.items():
                ratio = statistics.median(values) / statistics.median(peer["rates"][mode])
                print(f"  {mode:<8} {ratio:.2f}x")


def report(system: str, rates: dict[str, list[float]]) -> None:
    base = statistics.median(rates["base"])
    print(f"\n{system}\n{'mode':<8} {'out tok/s (median)':>19} {'vs base':>8}   runs")
    for mode, values in rates.items():
        rate = statistics.median(values)
        runs = ", ".join(f"{v:.1f}" for v in values)
        print(f"{mode:<8} {rate:>19.1f} {rate / base:>8.2f}   {runs}")


def run_vllm(spec: dict, folder: Path) -> dict:
    """``bench/peers/vllm_lora.py`` in vLLM's own venv; its result, or the error."""
    here = Path(__file__).resolve().parent
    python = here / "peers" / ".venv-vllm" / "bin" / "python"
    if not python.exists():
        return {"error": f"no vLLM venv at {python} (sh bench/peers/setup_vllm.sh)"}
    spec_path, result_path = folder / "vllm-spec.json", folder / "vllm-result.json"
    spec_path.write_text(json.dumps(spec))
    completed = subprocess.run(
        [str(python), str(here / "peers" / "vllm_lora.py"), str(spec_path), str(result_path)],
        capture_output=True,
        text=True,
    )
    if not result_path.exists():
        return {"error": f"exit {completed.returncode}: {completed.stderr[-2000:]}"}
    return json.loads(result_path.read_text())


if __name__ == "__main__":
    main()

"""One benchmark process: ``python -m cbgen.bench.worker SPEC.json RESULT.json``.

The harness starts one of these per system (and workload), pinned to the benchmark's
cores, so that the process's peak RSS is that system's alone. A spec is::

    {"kind": "system" | "roofline", "system": "cbgen", "model": "smollm2",
     "dtype": "float32", "threads": 2, "repeats": 3, "warmup": true,
     "options": {"engine_config": {...}, "generate_batch_size": 8, "tuned_page_size": null},
     "workloads": [{"name": ..., "max_new_tokens": ..., "prompts": [[ids], ...]}, ...],
     "roofline": {"m": 64, "min_time": 0.2}}

The result holds, per workload, the raw runs (``cbgen.bench.metrics``), the warm-up time,
the first run's output token ids, and an error (with traceback) if the system failed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from ..sysmem import proc_status_kib

WARMUP_PROMPTS = 4
WARMUP_TOKENS = 8


def _quiet_transformers() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def run_spec(spec: dict[str, Any]) -> dict[str, Any]:
    import torch

    from ..core.config import EngineConfig
    from ..frontends.args.speculative import build_speculative
    from ..models.loader import load_model
    from .systems import SystemOptions

    _quiet_transformers()
    threads = int(spec.get("threads") or torch.get_num_threads())
    torch.set_num_threads(threads)
    dtype = getattr(torch, spec.get("dtype", "float32"))
    result: dict[str, Any] = {
        "kind": spec["kind"],
        "system": spec.get("system"),
        "pid": os.getpid(),
        "threads": torch.get_num_threads(),
        "cpus": sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
    }
    started = time.perf_counter()
    # The prompts come as token ids: no tokenizer in the measured process.
    # The roofline is of the dense GEMMs in the run's dtype: a quantized model has no
    # nn.Linear left to take shapes from.
    dense = spec["kind"] == "roofline"
    model, _ = load_model(
        spec.get("model", "smollm2"),
        dtype=dtype,
        tokenizer=False,
        quantization=None if dense else spec.get("quantization"),
        lm_head_quantization=None if dense else spec.get("lm_head_quantization"),
        quantization_group_size=32 if dense else spec.get("quantization_group_size", 32),
    )
    result["load_s"] = time.perf_counter() - started
    result["rss_after_load_kib"] = proc_status_kib("VmRSS")

    if spec["kind"] == "roofline":
        from .roofline import linear_shapes, measure

        options = spec.get("roofline", {})
        result["roofline"] = measure(
            linear_shapes(model),
            m=int(options.get("m", 64)),
            dtype=dtype,
            min_time=float(options.get("min_time", 0.2)),
        )
        result["peak_rss_kib"] = proc_status_kib("VmHWM")
        return result

    system = spec["system"]
    raw_options = spec.get("options", {})
    options = SystemOptions(
        engine_config=EngineConfig(
            **raw_options.get("engine_config", {}),
            speculative=build_speculative(raw_options.get("speculative")),
        ),
        generate_batch_size=int(raw_options.get("generate_batch_size", 8)),
        tuned_page_size=raw_options.get("tuned_page_size"),
        tuned_attn=raw_options.get("tuned_attn"),
    )
    if system == "cbgen":  # one engine for every run, as the vLLM peer keeps one LLM
        from ..core.engine_core import EngineCore

        try:
            options.engine = EngineCore(model, options.engine_config)
        except Exception:  # each run then builds its own and reports the same error
            options.engine = None
        result["load_s"] = time.perf_counter() - started
        result["rss_after_load_kib"] = proc_status_kib("VmRSS")
    try:
        _run_workloads(spec, system, model, options, result)
    finally:
        if options.engine is not None:
            options.engine.close()
    result["peak_rss_kib"] = proc_status_kib("VmHWM")
    return result


def _run_workloads(
    spec: dict[str, Any], system: str, model: Any, options: Any, result: dict[str, Any]
) -> None:
    from .systems import run_system
    from .workloads import spread

    repeats = int(spec.get("repeats", 3))
    result["workloads"] = {}
    for workload in spec["workloads"]:
        name, prompts, max_new = workload["name"], workload["prompts"], workload["max_new_tokens"]
        entry: dict[str, Any] = {"runs": [], "warmup_s": None, "error": None}
        result["workloads"][name] = entry
        try:
            if spec.get("warmup", True):
                warm = spread(prompts, min(WARMUP_PROMPTS, len(prompts)))
                t = time.perf_counter()
                run_system(system, model, warm, min(max_new, WARMUP_TOKENS), options)
                entry["warmup_s"] = time.perf_counter() - t
            for repeat in range(repeats):
                run = run_system(system, model, prompts, max_new, options)
                entry["runs"].append(run.raw())
                if repeat == 0:
                    entry["output_ids"] = run.output_ids
                    entry["config"] = run.config
                print(
                    f"{system} {name} repeat {repeat + 1}/{repeats}: {run.wall_s:.2f} s", flush=True
                )
        except Exception as exc:  # report and go on with the next workload
            entry["error"] = f"{type(exc).__name__}: {exc}"
            entry["traceback"] = traceback.format_exc()
            print(entry["traceback"], file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print("usage: python -m cbgen.bench.worker SPEC.json RESULT.json", file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text(encoding="utf-8"))
    result = run_spec(spec)
    tmp = Path(argv[1] + ".tmp")
    tmp.write_text(json.dumps(result), encoding="utf-8")
    tmp.replace(argv[1])
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""vLLM (CPU build) on a cbgen bench workload; run with bench/peers/.venv-vllm/bin/python.

Started by ``python -m cbgen bench --peers vllm`` (see _common.py). The engine runs in this
process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) so its RSS is this process's, on the
benchmark's cores (``VLLM_CPU_OMP_THREADS_BIND``) with the same thread count. The model is
the Hugging Face folder cbgen converted (``~/.cache/cbgen/smollm2``), so both run the same
weights. The engine is stepped by hand with streaming (delta) outputs, so every token is
timestamped the way cbgen's are; greedy, ``ignore_eos``.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import cpu_list, proc_status_kib, read_spec, run_workloads, write_result  # noqa: E402


def main() -> int:
    spec, result_path = read_spec()
    threads = int(spec.get("threads") or 2)
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", cpu_list(spec))
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("CBGEN_BENCH_VLLM_KV_GIB", "4"))
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

    import vllm
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import RequestOutputKind

    engine_config = spec["options"]["engine_config"]
    longest = max(len(p) + w["max_new_tokens"] for w in spec["workloads"] for p in w["prompts"])
    started = time.perf_counter()
    llm = LLM(
        model=spec["model_folder"],
        dtype=spec.get("dtype", "float32"),
        max_num_seqs=engine_config.get("max_num_seqs", 128),
        max_num_batched_tokens=max(engine_config.get("max_batch_tokens", 512), 512),
        max_model_len=max(longest + 16, 256),
        seed=0,
    )
    result = {
        "kind": "peer",
        "system": "vllm",
        "engine": f"vllm {vllm.__version__}",
        "threads": threads,
        "cpus": sorted(os.sched_getaffinity(0)),
        "load_s": time.perf_counter() - started,
        "rss_after_load_kib": proc_status_kib("VmRSS"),
    }
    engine = llm.llm_engine
    counter = iter(range(1 << 62))

    def run_once(prompts: list[list[int]], max_new: int, progress):
        params = SamplingParams(
            max_tokens=max_new,
            temperature=0.0,
            ignore_eos=True,
            detokenize=False,
            output_kind=RequestOutputKind.DELTA,
        )
        times = [[] for _ in prompts]
        ids = [[] for _ in prompts]
        index_of = {}
        # cbgen starts every run with an empty cache; without this, vLLM's prefix cache
        # would keep the prompts of the warm-up and earlier repeats and skip their prefill
        # (chat64: TTFT p99 5.3 s and 301 tok/s with it kept).
        if not llm.reset_prefix_cache():
            raise RuntimeError("vLLM refused to reset its prefix cache")
        made = 0
        begin = time.perf_counter()
        progress(0)
        for index, prompt in enumerate(prompts):
            request_id = f"r{next(counter)}"
            index_of[request_id] = index
            engine.add_request(request_id, {"prompt_token_ids": list(prompt)}, params)
        while engine.has_unfinished_requests():
            outputs = engine.step()
            now = time.perf_counter() - begin
            for output in outputs:
                new = list(output.outputs[0].token_ids) if output.outputs else []
                index = index_of[output.request_id]
                times[index].extend([now] * len(new))
                ids[index].extend(new)
                made += len(new)
            progress(made)
        return time.perf_counter() - begin, times, ids

    run_workloads(spec, run_once, result)
    for workload in result["workloads"].values():
        workload["config"] = {
            "max_num_seqs": engine_config.get("max_num_seqs", 128),
            "max_num_batched_tokens": max(engine_config.get("max_batch_tokens", 512), 512),
            "VLLM_CPU_KVCACHE_SPACE": os.environ["VLLM_CPU_KVCACHE_SPACE"],
            "VLLM_CPU_OMP_THREADS_BIND": os.environ["VLLM_CPU_OMP_THREADS_BIND"],
        }
    write_result(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

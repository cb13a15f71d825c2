"""vLLM's multi-LoRA (CPU build) on the prompts and adapters of ``bench/lora.py``.

    bench/peers/.venv-vllm/bin/python bench/peers/vllm_lora.py SPEC.json RESULT.json

Started by ``bench/lora.py --peers vllm``, after cbgen's runs (never beside them). The
spec names the model folder (the safetensors cbgen converted the bundled GGUF to, so both
run the same weights), the dtype, thread count, token-id prompts, ``max_new_tokens`` and
the PEFT adapter folders. The modes are cbgen's: ``base``, ``mixed`` (prompt ``i`` under
adapter ``i % adapters``) and ``single`` (every prompt under adapter 0), alternating within
each repeat; greedy, ``ignore_eos``, the prefix cache reset before every run. The result is
each mode's output tokens per second per repeat, or the error if vLLM refused.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback


def main() -> int:
    spec = json.loads(open(sys.argv[1]).read())
    threads = int(spec["threads"])
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    result: dict = {"system": "vllm"}
    try:
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.lora.request import LoRARequest

        result["engine"] = f"vllm {vllm.__version__}"
        prompts = [{"prompt_token_ids": p} for p in spec["prompts"]]
        longest = max(len(p) for p in spec["prompts"]) + spec["max_new_tokens"]
        started = time.perf_counter()
        llm = LLM(
            model=spec["model_folder"],
            dtype=spec["dtype"],
            enable_lora=True,
            max_loras=len(spec["adapters"]),
            max_lora_rank=spec["rank"],
            max_num_seqs=128,
            max_num_batched_tokens=512,
            max_model_len=max(longest + 16, 256),
            seed=0,
        )
        result["load_s"] = time.perf_counter() - started
        params = SamplingParams(
            max_tokens=spec["max_new_tokens"], temperature=0.0, ignore_eos=True, detokenize=False
        )
        loras = [
            LoRARequest(f"adapter-{i}", i + 1, path) for i, path in enumerate(spec["adapters"])
        ]
        modes = {
            "base": None,
            "mixed": [loras[i % len(loras)] for i in range(len(prompts))],
            "single": loras[0],
        }

        def run(prompt_list, lora) -> float:
            llm.reset_prefix_cache()
            begin = time.perf_counter()
            outputs = llm.generate(prompt_list, params, lora_request=lora, use_tqdm=False)
            elapsed = time.perf_counter() - begin
            return sum(len(o.outputs[0].token_ids) for o in outputs) / elapsed

        run(prompts[:8], None)  # warm-up
        run(prompts[:8], modes["mixed"][:8])
        rates: dict[str, list[float]] = {mode: [] for mode in modes}
        for _ in range(spec["repeats"]):
            for mode, lora in modes.items():
                rates[mode].append(run(prompts, lora))
        result["rates"] = rates
    except Exception as exc:  # report why, so the caller can say it in its table
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()[-4000:]
    with open(sys.argv[2], "w") as handle:
        json.dump(result, handle)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

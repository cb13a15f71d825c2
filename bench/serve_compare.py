"""Serving throughput of ``cbgen serve`` against ``vllm serve``, measured by vLLM's own client.

    python bench/serve_compare.py                       # both servers, 3 repeats each
    python bench/serve_compare.py --systems cbgen --repeats 1
    python bench/serve_compare.py --backends openai,openai-chat   # /v1/completions too

Each server runs in turn on the bundled SmolLM2-135M-Instruct (cbgen's converted folder,
float32), pinned with its client to the same ``--cpus`` (default 0,1) with
``--threads`` compute threads, and is loaded by ``vllm bench serve --backend openai-chat``
(``/v1/chat/completions``; ``--backends openai`` loads ``/v1/completions``, whose client
sends vLLM's ``repetition_penalty`` and ``logprobs`` fields) through
``bench/peers/vllm_cli.py``, from the venv that ``sh bench/peers/setup_vllm.sh`` makes:
``--num-prompts`` random ``--input-len``-token prompts, ``--output-len`` tokens each with
EOS ignored, ``--concurrency`` at a time. One warm-up run precedes the measured repeats;
medians are reported, with cbgen's ratio to vLLM.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
VLLM_PY = ROOT / "bench" / "peers" / ".venv-vllm" / "bin" / "python"
VLLM_CLI = ROOT / "bench" / "peers" / "vllm_cli.py"
ENDPOINTS = {"openai": "/v1/completions", "openai-chat": "/v1/chat/completions"}
FIELDS = {
    "request_s": r"Request throughput \(req/s\):\s+([\d.]+)",
    "failed": r"Failed requests:\s+(\d+)",
    "output_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
    "ttft_median_ms": r"Median TTFT \(ms\):\s+([\d.]+)",
    "itl_median_ms": r"Median ITL \(ms\):\s+([\d.]+)",
    "tpot_median_ms": r"Median TPOT \(ms\):\s+([\d.]+)",
}


def _model_dir() -> Path:
    sys.path.insert(0, str(ROOT))
    from cbgen.models.loader import cache_dir, load_model

    folder = cache_dir() / "smollm2"
    if not (folder / "config.json").exists():
        load_model("smollm2", tokenizer=False)  # converts the bundled GGUF once
    return folder


def _pinned_env(args: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    env["OMP_NUM_THREADS"] = str(args.threads)
    return env


def _server_command(system: str, args: argparse.Namespace, folder: Path) -> tuple[list, dict]:
    env = _pinned_env(args)
    if system == "cbgen":
        cmd = [sys.executable, "-m", "cbgen", "serve", "--model", "smollm2"]
        cmd += [
            "--port",
            str(args.port),
            "--served-model-name",
            "smollm2",
            "--log-level",
            "warning",
        ]
        return cmd, env
    env["VLLM_CPU_OMP_THREADS_BIND"] = args.cpus  # "0,1": its OpenMP threads on our cores
    env["HF_HUB_OFFLINE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(args.vllm_kv_gib)
    cmd = [str(args.vllm_python), str(VLLM_CLI), "serve", str(folder)]
    cmd += ["--served-model-name", "smollm2"]
    cmd += ["--port", str(args.port), "--dtype", "float32", "--max-model-len", "2048"]
    cmd += ["--max-num-seqs", "128", "--max-num-batched-tokens", "512"]
    cmd += ["--uvicorn-log-level", "warning", "--disable-log-stats"]
    return cmd, env


def _wait_ready(port: int, proc: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited with {proc.returncode}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("the server did not become ready")


def _run_client(
    args: argparse.Namespace, folder: Path, num_prompts: int, backend: str
) -> dict[str, float]:
    cmd = [str(args.vllm_python), str(VLLM_CLI), "bench", "serve", "--backend", backend]
    cmd += ["--base-url", f"http://127.0.0.1:{args.port}", "--endpoint", ENDPOINTS[backend]]
    cmd += ["--model", "smollm2", "--tokenizer", str(folder), "--dataset-name", "random"]
    cmd += ["--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)]
    cmd += ["--num-prompts", str(num_prompts), "--max-concurrency", str(args.concurrency)]
    cmd += ["--ignore-eos", "--seed", "0", "--disable-tqdm"]
    env = dict(os.environ, VLLM_TARGET_DEVICE="cpu")
    cpus = {int(c) for c in args.cpus.split(",")}
    out = subprocess.run(
        cmd,
        env=env,
        capture_output=True,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
        timeout=args.timeout,
    )
    if out.returncode != 0:
        raise RuntimeError(f"vllm bench serve failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
    result = {}
    for name, pattern in FIELDS.items():
        match = re.search(pattern, out.stdout)
        result[name] = float(match.group(1)) if match else float("nan")
    if result["failed"] != 0:
        raise RuntimeError(f"{result['failed']:.0f} requests failed:\n{out.stdout[-3000:]}")
    return result


def measure(
    system: str, args: argparse.Namespace, folder: Path
) -> dict[str, list[dict[str, float]]]:
    """The runs of every backend (``--backends``) against one server."""
    cmd, env = _server_command(system, args, folder)
    cpus = {int(c) for c in args.cpus.split(",")}
    proc = subprocess.Popen(
        cmd,
        env=env,
        cwd=ROOT,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: os.sched_setaffinity(0, cpus),
    )
    try:
        _wait_ready(args.port, proc, args.timeout)
        runs: dict[str, list[dict[str, float]]] = {}
        for backend in args.backends.split(","):
            _run_client(args, folder, args.concurrency, backend)  # warm-up
            runs[backend] = []
            for i in range(args.repeats):
                result = _run_client(args, folder, args.num_prompts, backend)
                print(f"{system} {backend} run {i + 1}: {result}", flush=True)
                runs[backend].append(result)
        return runs
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--systems", default="cbgen,vllm")
    parser.add_argument("--cpus", default="0,1")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--port", type=int, default=8123)
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--vllm-kv-gib", type=int, default=4)
    parser.add_argument("--timeout", type=float, default=900)
    parser.add_argument("--backends", default="openai-chat", help="openai, openai-chat or both")
    parser.add_argument("--vllm-python", type=Path, default=VLLM_PY, help="vLLM's venv python")
    args = parser.parse_args(argv)
    if set(args.backends.split(",")) - set(ENDPOINTS):
        parser.error(f"--backends: one or more of {', '.join(ENDPOINTS)}")
    systems = args.systems.split(",")
    if not args.vllm_python.exists():
        print("the client is vLLM's: sh bench/peers/setup_vllm.sh", file=sys.stderr)
        return 1
    folder = _model_dir()
    medians: dict[tuple[str, str], dict[str, float]] = {}
    for system in systems:
        for backend, runs in measure(system, args, folder).items():
            medians[system, backend] = {k: statistics.median(r[k] for r in runs) for k in FIELDS}
    print()
    print(
        f"{'system':8} {'backend':12} {'req/s':>7} {'output tok/s':>13} {'TTFT ms':>9} "
        f"{'ITL ms':>8} {'TPOT ms':>8}"
    )
    for (system, backend), m in medians.items():
        print(
            f"{system:8} {backend:12} {m['request_s']:7.2f} {m['output_tok_s']:13.1f} "
            f"{m['ttft_median_ms']:9.0f} {m['itl_median_ms']:8.1f} {m['tpot_median_ms']:8.1f}"
        )
    for backend in args.backends.split(","):
        if ("cbgen", backend) in medians and ("vllm", backend) in medians:
            ratio = (
                medians["cbgen", backend]["output_tok_s"] / medians["vllm", backend]["output_tok_s"]
            )
            print(f"{backend}: cbgen / vLLM output tok/s {ratio:.2f}x (medians of {args.repeats})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

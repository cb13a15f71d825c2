"""A bounded load test of ``python -m cbgen serve`` over loopback.

    python bench/server_load.py                      # tiny random model, 32 clients, 200 requests
    python bench/server_load.py --model smollm2 --clients 8 --requests 40
    python bench/server_load.py --url http://127.0.0.1:8000 --served-model-name smollm2

Without ``--url`` it starts the server in a subprocess (``--model tiny``, the default,
is a 2-layer random Llama with SmolLM2's tokenizer and vocabulary, saved to a temporary
folder). ``--clients`` streaming clients share ``--requests`` requests (chat and plain
completions, random lengths); a fraction ``--disconnect`` of them hang up after a few
chunks. It then checks that every request ended (``data: [DONE]`` or a deliberate hang-up,
no errors), that the server is idle with zero KV blocks in use (from ``/metrics``) and
that it still answers, and prints requests/s and TTFT / ITL percentiles. Exit status 1
when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain gravity to a child in two sentences.",
    "List three uses for a paperclip.",
    "Why is the sky blue?",
    "Summarize the plot of Hamlet in one paragraph.",
    "Give me a recipe for pancakes.",
    "What are the benefits of regular exercise?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def save_tiny_model(folder: Path) -> None:
    """A 2-layer random Llama with SmolLM2's tokenizer (vocabulary 49,152) in ``folder``."""
    import torch
    import transformers as tf

    import cbgen
    from cbgen.models.loader import cache_dir

    source = cache_dir() / "smollm2"
    if not (source / "tokenizer.json").exists():
        cbgen.load_model("smollm2")  # converts the bundled model once
    tokenizer = tf.AutoTokenizer.from_pretrained(source)
    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {"p50": float("nan"), "p90": float("nan"), "p99": float("nan")}
    ordered = sorted(values)

    def pick(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": pick(0.5), "p90": pick(0.9), "p99": pick(0.99)}


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


async def _one(client: httpx.AsyncClient, model: str, rng: random.Random, args, stats) -> None:
    chat = rng.random() < 0.5
    max_tokens = rng.randint(max(1, args.max_tokens // 4), args.max_tokens)
    hang_up_after = rng.randint(1, 4) if rng.random() < args.disconnect else None
    body = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": 0.8,
        "seed": rng.randrange(1 << 30),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    prompt = rng.choice(PROMPTS)
    if chat:
        url = "/v1/chat/completions"
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        url = "/v1/completions"
        body["prompt"] = prompt
    start = time.perf_counter()
    last = None
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                stats["errors"].append(f"{response.status_code}: {(await response.aread())[:200]}")
                return
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    stats["completed"] += 1
                    return
                event = json.loads(data)
                if "error" in event:
                    stats["errors"].append(str(event["error"]))
                    return
                for choice in event.get("choices", []):
                    text = choice["delta"].get("content") if chat else choice.get("text")
                    if not text:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        stats["ttft"].append(now - start)
                    else:
                        stats["itl"].append(now - last)
                    last = now
                    chunks += 1
                    stats["chunks"] += 1
                if event.get("usage"):
                    stats["tokens"] += event["usage"]["completion_tokens"]
                if hang_up_after is not None and chunks >= hang_up_after:
                    stats["disconnected"] += 1
                    return  # leaving the block closes the connection mid-stream
            stats["errors"].append("stream ended without [DONE]")
    except httpx.HTTPError as exc:
        stats["errors"].append(f"{type(exc).__name__}: {exc}")


async def _load(base_url: str, model: str, headers: dict, args) -> dict:
    stats = {
        "completed": 0,
        "disconnected": 0,
        "errors": [],
        "ttft": [],
        "itl": [],
        "chunks": 0,
        "tokens": 0,
    }
    rng = random.Random(args.seed)
    todo = list(range(args.requests))
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout
    ) as client:

        async def worker() -> None:
            while todo:
                todo.pop()
                await _one(client, model, rng, args, stats)

        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(args.clients)))
        stats["wall"] = time.perf_counter() - started
    return stats


def _wait_idle(base_url: str, timeout: float) -> str:
    """The /metrics text once nothing runs, waits or holds a block (or at the deadline)."""
    deadline = time.monotonic() + timeout
    while True:
        text = httpx.get(f"{base_url}/metrics", timeout=10).text
        busy = sum(
            _metric(text, name)
            for name in ("cbgen_requests_running", "cbgen_requests_waiting", "cbgen_kv_blocks_used")
        )
        if busy == 0 or time.monotonic() > deadline:
            return text
        time.sleep(0.1)


def run_load(base_url: str, model: str, args, api_key: str | None = None) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    stats = asyncio.run(_load(base_url, model, headers, args))
    metrics = _wait_idle(base_url, 30)
    stats["blocks_used_idle"] = _metric(metrics, "cbgen_kv_blocks_used")
    stats["running_idle"] = _metric(metrics, "cbgen_requests_running") + _metric(
        metrics, "cbgen_requests_waiting"
    )
    stats["server_disconnects"] = _metric(metrics, "cbgen_client_disconnects_total")
    after = httpx.post(
        f"{base_url}/v1/completions",
        headers=headers,
        json={"model": model, "prompt": "Still there?", "max_tokens": 4},
        timeout=60,
    )
    stats["still_serving"] = after.status_code == 200 and len(after.json()["choices"]) == 1
    return stats


def report(stats: dict, args) -> bool:
    ttft = _percentiles(stats["ttft"])
    itl = _percentiles(stats["itl"])
    wall = stats["wall"]
    ended = stats["completed"] + stats["disconnected"] + len(stats["errors"])
    print(
        f"{args.requests} requests, {args.clients} clients: {stats['completed']} completed, "
        f"{stats['disconnected']} hung up on purpose (server saw "
        f"{stats['server_disconnects']:.0f}), {len(stats['errors'])} errors"
    )
    print(
        f"wall {wall:.2f} s | {ended / wall:.1f} req/s | {stats['chunks'] / wall:.1f} chunks/s | "
        f"{stats['tokens']} tokens in completed streams"
    )
    print(
        "TTFT ms  p50 {p50:.1f}  p90 {p90:.1f}  p99 {p99:.1f}".format(
            **{k: v * 1e3 for k, v in ttft.items()}
        )
    )
    print(
        "ITL  ms  p50 {p50:.1f}  p90 {p90:.1f}  p99 {p99:.1f}".format(
            **{k: v * 1e3 for k, v in itl.items()}
        )
    )
    print(
        f"idle after the run: {stats['blocks_used_idle']:.0f} KV blocks used, "
        f"{stats['running_idle']:.0f} requests running or waiting; "
        f"still serving: {stats['still_serving']}"
    )
    for error in stats["errors"][:5]:
        print("error:", error)
    ok = (
        ended == args.requests
        and not stats["errors"]
        and stats["blocks_used_idle"] == 0
        and stats["running_idle"] == 0
        and stats["still_serving"]
    )
    print("OK" if ok else "FAILED")
    return ok


def _start_server(args, folder: str, port: int) -> subprocess.Popen:
    command = [
        sys.executable,
        "-m",
        "cbgen",
        "serve",
        "--model",
        folder,
        "--served-model-name",
        args.served_model_name,
        "--port",
        str(port),
        "--num-blocks",
        str(args.num_blocks),
        "--log-level",
        "warning",
    ]
    if args.api_key:
        command += ["--api-key", args.api_key]
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    return subprocess.Popen(command, env=env)


def _wait_healthy(base_url: str, process: subprocess.Popen, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"the server exited with status {process.returncode}")
        try:
            if httpx.get(f"{base_url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"the server did not come up within {timeout:.0f} s")


def _stop_server(process: subprocess.Popen) -> None:
    """Ask the server to stop; kill it if it has not within 30 s."""
    process.terminate()
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", help="an already running server (else one is started)")
    parser.add_argument("--model", default="tiny", help="'tiny', 'smollm2' or a model folder")
    parser.add_argument("--served-model-name", default="tiny")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--disconnect", type=float, default=0.15, help="share that hang up")
    parser.add_argument("--num-blocks", type=int, default=512, help="started server's KV blocks")
    parser.add_argument("--threads", type=int, default=1, help="started server's torch threads")
    parser.add_argument("--timeout", type=float, default=120.0, help="per-request seconds")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.url:
        stats = run_load(args.url.rstrip("/"), args.served_model_name, args, args.api_key)
        return 0 if report(stats, args) else 1
    with tempfile.TemporaryDirectory(prefix="cbgen-load-") as tmp:
        folder = args.model
        if args.model == "tiny":
            folder = tmp
            save_tiny_model(Path(tmp))
        elif args.served_model_name == "tiny":
            args.served_model_name = args.model
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        process = _start_server(args, folder, port)
        try:
            _wait_healthy(base_url, process, 300)
            stats = run_load(base_url, args.served_model_name, args, args.api_key)
        finally:
            _stop_server(process)
    return 0 if report(stats, args) else 1


if __name__ == "__main__":
    sys.exit(main())

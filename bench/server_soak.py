"""A soak test of one ``python -m cbgen serve``: thousands of varied calls, then RSS and blocks.

    python bench/server_soak.py                                  # bundled SmolLM2, 10,000 calls
    python bench/server_soak.py --model tiny --calls 2000        # a quick run
    python bench/server_soak.py --env ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 --out soak.json

It starts the server (``--model``: ``smollm2``, ``tiny`` or a folder; see
``server_load.py``) and sends ``--calls`` calls from ``--clients`` concurrent clients:
chat and plain completions, streamed and not, prompts of a few to a few hundred
tokens, ``max_tokens`` from 1 to 64, some with ``n`` > 1, logprobs, a JSON or regex
constraint or a forced tool call, some hung up mid-stream, and some bad on purpose
(each must get a 4xx). After every 500 calls it reads the server's RSS (``VmRSS`` of
the process) and its KV blocks in use. At the end it waits for the server to go idle
and checks: no 5xx and no error inside a stream, every KV block back, the server still
answers, and RSS at the end within ``--rss-tolerance`` (10%) of RSS after the first 500
calls (the warm-up). Exit status 1 when a check fails.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).parent))
from server_load import (  # noqa: E402
    _free_port,
    _metric,
    _stop_server,
    _wait_healthy,
    _wait_idle,
    save_tiny_model,
)

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven wizards quietly judge "
    "boxing matches in the old town square and a river runs past the mill"
).split()
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
BAD = [  # (path, body): each must be a 4xx
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "temperature": -1}),
    ("/v1/completions", {"prompt": "x", "max_tokens": 4, "guided_regex": "([a-z"}),
    ("/v1/completions", {"prompt": "word " * 5000, "max_tokens": 4}),
    ("/v1/completions", {"prompt": [10**9], "max_tokens": 4}),
    ("/v1/completions", {"prompt": "", "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [], "max_tokens": 4}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_schema", "json_schema": {
                                  "name": "x", "schema": {"type": "nonsense"}}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "tools": [WEATHER], "tool_choice": {"type": "function",
                                                                 "function": {"name": "nope"}}}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "n": 0}),
]  # fmt: skip


def rss_mib(pid: int) -> float:
    """The process's resident memory (MiB), children included (none for ``cbgen serve``)."""
    total = 0.0
    for p in [pid, *_children(pid)]:
        try:
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1]) / 1024
        except OSError:
            pass
    return total


def _children(pid: int) -> list[int]:
    try:
        text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    except OSError:
        return []
    return [int(c) for c in text.split()]


def _prompt(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.choice([3, 10, 40, 120, 300])))


def make_call(rng: random.Random, model: str) -> tuple[str, dict, str]:
    """(path, body, kind) for one call."""
    roll = rng.random()
    if roll < 0.05:
        path, body = rng.choice(BAD)
        return path, {"model": model, **body}, "bad"
    chat = rng.random() < 0.5
    body: dict = {
        "model": model,
        "max_tokens": rng.randint(1, 64),
        "temperature": rng.choice([0, 0.7, 1.0]),
        "seed": rng.randrange(1 << 30),
        "stream": rng.random() < 0.6,
    }
    if chat:
        body["messages"] = [{"role": "user", "content": _prompt(rng)}]
    else:
        body["prompt"] = _prompt(rng)
    kind = "plain"
    extra = rng.random()
    if extra < 0.08:
        body["n"] = rng.randint(2, 4)
        kind = "n"
    elif extra < 0.16:
        if chat:
            body.update(logprobs=True, top_logprobs=3)
        else:
            body["logprobs"] = 3
        kind = "logprobs"
    elif extra < 0.22:
        if chat:
            body["response_format"] = {"type": "json_object"}
        else:
            body["guided_regex"] = "[a-z]{1,12}( [a-z]{1,12}){0,6}"
        kind = "structured"
    elif extra < 0.26 and chat:
        body.update(tools=[WEATHER], tool_choice="required", max_tokens=64)
        kind = "tools"
    if body["stream"] and rng.random() < 0.15:
        kind = "cancel"
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return path, body, kind


async def one_call(client: httpx.AsyncClient, rng: random.Random, model: str, stats: dict) -> None:
    path, body, kind = make_call(rng, model)
    stats["kinds"][kind] = stats["kinds"].get(kind, 0) + 1
    try:
        if body.get("stream"):
            hang_up = rng.randint(1, 3) if kind == "cancel" else None
            async with client.stream("POST", path, json=body) as response:
                if response.status_code != 200:
                    await response.aread()
                    _status(stats, response.status_code, kind, response.text)
                    return
                events = 0
                async for line in response.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        break
                    if '"error"' in line and "error" in json.loads(line[6:]):
                        stats["failures"].append(f"stream error: {line[:200]}")
                        return
                    events += 1
                    if hang_up is not None and events >= hang_up:
                        stats["cancelled"] += 1
                        return  # leaving the block closes the connection
                _status(stats, 200, kind, "")
        else:
            response = await client.post(path, json=body)
            _status(stats, response.status_code, kind, response.text)
    except httpx.HTTPError as exc:
        stats["failures"].append(f"{type(exc).__name__}: {exc}")


def _status(stats: dict, status: int, kind: str, text: str) -> None:
    stats["statuses"][status] = stats["statuses"].get(status, 0) + 1
    if status >= 500:
        stats["failures"].append(f"{status}: {text[:200]}")
    elif kind == "bad" and status < 400:
        stats["failures"].append(f"a bad call got {status}")
    elif kind != "bad" and status != 200:
        stats["failures"].append(f"a {kind} call got {status}: {text[:200]}")


async def soak(base_url: str, model: str, pid: int, args) -> dict:
    stats: dict = {"statuses": {}, "kinds": {}, "failures": [], "cancelled": 0, "samples": []}
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.clients, max_keepalive_connections=args.clients)
    handed = finished = 0
    started = time.perf_counter()
    async with httpx.AsyncClient(
        base_url=base_url, limits=limits, timeout=httpx.Timeout(args.timeout)
    ) as client:

        async def worker() -> None:
            nonlocal handed, finished
            while handed < args.calls:
                handed += 1
                await one_call(client, rng, model, stats)
                finished += 1
                count = finished
                if count % args.every == 0:
                    metrics = (await client.get("/metrics")).text
                    sample = {
                        "calls": count,
                        "seconds": round(time.perf_counter() - started, 1),
                        "rss_mib": round(rss_mib(pid), 1),
                        "kv_blocks_used": _metric(metrics, "cbgen_kv_blocks_used"),
                    }
                    stats["samples"].append(sample)
                    print(
                        f"{sample['calls']:>6} calls  {sample['seconds']:>8.1f} s  "
                        f"RSS {sample['rss_mib']:>8.1f} MiB  "
                        f"KV blocks in use {sample['kv_blocks_used']:.0f}",
                        flush=True,
                    )

        await asyncio.gather(*(worker() for _ in range(args.clients)))
    stats["wall_s"] = round(time.perf_counter() - started, 1)
    return stats


def check(stats: dict, base_url: str, model: str, pid: int, args) -> bool:
    metrics = _wait_idle(base_url, 60)
    stats["kv_blocks_used_idle"] = _metric(metrics, "cbgen_kv_blocks_used")
    time.sleep(5)  # the server trims its heap when it goes idle
    stats["rss_idle_mib"] = round(rss_mib(pid), 1)
    after = httpx.post(
        f"{base_url}/v1/completions",
        json={"model": model, "prompt": "Still there?", "max_tokens": 4},
        timeout=60,
    )
    stats["still_serving"] = after.status_code == 200
    samples = [s for s in stats["samples"] if s["calls"] >= args.warmup]
    warm = samples[0]["rss_mib"] if samples else float("nan")
    end = samples[-1]["rss_mib"] if samples else float("nan")
    stats["rss_growth"] = round(end / warm - 1, 4) if samples else None
    later = [s["rss_mib"] for s in stats["samples"] if s["calls"] >= args.calls // 4]
    if later:  # after the first quarter: how flat it stays
        stats["rss_range_after_first_quarter"] = [min(later), max(later)]
    print(
        f"{args.calls} calls in {stats['wall_s']} s; statuses {dict(sorted(stats['statuses'].items()))}; "
        f"{stats['cancelled']} hung up on purpose; kinds {stats['kinds']}"
    )
    if later:
        print(f"RSS from call {args.calls // 4} on: {min(later):.1f} to {max(later):.1f} MiB")
    print(
        f"RSS after {samples[0]['calls'] if samples else 0} calls {warm:.1f} MiB, at the end "
        f"{end:.1f} MiB ({100 * (stats['rss_growth'] or 0):+.1f}%), idle {stats['rss_idle_mib']} MiB; "
        f"KV blocks in use when idle {stats['kv_blocks_used_idle']:.0f}; "
        f"still serving {stats['still_serving']}"
    )
    for failure in stats["failures"][:10]:
        print("failure:", failure)
    ok = (
        not stats["failures"]
        and stats["kv_blocks_used_idle"] == 0
        and stats["still_serving"]
        and stats["rss_growth"] is not None
        and stats["rss_growth"] <= args.rss_tolerance
    )
    print("OK" if ok else "FAILED")
    return ok


def start_server(args, folder: str, port: int) -> subprocess.Popen:
    command = [sys.executable, "-m", "cbgen", "serve", "--model", folder,
               "--served-model-name", args.served_model_name, "--port", str(port),
               "--num-blocks", str(args.num_blocks), "--log-level", "warning",
               "--max-waiting-requests", "100000", "--commit-kv-cache"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1"}
    for item in args.env:
        key, _, value = item.partition("=")
        env[key] = value
    return subprocess.Popen(command, env=env)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2", help="'smollm2', 'tiny' or a folder")
    parser.add_argument("--served-model-name", default="soak")
    parser.add_argument("--calls", type=int, default=10_000)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--every", type=int, default=500, help="calls between RSS samples")
    parser.add_argument("--threads", type=int, default=2, help="the server's torch threads")
    parser.add_argument("--num-blocks", type=int, default=1024)
    parser.add_argument("--rss-tolerance", type=float, default=0.10)
    parser.add_argument(
        "--warmup", type=int, default=500, help="calls before the RSS the end is compared with"
    )
    parser.add_argument("--timeout", type=float, default=300.0, help="per-call seconds")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE",
                        help="extra environment for the server")  # fmt: skip
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        folder = args.model
        if folder == "tiny":
            folder = str(Path(tmp) / "tiny")
            save_tiny_model(Path(folder))
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        process = start_server(args, folder, port)
        try:
            _wait_healthy(base_url, process, 300)
            stats = asyncio.run(soak(base_url, args.served_model_name, process.pid, args))
            ok = check(stats, base_url, args.served_model_name, process.pid, args)
        finally:
            _stop_server(process)
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **stats}, indent=1))
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

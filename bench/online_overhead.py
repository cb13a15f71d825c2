"""Per-request overhead of the online engine, with thousands of one-token requests.

    .venv/bin/python bench/online_overhead.py [--requests 2000] [--threads 2]

A tiny random Llama (2 layers, hidden 64) keeps the forward pass cheap, and every
request asks for ``max_new_tokens=1``, so the run is dominated by bookkeeping. For
each way of consuming results it reports the wall time, the time spent inside
``core.step()`` and the difference per request: the engine's overhead (adding,
the command queue, publishing deltas, waking the consumer), in microseconds.
``core-sync`` is the synchronous core driven by a plain loop, for reference.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import threading
import time

import torch

from cbgen import EngineConfig, SamplingParams
from cbgen.core.engine_core import EngineCore
from cbgen.frontends.online import Engine


def tiny_model() -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


class StepTimer:
    """Wraps ``core.step`` and adds up the time spent inside it."""

    def __init__(self, core: EngineCore) -> None:
        self.inner = core.step
        self.seconds = 0.0
        self.steps = 0
        core.step = self  # type: ignore[method-assign]

    def __call__(self):
        start = time.perf_counter()
        try:
            return self.inner()
        finally:
            self.seconds += time.perf_counter() - start
            self.steps += 1


def run_core(model, config, prompts, params):
    """The synchronous core in a plain loop, on a thread of its own like the online loop."""
    result = []
    worker = threading.Thread(
        target=lambda: result.append(_run_core(model, config, prompts, params))
    )
    worker.start()
    worker.join()
    return result[0]


def _run_core(model, config, prompts, params):
    with EngineCore(model, config) as core:
        timer = StepTimer(core)
        start = time.perf_counter()
        for prompt in prompts:
            core.add_request(prompt, params)
        done = 0
        while core.has_unfinished():
            done += sum(out.finished for out in core.step())
        wall = time.perf_counter() - start
    assert done == len(prompts)
    return wall, timer


def run_online(mode, model, config, prompts, params):
    with Engine(model, None, config) as engine:
        engine.sync()  # the loop thread is up before the clock starts
        timer = StepTimer(engine.core)
        start = time.perf_counter()
        if mode == "get_result(any)":
            for prompt in prompts:
                engine.add_request(prompt, params)
            outs = [engine.get_result() for _ in prompts]
        elif mode == "get_result(id)":
            ids = [engine.add_request(prompt, params) for prompt in prompts]
            outs = [engine.get_result(rid) for rid in ids]
        elif mode == "stream":
            ids = [engine.add_request(prompt, params) for prompt in prompts]
            outs = [list(engine.stream(rid))[-1] for rid in ids]
        elif mode == "stream_async":

            async def consume(rid):
                return [d async for d in engine.stream_async(rid)][-1]

            async def main():
                ids = [engine.add_request(prompt, params) for prompt in prompts]
                return await asyncio.gather(*(consume(rid) for rid in ids))

            outs = asyncio.run(main())
        else:
            raise ValueError(mode)
        wall = time.perf_counter() - start
        assert len(outs) == len(prompts) and all(o.finished for o in outs)
        assert engine.core.allocator.num_free == engine.core.allocator.num_blocks
    return wall, timer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    parser.add_argument("--repeat", type=int, default=3, help="runs per mode; the best is shown")
    parser.add_argument(
        "--modes",
        default="core-sync,get_result(any),get_result(id),stream,stream_async",
        help="comma-separated subset of the modes",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rng = random.Random(0)
    prompts = [
        [rng.randrange(3, 256) for _ in range(rng.randint(4, 12))] for _ in range(args.requests)
    ]
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    config = EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=128, max_batch_tokens=2048)
    model = tiny_model()
    run_core(model, config, prompts, params)  # warm-up: the first big steps are slow
    print(f"{args.requests} requests, max_new_tokens=1, tiny llama, best of {args.repeat}")
    print(f"{'mode':<16} {'wall s':>8} {'step s':>8} {'steps':>6} {'overhead us/req':>16}")
    for mode in args.modes.split(","):
        runs = []
        for _ in range(args.repeat):
            if mode == "core-sync":
                wall, timer = run_core(model, config, prompts, params)
            else:
                wall, timer = run_online(mode, model, config, prompts, params)
            runs.append(((wall - timer.seconds) / args.requests * 1e6, wall, timer))
        overhead, wall, timer = min(runs, key=lambda run: run[0])
        print(f"{mode:<16} {wall:8.3f} {timer.seconds:8.3f} {timer.steps:6d} {overhead:16.1f}")


if __name__ == "__main__":
    main()

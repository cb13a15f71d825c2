"""Time cbgen decode steps at a fixed batch, comparing variants interleaved in one process.

``python bench/micro_step.py --seqs 64 --ctx 400 --threads 1``

``--arch phi3`` (any ``model_type`` transformers' ``AutoConfig.for_model`` knows) times a
random-weight model of that architecture at the bundled SmolLM2's sizes instead, in
``--dtype``: for architectures whose weights are not bundled.

Prefills ``--seqs`` random prompts of ``--ctx`` tokens, then times decode steps
(``EngineCore.step``) under each variant in turn (A, B, A, B, ...), reporting
medians: on a shared machine absolute timings drift, so only variants measured
side by side are compared. Times are the main thread's CPU time with one thread
(immune to being descheduled), wall time otherwise. Variants:

* ``fast``: the default, prepacked weights and the decoder fast path
  (``cbgen.executor.cpu.fast_forward``);
* ``prepack`` / ``no-prepack``: the model's own forward, with oneDNN prepacked
  linear maps on or off;
* ``unfused``: the model's own forward, prepacked, but q/k/v and gate/up as
  separate GEMMs;
* ``kernel`` / ``torch-attn``: the native paged decode kernel or the torch path;
* ``engine`` / ``engine-module``: the engine as it built itself (its own linear maps,
  in any dtype), with its fast decoder or with the model's own forward on the same maps.
  Compare these two with each other only: the variants above repack the maps.

``--profile`` prints a torch.profiler table of a few steps of the first variant.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.executor.attention import NativeCpuAttention, TorchReferenceAttention
from cbgen.executor.cpu.fast_forward import build_fast_forward
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.prepack import PackedLinears
from cbgen.executor.native import NativeKernels


def prefilled_engine(model: torch.nn.Module, seqs: int, ctx: int) -> EngineCore:
    """An engine whose ``seqs`` requests have all finished prefill (next steps are decodes)."""
    gen = torch.Generator().manual_seed(0)
    config = EngineConfig(max_num_seqs=seqs, max_batch_tokens=max(512, seqs * ctx))
    engine = EngineCore(model, config)
    for _ in range(seqs):
        prompt = torch.randint(100, 40000, (ctx,), generator=gen).tolist()
        engine.add_request(prompt, SamplingParams(max_new_tokens=4096, ignore_eos=True))
    while engine.stats["decode_tokens"] < seqs:
        engine.step()
    return engine


def smollm2_sized(arch: str, dtype: torch.dtype) -> torch.nn.Module:
    """A random-weight ``arch`` model with SmolLM2-135M's layer count, widths, heads and
    vocabulary (transformers' defaults for everything else)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        arch,
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=8192,
        pad_token_id=0,
    )
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=dtype).eval()


def variants(engine: EngineCore) -> dict[str, Callable[[], None]]:
    """Setters that switch the engine to each variant."""
    runner, builder, model = engine.executor.runner, engine.executor.batch_builder, engine.model
    kernel = decode_kernel()
    native = NativeCpuAttention(NativeKernels())
    packed: list[PackedLinears] = []
    own_fast_forward = runner.fast_forward

    def engine_built(fast: bool) -> Callable[[], None]:
        def apply() -> None:
            runner.fast_forward = own_fast_forward if fast else None

        return apply

    def prepack(on: bool, fuse: bool = True, fast: bool = True) -> Callable[[], None]:
        def apply() -> None:
            runner.linear.close()  # the engine's own packing, if any
            while packed:
                packed.pop().restore()
            if on:
                packed.append(PackedLinears(model, fuse=fuse))
            runner.fast_forward = (
                build_fast_forward(model, packed[0], runner.probe, kernel)
                if fast and packed
                else None
            )

        return apply

    def attn(use_native: bool) -> Callable[[], None]:
        def apply() -> None:
            builder.attention = native if use_native else TorchReferenceAttention()

        return apply

    return {
        "fast": prepack(True),
        "prepack": prepack(True, fast=False),
        "no-prepack": prepack(False),
        "unfused": prepack(True, fuse=False),
        "kernel": attn(True),
        "torch-attn": attn(False),
        "engine": engine_built(True),
        "engine-module": engine_built(False),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seqs", type=int, default=64)
    parser.add_argument("--ctx", type=int, default=30)
    parser.add_argument("--rounds", type=int, default=5, help="steps per variant")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compare", default="prepack,fast", help="comma-separated variants")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--arch", help="a random-weight model of this model_type, SmolLM2-sized")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.threads == 1 else time.perf_counter
    dtype = getattr(torch, args.dtype)
    if args.arch:
        model = smollm2_sized(args.arch, dtype)
    else:
        model, _ = cbgen.load_model("smollm2", dtype=dtype)
    engine = prefilled_engine(model, args.seqs, args.ctx)
    setters = variants(engine)
    names = args.compare.split(",")
    times: dict[str, list[float]] = {name: [] for name in names}
    for _ in range(args.rounds):
        for name in names:
            setters[name]()
            engine.step()  # settle after the switch
            start = clock()
            engine.step()
            times[name].append(clock() - start)
    for name in names:
        ms = [round(t * 1e3, 1) for t in times[name]]
        print(f"{name:>12}: median {statistics.median(times[name]) * 1e3:7.1f} ms  {ms}")
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        setters[names[0]]()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(3):
                engine.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    engine.close()


if __name__ == "__main__":
    main()

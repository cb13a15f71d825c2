"""A hybrid (state + attention) model against transformers' ``generate``, in one run.

    .venv/bin/python bench/hybrid.py [--arch falcon_h1|qwen3_next] [--repeats 3] [--threads 2]

Builds a random-weight model of about 100M parameters of the chosen shape (Falcon-H1:
Mamba2 mixers beside attention in every layer; Qwen3-Next: three gated-delta-rule
layers to one attention layer, mixture of experts), then decodes the same prompts with
``cbgen.generate_batch`` and with ``model.generate`` (one left-padded batch), 1 prompt
and 64 prompts, greedy, every request exactly ``--max-new-tokens`` long. Prints the
median output tokens per second of each, cbgen's ratio, whether the outputs agree, and
the engine's KV bytes per token and state bytes per request. Both run transformers'
torch implementations of the mixers (no mamba-ssm / flash-linear-attention on CPU).

``--samples N`` measures GRPO's shape instead: every prompt N times (``n=N``, sampled),
cbgen with prefix caching (the repeats start from a state checkpoint) against cbgen
without, and how many prompt tokens the cache served.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.state import state_bytes_per_request


def build_model(arch: str) -> torch.nn.Module:
    import transformers as tf

    common = dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    if arch == "falcon_h1":
        config = tf.FalconH1Config(
            **common,
            num_hidden_layers=8,
            mamba_d_ssm=1536,
            mamba_n_heads=24,
            mamba_d_head=64,
            mamba_n_groups=1,
            mamba_d_state=64,
            mamba_d_conv=4,
            mamba_expand=2,
            mamba_chunk_size=64,
        )
    elif arch == "qwen3_next":
        config = tf.Qwen3NextConfig(
            **common,
            num_hidden_layers=8,
            head_dim=64,
            linear_conv_kernel_dim=4,
            linear_key_head_dim=64,
            linear_value_head_dim=64,
            linear_num_key_heads=6,
            linear_num_value_heads=12,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=512,
            shared_expert_intermediate_size=1024,
        )
    else:
        raise SystemExit(f"unknown --arch {arch}")
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def prompts_for(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 32000) for _ in range(rng.randint(32, 96))] for _ in range(count)]


def run_cbgen(model, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    started = time.perf_counter()
    outputs = cbgen.generate_batch(model, prompts, params, EngineConfig(max_num_seqs=64))
    return time.perf_counter() - started, [o.token_ids for o in outputs]


def run_generate(model, prompts, new_tokens) -> tuple[float, list[list[int]]]:
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    started = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    return time.perf_counter() - started, out[:, width:].tolist()


def run_samples(model, prompts, new_tokens, samples, repeats) -> None:
    """``n=samples`` of every prompt, with and without prefix caching, alternated."""
    params = SamplingParams(
        max_new_tokens=new_tokens, ignore_eos=True, n=samples, temperature=1.0, seed=0
    )
    times: dict[bool, list[float]] = {True: [], False: []}
    cached: dict[bool, int] = {}
    for _ in range(repeats):
        for caching in (True, False):
            config = EngineConfig(max_num_seqs=64, enable_prefix_caching=caching)
            started = time.perf_counter()
            outputs = cbgen.generate_batch(model, prompts, params, config)
            times[caching].append(time.perf_counter() - started)
            cached[caching] = sum(c.num_cached_tokens for out in outputs for c in out.completions)
    tokens = len(prompts) * samples * new_tokens
    print("| prompts x samples | prefix caching | tok/s | prompt tokens from the cache |")
    print("|---|---|---:|---:|")
    for caching in (True, False):
        rate = tokens / statistics.median(times[caching])
        print(
            f"| {len(prompts)} x {samples} | {'on' if caching else 'off'} | {rate:.1f} "
            f"| {cached[caching]} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", default="falcon_h1")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batches", default="1,64")
    parser.add_argument("--samples", type=int, default=0, help="GRPO shape: n per prompt")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model = build_model(args.arch)
    params = sum(p.numel() for p in model.parameters())
    with EngineCore(model, EngineConfig(max_num_seqs=64)) as engine:
        kv_bytes = engine.executor.cache.bytes_per_block // engine.config.block_size
        state_bytes = state_bytes_per_request(engine.state_specs)
        state_layers = len(engine.state_specs)
    print(
        f"{args.arch}: {params / 1e6:.0f}M parameters, float32, {args.threads} threads; "
        f"KV {kv_bytes} bytes/token ({len(engine.executor.cache.layers)} attention layers), "
        f"state {state_bytes} bytes/request ({state_layers} state layers)"
    )
    if args.samples:
        prompts = prompts_for(64 // args.samples)
        run_samples(model, prompts, args.max_new_tokens, args.samples, args.repeats)
        return
    print(
        "| prompts | cbgen tok/s | generate tok/s | cbgen ÷ generate | ratio per repeat "
        "| same tokens |"
    )
    print("|---:|---:|---:|---:|---|---|")
    for count in (int(b) for b in args.batches.split(",")):
        prompts = prompts_for(count)
        run_cbgen(model, prompts[:1], 4)  # warm-up: kernels built, first-call costs paid
        times: dict[str, list[float]] = {"cbgen": [], "generate": []}
        same = True
        for _ in range(args.repeats):
            # Alternated, so drift on a shared machine hits both alike.
            elapsed, ours = run_cbgen(model, prompts, args.max_new_tokens)
            times["cbgen"].append(elapsed)
            elapsed, theirs = run_generate(model, prompts, args.max_new_tokens)
            times["generate"].append(elapsed)
            same = same and ours == theirs
        tokens = count * args.max_new_tokens
        rate = {name: tokens / statistics.median(t) for name, t in times.items()}
        # Each repeat's pair ran back to back: their ratio shows how far drift reaches.
        pairs = ", ".join(
            f"{g / c:.2f}" for c, g in zip(times["cbgen"], times["generate"], strict=True)
        )
        print(
            f"| {count} | {rate['cbgen']:.1f} | {rate['generate']:.1f} | "
            f"{rate['cbgen'] / rate['generate']:.2f}x | {pairs} | {'yes' if same else 'no'} |"
        )


if __name__ == "__main__":
    main()

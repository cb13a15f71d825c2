"""Shared-prefix workload with prefix caching on/off under both scheduler policies.

    .venv/bin/python bench/prefix_cache_compare.py [--model smollm2] [--num-prompts 32]
        [--prefix-len 512] [--suffix-len 32] [--max-new-tokens 64] [--max-batch-tokens 512]

Every prompt is one shared random prefix plus its own random suffix (token ids, no
tokenizer). Prints, per (policy, caching): prompt tokens computed (prefill work,
recomputation after preemption included), prompt tokens read from the cache,
preemptions, wall time and output tokens per second.
"""

from __future__ import annotations

import argparse
import random
import time

import torch

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams


def _prompts(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    prefix = [rng.randrange(3, vocab) for _ in range(args.prefix_len)]
    return [
        prefix + [rng.randrange(3, vocab) for _ in range(args.suffix_len)]
        for _ in range(args.num_prompts)
    ]


def _run(model, prompts, args, policy: str, caching: bool) -> dict[str, float]:
    config = EngineConfig(
        max_batch_tokens=args.max_batch_tokens,
        enable_prefix_caching=caching,
        scheduler_policy=policy,
        num_blocks=args.num_blocks,
    )
    params = SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True)
    output_tokens = 0
    with EngineCore(model, config) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, request_id=str(i))
        started = time.perf_counter()
        while engine.has_unfinished():
            output_tokens += len(engine.step())
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        wall = time.perf_counter() - started
        stats = dict(engine.stats)
        caching = engine.prefix_caching
    return {
        "caching": caching,
        "prefill": stats["prefill_tokens"],
        "cached": stats["cached_tokens"],
        "preempt": stats["preemptions"],
        "wall": wall,
        "tok_s": output_tokens / wall,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prefix-len", type=int, default=512)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--max-batch-tokens", type=int, default=512)
    parser.add_argument("--num-blocks", type=int, default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    model, _tokenizer = cbgen.load_model(args.model)
    vocab = int(model.get_input_embeddings().weight.shape[0])
    prompts = _prompts(args, vocab)
    print(
        f"{args.num_prompts} prompts = {args.prefix_len} shared + {args.suffix_len} own tokens, "
        f"{args.max_new_tokens} new tokens each, max_batch_tokens {args.max_batch_tokens}"
    )
    print(
        f"{'policy':<14} {'caching':<8} {'prefill tok':>11} {'cached tok':>10} "
        f"{'preempt':>7} {'wall s':>7} {'out tok/s':>9}"
    )
    for policy in ("fifo", "prefill_first"):
        for caching in (False, True):
            r = _run(model, prompts, args, policy, caching)
            print(
                f"{policy:<14} {'on' if r['caching'] else 'off':<8} {r['prefill']:>11} "
                f"{r['cached']:>10} {r['preempt']:>7} {r['wall']:>7.2f} {r['tok_s']:>9.1f}"
            )


if __name__ == "__main__":
    main()

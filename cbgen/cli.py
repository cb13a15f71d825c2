"""``python -m cbgen generate ...``: chat completions from the command line.

``python -m cbgen bench ...``: the benchmark harness (``cbgen.bench``).

``python -m cbgen serve ...``: an OpenAI-compatible server (``cbgen.frontends.server``).

``python -m cbgen batch ...``: a JSONL or Parquet file of prompts, resumable, on this
machine or on Ray (``cbgen.frontends.jobs``)."""

from __future__ import annotations

import argparse
import logging
import sys
import time
from typing import Any

from .core.config import EngineConfig
from .core.engine_core import EngineCore
from .frontends.args.parallel import add_parallel_arguments, parallel_settings
from .frontends.args.precision import add_precision_arguments, load_model_for
from .frontends.args.speculative import add_speculative_arguments, speculative_config
from .frontends.args.structured import add_structured_arguments, structured_output
from .frontends.generate import generate_batch
from .sampling.params import SamplingParams


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="cbgen", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)
    gen = commands.add_parser("generate", help="complete chat prompts with continuous batching")
    gen.add_argument("--model", default="smollm2", help="bundled name, HF folder or .gguf file")
    gen.add_argument("--prompt", action="append", default=[], help="a user message (repeatable)")
    gen.add_argument("--prompts-file", help="a file with one user message per line")
    gen.add_argument("--no-chat-template", action="store_true", help="tokenize prompts as raw text")
    gen.add_argument("--max-new-tokens", type=int, default=128)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--min-p", type=float, default=0.0)
    gen.add_argument("--repetition-penalty", type=float, default=1.0)
    gen.add_argument("--presence-penalty", type=float, default=0.0)
    gen.add_argument("--frequency-penalty", type=float, default=0.0)
    gen.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    gen.add_argument("--logprobs", type=int, help="print each token's logprob and the top N")
    add_structured_arguments(gen)
    add_precision_arguments(gen)
    add_speculative_arguments(gen)
    add_parallel_arguments(gen)
    gen.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    gen.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    gen.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    gen.add_argument("--progress", action="store_true", help="show a progress bar")
    gen.add_argument("--quiet", action="store_true", help="print only the throughput line")
    bench = commands.add_parser(
        "bench", help="benchmark cbgen against transformers' baselines (see README)"
    )
    from .bench.harness import add_arguments

    add_arguments(bench)
    serve = commands.add_parser(
        "serve", help="serve an OpenAI-compatible API (completions, chat) over HTTP"
    )
    from .frontends.server.cli import add_arguments as add_serve_arguments

    add_serve_arguments(serve)
    batch = commands.add_parser(
        "batch", help="run a JSONL/Parquet file of prompts into an output file (resumable, Ray)"
    )
    from .frontends.jobs.cli import add_arguments as add_batch_arguments

    add_batch_arguments(batch)
    return parser


def _read_prompts(args: argparse.Namespace) -> list[str]:
    prompts = list(args.prompt)
    if args.prompts_file:
        with open(args.prompts_file, encoding="utf-8") as f:
            prompts.extend(line.rstrip("\n") for line in f if line.strip())
    return prompts


def generate_command(args: argparse.Namespace) -> int:

    try:
        prompts = _read_prompts(args)
        constraint = structured_output(args)
    except OSError as exc:  # a missing or unreadable --prompts-file / --json-schema
        print(f"cbgen generate: {exc}", file=sys.stderr)
        return 2
    if not prompts:
        print("cbgen generate: give at least one --prompt or a --prompts-file", file=sys.stderr)
        return 2
    model, tokenizer = load_model_for(args)
    if args.no_chat_template:
        token_ids = [tokenizer(p)["input_ids"] for p in prompts]
    else:  # raw text for a tokenizer without a chat template
        from .bench.workloads import chat_token_ids

        token_ids = [chat_token_ids(tokenizer, p) for p in prompts]
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        seed=args.seed,
        ignore_eos=args.ignore_eos,
        repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        stop=args.stop,
        logprobs=args.logprobs,
        structured_output=constraint,
    )
    try:
        config = EngineConfig(
            block_size=args.block_size,
            max_batch_tokens=args.max_batch_tokens,
            max_num_seqs=args.max_num_seqs,
            kv_cache_dtype=args.kv_cache_dtype,
            speculative=speculative_config(args),
            **parallel_settings(args),
        )
        # Built apart, so the rates below count generation only: the first run on a
        # machine compiles the native kernels (about a minute), every run packs weights.
        started = time.perf_counter()
        engine = EngineCore(model, config, tokenizer)
        build = time.perf_counter() - started
        with engine:
            started = time.perf_counter()
            outputs = generate_batch(engine, token_ids, params, progress=args.progress)
            wall = time.perf_counter() - started
    except ValueError as exc:
        print(f"cbgen generate: {exc}", file=sys.stderr)
        return 2
    if not args.quiet:
        for prompt, output in zip(prompts, outputs, strict=True):
            text = output.text or ""
            print(
                f"### {prompt}\n{text.strip()}\n[{output.finish_reason}, {len(output.token_ids)} tokens]\n"
            )
            if output.logprobs is not None:
                _print_logprobs(tokenizer, output.token_ids, output.logprobs)
    prompt_tokens = sum(len(t) for t in token_ids)
    output_tokens = sum(len(o.token_ids) for o in outputs)
    print(
        f"{len(outputs)} requests | prompt {prompt_tokens} tok ({prompt_tokens / wall:.1f} tok/s) | "
        f"output {output_tokens} tok ({output_tokens / wall:.1f} tok/s) | wall {wall:.2f} s "
        f"(engine build {build:.2f} s not counted)"
    )
    return 0


def _print_logprobs(tokenizer: Any, token_ids: list[int], logprobs: list[dict[int, float]]) -> None:
    for token, entry in zip(token_ids, logprobs, strict=True):
        top = ", ".join(f"{tokenizer.decode([t])!r} {v:.3f}" for t, v in entry.items())
        print(f"  {tokenizer.decode([token])!r:>16} {entry[token]:8.3f} | {top}")
    print()


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    args = build_parser().parse_args(argv)
    if args.command == "generate":
        return generate_command(args)
    if args.command == "bench":
        from .bench.harness import run

        return run(args)
    if args.command == "serve":
        return serve_command(args)
    if args.command == "batch":
        from .frontends.jobs.cli import batch_command

        return batch_command(args)
    return 2


def serve_command(args: argparse.Namespace) -> int:
    from .frontends.server.cli import serve

    return serve(args)


if __name__ == "__main__":
    sys.exit(main())

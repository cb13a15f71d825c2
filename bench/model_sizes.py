"""Throughput against model size: cbgen against vLLM (bf16) and llama.cpp (4-bit) on the
bundled SmolLM2-135M and random-weight models of Llama-3.2-1B and Qwen2.5-3B shape.

    .venv/bin/python bench/model_sizes.py                       # the whole sweep
    .venv/bin/python bench/model_sizes.py --models shape:llama3.2-1b --modes bf16 --prompts 64

Each point is one ``python -m cbgen bench`` run (same run, same cores, medians of
``--repeats``) in ``OUT/<model>-<mode>-<prompts>/``; a point whose folder already holds
``results.json`` is not run again, so a sweep that was stopped picks up where it was.
At the end (and with ``--report-only``) the points are gathered into ``OUT/sizes.md``,
``OUT/sizes.json`` and ``OUT/tok_s_by_size.png``.

On 2 cores the sweep is long: a 3B model at 256 prompts is about 10 minutes per system
per repeat. ``--repeats`` sets the repeats of every point; ``--max-repeats-at N=R`` holds
the points of N prompts or more to R repeats; ``--no-warmup`` skips each point's untimed
warm-up run; ``--peer-timeout S`` stops a peer after S seconds and gives its point as a
bound (``< N tok/s``, ``cbgen ÷ peer > R``), which is what a vLLM point of hours can have.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from cbgen.bench import sizes
from cbgen.bench.workloads import resolve_model

ROOT = Path(__file__).resolve().parent


def parameters(model: str) -> int:
    folder = resolve_model(model)[0]
    return sizes.count_parameters(folder)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--models", default="smollm2,shape:llama3.2-1b,shape:qwen2.5-3b", help="comma-separated"
    )
    parser.add_argument("--modes", default="bf16,int4", help=f"from {','.join(sizes.MODES)}")
    parser.add_argument("--prompts", default="1,64,256", help="prompt counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--max-repeats-at",
        action="append",
        default=[],
        metavar="N=R",
        help="at N prompts or more, at most R repeats (repeatable)",
    )
    parser.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the untimed warm-up run of each point (long points: the warm-up doubles them)",
    )
    parser.add_argument(
        "--peer-timeout",
        type=float,
        metavar="S",
        help="stop a peer after S seconds (load included) and report the bound its progress "
        "gives: a point where vLLM would take hours is then bounded in S",
    )
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "model-sizes")
    parser.add_argument("--report-only", action="store_true", help="gather, do not run")
    args = parser.parse_args()

    caps = sorted((int(n), int(r)) for n, r in (c.split("=") for c in args.max_repeats_at))
    failed = 0
    if not args.report_only:
        for model in args.models.split(","):
            count = parameters(model)
            for mode in args.modes.split(","):
                for prompts in (int(p) for p in args.prompts.split(",")):
                    out = args.out / sizes.point_name(model, mode, prompts)
                    if (out / "results.json").exists():
                        print(f"model_sizes: {out.name}: done already", flush=True)
                        continue
                    repeats = args.repeats
                    for at, cap in caps:
                        if prompts >= at:
                            repeats = min(repeats, cap)
                    sizes.write_point(out, model, count, mode, prompts)
                    command = sizes.bench_command(model, mode, prompts, repeats, out)
                    command += ["--no-warmup"] if args.no_warmup else []
                    if args.peer_timeout:
                        command += ["--peer-timeout", str(args.peer_timeout)]
                    print(f"model_sizes: {out.name}: python -m cbgen {' '.join(command)}")
                    code = subprocess.call([sys.executable, "-m", "cbgen", *command])
                    failed += code != 0
    rows = sizes.collect(args.out)
    args.out.mkdir(parents=True, exist_ok=True)
    table = sizes.markdown(rows)
    (args.out / "sizes.md").write_text(table, encoding="utf-8")
    (args.out / "sizes.json").write_text(sizes.rows_json(rows), encoding="utf-8")
    why = sizes.plot(rows, args.out / "tok_s_by_size.png")
    print(table)
    print(why or f"model_sizes: wrote {args.out / 'tok_s_by_size.png'}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())

"""How cost grows with model size: one ``cbgen bench`` run per (model, mode, prompt count),
gathered into one table and one plot of output tok/s against parameters.

``bench/model_sizes.py`` drives the runs (each its own ``python -m cbgen bench`` with its
own output folder, skipped when that folder already holds results, so a long sweep can
be resumed) and then calls :func:`collect`, :func:`markdown` and :func:`plot` here.

Modes: ``bf16`` runs cbgen and vLLM on bfloat16 weights; ``int4`` runs cbgen's 4-bit
weights (bf16 activations) and ``w4a8`` its 4-bit weights with int8 activations, each
against llama.cpp's Q4 file of the same model.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

MODES = {
    "bf16": {"args": ["--dtype", "bfloat16"], "peer": "vllm"},
    "int4": {"args": ["--dtype", "bfloat16", "--quantization", "int4"], "peer": "llamacpp"},
    "w4a8": {"args": ["--dtype", "bfloat16", "--quantization", "w4a8"], "peer": "llamacpp"},
}


def workload_args(prompts: int) -> list[str]:
    """The workload of a prompt count: short chat questions, 128 new tokens each (64 of
    ``short64`` or fewer; 256 of ``many-short`` held to 128 new tokens)."""
    if prompts <= 64:
        return ["--workload", "short64", "--num-prompts", str(prompts)]
    return [
        "--workload",
        "many-short",
        "--num-prompts",
        str(prompts),
        "--max-new-tokens",
        "128",
    ]


def point_name(model: str, mode: str, prompts: int) -> str:
    return f"{model.replace('shape:', '').replace('/', '_')}-{mode}-{prompts}"


def bench_command(model: str, mode: str, prompts: int, repeats: int, out: Path) -> list[str]:
    """The ``cbgen bench`` arguments of one point."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: choose from {', '.join(MODES)}")
    return [
        "bench",
        "--model",
        model,
        *MODES[mode]["args"],
        "--systems",
        "cbgen",
        "--peers",
        MODES[mode]["peer"],
        *workload_args(prompts),
        "--repeats",
        str(repeats),
        "--no-roofline",
        "--out",
        str(out),
    ]


def count_parameters(folder: Path) -> int:
    """Parameters in a Hugging Face folder's safetensors files, read from their headers
    (tied weights are stored once, so they count once)."""
    total = 0
    for file in sorted(Path(folder).glob("*.safetensors")):
        with file.open("rb") as f:
            size = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(size))
        for key, entry in header.items():
            if key != "__metadata__":
                total += math.prod(entry["shape"])
    return total


@dataclass
class Row:
    """One system at one point: medians over the run's repeats."""

    model: str
    parameters: int
    mode: str
    prompts: int
    system: str
    output_tok_s: float | None
    peak_rss_mib: float | None
    load_s: float | None
    cbgen_ratio: float | None  # cbgen ÷ this system (None for cbgen)
    repeats: int
    error: str | None = None
    # a peer stopped at its time limit: its rate was below this, so cbgen ÷ it was above
    output_tok_s_below: float | None = None
    cbgen_ratio_above: float | None = None


def collect(root: Path) -> list[Row]:
    """Every point under ``root`` (folders with ``point.json`` and ``results.json``)."""
    rows: list[Row] = []
    for point_file in sorted(Path(root).glob("*/point.json")):
        results_file = point_file.with_name("results.json")
        if not results_file.exists():
            continue
        point = json.loads(point_file.read_text(encoding="utf-8"))
        results = json.loads(results_file.read_text(encoding="utf-8"))
        for workload in results["workloads"].values():
            for system, entry in workload["systems"].items():
                error = entry.get("error")
                median = entry.get("median") or {}
                unfinished = entry.get("unfinished") or {}
                rows.append(
                    Row(
                        model=point["model"],
                        parameters=int(point["parameters"]),
                        mode=point["mode"],
                        prompts=int(point["prompts"]),
                        system=system,
                        output_tok_s=median.get("output_tok_s"),
                        peak_rss_mib=entry.get("peak_rss_mib"),
                        load_s=entry.get("load_s"),
                        cbgen_ratio=entry.get("cbgen_ratio"),
                        repeats=len(entry.get("repeats") or []) or (1 if unfinished else 0),
                        error=error.splitlines()[0][:100] if error else None,
                        output_tok_s_below=unfinished.get("tok_s_below"),
                        cbgen_ratio_above=entry.get("cbgen_ratio_above"),
                    )
                )
    rows.sort(key=lambda r: (r.mode, r.parameters, r.prompts, r.system != "cbgen", r.system))
    return rows


def _num(value: float | None, digits: int = 1) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def markdown(rows: list[Row]) -> str:
    """One line per point: cbgen against its peer, with both sides' memory and load time."""
    lines = [
        "| model | parameters | mode | prompts | cbgen tok/s | peer | peer tok/s | cbgen ÷ peer "
        "| peak RSS MiB (cbgen / peer) | load s (cbgen / peer) | repeats |",
        "|---|---:|---|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    by_point: dict[tuple[str, str, int], dict[str, Row]] = {}
    for row in rows:
        by_point.setdefault((row.model, row.mode, row.prompts), {})[row.system] = row
    for (model, mode, prompts), systems in by_point.items():
        ours = systems.get("cbgen")
        for name, peer in systems.items():
            if name == "cbgen":
                continue
            base = ours or peer
            lines.append(
                "| "
                + " | ".join(
                    [
                        model,
                        f"{base.parameters / 1e9:.2f} B",
                        mode,
                        str(prompts),
                        (ours.error and "failed") or _num(ours.output_tok_s) if ours else "–",
                        name,
                        _peer_tok_s(peer),
                        _peer_ratio(peer),
                        f"{_num(ours.peak_rss_mib if ours else None, 0)} / "
                        f"{_num(peer.peak_rss_mib, 0)}",
                        f"{_num(ours.load_s if ours else None)} / {_num(peer.load_s)}",
                        str(min(r.repeats for r in (ours, peer) if r is not None)),
                    ]
                )
                + " |"
            )
    return "\n".join(lines) + "\n"


def _peer_tok_s(peer: Row) -> str:
    if peer.output_tok_s_below is not None:
        return f"< {peer.output_tok_s_below:,.1f} (stopped)"
    return "failed" if peer.error else _num(peer.output_tok_s)


def _peer_ratio(peer: Row) -> str:
    if peer.cbgen_ratio_above is not None:
        return f"> {peer.cbgen_ratio_above:.2f}x"
    return "–" if peer.cbgen_ratio is None else f"{peer.cbgen_ratio:.2f}x"


def plot(rows: list[Row], path: Path) -> str | None:
    """Output tok/s against parameters, one panel per prompt count, one line per system
    and mode; returns why no plot was drawn, or None. A peer stopped at its time limit
    has a bound, not a rate, and is left out of the plot (the table gives the bound)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no plot"
    counts = sorted({r.prompts for r in rows})
    if not counts:
        return "no results to plot"
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 4), squeeze=False)
    for ax, prompts in zip(axes[0], counts, strict=True):
        lines: dict[str, list[tuple[int, float]]] = {}
        sizes: set[int] = set()
        for r in rows:
            if r.prompts == prompts and r.output_tok_s:
                lines.setdefault(_label(r), []).append((r.parameters, r.output_tok_s))
                sizes.add(r.parameters)
        for label, points in sorted(lines.items()):
            points.sort()
            style = "-o" if label.startswith("cbgen") else "--s"
            ax.plot([p / 1e9 for p, _ in points], [t for _, t in points], style, label=label)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xticks(sorted(p / 1e9 for p in sizes), minor=False)
        ax.set_xticks([], minor=True)
        ax.set_xticklabels([f"{p / 1e9:.2f}" for p in sorted(sizes)])
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("output tok/s")
        ax.set_title(f"{prompts} prompt{'s' if prompts > 1 else ''}, 128 new tokens")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


def _label(row: Row) -> str:
    """A line's name: cbgen's mode, or the peer and what it ran beside (llama.cpp runs
    its own Q4 file whichever 4-bit mode cbgen ran)."""
    if row.system == "cbgen":
        return f"cbgen {row.mode}"
    if row.system == "llamacpp":
        return f"llama.cpp Q4 (beside cbgen {row.mode})"
    return f"{row.system} {row.mode}"


def write_point(out: Path, model: str, parameters: int, mode: str, prompts: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    point = {"model": model, "parameters": parameters, "mode": mode, "prompts": prompts}
    (out / "point.json").write_text(json.dumps(point), encoding="utf-8")


def rows_json(rows: list[Row]) -> str:
    return json.dumps([asdict(r) for r in rows], indent=1)


__all__ = [
    "MODES",
    "Row",
    "bench_command",
    "collect",
    "count_parameters",
    "markdown",
    "plot",
    "point_name",
    "workload_args",
    "write_point",
]

"""Write a benchmark's results: ``results.json``, ``results.md`` and ``throughput.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

BASELINES_ORDER = ("generate", "generate_batch", "generate_batch_tuned", "vllm", "llamacpp")


def _fmt(value: Any, digits: int = 1) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return str(value)


def _pair(a: Any, b: Any, digits: int) -> str:
    if a is None and b is None:
        return "–"
    return f"{_fmt(a, digits)} / {_fmt(b, digits)}"


def workload_table(workload: dict[str, Any]) -> list[str]:
    """The markdown table of one workload: one row per system, medians over repeats."""
    lines = [
        "| system | output tok/s | prompt tok/s | wall s | TTFT p50 / p99 s "
        "| ITL p50 / p99 ms | peak RSS MiB | tokens | same as cbgen | cbgen ÷ system |",
        "|---|---:|---:|---:|---:|---:|---:|---|---|---:|",
    ]
    for name, system in workload["systems"].items():
        unfinished = system.get("unfinished")
        if unfinished:
            above = system.get("cbgen_ratio_above")
            lines.append(
                f"| {name} | {describe_unfinished(unfinished)} | | | | | "
                f"{_fmt(system.get('peak_rss_mib'), 0)} | unfinished | – | "
                + ("–" if above is None else f"> {above:.2f}×")
                + " |"
            )
            continue
        if system.get("error"):
            error = system["error"].replace("|", "/").splitlines()[0][:120]
            lines.append(f"| {name} | failed: {error} | | | | | | | | |")
            continue
        m = system["median"]
        ratio = system.get("cbgen_ratio")
        lines.append(
            "| "
            + " | ".join(
                [
                    name,
                    _fmt(m["output_tok_s"]),
                    _fmt(m["prompt_tok_s"]),
                    _fmt(m["wall_s"], 2),
                    _pair(m["ttft_p50_s"], m["ttft_p99_s"], 2),
                    _pair(m["itl_p50_ms"], m["itl_p99_ms"], 1),
                    _fmt(system.get("peak_rss_mib"), 0),
                    "ok" if system.get("tokens_ok") else "WRONG",
                    system.get("same_as_cbgen") or "–",
                    "–" if ratio is None else f"{ratio:.2f}×",
                ]
            )
            + " |"
        )
    return lines


def describe_unfinished(unfinished: dict[str, Any]) -> str:
    """One line: the bound, and how far the run got."""
    partial = unfinished.get("partial_tok_s")
    return (
        f"below {unfinished['tok_s_below']:.1f} tok/s "
        f"({unfinished['tokens_done']:,} of {unfinished['tokens_total']:,} tokens "
        f"when stopped after {unfinished['elapsed_s']:,.0f} s of repeat {unfinished['repeat']}"
        + (f", {partial:.1f} tok/s so far" if partial else "")
        + ")"
    )


def speculation_line(workload: dict[str, Any]) -> list[str]:
    """cbgen's guesses on this workload (its first repeat), when it speculated."""
    config = (workload["systems"].get("cbgen") or {}).get("config") or {}
    counts = config.get("speculation")
    if not counts:
        return []
    proposed, accepted = counts["spec_proposed_tokens"], counts["spec_accepted_tokens"]
    verifications = counts["spec_verifications"]
    kept = f"{accepted / proposed:.0%}" if proposed else "–"
    mean = f"{1 + accepted / verifications:.2f}" if verifications else "–"
    return [
        f"cbgen speculative decoding ({config['engine_config'].get('speculative')}): "
        f"{proposed} guesses verified, {kept} kept, mean accepted length {mean} "
        "(tokens per verification, the sampled one included).",
        "",
    ]


def summary_table(results: dict[str, Any]) -> list[str]:
    """One row per workload: cbgen's output tok/s and its ratio to each baseline."""
    baselines = [
        b for b in BASELINES_ORDER if any(b in w["systems"] for w in results["workloads"].values())
    ]
    header = ["workload", "cbgen output tok/s"] + [f"cbgen ÷ {b}" for b in baselines]
    header.append("of roofline")
    lines = ["| " + " | ".join(header) + " |", "|---" + "|---:" * (len(header) - 1) + "|"]
    for name, workload in results["workloads"].items():
        cbgen = workload["systems"].get("cbgen", {})
        row = [name, _fmt((cbgen.get("median") or {}).get("output_tok_s"))]
        for baseline in baselines:
            entry = workload["systems"].get(baseline, {})
            ratio, above = entry.get("cbgen_ratio"), entry.get("cbgen_ratio_above")
            if above is not None:
                row.append(f"> {above:.2f}×")
            else:
                row.append("–" if ratio is None else f"{ratio:.2f}×")
        utilization = cbgen.get("roofline")
        row.append("–" if not utilization else f"{100 * utilization['fraction']:.1f}%")
        lines.append("| " + " | ".join(row) + " |")
    return lines


def roofline_line(roofline: dict[str, Any] | None) -> str:
    if not roofline:
        return "Roofline: not measured."
    kernels = sorted({s.get("kernel", "F.linear") for s in roofline.get("shapes", [])})
    return (
        f"Roofline: {roofline['peak_flops'] / 1e9:,.1f} GFLOP/s on the model's linear maps "
        f"(m={roofline['m']}, {roofline['dtype']}, {roofline['threads']} threads, "
        f"{' / '.join(kernels) or 'F.linear'}; best single "
        f"shape {roofline['best_shape_flops'] / 1e9:,.1f}); "
        f"{roofline['flops_per_token'] / 1e6:,.0f} MFLOP per token, so at most "
        f"{roofline['ceiling_tok_s']:,.0f} decoded tok/s."
    )


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    lines = [
        f"# cbgen benchmark, {meta['started']}",
        "",
        f"- machine: {meta['cpu']}, cores {meta['cpus']}, {meta['threads']} threads",
        f"- model {meta['model']}, {meta['dtype']}"
        f"{' + ' + meta['quantization'] if meta.get('quantization') else ''}; "
        f"repeats {meta['repeats']} (medians shown)" + (", quick" if meta["quick"] else ""),
        f"- cbgen EngineConfig: {meta['engine_config']}; speculative decoding: "
        f"{meta.get('speculative', 'off')}; generate batch size {meta['generate_batch_size']}",
        f"- versions: {meta['versions']}",
        f"- peak RSS: {meta['rss_note']}",
        "- TTFT counts from the start of the run (every request arrives at once); ITL is the "
        "gap between two tokens of one request. `cbgen ÷ system` is the ratio of output tok/s.",
        "",
        roofline_line(results.get("roofline")),
        "",
    ]
    for name, workload in results["workloads"].items():
        w = workload["workload"]
        lines += [
            f"## {name}",
            "",
            f"{w['description']}: {w['num_prompts']} prompts, {w['prompt_tokens']} prompt tokens "
            f"({w['prompt_len_min']}-{w['prompt_len_max']}, mean {w['prompt_len_mean']}), "
            f"{w['max_new_tokens']} new tokens each.",
            "",
            *workload_table(workload),
            "",
            *speculation_line(workload),
        ]
    lines += ["## Summary", "", *summary_table(results), ""]
    for note in results.get("notes", []):
        lines.append(f"- {note}")
    return "\n".join(lines).rstrip() + "\n"


def _bar_label(value: float) -> str:
    return f"{value:.0f}" if value >= 10 else f"{value:.2g}"


def chart(results: dict[str, Any], path: Path) -> str | None:
    """A bar chart of output tok/s and peak RSS per workload and system; None if skipped."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return "matplotlib is not installed (pip install -e '.[bench]'): no PNG chart"
    workloads = list(results["workloads"])
    systems: list[str] = []
    for workload in results["workloads"].values():
        for name in workload["systems"]:
            if name not in systems:
                systems.append(name)
    if not workloads or not systems:
        return "nothing to chart"
    figure, axes = plt.subplots(1, 2, figsize=(max(8, 2.6 * len(workloads) + 4), 4.8))
    width = 0.8 / len(systems)
    panels = [("output_tok_s", "output tok/s (median)"), ("peak_rss_mib", "peak RSS (MiB)")]
    for panel, (key, label) in zip(axes, panels, strict=True):
        for s, system in enumerate(systems):
            values = []
            for workload in workloads:
                entry = results["workloads"][workload]["systems"].get(system, {})
                value = (
                    entry.get(key)
                    if key == "peak_rss_mib"
                    else (entry.get("median") or {}).get(key)
                )
                values.append(value or 0.0)
            positions = [w + (s - (len(systems) - 1) / 2) * width for w in range(len(workloads))]
            bars = panel.bar(positions, values, width, label=system)
            if key == "output_tok_s":
                panel.bar_label(bars, fmt=_bar_label, fontsize=7, padding=1)
        panel.set_xticks(range(len(workloads)), workloads)
        panel.set_ylabel(label)
        panel.grid(axis="y", alpha=0.3)
    axes[0].legend(fontsize=8)
    meta = results["meta"]
    figure.suptitle(
        f"cbgen bench: {meta['model']} {meta['dtype']}"
        f"{' + ' + meta['quantization'] if meta.get('quantization') else ''}, {meta['threads']} threads"
        + (" (quick)" if meta["quick"] else "")
    )
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return None


def write(results: dict[str, Any], out_dir: Path) -> dict[str, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"json": out_dir / "results.json", "markdown": out_dir / "results.md"}
    chart_path = out_dir / "throughput.png"
    skipped = chart(results, chart_path)
    if skipped:
        results.setdefault("notes", []).append(f"chart skipped: {skipped}")
        print(f"cbgen bench: {skipped}")
    else:
        paths["png"] = chart_path
    paths["json"].write_text(json.dumps(results, indent=2) + "\n", encoding="utf-8")
    paths["markdown"].write_text(markdown(results), encoding="utf-8")
    return paths

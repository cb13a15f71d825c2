"""``python -m cbgen bench``: run named workloads on cbgen, transformers' baselines and peers.

Each system runs in its own process (one per workload by default) pinned to the same
cores with the same thread count; the harness reads that process's peak RSS from
``wait4``, summarizes the raw runs (medians over repeats) and writes JSON, markdown and a
PNG chart into the output folder.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
from pathlib import Path
from typing import Any

from ..core.config import EngineConfig
from ..frontends.args.parallel import parallel_settings
from ..frontends.args.speculative import describe, speculative_settings
from ..models.loader import bundled_gguf
from ..sysmem import cpu_name, meminfo_kib
from . import metrics
from .args import DEFAULT_REPEATS, add_arguments, parse_cpus, parse_engine_options, split_list
from .machine import choose_cpus, process_env, versions
from .peers import PEERS
from .report import describe_unfinished
from .shapes import is_shape, shape_gguf, shape_info
from .supervisor import ProcessOutcome, run_process, tail
from .systems import SYSTEMS
from .workloads import Workload, bench_dir, build_workload, load_tokenizer, resolve_model

__all__ = [
    "DEFAULT_REPEATS",
    "Bench",
    "ProcessOutcome",
    "add_arguments",
    "choose_cpus",
    "parse_cpus",
    "parse_engine_options",
    "run",
    "run_process",
]

# -- the run -------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.quick = args.quick
        self.repeats = args.repeats or (1 if args.quick else DEFAULT_REPEATS)
        self.cpus = choose_cpus(args)
        self.threads = args.threads
        stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
        self.out = args.out or bench_dir() / "results" / stamp
        self.started = _dt.datetime.now().isoformat(timespec="seconds")
        limit = args.max_rss_gib
        available = meminfo_kib("MemAvailable")
        self.max_rss_kib = (
            int(limit * 2**20) if limit else int(0.9 * available) if available else None
        )
        self.engine_config = {
            "block_size": args.block_size,
            "max_batch_tokens": args.max_batch_tokens,
            "max_num_seqs": args.max_num_seqs,
        }
        if args.num_blocks:
            self.engine_config["num_blocks"] = args.num_blocks
        if args.tensor_parallel_size != 1:
            self.engine_config.update(parallel_settings(args))
        self.engine_config.update(parse_engine_options(args.engine_option))
        if args.lm_head_quantization and not args.quantization:
            raise SystemExit("cbgen bench: --lm-head-quantization needs --quantization")
        if args.quantization_group_size != 32 and args.quantization not in ("int4", "w4a8"):
            raise SystemExit("cbgen bench: --quantization-group-size needs a 4-bit --quantization")
        try:
            EngineConfig(**self.engine_config)  # validate early
            self.speculative = speculative_settings(args)
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"cbgen bench: bad engine settings: {exc}") from None
        self.notes: list[str] = []
        self.model_gguf = bundled_gguf(args.model)
        if is_shape(args.model):
            print(f"cbgen bench: the {args.model} model (built once, random weights) ...")
        try:
            folder, _ = resolve_model(args.model)
        except ValueError as exc:  # an unknown shape
            raise SystemExit(f"cbgen bench: {exc}") from None
        if is_shape(args.model):
            args.model = str(folder)  # the workers and peers load the folder
        self.shape = shape_info(folder)
        if self.shape is not None and "llamacpp" in split_list(args.peers):
            print("cbgen bench: the same weights as a GGUF for llama.cpp (written once) ...")
            self.model_gguf = str(shape_gguf(folder))

    # processes

    def env(self) -> dict[str, str]:
        return process_env(self.threads)

    def spec(self, kind: str, system: str | None, workloads: list[Workload]) -> dict[str, Any]:
        folder, _ = resolve_model(self.args.model)
        return {
            "kind": kind,
            "system": system,
            "model": self.args.model,
            "model_folder": str(folder),
            "model_gguf": self.model_gguf,
            # a shape's GGUF is bf16: llama.cpp's 4-bit runs quantize it to Q4_0 once
            "gguf_quantize": "q4_0" if self.shape is not None else None,
            "dtype": self.args.dtype,
            "quantization": self.args.quantization,
            "lm_head_quantization": self.args.lm_head_quantization,
            "quantization_group_size": self.args.quantization_group_size,
            "threads": self.threads,
            "cpus": self.cpus,
            "repeats": self.repeats,
            "warmup": not self.args.no_warmup,
            "options": {
                "engine_config": self.engine_config,
                "speculative": self.speculative,
                "generate_batch_size": self.args.generate_batch_size,
                "tuned_page_size": self.args.tuned_page_size,
                "tuned_attn": self.args.tuned_attn,
            },
            "roofline": {"m": self.args.roofline_m, "min_time": 0.05 if self.quick else 0.2},
            "peer_cache": str(bench_dir() / "peers" / "models"),
            "workloads": [w.to_json() for w in workloads],
        }

    def launch(
        self, label: str, spec: dict[str, Any], command_prefix: list[str]
    ) -> tuple[dict[str, Any] | None, ProcessOutcome | None, str | None]:
        """Run one worker (or peer runner); return its result, outcome and an error."""
        if self.args.isolation == "none" and spec["kind"] != "peer":
            from .worker import run_spec

            try:
                return run_spec(spec), None, None
            except Exception as exc:
                return None, None, f"{type(exc).__name__}: {exc}"
        for sub in ("specs", "logs", "raw"):
            (self.out / sub).mkdir(parents=True, exist_ok=True)
        spec_path = self.out / "specs" / f"{label}.json"
        result_path = self.out / "raw" / f"{label}.json"
        log_path = self.out / "logs" / f"{label}.log"
        progress_path = self.progress_path(label)
        progress_path.unlink(missing_ok=True)
        spec = {**spec, "progress_path": str(progress_path)}
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        timeout = self.args.timeout
        if spec["kind"] == "peer" and self.args.peer_timeout:
            timeout = self.args.peer_timeout
        outcome = run_process(
            [*command_prefix, str(spec_path), str(result_path)],
            env=self.env(),
            cpus=self.cpus,
            log_path=log_path,
            timeout=timeout,
            max_rss_kib=self.max_rss_kib,
        )
        if outcome.killed or outcome.returncode != 0 or not result_path.exists():
            why = outcome.killed or f"exit code {outcome.returncode}"
            return None, outcome, f"{why}; log {log_path}:\n{tail(log_path)}"
        return json.loads(result_path.read_text(encoding="utf-8")), outcome, None

    def progress_path(self, label: str) -> Path:
        """Where a runner keeps its timed repeat's tokens so far (peers' runners do)."""
        return self.out / "raw" / f"{label}.progress.json"

    # the whole run

    def run(self) -> dict[str, Any]:
        args = self.args
        systems = split_list(args.systems)
        for system in systems:
            if system not in SYSTEMS:
                raise SystemExit(
                    f"cbgen bench: unknown system {system!r}; known: {', '.join(SYSTEMS)}"
                )
        peers = split_list(args.peers)
        for peer in peers:
            if peer not in PEERS:
                raise SystemExit(f"cbgen bench: unknown peer {peer!r}; known: {', '.join(PEERS)}")
        known = _all_workloads()
        names = args.workloads or known
        for name in names:
            if name not in known:
                raise SystemExit(
                    f"cbgen bench: unknown workload {name!r}; known: {', '.join(known)}"
                )
        if self.repeats < 1 or self.threads < 1:
            raise SystemExit("cbgen bench: --repeats and --threads must be at least 1")
        self.out.mkdir(parents=True, exist_ok=True)
        print(f"cbgen bench: results go to {self.out}")
        print(
            f"cbgen bench: {self.threads} threads pinned to cores {self.cpus}, {args.dtype}"
            f"{' + ' + args.quantization if args.quantization else ''}"
            f"{' (LM head ' + args.lm_head_quantization + ')' if args.lm_head_quantization else ''}"
            f"{f' in groups of {args.quantization_group_size}' if args.quantization_group_size != 32 else ''}, "
            f"{self.repeats} repeat(s), isolation {args.isolation}"
        )
        tokenizer = load_tokenizer(args.model)
        workloads = [
            build_workload(
                name,
                tokenizer,
                quick=self.quick,
                num_prompts=args.num_prompts,
                max_new_tokens=args.max_new_tokens,
            )
            for name in names
        ]
        (self.out / "workloads").mkdir(parents=True, exist_ok=True)
        for w in workloads:
            path = self.out / "workloads" / f"{w.name}.json"
            path.write_text(json.dumps({**w.summary(), **w.to_json()}), encoding="utf-8")
            s = w.summary()
            print(
                f"  {w.name}: {s['num_prompts']} prompts of {s['prompt_len_min']}-"
                f"{s['prompt_len_max']} tokens, {s['max_new_tokens']} new tokens each"
            )

        results: dict[str, Any] = {"meta": self.meta(), "roofline": None, "workloads": {}}
        for w in workloads:
            results["workloads"][w.name] = {"workload": w.summary(), "systems": {}}

        if not args.no_roofline:
            results["roofline"] = self.roofline()

        raw: dict[str, dict[str, Any]] = {w.name: {} for w in workloads}
        if args.isolation == "system":
            for system in systems:
                self.run_system_group(system, workloads, raw)
        else:
            for w in workloads:
                for system in systems:
                    self.run_system_group(system, [w], raw)
        for peer in peers:
            self.run_peer(peer, workloads, raw)

        for w in workloads:
            results["workloads"][w.name]["systems"] = self.compile(
                w, raw[w.name], results["roofline"]
            )
        results["notes"] = self.notes
        return results

    def meta(self) -> dict[str, Any]:
        isolation = self.args.isolation
        rss_note = {
            "workload": "VmHWM of the process that ran the system on that workload alone, "
            "model load included",
            "system": "VmHWM of the process that ran the system on all workloads (the "
            "maximum over them), model load included",
            "none": "not measured per system (--isolation none)",
        }[isolation]
        return {
            "started": self.started,
            "cpu": cpu_name(),
            "cpus": self.cpus,
            "threads": self.threads,
            "model": self.args.model,
            "shape": self.shape,
            "dtype": self.args.dtype,
            "quantization": self.args.quantization,
            "lm_head_quantization": self.args.lm_head_quantization,
            "quantization_group_size": self.args.quantization_group_size,
            "repeats": self.repeats,
            "quick": self.quick,
            "isolation": isolation,
            "engine_config": self.engine_config,
            "speculative": describe(self.speculative),
            "generate_batch_size": self.args.generate_batch_size,
            "tuned_page_size": self.args.tuned_page_size,
            "versions": versions(),
            "rss_note": rss_note,
            "command": " ".join(["python -m cbgen bench", *sys.argv[2:]])
            if len(sys.argv) > 1 and sys.argv[1] == "bench"
            else None,
        }

    def roofline(self) -> dict[str, Any] | None:
        print("cbgen bench: measuring the matmul roofline ...", flush=True)
        spec = self.spec("roofline", None, [])
        result, _, error = self.launch(
            "roofline", spec, [sys.executable, "-m", "cbgen.bench.worker"]
        )
        if error:
            self.notes.append(f"roofline failed: {error.splitlines()[0]}")
            print(f"cbgen bench: roofline failed: {error}")
            return None
        from .report import roofline_line

        print("  " + roofline_line(result["roofline"]))
        return result["roofline"]

    def run_system_group(
        self, system: str, workloads: list[Workload], raw: dict[str, dict[str, Any]]
    ) -> None:
        label = system if len(workloads) > 1 else f"{workloads[0].name}.{system}"
        print(f"cbgen bench: {label} ...", flush=True)
        spec = self.spec("system", system, workloads)
        result, outcome, error = self.launch(
            label, spec, [sys.executable, "-m", "cbgen.bench.worker"]
        )
        self._collect(system, workloads, result, outcome, error, raw)

    def run_peer(
        self, peer: str, workloads: list[Workload], raw: dict[str, dict[str, Any]]
    ) -> None:
        info = PEERS[peer]
        missing = info.missing_message()
        if missing:
            print(f"cbgen bench: {missing}")
            self.notes.append(missing)
            return
        python, runner, _ = info.paths()
        for w in workloads:
            label = f"{w.name}.{peer}"
            print(f"cbgen bench: {label} ...", flush=True)
            spec = self.spec("peer", peer, [w])
            result, outcome, error = self.launch(label, spec, [str(python), str(runner)])
            unfinished = unfinished_run(self.progress_path(label), outcome) if error else None
            self._collect(peer, [w], result, outcome, error, raw, unfinished)

    def _collect(
        self,
        system: str,
        workloads: list[Workload],
        result: dict[str, Any] | None,
        outcome: ProcessOutcome | None,
        error: str | None,
        raw: dict[str, dict[str, Any]],
        unfinished: dict[str, Any] | None = None,
    ) -> None:
        for w in workloads:
            if error or result is None:
                raw[w.name][system] = {"error": error or "no result"}
                if unfinished is not None and unfinished["workload"] == w.name:
                    raw[w.name][system]["unfinished"] = unfinished
                    raw[w.name][system]["peak_rss_kib"] = outcome.peak_rss_kib if outcome else None
                    bound = describe_unfinished(unfinished)
                    why = error.splitlines()[0] if error else "stopped"
                    print(f"  {w.name} {system}: {why}, {bound}")
                    continue
                print(f"  {w.name} {system}: FAILED: {error}")
                continue
            entry = dict(result["workloads"].get(w.name) or {"error": "no result"})
            entry["load_s"] = result.get("load_s")
            entry["rss_after_load_kib"] = result.get("rss_after_load_kib")
            peaks = [result.get("peak_rss_kib"), outcome.peak_rss_kib if outcome else None]
            peaks = [p for p in peaks if p]
            entry["peak_rss_kib"] = max(peaks) if peaks and outcome else None
            entry["engine"] = result.get("engine")
            raw[w.name][system] = entry
            if entry.get("error"):
                print(f"  {w.name} {system}: FAILED: {entry['error']}")
                continue
            m = metrics.median_figures(entry["runs"])
            rss = entry["peak_rss_kib"]
            print(
                f"  {w.name} {system}: {m['output_tok_s']:.1f} output tok/s, "
                f"wall {m['wall_s']:.2f} s" + (f", peak RSS {rss / 1024:.0f} MiB" if rss else ""),
                flush=True,
            )

    def compile(
        self, workload: Workload, raw: dict[str, Any], roofline: dict[str, Any] | None
    ) -> dict[str, Any]:
        from .roofline import utilization

        compiled: dict[str, Any] = {}
        expected = [workload.max_new_tokens] * len(workload.prompts)
        reference = (raw.get("cbgen") or {}).get("output_ids")
        cbgen_tok_s = None
        if raw.get("cbgen") and not raw["cbgen"].get("error"):
            cbgen_tok_s = metrics.median_figures(raw["cbgen"]["runs"])["output_tok_s"]
        for system, entry in raw.items():
            if entry.get("error"):
                compiled[system] = {"error": entry["error"]}
                unfinished = entry.get("unfinished")
                if unfinished:
                    peak = entry.get("peak_rss_kib")
                    compiled[system].update(
                        unfinished=unfinished,
                        cbgen_ratio_above=metrics.ratio(cbgen_tok_s, unfinished["tok_s_below"]),
                        peak_rss_mib=peak / 1024 if peak else None,
                        load_s=unfinished.get("load_s"),
                    )
                continue
            runs = entry["runs"]
            median = metrics.median_figures(runs)
            outputs = entry.get("output_ids")
            same = None
            if reference is not None and outputs is not None and system != "cbgen":
                matches = sum(a == b for a, b in zip(reference, outputs, strict=False))
                same = f"{matches}/{len(reference)}"
            peak = entry.get("peak_rss_kib")
            after_load = entry.get("rss_after_load_kib")
            tokens_ok = all(run["output_tokens"] == expected for run in runs)
            if not tokens_ok:
                self.notes.append(
                    f"{workload.name} {system}: output token counts differ from "
                    f"{workload.max_new_tokens} per prompt"
                )
            compiled[system] = {
                "median": median,
                "repeats": [metrics.summarize(run) for run in runs],
                "output_tokens": sum(runs[0]["output_tokens"]) if runs else 0,
                "prompt_tokens": sum(runs[0]["prompt_tokens"]) if runs else 0,
                "tokens_ok": tokens_ok,
                "same_as_cbgen": same,
                "cbgen_ratio": None
                if system == "cbgen"
                else metrics.ratio(cbgen_tok_s, median["output_tok_s"]),
                "peak_rss_mib": peak / 1024 if peak else None,
                "rss_after_load_mib": after_load / 1024 if after_load else None,
                "warmup_s": entry.get("warmup_s"),
                "load_s": entry.get("load_s"),
                "config": entry.get("config"),
                "engine": entry.get("engine"),
                "roofline": utilization(roofline, median["output_tok_s"]),
            }
        return compiled


def unfinished_run(progress_path: Path, outcome: ProcessOutcome | None) -> dict[str, Any] | None:
    """What a runner stopped at its time limit had done, from its progress file; None
    unless it was stopped for time in the middle of a timed repeat.

    It had not made its ``tokens_total`` tokens by the time it was stopped, so its rate
    on that repeat was below ``tokens_total / elapsed_s`` (``tok_s_below``): a true
    bound, whatever it would have done next. ``partial_tok_s`` is its rate over the part
    it ran, an estimate only (the end of a run, when the batch thins out, is not in it).
    """
    if outcome is None or outcome.timed_out_unix is None or not progress_path.exists():
        return None
    record = json.loads(progress_path.read_text(encoding="utf-8"))
    elapsed = outcome.timed_out_unix - record["started_unix"]
    if elapsed <= 0:
        return None
    measured = record["updated_unix"] - record["started_unix"]
    done = record["tokens_done"]
    return {
        **record,
        "elapsed_s": elapsed,
        "tok_s_below": record["tokens_total"] / elapsed,
        "partial_tok_s": done / measured if done and measured > 0 else None,
    }


def _all_workloads() -> list[str]:
    from .workloads import workload_names

    return workload_names()


def run(args: argparse.Namespace) -> int:
    """The ``bench`` subcommand; 0 when every system ran and produced the right counts."""
    from . import report
    from .workloads import load_definitions

    if args.list:
        for name, spec in load_definitions()["workloads"].items():
            print(f"{name:15s} {spec.get('description', '')}")
        return 0
    bench = Bench(args)
    results = bench.run()
    paths = report.write(results, bench.out)
    print()
    print(report.markdown(results))
    print("cbgen bench: wrote " + ", ".join(str(p) for p in paths.values()))
    failed = [
        f"{w}/{s}"
        for w, workload in results["workloads"].items()
        for s, entry in workload["systems"].items()
        if (entry.get("error") and not entry.get("unfinished"))
        or (not entry.get("error") and not entry.get("tokens_ok"))
    ]
    stopped = [
        f"{w}/{s}"
        for w, workload in results["workloads"].items()
        for s, entry in workload["systems"].items()
        if entry.get("unfinished")
    ]
    if stopped:
        print("cbgen bench: stopped at --peer-timeout, reported as bounds: " + ", ".join(stopped))
    if failed:
        print("cbgen bench: failed or wrong token counts: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0

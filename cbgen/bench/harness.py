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
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import EngineConfig
from ..sysmem import cpu_name, meminfo_kib, proc_status_kib
from . import metrics
from .peers import PEERS, bundled_gguf
from .systems import SYSTEMS
from .workloads import Workload, bench_dir, build_workload, load_tokenizer, resolve_model

DEFAULT_REPEATS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    w = parser.add_argument_group("what to run")
    w.add_argument(
        "--workload",
        action="append",
        dest="workloads",
        metavar="NAME",
        help="a workload of bench/workloads.json (repeatable; default: all)",
    )
    w.add_argument("--list", action="store_true", help="list the workloads and exit")
    w.add_argument(
        "--systems",
        default=",".join(SYSTEMS),
        help=f"comma-separated, from {','.join(SYSTEMS)} (default: all)",
    )
    w.add_argument(
        "--peers",
        default="",
        help=f"comma-separated, from {','.join(PEERS)}: each needs its venv (bench/peers/)",
    )
    w.add_argument("--model", default="smollm2", help="bundled name, HF folder or .gguf file")
    w.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    w.add_argument("--quick", action="store_true", help="few prompts, few tokens, 1 repeat")
    w.add_argument("--repeats", type=int, help=f"timed runs per system (default {DEFAULT_REPEATS})")
    w.add_argument("--num-prompts", type=int, help="override every workload's prompt count")
    w.add_argument("--max-new-tokens", type=int, help="override every workload's length")
    w.add_argument("--no-warmup", action="store_true", help="skip the untimed warm-up run")

    m = parser.add_argument_group("machine")
    m.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads per system")
    m.add_argument(
        "--cpus", help="cores to pin every system to, e.g. 0-1 or 2,3 (default: first --threads)"
    )
    m.add_argument(
        "--isolation",
        choices=["workload", "system", "none"],
        default="workload",
        help="a process per workload and system (default), per system, or none (in this "
        "process: no per-system peak RSS)",
    )
    m.add_argument("--timeout", type=float, default=7200.0, help="seconds allowed per process")
    m.add_argument(
        "--max-rss-gib",
        type=float,
        help="kill a system whose RSS passes this (default: 90%% of available memory)",
    )

    c = parser.add_argument_group("systems' settings")
    c.add_argument("--block-size", type=int, default=EngineConfig.block_size)
    c.add_argument("--max-batch-tokens", type=int, default=EngineConfig.max_batch_tokens)
    c.add_argument("--max-num-seqs", type=int, default=EngineConfig.max_num_seqs)
    c.add_argument("--num-blocks", type=int, help="cbgen KV cache blocks (default: by memory)")
    c.add_argument(
        "--engine-option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="another cbgen EngineConfig field, VALUE as JSON (repeatable)",
    )
    c.add_argument("--generate-batch-size", type=int, default=8, help="model.generate batch size")
    c.add_argument(
        "--tuned-page-size", type=int, help="generate_batch_tuned page size (default: --block-size)"
    )
    c.add_argument(
        "--tuned-attn",
        choices=["sdpa", "eager"],
        help="generate_batch_tuned attention: sdpa or eager (paged|eager); default the model's",
    )

    o = parser.add_argument_group("output")
    o.add_argument("--out", type=Path, help="output folder (default bench/results/<timestamp>/)")
    o.add_argument("--no-roofline", action="store_true", help="skip the matmul roofline")
    o.add_argument("--roofline-m", type=int, default=64, help="rows of the roofline matmuls")


# -- helpers -------------------------------------------------------------------------------


def parse_cpus(text: str) -> list[int]:
    cpus: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        if "-" in part:
            low, high = part.split("-")
            cpus.update(range(int(low), int(high) + 1))
        else:
            cpus.add(int(part))
    return sorted(cpus)


def parse_engine_options(items: list[str]) -> dict[str, Any]:
    """``["enable_prefix_caching=false", "scheduler_policy=fifo"]`` -> a dict; values are
    JSON where they parse as JSON, else strings."""
    options: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise SystemExit(f"cbgen bench: --engine-option wants KEY=VALUE, got {item!r}")
        try:
            options[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            options[key.strip()] = value
    return options


def choose_cpus(args: argparse.Namespace) -> list[int]:
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    if args.cpus:
        return parse_cpus(args.cpus)
    if not allowed:
        return []
    return allowed[: max(1, min(args.threads, len(allowed)))]


def _split(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for package in ("cbgen", "torch", "transformers"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    try:
        root = Path(__file__).resolve().parents[2]
        commit = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=5,
        ).stdout.strip()
        if commit:
            found["git"] = commit + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return found


@dataclass
class ProcessOutcome:
    returncode: int | None
    peak_rss_kib: int | None
    wall_s: float
    killed: str | None = None


def run_process(
    command: list[str],
    *,
    env: dict[str, str],
    cpus: list[int],
    log_path: Path,
    timeout: float,
    max_rss_kib: int | None,
) -> ProcessOutcome:
    """Run ``command`` pinned to ``cpus``; return its exit code and its own peak RSS.

    The peak is the child's ``VmHWM`` (its resident high-water mark, which starts afresh at
    ``exec``), polled from ``/proc`` while it runs; the worker also reports its final
    ``VmHWM`` itself. (``wait4``'s ``ru_maxrss`` would not do: it keeps the RSS the child
    inherited at ``fork``, i.e. this harness's own.) The process is killed if it outlives
    ``timeout`` or its RSS passes ``max_rss_kib``, so one runaway system cannot take the
    machine down.
    """

    def pin() -> None:
        if cpus and hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, cpus)

    started = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log:
        process = subprocess.Popen(
            command,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            preexec_fn=pin,
            start_new_session=True,
        )
    killed = None
    peak = None
    while True:
        pid, status = os.waitpid(process.pid, os.WNOHANG)
        if pid == process.pid:
            break
        hwm = proc_status_kib("VmHWM", process.pid)
        if hwm is not None:
            peak = max(peak or 0, hwm)
        rss = proc_status_kib("VmRSS", process.pid)
        elapsed = time.perf_counter() - started
        if killed is None and elapsed > timeout:
            killed = f"timed out after {timeout:.0f} s"
        elif killed is None and max_rss_kib and rss and rss > max_rss_kib:
            killed = f"RSS passed the limit of {max_rss_kib / 2**20:.1f} GiB"
        if killed is not None:
            try:
                os.killpg(process.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.1)
    process.returncode = os.waitstatus_to_exitcode(status)
    return ProcessOutcome(process.returncode, peak, time.perf_counter() - started, killed)


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


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
        self.engine_config.update(parse_engine_options(args.engine_option))
        try:
            EngineConfig(**self.engine_config)  # validate early
        except (TypeError, ValueError) as exc:
            raise SystemExit(f"cbgen bench: bad engine settings: {exc}") from None
        self.notes: list[str] = []

    # processes

    def env(self) -> dict[str, str]:
        env = dict(os.environ)
        threads = str(self.threads)
        env.update(
            OMP_NUM_THREADS=threads,
            MKL_NUM_THREADS=threads,
            OPENBLAS_NUM_THREADS=threads,
            TOKENIZERS_PARALLELISM="false",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_VERBOSITY="error",
            PYTHONUNBUFFERED="1",
        )
        return env

    def spec(self, kind: str, system: str | None, workloads: list[Workload]) -> dict[str, Any]:
        folder, _ = resolve_model(self.args.model)
        return {
            "kind": kind,
            "system": system,
            "model": self.args.model,
            "model_folder": str(folder),
            "model_gguf": bundled_gguf(self.args.model),
            "dtype": self.args.dtype,
            "threads": self.threads,
            "cpus": self.cpus,
            "repeats": self.repeats,
            "warmup": not self.args.no_warmup,
            "options": {
                "engine_config": self.engine_config,
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
        spec_path.write_text(json.dumps(spec), encoding="utf-8")
        outcome = run_process(
            [*command_prefix, str(spec_path), str(result_path)],
            env=self.env(),
            cpus=self.cpus,
            log_path=log_path,
            timeout=self.args.timeout,
            max_rss_kib=self.max_rss_kib,
        )
        if outcome.killed or outcome.returncode != 0 or not result_path.exists():
            why = outcome.killed or f"exit code {outcome.returncode}"
            return None, outcome, f"{why}; log {log_path}:\n{_tail(log_path)}"
        return json.loads(result_path.read_text(encoding="utf-8")), outcome, None

    # the whole run

    def run(self) -> dict[str, Any]:
        args = self.args
        systems = _split(args.systems)
        for system in systems:
            if system not in SYSTEMS:
                raise SystemExit(
                    f"cbgen bench: unknown system {system!r}; known: {', '.join(SYSTEMS)}"
                )
        peers = _split(args.peers)
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
            f"cbgen bench: {self.threads} threads pinned to cores {self.cpus}, {args.dtype}, "
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
            "dtype": self.args.dtype,
            "repeats": self.repeats,
            "quick": self.quick,
            "isolation": isolation,
            "engine_config": self.engine_config,
            "generate_batch_size": self.args.generate_batch_size,
            "tuned_page_size": self.args.tuned_page_size,
            "versions": _versions(),
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
            self._collect(peer, [w], result, outcome, error, raw)

    def _collect(
        self,
        system: str,
        workloads: list[Workload],
        result: dict[str, Any] | None,
        outcome: ProcessOutcome | None,
        error: str | None,
        raw: dict[str, dict[str, Any]],
    ) -> None:
        for w in workloads:
            if error or result is None:
                raw[w.name][system] = {"error": error or "no result"}
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
        if entry.get("error") or not entry.get("tokens_ok")
    ]
    if failed:
        print("cbgen bench: failed or wrong token counts: " + ", ".join(failed), file=sys.stderr)
        return 1
    return 0

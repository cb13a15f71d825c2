"""Does torch.compile beat cbgen's hand-written CPU fast path, and what makes compiling faster?

``python bench/compile_experiment.py [--quick] [--threads 2] [--out /tmp/compile_experiment.json]``

Why: cbgen's decode step on CPU runs a hand-written decoder (``cbgen.executor.cpu.fast_forward``:
prepacked oneDNN GEMMs, fused q/k/v and gate/up, C++ ``add_rms_norm`` / ``rope_qkv`` and
paged attention). The obvious alternative is to let ``torch.compile`` (inductor) fuse the
Hugging Face model's own forward. This script measures both on the bundled SmolLM2-135M,
in bfloat16 and with weight-only int8 linear maps (``cbgen.executor.cpu.quantization.QuantizedLinear``,
which call ``torch._weight_int8pack_mm``), and how long compiling costs.

How (every measurement in a fresh subprocess, ``torch.set_num_threads(--threads)``):

* ``engine``: the hand-written path. An ``EngineCore`` is prefilled with ``rows`` requests
  of ``--ctx`` random tokens (``bench/micro_step.py``'s ``prefilled_engine``), then the
  median wall time of ``EngineCore.step()`` (one decode token per sequence) is taken.
  This is NOT the same work as the compiled forward below: it decodes ``rows``
  independent sequences attending over a paged KV cache of ~``--ctx`` tokens each, and
  computes logits and samples for every row. It is the reference the compiled forward
  would have to beat to be worth wiring in.
* compile variants: the plain HF model (``use_cache=False``, under ``torch.no_grad()``)
  on ``input_ids`` of shape ``[1, rows]`` (one packed sequence of ``rows`` tokens,
  causal attention among them, logits for every position), eager vs
  ``torch.compile(..., backend="inductor")``. Variants: whole model or regional
  (each decoder layer compiled on its own: the 30 layers share one compiled graph),
  ``dynamic=False`` (one graph per shape bucket) or ``dynamic=True``, with or without
  ``torch._inductor.config.freezing`` (weights folded in as constants, which lets
  inductor prepack them for oneDNN). Each variant runs in three processes:

  - ``cold``: an empty ``TORCHINDUCTOR_CACHE_DIR``; first-call wall time per shape
    (trace + compile + run), then steady state: eager and compiled forwards alternated
    (``--iters`` each, medians), so both see the same machine load. At the end it saves
    ``torch.compiler.save_cache_artifacts()`` (the "mega-cache") to a file.
  - ``warm``: a new process on the same (now filled) cache dir: first-call times again.
  - ``mega``: a new process on an empty cache dir that first calls
    ``torch.compiler.load_cache_artifacts()`` with the saved bytes (how a cache is
    shipped to another machine or container), then first-call times.

  Dynamo still traces the Python code in every process; the caches (inductor's FX graph
  cache, AOTAutograd's cache) skip what follows. Cache hit/miss/bypass counters, graph
  breaks and recompiles are recorded from ``torch._dynamo.utils.counters``; an exception
  while compiling is recorded (first line) instead of aborting the run. The compiled
  logits are checked against eager ones (max abs difference, greedy-argmax agreement).

Results print as a markdown table and go to ``--out`` as JSON. On a shared machine the
absolute times drift; the eager/compiled ratios are measured side by side and are the
numbers to trust. The default matrix (``DEFAULT_PLAN``) takes about 10 minutes on 2
cores, ``--quick`` (``QUICK_PLAN``: per-layer compile, bf16 cold and warm, int8 cold)
about 3; ``--all`` runs every dtype, variant and phase, ``--plan`` any subset.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BENCH_DIR = Path(__file__).resolve().parent
REPO_ROOT = BENCH_DIR.parent
DTYPES = ("bf16", "int8")
PHASES = ("cold", "warm", "mega")


@dataclass(frozen=True)
class Variant:
    """One way to compile the model."""

    name: str
    regional: bool  # compile each decoder layer instead of the whole model
    dynamic: bool
    freezing: bool

    def describe(self) -> str:
        scope = "per-layer" if self.regional else "whole model"
        return f"{scope}, dynamic={self.dynamic}, freezing={self.freezing}"


VARIANTS = {
    v.name: v
    for v in (
        Variant("full", regional=False, dynamic=False, freezing=False),
        Variant("full-freeze", regional=False, dynamic=False, freezing=True),
        Variant("full-dynamic", regional=False, dynamic=True, freezing=False),
        Variant("regional", regional=True, dynamic=False, freezing=False),
        Variant("regional-freeze", regional=True, dynamic=False, freezing=True),
        Variant("regional-dynamic", regional=True, dynamic=True, freezing=False),
    )
}

# (dtype, variant, phases) run by default and by --quick; the engine reference always runs.
DEFAULT_PLAN: list[tuple[str, str, tuple[str, ...]]] = [
    ("bf16", "regional", PHASES),
    ("bf16", "full", ("cold", "warm")),
    ("bf16", "regional-freeze", ("cold",)),
    ("bf16", "regional-dynamic", ("cold",)),
    ("int8", "regional", ("cold", "warm")),
]
QUICK_PLAN: list[tuple[str, str, tuple[str, ...]]] = [
    ("bf16", "regional", ("cold", "warm")),
    ("int8", "regional", ("cold",)),
]


# --------------------------------------------------------------------------- workers


def _load(dtype: str) -> torch.nn.Module:
    import cbgen

    if dtype == "bf16":
        model, _ = cbgen.load_model("smollm2", dtype=torch.bfloat16, tokenizer=False)
    else:
        model, _ = cbgen.load_model("smollm2", quantization="int8", tokenizer=False)
    return model.eval()


def _error(exc: BaseException) -> str:
    lines = [line for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0][:300] if lines else ''}"


def _counters() -> dict[str, Any]:
    from torch._dynamo.utils import counters

    keep = ("stats", "inductor", "aot_autograd", "graph_break", "recompiles")
    out: dict[str, Any] = {}
    for group in keep:
        values = counters.get(group)
        if values:
            out[group] = {str(k)[:200]: v for k, v in values.items()}
    return out


def engine_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Median decode-step time of the hand-written path at each batch size."""
    sys.path.insert(0, str(BENCH_DIR))
    from micro_step import prefilled_engine

    model = _load(spec["dtype"])
    result: dict[str, Any] = {"rows": {}}
    for rows in spec["rows"]:
        start = time.perf_counter()
        engine = prefilled_engine(model, rows, spec["ctx"])
        prefill_s = time.perf_counter() - start
        for _ in range(2):
            engine.step()
        times = []
        for _ in range(spec["iters"]):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        result["rows"][str(rows)] = {
            "step_ms": statistics.median(times) * 1e3,
            "step_ms_all": [round(t * 1e3, 2) for t in times],
            "prefill_s": prefill_s,
            "fast_forward": engine.executor.runner.fast_forward is not None,
        }
        engine.close()
    return result


def _compile(model: torch.nn.Module, variant: Variant) -> Any:
    import torch._inductor.config as inductor_config

    inductor_config.freezing = variant.freezing
    if variant.regional:
        for layer in model.model.layers:  # type: ignore[union-attr]
            layer.compile(backend="inductor", dynamic=variant.dynamic)
        return model
    return torch.compile(model, backend="inductor", dynamic=variant.dynamic)


def compile_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """First-call (compile) times, and in the cold phase steady-state eager vs compiled."""
    import torch._dynamo

    variant = VARIANTS[spec["variant"]]
    torch._dynamo.config.recompile_limit = max(64, torch._dynamo.config.recompile_limit)
    result: dict[str, Any] = {"rows": {}, "errors": []}
    start = time.perf_counter()
    model = _load(spec["dtype"])
    result["load_s"] = time.perf_counter() - start
    if spec["phase"] == "mega":
        start = time.perf_counter()
        data = Path(spec["mega_path"]).read_bytes()
        info = torch.compiler.load_cache_artifacts(data)
        result["mega_load_s"] = time.perf_counter() - start
        result["mega_info"] = str(info)[:500]
    gen = torch.Generator().manual_seed(0)
    inputs = {r: torch.randint(100, 40000, (1, r), generator=gen) for r in spec["all_rows"]}
    with torch.no_grad():
        # Eager reference logits; this also builds QuantizedLinear's lazy kernel map.
        reference = {r: model(input_ids=ids, use_cache=False).logits for r, ids in inputs.items()}
        compiled = _compile(model, variant)

        def eager(**kwargs: Any) -> Any:
            # Regional compiles patch the layers in place: force_eager runs them uncompiled.
            with torch.compiler.set_stance("force_eager"):
                return model(**kwargs)

        for rows, ids in inputs.items():
            entry: dict[str, Any] = {}
            result["rows"][str(rows)] = entry
            start = time.perf_counter()
            try:
                logits = compiled(input_ids=ids, use_cache=False).logits
            except Exception as exc:  # noqa: BLE001 - recorded, the run goes on
                entry["error"] = _error(exc)
                result["errors"].append(f"rows={rows}: {entry['error']}")
                continue
            entry["first_call_s"] = time.perf_counter() - start
            ref = reference[rows]
            entry["max_abs_diff"] = float((logits.float() - ref.float()).abs().max())
            entry["argmax_agree"] = float((logits.argmax(-1) == ref.argmax(-1)).float().mean())
        if spec["phase"] == "cold":
            for rows in spec["rows"]:
                entry = result["rows"][str(rows)]
                if "error" in entry:
                    continue
                ids = inputs[rows]
                eager_t, compiled_t = [], []
                for fn in (eager, compiled):
                    fn(input_ids=ids, use_cache=False)  # settle
                for _ in range(spec["iters"]):
                    for fn, times in ((eager, eager_t), (compiled, compiled_t)):
                        start = time.perf_counter()
                        fn(input_ids=ids, use_cache=False)
                        times.append(time.perf_counter() - start)
                entry["eager_ms"] = statistics.median(eager_t) * 1e3
                entry["compiled_ms"] = statistics.median(compiled_t) * 1e3
            if hasattr(torch.compiler, "save_cache_artifacts") and spec.get("mega_path"):
                try:
                    saved = torch.compiler.save_cache_artifacts()
                    if saved is not None:
                        Path(spec["mega_path"]).write_bytes(saved[0])
                        result["mega_bytes"] = len(saved[0])
                except Exception as exc:  # noqa: BLE001
                    result["errors"].append(f"save_cache_artifacts: {_error(exc)}")
    result["counters"] = _counters()
    result["compile_times_s"] = _compile_times()
    return result


# Phases of torch._dynamo.utils.compile_times(), summed over every compile in the process.
TIME_KEYS = {
    "_compile.compile_inner": "total",
    "bytecode_tracing": "dynamo_trace",
    "create_aot_dispatcher_function": "aot_and_inductor",
    "GraphLowering.codegen": "inductor_codegen",
    "compile_file": "cxx_compile",
    "async_compile.wait": "async_compile_wait",
    "PyCodeCache.load_by_key_path": "load_module",
}


def _compile_times() -> dict[str, float]:
    from torch._dynamo.utils import compile_times

    try:
        names, values = compile_times(repr="csv")  # type: ignore[misc]
    except Exception:  # noqa: BLE001 - an internal API; the timings are a bonus
        return {}
    out: dict[str, float] = {}
    for name, value in zip(names, values, strict=False):
        if name in TIME_KEYS:
            out[TIME_KEYS[name]] = round(sum(float(v) for v in value.split(",") if v.strip()), 2)
    return out


def worker_main(spec: dict[str, Any]) -> None:
    torch.set_num_threads(spec["threads"])
    start = time.perf_counter()
    if spec["kind"] == "engine":
        result = engine_worker(spec)
    else:
        result = compile_worker(spec)
    result["process_s"] = time.perf_counter() - start
    print("RESULT " + json.dumps(result), flush=True)


# --------------------------------------------------------------------------- driver


def run_worker(spec: dict[str, Any], env: dict[str, str], timeout: float) -> dict[str, Any]:
    """Run one worker subprocess; its result, or an ``error`` entry."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    start = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO_ROOT
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s", "wall_s": time.perf_counter() - start}
    wall = time.perf_counter() - start
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            result = json.loads(line[len("RESULT ") :])
            result["wall_s"] = wall
            return result
    tail = [line for line in proc.stderr.splitlines() if line.strip()][-3:]
    return {"error": f"exit {proc.returncode}: {' | '.join(tail)[:500]}", "wall_s": wall}


def _fmt(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _notes(results: dict[str, Any], rows: list[int]) -> str:
    notes: list[str] = []
    cold = results.get("cold", {})
    for phase in PHASES:
        if phase in results and "error" in results[phase]:
            notes.append(f"{phase}: {results[phase]['error']}")
    notes.extend(cold.get("errors", []))
    counters = cold.get("counters", {})
    breaks = counters.get("graph_break", {})
    if breaks:
        top = sorted(breaks.items(), key=lambda kv: -kv[1])[:2]
        notes.append("graph breaks: " + "; ".join(f"{k[:80]} x{v}" for k, v in top))
    unique = counters.get("stats", {}).get("unique_graphs")
    if unique is not None:
        notes.append(f"{unique} graphs")
    for phase in PHASES:
        times = results.get(phase, {}).get("compile_times_s", {})
        if "total" in times:
            notes.append(
                f"{phase}: compile {times['total']:.0f} s, g++ {times.get('cxx_compile', 0):.0f} s summed"
            )
        inductor = results.get(phase, {}).get("counters", {}).get("inductor", {})
        hits = {k: v for k, v in inductor.items() if k.startswith("fxgraph_cache")}
        if hits:
            notes.append(f"{phase} " + ",".join(f"{k[14:]}={v}" for k, v in sorted(hits.items())))
    for key, entry in cold.get("rows", {}).items():
        if key not in {str(r) for r in rows} and "first_call_s" in entry:
            notes.append(f"new shape rows={key}: first call {entry['first_call_s']:.1f} s")
    return "; ".join(notes)


def table(report: dict[str, Any]) -> str:
    head = (
        "| dtype | variant | rows | 1st call cold s | 1st call warm s | 1st call mega s | eager ms "
        "| compiled ms | eager/compiled | hand-written step ms | argmax agree | notes |"
    )
    lines = [head, "|" + "|".join("---" for _ in range(head.count("|") - 1)) + "|"]
    engine = report["engine"]
    for run in report["runs"]:
        dtype, name, res = run["dtype"], run["variant"], run["results"]
        notes = _notes(res, report["rows"])
        for i, rows in enumerate(report["rows"]):
            key = str(rows)
            phase_first = {
                p: res.get(p, {}).get("rows", {}).get(key, {}).get("first_call_s") for p in PHASES
            }
            cold = res.get("cold", {}).get("rows", {}).get(key, {})
            eager, comp = cold.get("eager_ms"), cold.get("compiled_ms")
            ratio = eager / comp if eager and comp else None
            ref = engine.get(dtype, {}).get("rows", {}).get(key, {}).get("step_ms")
            lines.append(
                f"| {dtype} | {name} | {rows} | {_fmt(phase_first['cold'])} "
                f"| {_fmt(phase_first['warm'])} | {_fmt(phase_first['mega'])} "
                f"| {_fmt(eager)} | {_fmt(comp)} | {_fmt(ratio, 2)} | {_fmt(ref)} "
                f"| {_fmt(cold.get('argmax_agree'), 3)} | {notes if i == 0 else ''} |"
            )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quick", action="store_true", help="a ~2-3 minute subset")
    parser.add_argument(
        "--all", action="store_true", help="every dtype, variant and phase (about an hour)"
    )
    parser.add_argument("--out", default="/tmp/compile_experiment.json")
    parser.add_argument("--rows", default="1,64", help="comma-separated batch/token counts")
    parser.add_argument("--ctx", type=int, default=100, help="context tokens for the engine")
    parser.add_argument("--iters", type=int, default=10, help="timed calls per measurement")
    parser.add_argument(
        "--plan",
        default=None,
        help="override the matrix: 'dtype:variant:phase+phase,...' "
        f"(variants: {', '.join(VARIANTS)}; phases: {', '.join(PHASES)})",
    )
    parser.add_argument("--timeout", type=float, default=600, help="per subprocess, seconds")
    parser.add_argument("--keep-cache", action="store_true", help="keep the cache dirs")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker_main(json.loads(args.worker))
        return

    total_start = time.perf_counter()
    rows = [int(r) for r in args.rows.split(",")]
    if args.plan:
        plan = []
        for item in args.plan.split(","):
            dtype, name, phases = item.split(":")
            plan.append((dtype, name, tuple(phases.split("+"))))
    elif args.all:
        plan = [(d, name, PHASES) for d in DTYPES for name in VARIANTS]
    else:
        plan = QUICK_PLAN if args.quick else DEFAULT_PLAN
    for dtype, name, phases in plan:
        assert dtype in DTYPES and name in VARIANTS and set(phases) <= set(PHASES), (dtype, name)
    base = {"threads": args.threads, "rows": rows, "ctx": args.ctx, "iters": args.iters}
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env.setdefault("HF_HUB_OFFLINE", "1")
    root = Path(tempfile.mkdtemp(prefix="cbgen-compile-"))
    report: dict[str, Any] = {
        "torch": torch.__version__,
        "threads": args.threads,
        "rows": rows,
        "ctx": args.ctx,
        "iters": args.iters,
        "cpu_count": os.cpu_count(),
        "engine": {},
        "runs": [],
    }

    def log(msg: str) -> None:
        print(f"[{time.perf_counter() - total_start:6.0f} s] {msg}", flush=True)

    try:
        for dtype in sorted({d for d, _, _ in plan}):
            log(f"engine {dtype}")
            spec = {**base, "kind": "engine", "dtype": dtype}
            report["engine"][dtype] = run_worker(spec, env, args.timeout)
        for dtype, name, phases in plan:
            cache = root / f"{dtype}-{name}"
            mega_path = root / f"{dtype}-{name}.mega"
            results: dict[str, Any] = {}
            extra = [48] if VARIANTS[name].dynamic else []  # does a new shape recompile?
            for phase in phases:
                if phase == "mega" and not mega_path.exists():
                    results[phase] = {"error": "no mega-cache saved by the cold run"}
                    continue
                phase_cache = root / f"{dtype}-{name}-mega" if phase == "mega" else cache
                if phase == "warm" and not cache.exists():
                    results[phase] = {"error": "no cold run to warm the cache"}
                    continue
                log(f"{dtype} {name} {phase}")
                spec = {
                    **base,
                    "kind": "compile",
                    "dtype": dtype,
                    "variant": name,
                    "phase": phase,
                    "all_rows": rows + extra,
                    "mega_path": str(mega_path),
                }
                phase_env = {**env, "TORCHINDUCTOR_CACHE_DIR": str(phase_cache)}
                results[phase] = run_worker(spec, phase_env, args.timeout)
                if phase_cache.exists():
                    files = [f for f in phase_cache.rglob("*") if f.is_file()]
                    results[phase]["cache_dir"] = {
                        "files": len(files),
                        "so_files": sum(f.suffix == ".so" for f in files),
                        "mib": round(sum(f.stat().st_size for f in files) / 2**20, 1),
                    }
            report["runs"].append(
                {
                    "dtype": dtype,
                    "variant": name,
                    "describe": VARIANTS[name].describe(),
                    "results": results,
                }
            )
    finally:
        if not args.keep_cache:
            shutil.rmtree(root, ignore_errors=True)
    report["total_s"] = time.perf_counter() - total_start
    Path(args.out).write_text(json.dumps(report, indent=1))
    print()
    print(table(report))
    print()
    for name, variant in VARIANTS.items():
        if any(name == n for _, n, _ in plan):
            print(f"- {name}: {variant.describe()}")
    print(f"\ntotal {report['total_s']:.0f} s; JSON in {args.out}")


if __name__ == "__main__":
    main()

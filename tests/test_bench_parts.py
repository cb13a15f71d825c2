"""The benchmark harness's parts alone: its arguments, the machine facts, the supervisor."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import pytest

from cbgen.bench.args import add_arguments, split_list
from cbgen.bench.machine import choose_cpus, process_env, versions
from cbgen.bench.supervisor import ProcessOutcome, run_process, tail


def bench_args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_arguments_defaults():
    args = bench_args()
    assert args.workloads is None and args.threads == 2 and args.isolation == "workload"
    assert args.engine_option == [] and args.peers == ""
    assert bench_args("--workload", "a", "--workload", "b").workloads == ["a", "b"]


def test_split_list_drops_blanks():
    assert split_list(" cbgen, ,generate ,") == ["cbgen", "generate"]
    assert split_list("") == []


def test_choose_cpus_takes_the_given_cores():
    assert choose_cpus(bench_args("--cpus", "3,1-2", "--threads", "1")) == [1, 2, 3]


@pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity here")
def test_choose_cpus_defaults_to_the_first_allowed_cores():
    allowed = sorted(os.sched_getaffinity(0))
    assert choose_cpus(bench_args("--threads", "1")) == allowed[:1]
    assert choose_cpus(bench_args("--threads", str(len(allowed) + 5))) == allowed


def test_process_env_sets_every_thread_pool_and_goes_offline():
    env = process_env(3)
    assert env["OMP_NUM_THREADS"] == env["MKL_NUM_THREADS"] == env["OPENBLAS_NUM_THREADS"] == "3"
    assert env["HF_HUB_OFFLINE"] == "1" and env["TOKENIZERS_PARALLELISM"] == "false"
    assert env["PATH"] == os.environ["PATH"]


def test_versions_name_python_and_torch():
    found = versions()
    assert found["python"] == ".".join(map(str, sys.version_info[:3]))
    assert "torch" in found


def test_tail_reads_the_last_lines(tmp_path):
    path = tmp_path / "log"
    path.write_text("\n".join(str(i) for i in range(30)), encoding="utf-8")
    assert tail(path, 3) == "27\n28\n29"
    assert tail(tmp_path / "missing") == ""


def test_run_process_reports_the_exit_code_and_writes_the_log(tmp_path):
    log = tmp_path / "log"
    outcome = run_process(
        [sys.executable, "-c", "import sys; print('hello'); sys.exit(3)"],
        env=dict(os.environ),
        cpus=[],
        log_path=log,
        timeout=60,
        max_rss_kib=None,
    )
    assert outcome.returncode == 3 and outcome.killed is None
    assert log.read_text(encoding="utf-8").strip() == "hello"


# -- a peer stopped at its time limit ------------------------------------------------------


def _peers_common(monkeypatch):
    """The peers' shared runner code (standard library only; each peer has its own venv)."""
    from cbgen.bench.workloads import bench_dir

    monkeypatch.syspath_prepend(str(bench_dir() / "peers"))
    import _common

    return _common


def test_a_runners_timed_repeats_keep_a_progress_file(tmp_path, monkeypatch):
    common = _peers_common(monkeypatch)
    monkeypatch.setattr(common, "PROGRESS_EVERY_S", 0.0)
    path = tmp_path / "peer.progress.json"
    seen = []

    clock_started_first = []

    def run_once(prompts, max_new, progress):
        clock = time.time()
        progress(0)  # the run's clock starts
        started = json.loads(path.read_text()) if path.exists() else None
        seen.append((len(prompts), max_new, started and started["repeat"]))
        if started is not None:
            clock_started_first.append(started["started_unix"] >= clock)
        for made in range(1, len(prompts) * max_new + 1):
            progress(made)
        return 1.0, [[0.5] * max_new for _ in prompts], [[7] * max_new for _ in prompts]

    spec = {
        "repeats": 2,
        "warmup": True,
        "progress_path": str(path),
        "workloads": [{"name": "w", "max_new_tokens": 16, "prompts": [[1, 2]] * 5}],
    }
    result = {"load_s": 3.5}
    common.run_workloads(spec, run_once, result)
    assert result["workloads"]["w"]["error"] is None
    # The warm-up (4 prompts, 8 tokens) writes nothing; each timed repeat starts afresh.
    assert seen == [(4, 8, None), (5, 16, 1), (5, 16, 2)]
    # A repeat's start is taken when its clock starts, never earlier (the bound errs on the
    # peer's side).
    assert clock_started_first == [True, True]
    record = json.loads(path.read_text())
    assert record["workload"] == "w" and record["repeat"] == 2 and record["load_s"] == 3.5
    assert record["tokens_done"] == record["tokens_total"] == 80
    assert record["updated_unix"] >= record["started_unix"]


def test_a_peer_stopped_for_time_mid_repeat_is_a_bound(tmp_path):
    from cbgen.bench.harness import unfinished_run

    path = tmp_path / "vllm.progress.json"
    record = {"workload": "many-short", "repeat": 1, "tokens_total": 32768, "load_s": 120.0}
    record.update(started_unix=1000.0, updated_unix=1090.0, tokens_done=900)
    path.write_text(json.dumps(record))
    stopped = ProcessOutcome(-9, 4096, 220.0, "timed out after 220 s", timed_out_unix=1100.0)
    unfinished = unfinished_run(path, stopped)
    assert unfinished["elapsed_s"] == 100.0
    assert unfinished["tok_s_below"] == pytest.approx(327.68)
    assert unfinished["partial_tok_s"] == pytest.approx(10.0)
    # Killed for memory, exited by itself, or stopped before its first timed repeat: no bound.
    memory = ProcessOutcome(-9, 4096, 220.0, "RSS passed the limit of 1.0 GiB")
    assert unfinished_run(path, memory) is None
    assert unfinished_run(path, ProcessOutcome(1, 4096, 220.0)) is None
    assert unfinished_run(tmp_path / "none.json", stopped) is None


def test_the_report_gives_a_stopped_peer_as_a_bound(tmp_path):
    from cbgen.bench.harness import Bench
    from cbgen.bench.report import summary_table, workload_table
    from cbgen.bench.workloads import Workload

    bench = Bench(bench_args("--model", "smollm2", "--out", str(tmp_path)))
    workload = Workload("w", "two prompts", [[1, 2, 3], [4, 5]], max_new_tokens=4)
    run = {"wall_s": 2.0, "prompt_tokens": [3, 2], "output_tokens": [4, 4]}
    run["token_times"] = [[0.5, 1.0, 1.5, 2.0]] * 2
    raw = {"w": {"cbgen": {"runs": [run], "output_ids": [[1] * 4] * 2}}}
    unfinished = {"workload": "w", "repeat": 1, "tokens_total": 8, "tokens_done": 3}
    unfinished.update(elapsed_s=4.0, tok_s_below=2.0, partial_tok_s=1.0, load_s=9.0)
    outcome = ProcessOutcome(-9, 2048, 13.0, "timed out after 13 s", 1.0)
    bench._collect("vllm", [workload], None, outcome, "timed out after 13 s", raw, unfinished)
    compiled = bench.compile(workload, raw["w"], None)
    assert compiled["cbgen"]["median"]["output_tok_s"] == 4.0
    vllm = compiled["vllm"]
    assert vllm["cbgen_ratio_above"] == 2.0 and vllm["peak_rss_mib"] == 2.0
    assert vllm["load_s"] == 9.0
    table = workload_table({"systems": compiled})
    assert "below 2.0 tok/s (3 of 8 tokens when stopped after 4 s of repeat 1" in table[3]
    assert table[3].endswith("| unfinished | – | > 2.00× |")
    results = {"workloads": {"w": {"systems": compiled}}}
    assert summary_table(results)[2].startswith("| w | 4.0 | > 2.00× |")

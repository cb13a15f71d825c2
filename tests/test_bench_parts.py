"""The benchmark harness's parts alone: its arguments, the machine facts, the supervisor."""

from __future__ import annotations

import argparse
import os
import sys

import pytest

from cbgen.bench.args import add_arguments, split_list
from cbgen.bench.machine import choose_cpus, process_env, versions
from cbgen.bench.supervisor import run_process, tail


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

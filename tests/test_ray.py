"""Batch jobs on a local Ray cluster (started here): two actors of one thread each.

The outputs must be exactly a single ``generate_batch`` run's, in input order; an actor
killed mid-job must cost no row and duplicate none; an interrupted job must resume with
only the missing rows.
"""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from conftest import expected_token_ids, job_rows, write_jsonl  # noqa: E402

from cbgen.frontends.jobs import run_batch_job  # noqa: E402
from cbgen.frontends.jobs.files import read_rows  # noqa: E402
from cbgen.frontends.jobs.ray import Generator  # noqa: E402

ROWS = 1000
MAX_NEW_TOKENS = 4
ACTOR = b"MapWorker(MapBatches(JobGenerator))"


@pytest.fixture(scope="module")
def cluster():
    # Logical CPUs: the two one-thread actors, with room for Ray Data's own tasks.
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def dataset(tiny_chat_model_dir, tmp_path_factory):
    """1,000 rows and the token ids ``generate_batch`` gives for them."""
    rows = job_rows(ROWS)
    path = tmp_path_factory.mktemp("ray") / "in.jsonl"
    write_jsonl(path, rows)
    return path, expected_token_ids(tiny_chat_model_dir, rows, MAX_NEW_TOKENS)


def run(model_dir, input_path, output_path, **kwargs):
    return run_batch_job(
        input_path,
        output_path,
        {"model": str(model_dir), "max_new_tokens": MAX_NEW_TOKENS, "threads": 1},
        ray=True,
        actors=2,
        progress=False,
        **kwargs,
    )


def actor_pids() -> list[int]:
    """The processes of the job's Ray actors (Ray titles them after the map operator)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if ACTOR in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # gone meanwhile
                continue
    return pids


def test_two_actors_give_a_single_engines_greedy_outputs(
    cluster, tiny_chat_model_dir, dataset, tmp_path
):
    input_path, want = dataset
    report = run(tiny_chat_model_dir, input_path, tmp_path / "out.jsonl", batch_size=50)
    assert (report.written, report.errors, report.duplicates) == (ROWS, 0, 0)
    out = read_rows(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == list(range(ROWS))
    assert [r["token_ids"] for r in out] == want


@pytest.mark.skipif(not Path("/proc/self/cmdline").exists(), reason="finds actors through /proc")
def test_an_actor_killed_mid_job_loses_no_row_and_writes_none_twice(
    cluster, tiny_chat_model_dir, dataset, tmp_path
):
    input_path, want = dataset
    killed: list[int] = []

    def kill_an_actor(written: int) -> None:
        if not killed and written >= 200:  # 800 rows to go: the actors hold batches
            pids = actor_pids()
            assert pids, "no actor process found"
            os.kill(pids[0], signal.SIGKILL)
            wait_until_gone(pids[0])
            killed.append(pids[0])

    report = run(
        tiny_chat_model_dir,
        input_path,
        tmp_path / "out.jsonl",
        batch_size=25,
        on_written=kill_an_actor,
    )
    assert killed and report.written == ROWS and report.duplicates == 0
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    ids = [json.loads(line)["id"] for line in lines]
    assert ids == list(range(ROWS))  # every row exactly once, in order
    assert [json.loads(line)["token_ids"] for line in lines] == want


def wait_until_gone(pid: int) -> None:
    """Return once ``pid`` is no actor any more (SIGKILL is delivered asynchronously)."""
    deadline = time.monotonic() + 60
    while pid in actor_pids():
        assert time.monotonic() < deadline, f"actor {pid} outlived SIGKILL for 60 s"
        time.sleep(0.05)


class Interrupted(Exception):
    pass


def test_a_rerun_after_an_interrupted_job_writes_only_the_missing_rows(
    cluster, tiny_chat_model_dir, dataset, tmp_path
):
    input_path, want = dataset

    def interrupt(written: int) -> None:
        if written >= 300:
            raise Interrupted

    with pytest.raises(Interrupted):
        run(
            tiny_chat_model_dir,
            input_path,
            tmp_path / "out.jsonl",
            batch_size=100,
            on_written=interrupt,
        )
    first = (tmp_path / "out.jsonl").read_text().splitlines()
    assert 300 <= len(first) < ROWS
    report = run(tiny_chat_model_dir, input_path, tmp_path / "out.jsonl", batch_size=100)
    assert (report.skipped, report.written) == (len(first), ROWS - len(first))
    lines = (tmp_path / "out.jsonl").read_text().splitlines()
    assert lines[: len(first)] == first  # untouched
    rows = [json.loads(line) for line in lines]
    assert sorted(r["id"] for r in rows) == list(range(ROWS))
    by_id = {r["id"]: r["token_ids"] for r in rows}
    assert [by_id[i] for i in range(ROWS)] == want


def test_generator_is_a_map_batches_class(cluster, tiny_chat_model_dir):
    rows = [{"prompt": f"Question {i}?", "max_new_tokens": 1 + i % 3} for i in range(12)]
    ds = ray.data.from_items(rows).map_batches(
        Generator,
        fn_constructor_kwargs={"model": str(tiny_chat_model_dir), "threads": 1},
        compute=ray.data.ActorPoolStrategy(size=1),
        num_cpus=1,
        batch_size=5,
    )
    out = sorted(ds.take_all(), key=lambda r: r["prompt"])
    assert [len(r["token_ids"]) for r in out] == [
        r["max_new_tokens"] for r in sorted(rows, key=lambda r: r["prompt"])
    ]
    assert all(r["finish_reason"] == "length" and r["error"] is None for r in out)

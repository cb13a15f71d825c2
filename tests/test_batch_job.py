"""Batch jobs in one process: exact outputs, bad rows written with their error, resume."""

from __future__ import annotations

import re
import sys

import numpy as np
import pytest
from conftest import expected_token_ids, job_rows, write_jsonl

from cbgen.cli import main
from cbgen.frontends.jobs import Generator, run_batch_job
from cbgen.frontends.jobs.files import read_rows


def test_a_job_matches_generate_batch_and_keeps_the_rows(tiny_chat_model_dir, tmp_path):
    rows = job_rows(40)
    write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_batch_job(
        tmp_path / "in.jsonl",
        tmp_path / "out.jsonl",
        {"model": str(tiny_chat_model_dir), "max_new_tokens": 6},
        batch_size=7,  # several batches, two in the engine at once
        progress=False,
    )
    assert (report.rows, report.written, report.skipped, report.errors) == (40, 40, 0, 0)
    out = read_rows(tmp_path / "out.jsonl")
    assert [r["id"] for r in out] == list(range(40))  # input order
    for row, written in zip(rows, out, strict=True):
        assert {k: written[k] for k in row} == row
        assert written["finish_reason"] in ("length", "eos") and written["error"] is None
        assert isinstance(written["text"], str)
    want = expected_token_ids(tiny_chat_model_dir, rows, 6)
    assert [r["token_ids"] for r in out] == want


def test_bad_rows_are_written_with_their_error(tiny_chat_model_dir, tmp_path):
    rows = [
        {"id": "ok", "prompt": "Hello"},
        {"id": "cold", "prompt": "Hello", "temperature": -1},
        {"id": "long", "prompt": "word " * 700},  # past the model's 512 positions
        {"id": "empty", "prompt": ""},
        {"id": "nothing"},
        {"id": "zero", "prompt": "Hello", "max_new_tokens": 0},
        {"id": "ok2", "messages": [{"role": "user", "content": "Hi"}]},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    report = run_batch_job(
        tmp_path / "in.jsonl",
        tmp_path / "out.jsonl",
        {"model": str(tiny_chat_model_dir), "max_new_tokens": 4},
        progress=False,
    )
    assert (report.written, report.errors) == (7, 5)
    out = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert out["ok"]["error"] is None and len(out["ok"]["token_ids"]) == 4
    assert out["ok2"]["error"] is None
    for key, message in [
        ("cold", "temperature"),
        ("long", "context"),
        ("empty", "empty"),
        ("nothing", "needs `prompt`"),
        ("zero", "max_new_tokens"),
    ]:
        assert out[key]["finish_reason"] == "error" and out[key]["token_ids"] == []
        assert message in out[key]["error"], out[key]["error"]
        assert not out[key]["error"].startswith("request '")


class Interrupted(Exception):
    pass


def test_a_rerun_after_an_interrupted_job_writes_only_the_missing_rows(
    tiny_chat_model_dir, tmp_path
):
    rows = job_rows(30)
    write_jsonl(tmp_path / "in.jsonl", rows)
    options = {"model": str(tiny_chat_model_dir), "max_new_tokens": 5}

    def interrupt(written: int) -> None:
        if written >= 10:
            raise Interrupted

    with pytest.raises(Interrupted):
        run_batch_job(
            tmp_path / "in.jsonl",
            tmp_path / "out.jsonl",
            options,
            batch_size=5,
            progress=False,
            on_written=interrupt,
        )
    first = read_rows(tmp_path / "out.jsonl")
    assert 10 <= len(first) < 30
    report = run_batch_job(
        tmp_path / "in.jsonl", tmp_path / "out.jsonl", options, batch_size=5, progress=False
    )
    assert report.skipped == len(first) and report.written == 30 - len(first)
    out = read_rows(tmp_path / "out.jsonl")
    assert out[: len(first)] == first
    assert sorted(r["id"] for r in out) == list(range(30))
    by_id = {r["id"]: r["token_ids"] for r in out}
    assert [by_id[i] for i in range(30)] == expected_token_ids(tiny_chat_model_dir, rows, 5)
    again = run_batch_job(tmp_path / "in.jsonl", tmp_path / "out.jsonl", options, progress=False)
    assert (again.written, again.skipped) == (0, 30)


def test_parquet_in_and_out(tiny_chat_model_dir, tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"id": f"r{i}", "prompt": f"Tell me about {i}.", "temperature": 0.0} for i in range(6)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "in.parquet")
    report = run_batch_job(
        tmp_path / "in.parquet",
        tmp_path / "out.parquet",
        {"model": str(tiny_chat_model_dir), "max_new_tokens": 3},
        progress=False,
    )
    assert report.written == 6
    out = read_rows(tmp_path / "out.parquet")
    assert [r["id"] for r in out] == [r["id"] for r in rows]
    assert all(len(r["token_ids"]) == 3 and r["error"] is None for r in out)
    assert not (tmp_path / "out.parquet.partial.jsonl").exists()


def test_generator_takes_numpy_and_pandas_batches(tiny_chat_model_dir):
    pd = pytest.importorskip("pandas")
    with Generator(str(tiny_chat_model_dir), max_new_tokens=3, threads=1) as generator:
        batch = {
            "prompt": np.array(["Hello", None], dtype=object),
            "messages": np.array([None, [{"role": "user", "content": "Hi"}]], dtype=object),
            "max_new_tokens": np.array([2.0, np.nan]),
        }
        out = generator(batch)
        assert [len(t) for t in out["token_ids"]] == [2, 3]
        assert list(out["error"]) == [None, None]
        frame = generator(pd.DataFrame({"prompt": ["Hello", "Hi"], "temperature": [0.0, -1.0]}))
        assert list(frame.columns) == [
            "prompt",
            "temperature",
            "text",
            "token_ids",
            "finish_reason",
            "error",
        ]
        assert frame["finish_reason"].tolist()[1] == "error"
        assert list(frame["token_ids"][0]) == list(out["token_ids"][0]) + [frame["token_ids"][0][2]]


def test_the_cli_runs_a_job_and_refuses_actors_without_ray(tiny_chat_model_dir, tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", job_rows(5))
    args = ["batch", "--model", str(tiny_chat_model_dir), "--input", str(tmp_path / "in.jsonl")]
    args += ["--output", str(tmp_path / "out.jsonl"), "--max-new-tokens", "2", "--no-progress"]
    assert main(args) == 0
    assert "5 rows: 5 written" in capsys.readouterr().out
    assert main(args) == 0
    assert "0 written (0 with an error), 5 already done" in capsys.readouterr().out
    assert main([*args, "--actors", "2"]) == 2
    assert "--actors needs --ray" in capsys.readouterr().err
    assert main([*args[:-1], "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main([*args, "--json-schema", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_the_cli_says_how_to_resume_when_interrupted(tmp_path, monkeypatch, capsys):
    import cbgen.frontends.jobs.job

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(cbgen.frontends.jobs.job, "run_batch_job", interrupted)
    out = str(tmp_path / "out.jsonl")
    assert main(["batch", "--input", "in.jsonl", "--output", out]) == 130
    assert f"kept in {out}, and the same command resumes" in capsys.readouterr().err


def test_rows_carry_their_own_output_constraint_over_the_default(tiny_chat_model_dir, tmp_path):
    rows = [
        {"id": "digits", "prompt": "A number:", "regex": "[0-9]{3}"},
        {"id": "default", "prompt": "Two letters:"},
        {"id": "object", "prompt": "JSON:", "json_object": True, "max_new_tokens": 1},
        {"id": "two", "prompt": "x", "regex": "a", "json_schema": {"type": "object"}},
        {"id": "broken", "prompt": "x", "regex": "("},
    ]
    write_jsonl(tmp_path / "in.jsonl", rows)
    args = ["batch", "--model", str(tiny_chat_model_dir), "--input", str(tmp_path / "in.jsonl")]
    args += ["--output", str(tmp_path / "out.jsonl"), "--regex", "[a-z]{2}", "--no-progress"]
    assert main(args) == 0
    out = {r["id"]: r for r in read_rows(tmp_path / "out.jsonl")}
    assert re.fullmatch("[0-9]{3}", out["digits"]["text"]), out["digits"]
    assert re.fullmatch("[a-z]{2}", out["default"]["text"]), out["default"]
    assert out["object"]["text"] == "{" and out["object"]["finish_reason"] == "length"
    assert "exactly one of" in out["two"]["error"]
    assert out["broken"]["finish_reason"] == "error" and out["broken"]["error"]


def test_ray_jobs_say_how_to_install_ray(tiny_chat_model_dir, tmp_path, monkeypatch, capsys):
    from cbgen.frontends.jobs.ray import import_ray

    monkeypatch.setitem(sys.modules, "ray", None)  # as if ray were not installed
    with pytest.raises(ImportError, match=r"pip install 'cbgen\[ray\]'"):
        import_ray()
    write_jsonl(tmp_path / "in.jsonl", job_rows(2))
    args = ["batch", "--model", str(tiny_chat_model_dir), "--input", str(tmp_path / "in.jsonl")]
    assert main([*args, "--output", str(tmp_path / "out.jsonl"), "--ray", "--no-progress"]) == 2
    assert "cbgen[ray]" in capsys.readouterr().err


def test_the_generator_takes_the_lm_head_option(tiny_chat_model_dir):
    """``cbgen batch --lm-head-quantization`` reaches the model the job's engine runs."""
    with Generator(
        str(tiny_chat_model_dir),
        max_new_tokens=2,
        threads=1,
        quantization="int4",
        lm_head_quantization="int4",
    ) as generator:
        assert generator.engine.core.model.lm_head.mode == "int4"

"""A batch job's files: reading rows, row keys, writing each row once, resuming."""

from __future__ import annotations

import pytest
from conftest import write_jsonl
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.frontends.jobs.files import OutputWriter, read_rows, row_keys


def out_row(key, **extra):
    return {
        "id": key,
        "text": "t",
        "token_ids": [1],
        "finish_reason": "length",
        "error": None,
        **extra,
    }


def test_jsonl_rows_skip_blank_lines_and_name_bad_lines(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text('{"prompt": "a"}\n\n{"prompt": "b"}\n')
    assert read_rows(path) == [{"prompt": "a"}, {"prompt": "b"}]
    path.write_text('{"prompt": "a"}\nnope\n')
    with pytest.raises(ValueError, match=r"in.jsonl:2: not JSON"):
        read_rows(path)
    path.write_text("[1, 2]\n")
    with pytest.raises(ValueError, match="must be a JSON object"):
        read_rows(path)


def test_keys_are_ids_when_given_else_positions():
    assert row_keys([{"prompt": "a"}, {"prompt": "b"}]) == ([0, 1], False)
    assert row_keys([{"id": "x"}, {"id": 3}]) == (["x", 3], True)
    with pytest.raises(ValueError, match="row 1 has no `id`"):
        row_keys([{"id": "x"}, {"prompt": "b"}])
    with pytest.raises(ValueError, match="not unique"):
        row_keys([{"id": "x"}, {"id": "x"}])
    with pytest.raises(ValueError, match="string or an integer"):
        row_keys([{"id": 1.5}])


def test_a_key_is_written_once_and_a_reopened_writer_knows_it(tmp_path):
    path = tmp_path / "out.jsonl"
    writer = OutputWriter(path)
    assert writer.write([out_row(0), out_row(1), out_row(0)]) == [out_row(0), out_row(1)]
    assert writer.duplicates == 1
    writer.finish()
    again = OutputWriter(path)
    assert again.done == {0, 1}
    assert again.write([out_row(1), out_row(2)]) == [out_row(2)]
    again.finish()
    assert [r["id"] for r in read_rows(path)] == [0, 1, 2]


def test_a_line_cut_short_by_a_kill_is_dropped_on_resume(tmp_path):
    path = tmp_path / "out.jsonl"
    write_jsonl(path, [out_row(0), out_row(1)])
    with path.open("a") as f:
        f.write('{"id": 2, "text": "half')  # the process died mid-write
    writer = OutputWriter(path)
    assert writer.done == {0, 1}
    writer.write([out_row(2)])
    writer.finish()
    assert [r["id"] for r in read_rows(path)] == [0, 1, 2]


def test_an_output_that_is_not_ours_is_refused(tmp_path):
    path = tmp_path / "out.jsonl"
    path.write_text("not json\n")
    with pytest.raises(ValueError, match="is this a cbgen output"):
        OutputWriter(path)
    write_jsonl(path, [{"prompt": "no id"}])
    with pytest.raises(ValueError, match="has no `id`"):
        OutputWriter(path)


def test_parquet_output_journals_rows_until_the_job_completes(tmp_path):
    pytest.importorskip("pyarrow")
    path = tmp_path / "out.parquet"
    writer = OutputWriter(path)
    writer.write([out_row(0, prompt="a"), out_row(1, prompt="b", temperature=0.5)])
    writer.close()  # interrupted: no Parquet yet, the journal holds the rows
    assert not path.exists() and writer.journal.exists()
    resumed = OutputWriter(path)
    assert resumed.done == {0, 1}
    resumed.write([out_row(2, prompt="c", error=None, text=None)])
    resumed.finish()
    assert not resumed.journal.exists()
    rows = read_rows(path)
    assert [r["id"] for r in rows] == [0, 1, 2]
    assert rows[1]["temperature"] == 0.5 and rows[0]["temperature"] is None
    final = OutputWriter(path)  # a finished Parquet output is read back for resume too
    assert final.done == {0, 1, 2}
    final.finish()
    assert [r["id"] for r in read_rows(path)] == [0, 1, 2]


# Each example writes, fsyncs and reads files: no deadline (a slow disk is no failure).
@settings(deadline=None)
@given(st.lists(st.integers(0, 20), max_size=40), st.integers(0, 40))
def test_every_key_lands_once_however_writes_are_split(tmp_path_factory, keys, cut):
    path = tmp_path_factory.mktemp("w") / "out.jsonl"
    first = OutputWriter(path)
    first.write([out_row(k) for k in keys[:cut]])
    first.close()
    second = OutputWriter(path)
    second.write([out_row(k) for k in keys[cut:]])
    second.finish()
    written = [r["id"] for r in read_rows(path)]
    assert sorted(written) == sorted(set(keys))
    assert written == list(dict.fromkeys(keys))  # first arrival order

"""A batch job's files: rows in (JSONL or Parquet), rows out as they finish, and resume.

The output is written row by row as results arrive, so a job killed at any moment keeps
everything it finished; a re-run reads which rows are there and runs only the others.
JSONL output is appended to directly (a line cut short by a kill is dropped on resume).
A Parquet file cannot grow row by row, so Parquet output goes to a JSONL journal next to
it (``out.parquet.partial.jsonl``) and becomes the Parquet file when the job completes.

A row is known by its ``id`` field when the input has one (then every row needs a
unique one), else by its 0-based position in the input, which the output row gets as
``id`` so that a re-run can match it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path
from typing import Any

PARQUET_SUFFIXES = (".parquet", ".pq")


def is_parquet(path: str | Path) -> bool:
    return Path(path).suffix.lower() in PARQUET_SUFFIXES


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """Every row of a JSONL (one JSON object per line) or Parquet file."""
    path = Path(path)
    if is_parquet(path):
        return _parquet().read_table(path).to_pylist()
    rows = []
    with path.open(encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{path}:{number}: not JSON ({exc})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{number}: a row must be a JSON object")
            rows.append(row)
    return rows


def row_keys(rows: Sequence[dict[str, Any]]) -> tuple[list[Hashable], bool]:
    """Each row's key, and whether the keys are the rows' own ``id`` fields."""
    with_id = [i for i, row in enumerate(rows) if row.get("id") is not None]
    if not with_id:
        return list(range(len(rows))), False
    if len(with_id) != len(rows):
        missing = next(i for i, row in enumerate(rows) if row.get("id") is None)
        raise ValueError(f"row {missing} has no `id` while others do: give every row one")
    keys: list[Hashable] = []
    seen: set[Hashable] = set()
    for index, row in enumerate(rows):
        key = row["id"]
        if not isinstance(key, (str, int)) or isinstance(key, bool):
            raise ValueError(f"row {index}: `id` must be a string or an integer, got {key!r}")
        if key in seen:
            raise ValueError(f"row {index}: `id` {key!r} is not unique")
        seen.add(key)
        keys.append(key)
    return keys, True


class OutputWriter:
    """Appends output rows as they finish; ``done`` holds the keys already written.

    A row is written once: ``write`` skips (and counts in ``duplicates``) a key already
    in the file, so a retried batch's second result can never add it again.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.parquet = is_parquet(self.path)
        self.journal = self.path.with_name(self.path.name + ".partial.jsonl")
        self.duplicates = 0
        self.done: set[Hashable] = set()
        if self.parquet and self.path.exists():
            self.done.update(row.get("id") for row in read_rows(self.path))
        target = self.journal if self.parquet else self.path
        self.done.update(_recover_jsonl(target))
        target.parent.mkdir(parents=True, exist_ok=True)
        self._file = target.open("a", encoding="utf-8")

    def write(self, rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
        """Append the rows not written yet, flushed to the OS before returning; those rows."""
        written = []
        for row in rows:
            key = row["id"]
            if key in self.done:
                self.duplicates += 1
                continue
            self._file.write(json.dumps(row, ensure_ascii=False, default=str) + "\n")
            self.done.add(key)
            written.append(row)
        self._file.flush()
        return written

    def close(self) -> None:
        if not self._file.closed:
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()

    def finish(self) -> None:
        """Close; for Parquet output, fold the journal into the Parquet file."""
        self.close()
        if not self.parquet:
            return
        rows = read_rows(self.path) if self.path.exists() else []
        rows += read_rows(self.journal)
        pq = _parquet()
        import pyarrow as pa

        partial = self.path.with_name(self.path.name + ".tmp")
        names = dict.fromkeys(name for row in rows for name in row)  # rows may differ in fields
        table = pa.Table.from_pydict({name: [row.get(name) for row in rows] for name in names})
        pq.write_table(table, partial)
        os.replace(partial, self.path)
        self.journal.unlink()


def _recover_jsonl(path: Path) -> set[Hashable]:
    """The keys of a JSONL output, after cutting off a last line a kill left unfinished."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with path.open("r+b") as f:
            f.truncate(end)
    keys: set[Hashable] = set()
    for number, line in enumerate(data[:end].splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise ValueError(
                f"{path}:{number} is not JSON: is this a cbgen output? Move it away or pick "
                "another output path"
            ) from None
        if not isinstance(row, dict) or "id" not in row:
            raise ValueError(f"{path}:{number} has no `id`: it is not a cbgen batch output")
        keys.add(row["id"])
    return keys


def _parquet() -> Any:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise ImportError(
            "Parquet files need pyarrow: pip install 'cbgen[ray]' (or pyarrow)"
        ) from None
    return pq

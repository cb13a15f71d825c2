"""A batch job: every row of an input file through cbgen, into an output file, resumably.

The job runs on one engine in this process, or on a pool of Ray actors with one engine
each (``cbgen.frontends.jobs.ray``). Either way the results come back here as batches, in input order,
and only this process writes the output: an actor that dies mid-batch has its batch
retried by Ray, and since nothing it computed was written, no row is written twice.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import itertools
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from ...core.config import EngineConfig
from .files import OutputWriter, read_rows, row_keys
from .generator import CALLS_IN_FLIGHT, Generator, ResultBatches, generator_defaults


@dataclasses.dataclass(frozen=True)
class JobReport:
    rows: int  # in the input
    skipped: int  # already in the output when the job started
    written: int  # by this run
    errors: int  # written with an error (a row that could not run)
    duplicates: int  # results dropped because their row was written already
    seconds: float

    @property
    def rows_per_second(self) -> float:
        return self.written / self.seconds if self.seconds > 0 else 0.0

    def summary(self) -> str:
        return (
            f"{self.rows} rows: {self.written} written ({self.errors} with an error), "
            f"{self.skipped} already done | {self.rows_per_second:.2f} rows/s | "
            f"wall {self.seconds:.1f} s"
        )


def run_batch_job(
    input_path: str | Path,
    output_path: str | Path,
    generator: Mapping[str, Any] | None = None,
    *,
    ray: bool = False,
    ray_address: str | None = None,
    actors: int = 1,
    gpus_per_actor: float = 0.0,
    batch_size: int | None = None,
    progress: bool = True,
    on_written: Callable[[int], None] | None = None,
) -> JobReport:
    """Generate for every row of ``input_path`` not yet in ``output_path``.

    ``generator`` holds ``cbgen.frontends.jobs.ray.Generator``'s arguments (the model, the sampling
    defaults, ``threads``...). With ``ray`` the rows run on ``actors`` Ray actors (one
    engine each, ``threads`` CPUs and ``gpus_per_actor`` GPUs apiece) of the cluster at
    ``ray_address`` (``None``: a local one started here). ``batch_size`` rows go to an
    engine at a time (default: ``max_num_seqs``), the unit Ray retries when an actor
    dies. ``on_written(total)`` is called after every batch written, with the rows this
    run has written so far.
    """
    options = dict(generator or {})
    if actors < 1:
        raise ValueError(f"actors must be at least 1, got {actors}")
    if actors > 1 and not ray:
        raise ValueError("several actors need Ray (ray=True); one process runs one engine")
    generator_defaults(options)  # a bad default fails the job here, before a model loads
    config = options.get("config") or EngineConfig()
    batch_size = batch_size or config.max_num_seqs
    if batch_size < 1:
        raise ValueError(f"batch_size must be at least 1, got {batch_size}")
    started = time.perf_counter()
    rows = read_rows(input_path)
    keys, own_ids = row_keys(rows)
    writer = OutputWriter(output_path)
    pending = [i for i, key in enumerate(keys) if key not in writer.done]
    skipped = len(rows) - len(pending)
    written = errors = 0
    bar = tqdm(total=len(pending), desc="cbgen batch", unit="row", disable=not progress)
    try:
        if pending:
            with contextlib.closing(
                _result_batches(
                    rows, pending, options, ray, ray_address, actors, gpus_per_actor, batch_size
                )
            ) as batches:  # closed at once if this loop stops early: the engines stop too
                for positions, outputs in batches:
                    fresh = writer.write(
                        _output_row(rows[i], keys[i], own_ids, fields)
                        for i, fields in zip(positions, outputs, strict=True)
                    )
                    written += len(fresh)
                    errors += sum(row["error"] is not None for row in fresh)
                    bar.update(len(fresh))
                    if on_written is not None:
                        on_written(written)
        writer.finish()
    finally:
        writer.close()
        bar.close()
    return JobReport(
        len(rows), skipped, written, errors, writer.duplicates, time.perf_counter() - started
    )


def _result_batches(
    rows: Sequence[Mapping[str, Any]],
    pending: Sequence[int],
    options: Mapping[str, Any],
    ray: bool,
    ray_address: str | None,
    actors: int,
    gpus_per_actor: float,
    batch_size: int,
) -> ResultBatches:
    if not ray:
        return local_batches(rows, pending, options, batch_size)
    from .ray import ray_batches

    return ray_batches(
        rows,
        pending,
        options,
        address=ray_address,
        actors=actors,
        gpus_per_actor=gpus_per_actor,
        batch_size=batch_size,
    )


def local_batches(
    rows: Sequence[Mapping[str, Any]],
    pending: Sequence[int],
    generator: Mapping[str, Any],
    batch_size: int,
) -> ResultBatches:
    """The pending rows' results from one engine in this process, batch by batch."""
    engine = Generator(**generator)
    chunks = (list(pending[i : i + batch_size]) for i in range(0, len(pending), batch_size))
    pool = ThreadPoolExecutor(CALLS_IN_FLIGHT, thread_name_prefix="cbgen-batch")
    running: collections.deque = collections.deque()

    def submit(chunk: list[int]) -> None:
        running.append((chunk, pool.submit(engine.generate_rows, [rows[i] for i in chunk])))

    try:
        for chunk in itertools.islice(chunks, CALLS_IN_FLIGHT):
            submit(chunk)
        while running:
            chunk, future = running.popleft()
            outputs = future.result()
            following = next(chunks, None)
            if following is not None:
                submit(following)
            yield chunk, outputs
    finally:  # done or abandoned: closing the engine ends the calls still running
        engine.close()
        pool.shutdown(wait=True, cancel_futures=True)


def _output_row(
    row: Mapping[str, Any], key: Any, own_id: bool, fields: Mapping[str, Any]
) -> dict[str, Any]:
    head = {} if own_id else {"id": key}
    return {**head, **row, **fields}

"""cbgen on Ray: ``Generator`` for Ray Data pipelines, and the Ray side of batch jobs.

``Generator`` (``cbgen.frontends.jobs.generator``) is a plain class; Ray Data runs one per actor
with ``map_batches``, and Ray restarts an actor that dies and retries its batch (Ray
Data's defaults for actor pools: ``max_restarts=-1``, ``max_task_retries=-1``).

A batch job (``python -m cbgen batch --ray``) ships each row's request fields to the
actors as JSON text and gets the outputs back the same way: Arrow would otherwise fix a
column's type from its first block (``temperature`` 0 is an integer, 0.7 a float; a
batch of error rows has no text at all) and fail on the next block that differs.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from .generator import CALLS_IN_FLIGHT, Generator, ResultBatches
from .rows import SAMPLING_FIELDS, STRUCTURED_FIELDS

__all__ = ["Generator", "import_ray", "ray_batches"]

REQUEST_FIELDS = ("prompt", "messages", "n", *SAMPLING_FIELDS, *STRUCTURED_FIELDS)
ROW = "_cbgen_row"
REQUEST = "_cbgen_request"
OUTPUT = "_cbgen_output"


class JobGenerator(Generator):
    """A ``Generator`` over a batch job's JSON-encoded rows (``ROW``, ``REQUEST`` columns)."""

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        outputs = self.generate_rows([json.loads(text) for text in batch[REQUEST]])
        return {ROW: batch[ROW], OUTPUT: [json.dumps(o, ensure_ascii=False) for o in outputs]}


def ray_batches(
    rows: Sequence[Mapping[str, Any]],
    pending: Sequence[int],
    generator: Mapping[str, Any],
    *,
    address: str | None,
    actors: int,
    gpus_per_actor: float,
    batch_size: int,
) -> ResultBatches:
    """The pending rows' results from ``actors`` Ray actors, batch by batch in input order.

    Connects to the cluster at ``address``, or starts a local one (stopped again at the
    end) with enough logical CPUs for the actors when neither ``address`` nor
    ``RAY_ADDRESS`` names one. A Ray already initialized in this process is used as is.
    """
    ray = import_ray()
    from ray.data import ActorPoolStrategy, DataContext

    threads = generator.get("threads") or 1
    options = dict(generator, threads=threads)
    if gpus_per_actor > 0 and "device" not in options:
        options["device"] = "cuda"
    started = not ray.is_initialized()
    if started:
        if address or os.environ.get("RAY_ADDRESS"):
            ray.init(address=address or None)
        else:
            ray.init(num_cpus=max(os.cpu_count() or 1, actors * threads))
    context = DataContext.get_current()
    saved = context.execution_options.preserve_order, context.enable_progress_bars
    context.execution_options.preserve_order = True  # the output follows the input
    context.enable_progress_bars = False  # the job's own bar counts rows written
    try:
        items = [
            {ROW: i, REQUEST: json.dumps(_request_fields(rows[i]), default=str)} for i in pending
        ]
        results = ray.data.from_items(items).map_batches(
            JobGenerator,
            fn_constructor_kwargs=options,
            compute=ActorPoolStrategy(
                size=actors,
                max_concurrent_calls_per_actor=CALLS_IN_FLIGHT,
                enable_true_multi_threading=True,
                # No batch waits in an actor's queue: the actor that starts first would
                # otherwise take four, and one that starts later find fewer left to run.
                max_tasks_in_flight_per_actor=CALLS_IN_FLIGHT,
            ),
            num_cpus=threads,
            num_gpus=gpus_per_actor or None,
            batch_size=batch_size,
            batch_format="numpy",
        )
        for batch in results.iter_batches(batch_size=None, batch_format="numpy"):
            positions = [int(i) for i in batch[ROW]]
            yield positions, [json.loads(text) for text in batch[OUTPUT]]
    finally:
        context.execution_options.preserve_order, context.enable_progress_bars = saved
        if started:
            ray.shutdown()


def import_ray() -> Any:
    """The ``ray`` package, or an ``ImportError`` that says how to get it."""
    try:
        import ray
    except ImportError:
        raise ImportError("cbgen on Ray needs ray: pip install 'cbgen[ray]'") from None
    return ray


def _request_fields(row: Mapping[str, Any]) -> dict[str, Any]:
    return {name: row[name] for name in REQUEST_FIELDS if name in row}

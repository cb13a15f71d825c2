"""cbgen as a batch function: rows in, the same rows plus their outputs out.

One ``Generator`` holds one model and one online engine. Calls may overlap (Ray Data
runs two per actor, a local job two threads): each call's rows join the engine's running
batch at once, so the engine stays full while one call's last rows finish and the next
call's first rows start, instead of draining to a tail at every batch boundary.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import itertools
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from ...core.config import EngineConfig
from ...core.input_processor import strip_request_prefix
from ...sampling.params import SamplingParams
from ...sampling.structured import StructuredOutput
from .rows import OUTPUT_FIELDS, error_fields, output_fields, row_request, sampling_defaults

RETAINED_RESULTS = 1 << 30
"""Every result is collected by the call that added it, however many rows a batch has."""


CALLS_IN_FLIGHT = 2
"""Batches an engine holds at once: the next one fills the batch as the last one drains."""

ResultBatches = collections.abc.Generator[tuple[list[int], list[dict[str, Any]]], None, None]
"""(input row positions, their output fields), batch after batch in input order."""


class Generator:
    """Generates for the rows of a batch; usable as Ray Data's ``map_batches`` class.

    ``ds.map_batches(Generator, fn_constructor_kwargs={"model": "smollm2"},
    compute=ray.data.ActorPoolStrategy(size=2), num_cpus=1)`` runs one engine per actor.
    A batch is a dict of columns (Ray's NumPy format) or a pandas DataFrame; the result is
    the same batch with ``text``, ``token_ids``, ``finish_reason`` and ``error`` added.
    Rows give ``prompt`` (raw text) or ``messages`` (chat turns) and may set the sampling
    fields of ``cbgen.frontends.jobs.rows.SAMPLING_FIELDS`` and an output constraint
    (``json_schema``, ``regex``, ``grammar`` or ``json_object``); ``max_new_tokens``,
    ``temperature``, ``sampling`` (more fields) and ``structured_output`` are the
    defaults. A row that cannot run (an invalid value, an over-long prompt) gets
    ``finish_reason="error"`` and the reason in ``error``; the other rows run normally.

    ``threads`` sets torch's thread count for the process (an actor's CPUs); ``dtype``
    (``"bfloat16"``...), ``quantization``, ``lm_head_quantization``,
    ``quantization_group_size`` and ``device`` are
    ``cbgen.load_model``'s.
    ``lora_modules`` (name -> PEFT adapter folder) are loaded at once; a row's ``lora``
    names the one it runs under (an unknown name fails that row only).
    """

    def __init__(
        self,
        model: str = "smollm2",
        *,
        max_new_tokens: int = 128,
        temperature: float = 0.0,
        sampling: Mapping[str, Any] | None = None,
        structured_output: StructuredOutput | None = None,
        threads: int | None = None,
        dtype: str | None = None,
        quantization: str | None = None,
        lm_head_quantization: str | None = None,
        quantization_group_size: int = 32,
        device: str = "cpu",
        config: EngineConfig | None = None,
        lora_modules: Mapping[str, str] | None = None,
    ) -> None:
        from ..args.precision import load_worker_model
        from ..online import Engine

        self.defaults = generator_defaults(
            {
                "max_new_tokens": max_new_tokens,
                "temperature": temperature,
                "sampling": sampling,
                "structured_output": structured_output,
            }
        )
        loaded, self.tokenizer = load_worker_model(
            model,
            threads=threads,
            dtype=dtype,
            quantization=quantization,
            lm_head_quantization=lm_head_quantization,
            quantization_group_size=quantization_group_size,
            device=device,
        )
        self.engine = Engine(loaded, self.tokenizer, config, max_retained_results=RETAINED_RESULTS)
        try:
            _load_adapters(self.engine, lora_modules or {})
        except BaseException:
            self.engine.close()
            raise
        self._calls = itertools.count()
        # Fast tokenizers may refuse a second thread mid-call ("Already borrowed"); a
        # row's tokenization is microseconds next to its generation.
        self._tokenizing = threading.Lock()

    def generate_rows(self, rows: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
        """The output fields of each row, in order."""
        call = next(self._calls)
        results: list[dict[str, Any] | None] = [None] * len(rows)
        added: dict[int, str] = {}
        try:
            for index, row in enumerate(rows):
                try:
                    with self._tokenizing:
                        request = row_request(row, self.defaults, self.tokenizer)
                except Exception as exc:  # a bad row (a chat template's own error too)
                    results[index] = error_fields(_message(exc))
                    continue
                try:
                    added[index] = self.engine.add_request(
                        request.prompt_token_ids,
                        request.params,
                        request_id=f"{call}-{index}",
                        lora=request.lora,
                    )
                except ValueError as exc:  # the engine's checks: vocabulary, context, values
                    results[index] = error_fields(strip_request_prefix(str(exc)))
            for index, request_id in list(added.items()):
                results[index] = output_fields(self.engine.get_result(request_id))
                del added[index]
        finally:  # interrupted (the engine closed, the caller gave up): free the rest
            for request_id in added.values():
                self.engine.cancel(request_id)
        return results  # type: ignore[return-value]

    def __call__(self, batch: Any) -> Any:
        """``batch`` (a dict of columns or a pandas DataFrame) with the output columns."""
        if hasattr(batch, "to_dict") and hasattr(batch, "assign"):  # pandas
            outputs = self.generate_rows(batch.to_dict("records"))
            return batch.assign(**{name: [o[name] for o in outputs] for name in OUTPUT_FIELDS})
        columns = dict(batch)
        count = len(next(iter(columns.values()))) if columns else 0
        rows = [{name: values[i] for name, values in columns.items()} for i in range(count)]
        outputs = self.generate_rows(rows)
        for name in OUTPUT_FIELDS:
            columns[name] = _object_column([o[name] for o in outputs])
        return columns

    def close(self) -> None:
        self.engine.close()

    def __enter__(self) -> Generator:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _load_adapters(engine: Any, modules: Mapping[str, str]) -> None:
    """Load the job's adapters before any row runs; ``ValueError`` naming the first that
    cannot be loaded and why, so a job never writes rows without an adapter it was given."""
    for name, path in modules.items():
        try:
            engine.add_lora(name, path)
        except ValueError as exc:  # the reader names what is wrong with the folder
            raise ValueError(f"--lora-modules {name}={path}: {exc}") from None


def generator_defaults(options: Mapping[str, Any]) -> SamplingParams:
    """The default ``SamplingParams`` of a ``Generator`` built with ``**options``."""
    params = sampling_defaults(
        {
            "max_new_tokens": options.get("max_new_tokens", 128),
            "temperature": options.get("temperature", 0.0),
            **(options.get("sampling") or {}),
        }
    )
    structured = options.get("structured_output")
    if structured is None:
        return params
    params = dataclasses.replace(params, structured_output=structured)
    params.validate()
    return params


def _object_column(values: list[Any]) -> Any:
    """A NumPy object column holding ``values`` as they are (ragged lists stay lists)."""
    import numpy as np

    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column


def _message(exc: Exception) -> str:
    return str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"

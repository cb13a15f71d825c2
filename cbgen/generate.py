"""Offline batch generation: the one-call entry point."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from .config import EngineConfig
from .engine import Engine
from .request import FinishReason, RequestOutput
from .sampling import SamplingParams


def generate_batch(
    model: torch.nn.Module,
    prompts_token_ids: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | Any | None = None,
    config: EngineConfig | None = None,
    *,
    progress: bool = False,
    raise_on_invalid: bool = True,
) -> list[RequestOutput]:
    """Generate for every prompt with continuous batching; outputs follow the input order.

    ``params`` is one ``SamplingParams`` for all prompts, a list with one per
    prompt, or a ``transformers.GenerationConfig``. With ``raise_on_invalid``
    (the default) an invalid prompt or setting raises ``ValueError`` before any
    work starts, naming every bad request; without it, those requests come back
    with ``finish_reason == "error"`` and the rest run normally.
    """
    per_prompt = _per_prompt_params(params, len(prompts_token_ids))
    outputs: list[RequestOutput | None] = [None] * len(prompts_token_ids)
    with Engine(model, config) as engine:
        errors: list[str] = []
        for index, (prompt, request_params) in enumerate(
            zip(prompts_token_ids, per_prompt, strict=True)
        ):
            try:
                engine.add_request(prompt, request_params, request_id=str(index))
            except ValueError as exc:
                errors.append(str(exc))
                outputs[index] = RequestOutput(
                    request_id=str(index),
                    prompt_token_ids=list(prompt),
                    token_ids=[],
                    finished=True,
                    finish_reason=FinishReason.ERROR,
                    error=str(exc),
                )
        if errors and raise_on_invalid:
            raise ValueError("invalid requests:\n  " + "\n  ".join(errors))
        _run(engine, outputs, progress)
    return outputs  # type: ignore[return-value]


def _run(engine: Engine, outputs: list[RequestOutput | None], progress: bool) -> None:
    total = engine.num_unfinished
    bar = tqdm(total=total, desc="cbgen", unit="req", disable=not progress, dynamic_ncols=True)
    started = time.perf_counter()
    generated = 0
    try:
        while engine.has_unfinished():
            for output in engine.step():
                generated += 1
                if output.finished:
                    outputs[int(output.request_id)] = output
                    bar.update(1)
            elapsed = time.perf_counter() - started
            bar.set_postfix(out_tok_s=f"{generated / max(elapsed, 1e-9):.1f}", refresh=False)
    finally:
        bar.close()


def _per_prompt_params(params: Any, count: int) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * count
    if isinstance(params, SamplingParams):
        return [params] * count
    if isinstance(params, Sequence) and not isinstance(params, (str, bytes)):
        if len(params) != count:
            raise ValueError(f"got {len(params)} SamplingParams for {count} prompts")
        return list(params)
    if hasattr(params, "do_sample") and hasattr(params, "max_new_tokens"):
        return [SamplingParams.from_generation_config(params)] * count
    raise TypeError(
        "params must be SamplingParams, a list of them, or a transformers.GenerationConfig; "
        f"got {type(params).__name__}"
    )

"""Offline batch generation: the one-call entry point."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from tqdm.auto import tqdm

from ..core.config import EngineConfig
from ..core.engine_core import EngineCore
from ..core.input_processor import fan_out
from ..requests.request import Completion, FinishReason, RequestOutput
from ..sampling.params import SamplingParams


def generate_batch(
    model: torch.nn.Module | EngineCore,
    prompts_token_ids: Sequence[Sequence[int]],
    params: SamplingParams | Sequence[SamplingParams] | Any | None = None,
    config: EngineConfig | None = None,
    *,
    tokenizer: Any = None,
    progress: bool = False,
    raise_on_invalid: bool = True,
    lora: Any = None,
) -> list[RequestOutput]:
    """Generate for every prompt with continuous batching; outputs follow the input order.

    ``params`` is one ``SamplingParams`` for all prompts, a list with one per
    prompt, or a ``transformers.GenerationConfig``. With ``raise_on_invalid``
    (the default) an invalid prompt or setting raises ``ValueError`` before any
    work starts, naming every bad request; without it, those requests come back
    with ``finish_reason == "error"`` and the rest run normally.

    There is one ``RequestOutput`` per prompt. A prompt with ``params.n > 1`` runs
    as ``n`` requests sharing its cached prefix blocks (sample ``i`` seeded with
    ``seed + i`` when a seed is given); its output's ``completions`` lists all
    ``n`` samples and its ``token_ids`` / ``finish_reason`` are the first one's.

    With a ``tokenizer`` every output has its ``text``, and requests may list stop
    strings (``SamplingParams.stop``).

    ``model`` may also be an open ``EngineCore`` with no unfinished requests (its own
    config and tokenizer apply; it stays open), so that building it (native kernels,
    packed weights, the KV cache) is paid once and timed apart from generating.

    ``lora``: a LoRA adapter for every prompt, or a list with one per prompt (``None``:
    the base model). An adapter is a PEFT adapter folder or a ``peft`` model (or, on an
    open ``EngineCore``, the name of one it holds); the adapters are added for the call
    (at most ``EngineConfig.max_loras`` distinct ones) and removed after it.
    """
    if isinstance(model, EngineCore):
        if config is not None or tokenizer is not None:
            raise ValueError(
                "generate_batch on an EngineCore takes the engine's own config and tokenizer; "
                "pass them to EngineCore(model, config, tokenizer)"
            )
        if model.has_unfinished():
            raise ValueError("generate_batch needs an EngineCore with no unfinished requests")
    per_prompt = _per_prompt_params(params, len(prompts_token_ids))
    outputs: list[RequestOutput | None] = [None] * len(prompts_token_ids)
    samples: dict[str, tuple[int, int]] = {}  # request id -> (prompt index, sample index)
    results: dict[int, list[RequestOutput | None]] = {}
    opened = (
        contextlib.nullcontext(model)
        if isinstance(model, EngineCore)
        else EngineCore(model, config, tokenizer)
    )
    with opened as engine, _call_loras(engine, lora, len(prompts_token_ids)) as lora_names:
        errors: list[str] = []
        for index, (prompt, request_params) in enumerate(
            zip(prompts_token_ids, per_prompt, strict=True)
        ):
            added: list[str] = []
            try:
                per_sample = fan_out(str(index), request_params)
                for i, sample_params in enumerate(per_sample):
                    request_id = str(index) if len(per_sample) == 1 else f"{index}.{i}"
                    engine.add_request(
                        prompt, sample_params, request_id=request_id, lora=lora_names[index]
                    )
                    added.append(request_id)
                    samples[request_id] = (index, i)
                results[index] = [None] * len(per_sample)
            except ValueError as exc:
                for request_id in added:
                    engine.abort(request_id)
                    del samples[request_id]
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
        _run(engine, samples, results, progress)
    for index, sample_outputs in results.items():
        first = sample_outputs[0]
        assert first is not None and all(o is not None for o in sample_outputs)
        completions = [
            Completion(o.token_ids, o.finish_reason, o.num_cached_tokens, o.logprobs, o.text)
            for o in sample_outputs
            if o is not None
        ]
        outputs[index] = dataclasses.replace(first, request_id=str(index), completions=completions)
    return outputs  # type: ignore[return-value]


def _run(
    engine: EngineCore,
    samples: dict[str, tuple[int, int]],
    results: dict[int, list[RequestOutput | None]],
    progress: bool,
) -> None:
    total = engine.num_unfinished
    bar = tqdm(total=total, desc="cbgen", unit="req", disable=not progress, dynamic_ncols=True)
    started = time.perf_counter()
    generated = 0
    try:
        while engine.has_unfinished():
            for output in engine.step():
                generated += 1
                if output.finished:
                    index, sample = samples[output.request_id]
                    results[index][sample] = output
                    bar.update(1)
            elapsed = time.perf_counter() - started
            bar.set_postfix(out_tok_s=f"{generated / max(elapsed, 1e-9):.1f}", refresh=False)
    finally:
        bar.close()


@contextlib.contextmanager
def _call_loras(engine: EngineCore, lora: Any, count: int) -> Iterator[list[str | None]]:
    """The adapter name of each prompt, the call's own adapters added first and removed
    when it ends."""
    if isinstance(lora, (list, tuple)):
        if len(lora) != count:
            raise ValueError(f"got {len(lora)} LoRA adapters for {count} prompts")
        sources = list(lora)
    else:
        sources = [lora] * count
    held = {info.name for info in engine.list_loras()}
    added: dict[Any, str] = {}  # source (its path, or the object's id) -> name
    names: list[str | None] = []
    try:
        for source in sources:
            if source is None:
                names.append(None)
                continue
            if isinstance(source, str) and source in held:
                names.append(source)
                continue
            key = os.fspath(source) if isinstance(source, (str, os.PathLike)) else id(source)
            if key not in added:
                name = f"generate_batch-lora-{len(added)}"
                engine.add_lora(name, source)
                added[key] = name
            names.append(added[key])
        yield names
    finally:
        for name in added.values():
            # Only a failed run leaves requests under it; that failure is the one to see.
            with contextlib.suppress(ValueError):
                engine.remove_lora(name)


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

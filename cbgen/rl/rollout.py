"""Rollouts for policy-gradient training: many samples per prompt, with the logprob of
every sampled token, shaped for the loss.

``rollout`` runs on a model (an engine is built for the call and closed after it, so the
model is the trainer's again when it returns) or on an open ``EngineCore`` (kept across
training steps: ``pause``/``sleep`` it for the training step and ``resume``/``wake`` it
after; it notices the new weights and computes every K/V again).

A ``peft`` model (LoRA) is run as its base model plus the adapter in one of cbgen's LoRA
slots, its peft wrappers stepped aside for the call (``cbgen.rl.peft_target``); across
training steps ``cbgen.rl.peft_rollouts.PeftRollouts`` keeps the packed base and syncs
only the adapter.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..core.config import EngineConfig
from ..core.engine_core import EngineCore
from ..core.input_processor import fan_out
from ..sampling.params import SamplingParams
from .peft_target import POLICY, PeftTarget, engine_config, is_peft_model


@dataclass
class Rollout:
    """``num_samples`` rows per prompt, prompt by prompt (row ``i`` answers prompt
    ``group[i]``). ``logprobs[i][t]`` is the model's log-probability of
    ``completion_ids[i][t]`` given everything before it: from the raw logits, before
    temperature or any processor, so it equals ``log_softmax`` of a training forward's
    logits at that position (``SamplingParams(temperature=1.0)`` samples from exactly
    that distribution). ``finish_reasons`` are ``"eos"``, ``"length"``, ``"stop"``, ...
    """

    prompt_ids: list[list[int]]
    completion_ids: list[list[int]]
    logprobs: list[list[float]]
    finish_reasons: list[str]
    group: list[int]
    num_samples: int

    def __len__(self) -> int:
        return len(self.completion_ids)

    def tensors(self, pad_token_id: int = 0) -> dict[str, torch.Tensor]:
        """Right-padded ``[rows, longest completion]`` tensors: ``completion_ids``,
        ``completion_mask`` (1.0 on real tokens), ``logprobs`` (0 on padding), and
        ``group`` (``[rows]``)."""
        rows, width = len(self), max((len(c) for c in self.completion_ids), default=0)
        ids = torch.full((rows, width), pad_token_id, dtype=torch.long)
        mask = torch.zeros(rows, width)
        logprobs = torch.zeros(rows, width)
        for row, (tokens, values) in enumerate(
            zip(self.completion_ids, self.logprobs, strict=True)
        ):
            ids[row, : len(tokens)] = torch.tensor(tokens, dtype=torch.long)
            mask[row, : len(tokens)] = 1.0
            logprobs[row, : len(values)] = torch.tensor(values)
        group = torch.tensor(self.group, dtype=torch.long)
        return {
            "completion_ids": ids,
            "completion_mask": mask,
            "logprobs": logprobs,
            "group": group,
        }


def rollout(
    model: torch.nn.Module | EngineCore,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams | None = None,
    num_samples: int = 1,
    *,
    config: EngineConfig | None = None,
    tokenizer: Any = None,
    lora: str | None = None,
) -> Rollout:
    """Sample ``num_samples`` completions of every prompt (token ids) with ``params``
    (default: temperature 1, 64 new tokens) and return them with the logprob of each
    sampled token. Sample ``i`` of a seeded ``params`` uses ``seed + i``.

    ``model`` is a ``transformers`` model (an engine with ``config`` is built for this
    call), a ``peft`` model with one active LoRA adapter (the engine runs its base model,
    the adapter in a LoRA slot; the peft model is as it was when this returns), or an
    open ``EngineCore``, which must have no other unfinished requests; ``lora`` names
    the engine's adapter to sample under (None: the base model)."""
    if isinstance(num_samples, bool) or not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
    params = params if params is not None else SamplingParams(temperature=1.0, max_new_tokens=64)
    if not isinstance(params, SamplingParams):
        raise ValueError(f"params must be a cbgen.SamplingParams, got {type(params).__name__}")
    if params.n != 1:
        raise ValueError("give the samples per prompt as num_samples, not params.n")
    params = dataclasses.replace(params, n=num_samples, logprobs=params.logprobs or 0)
    if isinstance(model, EngineCore):
        return _sample(model, prompts, params, num_samples, lora)
    if lora is not None:
        raise ValueError("lora names an adapter of an open EngineCore; pass the engine")
    if is_peft_model(model):
        target = PeftTarget(model)
        with (
            target.lent() as base,
            EngineCore(base, engine_config(config, target), tokenizer) as engine,
        ):
            engine.add_lora(POLICY, target.adapter)
            return _sample(engine, prompts, params, num_samples, POLICY)
    with EngineCore(model, config, tokenizer) as engine:
        return _sample(engine, prompts, params, num_samples)


def _sample(
    engine: EngineCore,
    prompts: Sequence[Sequence[int]],
    params: SamplingParams,
    samples: int,
    lora: str | None = None,
) -> Rollout:
    if engine.has_unfinished():
        raise ValueError("rollout needs an engine with no unfinished requests")
    order: list[str] = []
    try:
        for index, prompt in enumerate(prompts):
            for i, sample in enumerate(fan_out(f"rollout-{index}", params)):
                order.append(engine.add_request(prompt, sample, f"rollout-{index}.{i}", lora=lora))
    except ValueError:
        for request_id in order:
            engine.abort(request_id)
        raise
    finished = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    result = Rollout([], [], [], [], [], samples)
    for position, request_id in enumerate(order):
        out = finished[request_id]
        if out.error is not None:
            raise RuntimeError(f"rollout request {request_id!r} failed: {out.error}")
        assert out.logprobs is not None
        result.prompt_ids.append(list(prompts[position // samples]))
        result.completion_ids.append(out.token_ids)
        result.logprobs.append(
            [entry[t] for entry, t in zip(out.logprobs, out.token_ids, strict=True)]
        )
        result.finish_reasons.append(str(out.finish_reason))
        result.group.append(position // samples)
    return result

"""cbgen as the generation backend of TRL's ``GRPOTrainer``, through its ``rollout_func``.

TRL (1.x) lets a custom backend in through ``GRPOTrainer(rollout_func=...)``, marked
experimental there: a callable given the prompts of the batch (each already repeated
``num_generations`` times, consecutively) and the trainer, returning ``prompt_ids``,
``completion_ids`` and the ``logprobs`` of the completion tokens, one row per prompt
entry. ``grpo_rollout_func`` is that callable. Each call builds an engine on the
trainer's model as it is now (so the weights are always the ones being trained, with no
sync step) and closes it before returning, so the model is the trainer's again.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..core.config import EngineConfig
from ..sampling.params import SamplingParams
from .rollout import rollout


def grpo_rollout_func(
    params: SamplingParams | None = None, config: EngineConfig | None = None
) -> Callable[[list[Any], Any], dict[str, Any]]:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that generates with cbgen.

    ``params`` default to the trainer's own settings (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``, ``max_completion_length``). Prompts
    may be text or chat messages (templated with the trainer's tokenizer).
    """

    def rollout_func(prompts: list[Any], trainer: Any) -> dict[str, Any]:
        tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        training = model.training
        group = trainer.num_generations if training else trainer.num_generations_eval
        ids = [_prompt_ids(tokenizer, prompt) for prompt in prompts]
        if len(ids) % group or any(
            ids[i] != ids[i - i % group] for i in range(len(ids))
        ):  # not in whole consecutive groups: one sample per entry
            group = 1
        sampling = params or _trainer_params(trainer)
        try:
            samples = rollout(model, ids[::group], sampling, group, config=config)
        finally:
            model.train(training)  # the engine put the model in eval mode
        return {
            "prompt_ids": samples.prompt_ids,
            "completion_ids": samples.completion_ids,
            "logprobs": samples.logprobs,
        }

    return rollout_func


def _trainer_params(trainer: Any) -> SamplingParams:
    return SamplingParams(
        temperature=trainer.temperature,
        top_p=trainer.top_p if trainer.top_p is not None else 1.0,
        top_k=trainer.top_k if trainer.top_k else 0,
        min_p=trainer.min_p or 0.0,
        repetition_penalty=trainer.repetition_penalty or 1.0,
        max_new_tokens=trainer.max_completion_length,
    )


def _prompt_ids(tokenizer: Any, prompt: Any) -> list[int]:
    if isinstance(prompt, list):  # chat messages
        encoded = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
        if not isinstance(encoded, list):  # a BatchEncoding
            encoded = encoded["input_ids"]
        return [int(t) for t in encoded]
    return [int(t) for t in tokenizer(prompt)["input_ids"]]

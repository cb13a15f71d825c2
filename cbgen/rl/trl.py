"""cbgen as the generation backend of TRL's ``GRPOTrainer``, through its ``rollout_func``.

TRL (1.x) lets a custom backend in through ``GRPOTrainer(rollout_func=...)``, marked
experimental there: a callable given the prompts of the batch (each already repeated
``num_generations`` times, consecutively) and the trainer, returning ``prompt_ids``,
``completion_ids`` and the ``logprobs`` of the completion tokens, one row per prompt
entry. ``grpo_rollout_func`` makes that callable.

A full model: each call builds an engine on the trainer's model as it is now (so the
weights are always the ones being trained, with no sync step) and closes it before
returning, so the model is the trainer's again. A ``peft`` model (``GRPOTrainer(...,
peft_config=LoraConfig(...))``): one engine is kept across the training steps
(``cbgen.rl.peft_rollouts.PeftRollouts``), its base packed once, and each call syncs only
the adapter from the trainer's live weights; between calls the model is the trainer's
(peft's wrappers, its own attention and forwards). It is closed when training ends.
"""

from __future__ import annotations

from typing import Any

from transformers import TrainerCallback

from ..core.config import EngineConfig
from ..sampling.params import SamplingParams
from .peft_rollouts import PeftRollouts
from .peft_target import is_peft_model
from .rollout import Rollout, rollout


class GRPORolloutFunc:
    """TRL's ``rollout_func``: called with the batch's prompts and the trainer (see the
    module's docstring); ``close()`` frees an engine kept for a peft model (done when
    training ends, through a trainer callback)."""

    def __init__(self, params: SamplingParams | None, config: EngineConfig | None) -> None:
        self.params = params
        self.config = config
        self.peft: PeftRollouts | None = None  # the kept engine of a peft model

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        """Generate the batch's completions: ``prompt_ids``, ``completion_ids`` and
        ``logprobs``, a row per prompt entry."""
        tokenizer = getattr(trainer, "_tokenizer", None) or trainer.processing_class
        model = trainer.accelerator.unwrap_model(trainer.model)
        group = trainer.num_generations if model.training else trainer.num_generations_eval
        ids = [_prompt_ids(tokenizer, prompt) for prompt in prompts]
        if len(ids) % group or any(
            ids[i] != ids[i - i % group] for i in range(len(ids))
        ):  # not in whole consecutive groups: one sample per entry
            group = 1
        sampling = self.params or _trainer_params(trainer)
        samples = self._rollout(model, trainer, ids[::group], sampling, group)
        return {
            "prompt_ids": samples.prompt_ids,
            "completion_ids": samples.completion_ids,
            "logprobs": samples.logprobs,
        }

    def _rollout(
        self, model: Any, trainer: Any, prompts: list[list[int]], params: SamplingParams, n: int
    ) -> Rollout:
        if not is_peft_model(model):
            training = model.training
            try:
                return rollout(model, prompts, params, n, config=self.config)
            finally:
                model.train(training)  # the engine put the model in eval mode
        if self.peft is None or self.peft.model is not model:
            self.close()
            self.peft = PeftRollouts(model, self.config)
            trainer.add_callback(_CloseWhenTrainingEnds(self))
        return self.peft.rollout(prompts, params, n)

    def close(self) -> None:
        """Free the engine kept for a peft model, if any (idempotent)."""
        peft, self.peft = self.peft, None
        if peft is not None:
            peft.close()


def grpo_rollout_func(
    params: SamplingParams | None = None, config: EngineConfig | None = None
) -> GRPORolloutFunc:
    """A ``rollout_func`` for ``trl.GRPOTrainer`` that generates with cbgen.

    ``params`` default to the trainer's own settings (``temperature``, ``top_p``,
    ``top_k``, ``min_p``, ``repetition_penalty``, ``max_completion_length``). Prompts
    may be text or chat messages (templated with the trainer's tokenizer). For a
    ``peft`` model the engine (``config``) is kept across steps and only the adapter is
    synced (see the module's docstring).
    """
    return GRPORolloutFunc(params, config)


class _CloseWhenTrainingEnds(TrainerCallback):
    """Frees the engine a ``GRPORolloutFunc`` kept for the trainer's peft model."""

    def __init__(self, owner: GRPORolloutFunc) -> None:
        self.owner = owner

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.owner.close()


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

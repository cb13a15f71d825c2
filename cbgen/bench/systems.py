"""The systems under test, each run once over a workload's prompts, returning a raw run.

- ``cbgen``: ``cbgen.EngineCore`` driven step by step; each request's tokens are timestamped
  as ``step()`` returns them.
- ``generate``: ``model.generate`` over padded batches of ``generate_batch_size`` prompts
  sorted by length (longest first), left padding and an attention mask; a streamer
  timestamps every decoding step.
- ``generate_batch``: ``model.generate_batch`` (transformers' continuous batching) with its
  default ``ContinuousBatchingConfig``, timestamps from ``record_timestamps=True``.
- ``generate_batch_tuned``: the same with a config sized for the workload on CPU (see
  :func:`tuned_cb_config`).

All runs are greedy and ignore EOS, so every request gets exactly ``max_new_tokens``.
The benchmark's workers build one cbgen engine per process and reuse it for the warm-up
and every repeat, with its prefix cache reset before each run, as the vLLM peer keeps
one ``LLM``; the build counts in the worker's load time, not in a run's clock. Without
an engine (``SystemOptions.engine`` None), a run builds its own inside its clock.
``generate_batch`` builds its manager inside every run.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..core.config import EngineConfig

SYSTEMS = ("cbgen", "generate", "generate_batch", "generate_batch_tuned")
SPEC_COUNTS = ("spec_proposed_tokens", "spec_accepted_tokens", "spec_verifications")
PEERS = ("vllm", "llamacpp")


@dataclass
class SystemOptions:
    """Knobs shared by every system of one benchmark run."""

    engine_config: EngineConfig = field(default_factory=EngineConfig)
    generate_batch_size: int = 8
    tuned_page_size: int | None = None  # None: cbgen's block_size
    tuned_attn: str | None = None  # "sdpa" or "eager" (paged|eager); None: the model's own
    engine: Any = None  # cbgen: an EngineCore reused by every run (see the module docstring)


@dataclass
class Run:
    wall_s: float
    token_times: list[list[float]] | None
    output_ids: list[list[int]]
    prompt_tokens: list[int]
    config: dict[str, Any] = field(default_factory=dict)
    setup_s: float | None = None  # building the engine, inside wall_s (no reused engine)
    speculation: dict[str, int] = field(default_factory=dict)  # cbgen: this run's spec_* counts

    def raw(self) -> dict[str, Any]:
        """The raw record of ``cbgen.bench.metrics`` (token ids are kept separately)."""
        return {
            "wall_s": self.wall_s,
            "setup_s": self.setup_s,
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": [len(ids) for ids in self.output_ids],
            "token_times": self.token_times,
        }


def run_system(
    system: str,
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    options: SystemOptions,
) -> Run:
    if system == "cbgen":
        return run_cbgen(model, prompts, max_new_tokens, options.engine_config, options.engine)
    if system == "generate":
        return run_generate(model, prompts, max_new_tokens, options.generate_batch_size)
    if system == "generate_batch":
        return run_generate_batch(model, prompts, max_new_tokens, None)
    if system == "generate_batch_tuned":
        config = tuned_cb_config(prompts, max_new_tokens, options)
        original = model.config._attn_implementation
        if options.tuned_attn and options.tuned_attn != original:
            model.set_attn_implementation(options.tuned_attn)
        try:
            run = run_generate_batch(model, prompts, max_new_tokens, config)
        finally:
            if model.config._attn_implementation != original:
                model.set_attn_implementation(original)
        run.config["attn_implementation"] = options.tuned_attn or original
        return run
    raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")


# -- cbgen ---------------------------------------------------------------------------------


def run_cbgen(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    config: EngineConfig,
    engine: Any = None,
) -> Run:
    """Run ``prompts`` on ``engine`` (its prefix cache reset first), or on an engine built
    for this run inside its clock."""
    from ..core.engine_core import EngineCore

    started = time.perf_counter()
    if engine is not None:
        engine.reset_prefix_cache()
        run = _drive(engine, prompts, max_new_tokens, started)
    else:
        with EngineCore(model, config) as built:
            setup = time.perf_counter() - started
            run = _drive(built, prompts, max_new_tokens, started)
        run.wall_s = time.perf_counter() - started
        run.setup_s = setup
    # JSON-ready: a torch dtype (kv_cache_dtype) as its name, speculation by its method.
    settings = {
        k: str(v).removeprefix("torch.") if isinstance(v, torch.dtype) else v
        for k, v in vars(config).items()
        if k != "speculative"
    }
    run.config = {"engine_config": settings}
    if config.speculative is not None:
        settings["speculative"] = f"{config.speculative.method}, k={config.speculative.num_tokens}"
        run.config["speculation"] = run.speculation
    return run


def _drive(
    engine: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, started: float
) -> Run:
    from ..sampling.params import SamplingParams

    params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
    before = {k: v for k, v in engine.stats.items() if k in SPEC_COUNTS}
    times: list[list[float]] = [[] for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    for index, prompt in enumerate(prompts):
        engine.add_request(prompt, params, request_id=str(index))
    while engine.has_unfinished():
        outputs = engine.step()
        now = time.perf_counter() - started
        for output in outputs:
            index = int(output.request_id)
            times[index].extend([now] * len(output.new_token_ids))
            ids[index].extend(output.new_token_ids)
    run = Run(time.perf_counter() - started, times, ids, [len(p) for p in prompts])
    run.speculation = {k: engine.stats.get(k, 0) - before.get(k, 0) for k in SPEC_COUNTS}
    return run


# -- model.generate ------------------------------------------------------------------------


class _StepClock:
    """A ``generate`` streamer that only notes when each decoding step hands out tokens."""

    def __init__(self, started: float) -> None:
        self.started = started
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() first puts the prompt
            self._prompt_seen = True
            return
        self.times.append(time.perf_counter() - self.started)

    def end(self) -> None:
        pass


def pad_token_id(model: torch.nn.Module) -> int:
    generation_config = getattr(model, "generation_config", None)
    for source in (generation_config, model.config):
        for name in ("pad_token_id", "eos_token_id", "bos_token_id"):
            value = getattr(source, name, None)
            if isinstance(value, (list, tuple)):
                value = value[0] if value else None
            if isinstance(value, int) and value >= 0:
                return value
    return 0


def _greedy_generation_config(model: torch.nn.Module, max_new_tokens: int) -> Any:
    from transformers import GenerationConfig

    # eos_token_id=-1 matches no token: every request runs to max_new_tokens (ignore_eos).
    return GenerationConfig(
        max_new_tokens=max_new_tokens,
        min_new_tokens=None,
        do_sample=False,
        eos_token_id=-1,
        pad_token_id=pad_token_id(model),
        bos_token_id=getattr(model.generation_config, "bos_token_id", None),
    )


def run_generate(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    batch_size: int,
) -> Run:
    pad = pad_token_id(model)
    generation_config = _greedy_generation_config(model, max_new_tokens)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]), reverse=True)
    times: list[list[float]] = [[] for _ in prompts]
    ids: list[list[int]] = [[] for _ in prompts]
    started = time.perf_counter()
    with torch.inference_mode():
        for first in range(0, len(order), batch_size):
            batch = order[first : first + batch_size]
            width = max(len(prompts[i]) for i in batch)
            input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
            attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
            for row, index in enumerate(batch):
                prompt = torch.as_tensor(list(prompts[index]), dtype=torch.long)
                input_ids[row, width - len(prompt) :] = prompt
                attention_mask[row, width - len(prompt) :] = 1
            clock = _StepClock(started)
            output = model.generate(
                input_ids=input_ids.to(model.device),
                attention_mask=attention_mask.to(model.device),
                generation_config=generation_config,
                streamer=clock,
            )
            new_tokens = output[:, width:].tolist()
            for row, index in enumerate(batch):
                ids[index] = new_tokens[row]
                times[index] = clock.times[: len(new_tokens[row])]
    wall = time.perf_counter() - started
    return Run(wall, times, ids, [len(p) for p in prompts], {"batch_size": batch_size})


# -- model.generate_batch ------------------------------------------------------------------


def tuned_cb_config(
    prompts: Sequence[Sequence[int]], max_new_tokens: int, options: SystemOptions
) -> Any:
    """A ``ContinuousBatchingConfig`` for CPU sized like cbgen's engine.

    The default config sizes the cache to 60% of RAM and zero-fills it (gigabytes touched
    for a 135M model) and runs a warm-up at the largest batch shape. The tuned one uses
    cbgen's per-step budget (``max_batch_tokens``, ``max_num_seqs``) and pages of cbgen's
    ``block_size`` tokens (unless ``tuned_page_size`` says otherwise), no
    async double buffering, and just enough blocks for the ``max_num_seqs`` longest
    requests of the workload to run at once.
    """
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    engine = options.engine_config
    page = options.tuned_page_size or engine.block_size
    concurrent = min(len(prompts), engine.max_num_seqs)
    lengths = sorted((len(p) + max_new_tokens for p in prompts), reverse=True)[:concurrent]
    num_blocks = sum(math.ceil(n / page) for n in lengths) + concurrent
    return ContinuousBatchingConfig(
        page_size=page,
        num_blocks=num_blocks,
        max_batch_tokens=engine.max_batch_tokens,
        max_requests_per_batch=engine.max_num_seqs,
        use_async_batching=False,
        use_cuda_graph=False,
    )


def _cb_config_dict(config: Any) -> dict[str, Any]:
    if config is None:
        return {"continuous_batching_config": "default"}
    keys = (
        "page_size",
        "num_blocks",
        "max_batch_tokens",
        "max_requests_per_batch",
        "use_async_batching",
        "use_cuda_graph",
    )
    return {"continuous_batching_config": {k: getattr(config, k, None) for k in keys}}


def run_generate_batch(
    model: torch.nn.Module,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    config: Any,
) -> Run:
    generation_config = _greedy_generation_config(model, max_new_tokens)
    inputs = [list(p) for p in prompts]
    # The default config warms up (for CUDA graphs) inside every call, as a user would get it;
    # the tuned one skips that, since there are no graphs on CPU.
    started = time.perf_counter()
    results = model.generate_batch(
        inputs,
        generation_config=generation_config,
        continuous_batching_config=config,
        record_timestamps=True,
        progress_bar=False,
        warmup=config is None,
    )
    wall = time.perf_counter() - started
    outputs = list(results.values())
    if len(outputs) != len(inputs):
        raise RuntimeError(f"generate_batch returned {len(outputs)} results for {len(inputs)}")
    ids, times = [], []
    for output, prompt in zip(outputs, inputs, strict=True):
        if output.error is not None:
            raise RuntimeError(f"generate_batch request {output.request_id}: {output.error}")
        if list(output.prompt_ids) != prompt:
            raise RuntimeError("generate_batch returned its results out of order")
        ids.append(list(output.generated_tokens))
        stamps = output.timestamps or []
        times.append([t - started for t in stamps])
    return Run(wall, times, ids, [len(p) for p in prompts], _cb_config_dict(config))

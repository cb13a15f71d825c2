"""``cbgen serve``'s OpenAI-compatible app as Ray Serve replicas, one engine in each.

Ray Serve routes every request of the one HTTP route to a replica; each replica is a
whole ``cbgen serve`` (the same app, limits and metrics) with its own model and
continuous-batching engine. Ray Serve's default of 5 requests in flight per replica
would starve the engine's batch, so ``application`` lets a replica hold as many as its
engine can batch, and twice that waiting.

``examples/ray_serve.py`` is the runnable form.
"""

from __future__ import annotations

from typing import Any

from ..core.config import EngineConfig
from .jobs.ray import import_ray

import_ray()  # says how to install ray when it is missing

from ray import serve  # noqa: E402


@serve.deployment
@serve.ingress()
class CbgenReplica:
    """One replica: the model, its online engine and the app serving it.

    Without an ``api_key`` the app serves loopback ``Host`` names only (as ``cbgen
    serve`` does); behind a cluster's address give an ``api_key`` or ``allowed_hosts``.
    ``tool_call_parser``, ``reasoning_parser`` and ``lora_modules`` are ``cbgen serve``'s
    flags of the same names; ``chat_template`` is a template's text (not a file name,
    which a replica on another node may not see).
    """

    def __init__(
        self,
        model: str = "smollm2",
        *,
        served_model_name: str | None = None,
        threads: int | None = None,
        dtype: str | None = None,
        quantization: str | None = None,
        lm_head_quantization: str | None = None,
        quantization_group_size: int = 32,
        device: str = "cpu",
        config: EngineConfig | None = None,
        api_key: str | None = None,
        allowed_hosts: list[str] | None = None,
        tool_call_parser: str | None = None,
        reasoning_parser: str | None = None,
        chat_template: str | None = None,
        lora_modules: dict[str, str] | None = None,
    ) -> None:
        from .args.precision import load_worker_model
        from .online import Engine
        from .server.app import create_app

        loaded, tokenizer = load_worker_model(
            model,
            threads=threads,
            dtype=dtype,
            quantization=quantization,
            lm_head_quantization=lm_head_quantization,
            quantization_group_size=quantization_group_size,
            device=device,
        )
        if chat_template is not None:
            tokenizer.chat_template = chat_template
        self.engine = Engine(loaded, tokenizer, config)
        self.openai_app = create_app(
            self.engine,
            tokenizer,
            served_model_name or model,
            api_key=api_key,
            allowed_hosts=allowed_hosts,
            tool_call_parser=tool_call_parser,
            reasoning_parser=reasoning_parser,
            lora_modules=lora_modules,
        )

    def __serve_build_asgi_app__(self) -> Any:
        return self.openai_app  # not ``self.app``: Ray Serve's wrapper owns that name

    def __del__(self) -> None:  # Ray Serve calls it when the replica stops
        app = getattr(self, "openai_app", None)
        if app is not None:
            app.state.cbgen.close()  # the tokenizer pool
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.close()


def application(
    model: str = "smollm2",
    *,
    replicas: int = 2,
    threads: int = 1,
    gpus_per_replica: float = 0.0,
    **options: Any,
) -> Any:
    """The Ray Serve application: ``replicas`` copies of ``CbgenReplica``, ``threads`` CPUs
    (and ``gpus_per_replica`` GPUs) apiece; ``options`` go to ``CbgenReplica``."""
    config = options.get("config") or EngineConfig()
    actor_options: dict[str, Any] = {"num_cpus": threads}
    if gpus_per_replica > 0:
        actor_options["num_gpus"] = gpus_per_replica
        options.setdefault("device", "cuda")
    deployment: Any = CbgenReplica  # a serve.Deployment, whatever the class statement says
    return deployment.options(
        num_replicas=replicas,
        ray_actor_options=actor_options,
        max_ongoing_requests=config.max_num_seqs,
        max_queued_requests=2 * config.max_num_seqs,
    ).bind(model, threads=threads, **options)

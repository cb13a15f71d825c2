"""The executor seam: backends chosen once per model, device and dtype.

``base`` has the roles (``AttentionBackend``, ``LinearBackend``, ``LayerOps``,
``GreedyBackend``, ``ModelAdapter``), each backend answering
``supports(model, dtype, device) -> reason | None``; ``registry`` orders the
candidates and chooses; ``runner.Executor`` is built from the chosen ones and
runs a step. Backends: ``attention`` (native CPU paged kernel; torch reference,
the test oracle, serving CUDA today), ``linear`` (oneDNN float32 prepacked;
``F.linear``), ``native`` (the kernel module; fused layer ops), ``greedy``
(argmax), ``adapters`` (the Llama-family fast decoder; transformers' modules).
Import the submodules themselves: this package imports nothing, so that
``cbgen.executor.attention_hook`` can use ``metadata`` without a cycle.
"""

"""Tensor parallelism: one engine's model split over several processes (CPU ranks over
gloo, GPUs over NCCL). ``executor.TensorParallelExecutor`` is the engine's side;
``sharding`` says which weights each rank holds; ``worker`` is the other ranks' process.

Nothing is imported here: the fast decoder (``cbgen.executor.cpu.fast_forward``) reads
``sharding``'s hook marker, and ``executor`` imports the executor that imports it."""

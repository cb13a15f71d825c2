"""Tensor parallelism: one engine's model split over several processes (CPU ranks over
gloo, GPUs over NCCL). ``TensorParallelExecutor`` is the engine's side; ``sharding``
says which weights each rank holds; ``worker`` is the other ranks' process."""

from .executor import TensorParallelError, TensorParallelExecutor
from .sharding import ShardPlan, plan_shards

__all__ = ["ShardPlan", "TensorParallelError", "TensorParallelExecutor", "plan_shards"]

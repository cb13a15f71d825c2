"""``TensorParallelExecutor``: the ``ModelExecutor`` seam over several processes.

The driver, in the engine's process, is rank 0: it holds its own shard of the model and
of the cache, and the sampler. Ranks 1..N-1 are worker processes
(``cbgen.executor.parallel.worker``). Each step the driver sends the step's
``SchedulerOutput`` (a value) down every worker's pipe, then all ranks build the same
batch from it and run their shards' forward passes, meeting at each block's all-reduce;
the logits are the driver's own, so nothing comes back. Block tables, the prefix cache
and every other decision stay with the engine's one scheduler and KV-cache manager.

A worker that fails, or dies, fails the next collective at once; the driver then raises
``TensorParallelError`` with what the worker said (or its exit code), and every later
call raises it again: the engine is down and says why.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any

import torch

from ...cache.groups import CacheGroup, LayerSpec
from ...cache.state import StateSpec
from ...requests.scheduler_output import BlockMove, SchedulerOutput
from ...sampling.sampler import SamplerOutput
from ..base import model_device
from ..batch import StepBatch
from ..lora_slots import LoraSlots
from ..model_executor import ModelExecutor
from .group import DEFAULT_TIMEOUT_S, RankGroup
from .placement import rank_cpus
from .sharding import ShardPlan, plan_shards, shard_model
from .shm_reduce import ShmAllReduce, create_file, shm_supported
from .worker import WorkerSpec, worker_main

logger = logging.getLogger(__name__)

_CLOSE_WAIT_S = 10.0
_SPAWN_HINT = (
    "a worker process starts by importing the script that built the engine, so a script "
    "must build a tensor-parallel engine under `if __name__ == '__main__':`"
)


@contextlib.contextmanager
def _portable(model: torch.nn.Module) -> Iterator[None]:
    """``model`` without the instance ``forward`` overrides another engine's executor put
    on its modules (closures, which do not pickle) while a worker process is started:
    the worker runs the classes' own code on its shard."""
    overrides = {m: m.__dict__.pop("forward") for m in model.modules() if "forward" in m.__dict__}
    try:
        yield
    finally:
        for module, forward in overrides.items():
            module.__dict__["forward"] = forward


def _shm_capacity(model: torch.nn.Module) -> int:
    """Bytes of one rank's all-reduce slot: a float32 hidden state of 2,048 tokens,
    between 1 and 64 MiB (a larger step's sums go through gloo)."""
    hidden = int(getattr(getattr(model, "config", None), "hidden_size", 0) or 4096)
    return min(64 << 20, max(1 << 20, hidden * 2048 * 4))


class TensorParallelError(RuntimeError):
    """A rank of a tensor-parallel engine failed; the engine cannot run another step."""


class TensorParallelExecutor(ModelExecutor):
    """A ``ModelExecutor`` whose model is split over ``tensor_parallel_size`` ranks
    (see the module's docstring). ``threads_per_rank``: each rank's threads and cores
    (``cbgen.executor.parallel.placement.rank_cpus``); the driver's rank sets its
    process's torch thread count to its share."""

    def __init__(
        self,
        model: torch.nn.Module,
        *,
        tensor_parallel_size: int,
        threads_per_rank: int | None = None,
        use_native_kernels: bool,
        prepack_linear: bool | None,
        eos_token_ids: set[int],
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        world = tensor_parallel_size
        self.plan: ShardPlan = plan_shards(model, world)
        self.world = world
        self.failure: str | None = None
        self._workers: list[tuple[BaseProcess, Connection]] = []
        self._mid_step = False  # workers inside a step's collectives (prepare to forward)
        self.group: RankGroup | None = None
        cpus = rank_cpus(world, threads_per_rank)
        store = RankGroup.listen(world, timeout_s)
        context = mp.get_context("spawn")
        device = model_device(model)
        capacity = _shm_capacity(model)
        shm_path = (
            create_file(world, capacity) if device.type == "cpu" and shm_supported() else None
        )
        try:
            for rank in range(1, world):
                spec = WorkerSpec(
                    rank,
                    world,
                    store.port,
                    self.plan,
                    tuple(cpus[rank]),
                    use_native_kernels,
                    prepack_linear,
                    frozenset(eos_token_ids),
                    timeout_s,
                    shm_path,
                    capacity,
                )
                parent, child = context.Pipe()
                process = context.Process(
                    target=worker_main,
                    args=(child, model, spec),
                    name=f"cbgen-tp-rank{rank}",
                    daemon=True,
                )
                with _portable(model):
                    process.start()  # pickles the model (its tensors go to shared memory)
                child.close()
                self._workers.append((process, parent))
            for rank in range(1, world):
                try:
                    self._reply(rank, "loaded", timeout_s)
                except TensorParallelError as exc:
                    raise TensorParallelError(f"{exc} while starting; {_SPAWN_HINT}") from None
            torch.set_num_threads(max(1, len(cpus[0])))
            shm = None
            if shm_path is not None:
                shm = ShmAllReduce(shm_path, 0, world, capacity, self._workers_alive, timeout_s)
            self.group = RankGroup(
                0, world, store.port, device, store=store, timeout_s=timeout_s, shm=shm
            )
            shard = shard_model(model, self.plan, 0, self.group.all_reduce)
            super().__init__(
                shard,
                use_native_kernels=use_native_kernels,
                prepack_linear=prepack_linear,
                eos_token_ids=eos_token_ids,
            )
            for rank in range(1, world):
                spec_seen = self._reply(rank, "ready", timeout_s)
                if spec_seen != self.cache_spec:
                    raise TensorParallelError(
                        f"rank {rank} probed another cache layout than rank 0: "
                        f"{spec_seen} != {self.cache_spec}"
                    )
        except BaseException as exc:
            problem = self._worker_problem() if isinstance(exc, Exception) else None
            if self.group is not None:
                self.group.close()
            self._stop_workers()
            if problem is not None and not isinstance(exc, TensorParallelError):
                raise TensorParallelError(problem) from exc
            raise
        finally:
            if shm_path is not None:  # every rank has it mapped (or failed): no file left
                os.unlink(shm_path)
        logger.info(
            "cbgen: %s; all-reduce through %s",
            self.plan.describe(),
            "shared memory" if shm_path is not None else "gloo",
        )

    # -- what differs from one process ----------------------------------------------------

    def allocate(
        self,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int,
        groups: Sequence[CacheGroup],
        state_specs: Sequence[StateSpec],
        num_state_slots: int,
        swap_bytes: int | None,
    ) -> None:
        args = (
            list(layers),
            num_blocks,
            block_size,
            list(groups),
            list(state_specs),
            num_state_slots,
            swap_bytes,
        )
        self._broadcast("allocate", args)
        super().allocate(*args)
        for rank in range(1, self.world):
            self._reply(rank, "ok")

    def commit_cache(self) -> int:
        self._broadcast("commit", None)
        total = super().commit_cache()
        return total + sum(self._reply(rank, "ok") for rank in range(1, self.world))

    def free(self) -> None:
        self._broadcast("free", None)
        super().free()

    def prepare(self, scheduled: SchedulerOutput) -> StepBatch:
        self._broadcast("step", scheduled)
        # Until forward returns the workers are in this step's collectives, waiting on
        # this rank: a close in between (Ctrl-C) cannot expect them to answer.
        self._mid_step = True
        return super().prepare(scheduled)

    def forward(
        self, batch: StepBatch, previous: futures.Future[SamplerOutput] | None
    ) -> torch.Tensor:
        self._check()
        try:
            logits = super().forward(batch, previous)
        except Exception as exc:
            raise self._failed(exc) from exc
        self._mid_step = False
        return logits

    def copy_blocks(
        self, swap_out: Sequence[BlockMove], swap_in: Sequence[BlockMove]
    ) -> list[BlockMove]:
        self._broadcast("copy", (list(swap_out), list(swap_in)))
        return super().copy_blocks(swap_out, swap_in)

    def reduce_stats(self) -> list[tuple[float, int]]:
        """Per rank: seconds spent in all-reduce and how many, since the engine started."""
        assert self.group is not None
        self._broadcast("stats", None)
        own = (self.group.reduce_seconds, self.group.reduces)
        return [own, *(self._reply(rank, "ok") for rank in range(1, self.world))]

    def _slots(self) -> LoraSlots:
        raise ValueError(
            f"LoRA adapters do not run under tensor parallelism (tensor_parallel_size="
            f"{self.world}); use tensor_parallel_size=1"
        )

    def release_weights(self) -> None:
        raise self._no_weight_changes("sleep() and pause()")

    def detach_weights(self) -> None:
        raise self._no_weight_changes("pause()")

    def rebuild(self) -> None:
        raise self._no_weight_changes("update_weights() and refresh()")

    def _no_weight_changes(self, what: str) -> ValueError:
        return ValueError(
            f"{what} are not supported under tensor parallelism (tensor_parallel_size="
            f"{self.world}): every rank holds its own copy of its shard; build a new engine "
            "for new weights"
        )

    def close(self) -> None:
        try:
            super().close()
        finally:
            self._stop_workers()
            if self.group is not None:
                self.group.close()

    def _workers_alive(self) -> bool:
        return all(process.is_alive() for process, _ in self._workers)

    # -- the workers ----------------------------------------------------------------------

    def _broadcast(self, command: str, args: Any) -> None:
        self._check()
        for rank, (_, conn) in enumerate(self._workers, start=1):
            try:
                conn.send((command, args))
            except (OSError, ValueError) as exc:
                raise self._failed(exc, rank) from exc

    def _reply(self, rank: int, expected: str, timeout_s: float | None = None) -> Any:
        """The next message of worker ``rank``, which must be ``expected``."""
        process, conn = self._workers[rank - 1]
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not conn.poll(0.1):
            if not process.is_alive() and not conn.poll(0):
                raise self._failed(None, rank)
            if deadline is not None and time.monotonic() > deadline:
                raise self._failed(TimeoutError(f"no answer in {timeout_s:.0f} s"), rank)
        try:
            kind, value = conn.recv()
        except (EOFError, OSError) as exc:
            raise self._failed(exc, rank) from exc
        if kind == "error":
            raise self._failed(None, rank, value)
        if kind != expected:
            raise self._failed(RuntimeError(f"answered {kind!r}, not {expected!r}"), rank)
        return value

    def _check(self) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)

    def _failed(
        self, exc: BaseException | None, rank: int | None = None, said: str | None = None
    ) -> TensorParallelError:
        """The engine's failure, worded from what the workers say; it sticks."""
        if self.failure is None:
            self.failure = self._diagnose(exc, rank, said)
            logger.error("cbgen: %s", self.failure)
            self._stop_workers()
        return TensorParallelError(self.failure)

    def _diagnose(self, exc: BaseException | None, rank: int | None, said: str | None) -> str:
        if said is not None:
            return f"tensor-parallel rank {rank} failed: {said.splitlines()[0]}"
        problem = self._worker_problem()
        if problem is not None:
            return problem
        where = f"rank {rank}" if rank is not None else "a collective"
        return f"tensor-parallel {where} failed: {type(exc).__name__}: {exc}"

    def _worker_problem(self) -> str | None:
        """What a failed or dead worker left behind, if one did."""
        time.sleep(0.2)  # let a dying worker's last word and exit code arrive
        for rank, (process, conn) in enumerate(self._workers, start=1):
            message = None
            try:
                while conn.poll(0):
                    kind, value = conn.recv()
                    if kind == "error":
                        message = value.splitlines()[0]
            except (EOFError, OSError):
                pass
            if message is not None:
                return f"tensor-parallel rank {rank} failed: {message}"
            if not process.is_alive():
                return (
                    f"tensor-parallel rank {rank} (pid {process.pid}) died "
                    f"with exit code {process.exitcode}"
                )
        return None

    def _stop_workers(self) -> None:
        """Close every worker; terminate, then kill, any that does not exit. Workers left
        inside a step (this rank interrupted in it) wait in a collective that will not
        complete, so they are terminated at once instead of after ``_CLOSE_WAIT_S``."""
        workers, self._workers = self._workers, []
        for _, conn in workers:
            try:
                conn.send(("close", None))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + (0.0 if self._mid_step else _CLOSE_WAIT_S)
        for process, conn in workers:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(2.0)
            if process.is_alive():
                process.kill()
                process.join()
            conn.close()

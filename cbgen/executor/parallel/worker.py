"""A tensor-parallel worker process: one rank's shard of the model and of the cache.

It runs what the driver (rank 0, in the engine's process) sends down its pipe, in the
driver's order: allocate the cache, run a step's forward pass (building the step's
batch from the same ``SchedulerOutput`` the driver runs), copy swapped blocks, close.
The forward passes meet the driver's at every all-reduce. The worker samples nothing:
its LM head is skipped, the driver's rank computes the logits.

It never outlives the driver: a closed pipe ends its loop, a watchdog thread exits the
process once its parent is gone (even mid-step), and Ctrl-C in the terminal is left to
the driver, which closes the workers itself. Any failure is sent up the pipe, then
the process exits, which fails the driver's next all-reduce at once.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, replace
from multiprocessing.connection import Connection

import torch

from ..base import model_device
from ..model_executor import ModelExecutor
from .group import RankGroup
from .sharding import ShardPlan, shard_model
from .shm_reduce import ShmAllReduce

_WATCH_S = 1.0


@dataclass(frozen=True)
class WorkerSpec:
    """What a worker needs besides the model: its place in the group and the executor's
    options (the driver's own)."""

    rank: int
    world: int
    port: int
    plan: ShardPlan
    cpus: tuple[int, ...]
    use_native_kernels: bool
    prepack_linear: bool | None
    eos_token_ids: frozenset[int]
    timeout_s: float
    shm_path: str | None  # the shared-memory all-reduce's file (None: gloo alone)
    shm_capacity: int


def worker_main(conn: Connection, model: torch.nn.Module, spec: WorkerSpec) -> None:
    """The worker process's body (``multiprocessing`` spawn target)."""
    parent = os.getppid()
    _watch_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        _place(spec.cpus)
        conn.send(("loaded", os.getpid()))
        device = model_device(model)
        if device.type == "cuda":
            device = torch.device("cuda", spec.rank)
            torch.cuda.set_device(device)
        shm = None
        if spec.shm_path is not None:
            shm = ShmAllReduce(
                spec.shm_path,
                spec.rank,
                spec.world,
                spec.shm_capacity,
                lambda: os.getppid() == parent,
                spec.timeout_s,
            )
        group = RankGroup(
            spec.rank, spec.world, spec.port, device, timeout_s=spec.timeout_s, shm=shm
        )
        shard = shard_model(model, spec.plan, spec.rank, group.all_reduce).to(device)
        del model
        executor = ModelExecutor(
            shard,
            use_native_kernels=spec.use_native_kernels,
            prepack_linear=spec.prepack_linear,
            eos_token_ids=set(spec.eos_token_ids),
        )
        conn.send(("ready", executor.cache_spec))
        _serve(conn, executor, group)
    except (EOFError, BrokenPipeError, ConnectionResetError):
        sys.exit(0)  # the driver is gone
    except BaseException as exc:
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        except (OSError, ValueError):
            pass
        sys.exit(1)


def _serve(conn: Connection, executor: ModelExecutor, group: RankGroup) -> None:
    while True:
        command, args = conn.recv()
        if command == "step":
            batch = executor.prepare(args)
            # Only the driver samples: no LM head here.
            executor.forward(replace(batch, logits_indices=batch.logits_indices[:0]), None)
        elif command == "copy":
            executor.copy_blocks(*args)
        elif command == "allocate":
            executor.allocate(*args)
            conn.send(("ok", None))
        elif command == "commit":
            conn.send(("ok", executor.commit_cache()))
        elif command == "free":
            executor.free()
        elif command == "stats":
            conn.send(("ok", (group.reduce_seconds, group.reduces)))
        elif command == "close":
            executor.close()
            group.close()
            conn.send(("ok", None))
            return
        else:
            raise ValueError(f"unknown command {command!r}")


def _place(cpus: tuple[int, ...]) -> None:
    """Run on ``cpus`` with one thread each."""
    if cpus and hasattr(os, "sched_setaffinity"):
        try:
            os.sched_setaffinity(0, cpus)
        except OSError:
            pass  # a container may forbid it; the thread count still holds
    torch.set_num_threads(max(1, len(cpus)))


def _watch_parent(parent: int) -> None:
    """Exit as soon as the driver process is gone (the worker is re-parented)."""

    def watch() -> None:
        while True:
            time.sleep(_WATCH_S)
            if os.getppid() != parent:
                os._exit(0)

    threading.Thread(target=watch, name="cbgen-tp-watchdog", daemon=True).start()

"""Engine-wide settings: cache geometry, batch budget and limits."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..spec.speculative import SpeculativeConfig

SCHEDULER_POLICIES = ("fifo", "prefill_first")
PREEMPTION_MODES = ("recompute", "swap")
ADMISSION_MODES = ("eager", "full_length")
KV_CACHE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def resolve_kv_cache_dtype(value: torch.dtype | str | None) -> torch.dtype | None:
    """``EngineConfig.kv_cache_dtype`` as a torch dtype (None: the model's), or a ValueError."""
    if value is None or value == "auto":
        return None
    if isinstance(value, str) and isinstance(getattr(torch, value, None), torch.dtype):
        value = getattr(torch, value)
    if value not in KV_CACHE_DTYPES:
        names = ", ".join(str(d).removeprefix("torch.") for d in KV_CACHE_DTYPES)
        raise ValueError(f"kv_cache_dtype must be None or one of {names}, got {value!r}")
    return value  # type: ignore[return-value]


@dataclass
class EngineConfig:
    """How big the paged KV cache is and how much work one step may carry.

    The cache size is either an explicit ``num_blocks`` or a byte budget
    (``kv_cache_memory``); when both are ``None`` the engine picks a budget from
    the device's free memory (see ``cbgen.cache.paged_cache.default_cache_budget``).
    CPU memory for the cache is committed lazily by the OS, so a generous budget
    only costs what the running requests actually touch.

    ``enable_prefix_caching`` keeps computed full blocks reusable by later requests
    with the same prefix (turned off automatically for models with sliding-window
    layers). ``scheduler_policy`` is ``"fifo"`` (decodes first, then prefills, in
    arrival order) or ``"prefill_first"`` (admit new prompts before running
    decodes when memory allows); both honour ``SamplingParams.priority``.

    ``preemption_mode`` says what happens to a request pushed out when the cache
    is full: ``"recompute"`` drops its K/V and prefills it again later (no extra
    memory); ``"swap"`` copies its computed blocks into a host swap space of
    ``swap_space`` bytes and copies them back when it resumes (falls back to
    recompute while the swap space is full). Swap pays off when prompts are long
    relative to the copy bandwidth, e.g. on a GPU with a fast host link.

    ``admission`` says when a waiting request may start. ``"eager"`` starts it as
    soon as this step's tokens fit (the most requests in flight; when the cache
    fills up, running requests are preempted). ``"full_length"`` starts it only if
    the cache can also hold every running request and this one up to their prompt
    plus ``max_new_tokens``: fewer requests in flight, but no preemption, which
    is what a small ``kv_cache_memory`` budget wants (recomputing preempted
    prompts costs more than a smaller batch).

    ``async_scheduling`` runs the forward passes on a worker thread: while step
    ``N`` runs, the engine schedules and builds step ``N + 1`` (whose inputs take
    step ``N``'s sampled tokens on the device, a placeholder id standing in on the
    host) and hands out step ``N - 1``'s outputs. Outputs are identical to the
    synchronous loop; a request that stops at step ``N`` has one wasted token in
    step ``N + 1``.

    ``kv_cache_dtype`` stores K/V in another dtype than the model's: ``torch.bfloat16``
    (or ``"bfloat16"``) under float32 weights halves the cache's memory, K/V rounded
    to 8 bits of mantissa as they are written, attention still computed in float32;
    ``None`` (the default) is the model's dtype, the exact mode.

    ``max_waiting_requests`` and ``max_queued_tokens`` bound the online engine's
    queue (``cbgen.Engine``, and so the server): requests added but not started yet,
    and their prompt tokens. Past either, ``add_request`` raises
    ``EngineOverloadedError`` (the server answers 429). ``None`` is no bound; a single
    request longer than ``max_queued_tokens`` is still taken when nothing waits.
    ``generate_batch`` adds every prompt up front and ignores them.

    ``speculative`` (a ``cbgen.SpeculativeConfig``) turns speculative decoding on: each
    step a proposer guesses up to k next tokens per decoding request and the same forward
    pass verifies them; output is unchanged (greedy: token-identical; sampled: the same
    distribution), only the number of steps drops when guesses are right. ``None``: off.

    ``max_loras`` LoRA adapters of rank up to ``max_lora_rank`` can be held at once
    (``EngineCore.add_lora``); rows of different adapters and base rows share every step.
    An adapter costs memory only once added; ``max_loras=0`` turns LoRA off.

    ``tensor_parallel_size`` splits the model over that many processes (this one and
    ``tensor_parallel_size - 1`` workers; ``cbgen.executor.parallel``): each holds its
    share of the attention heads and MLP widths, and of the KV cache, and the ranks sum
    their partial results with an all-reduce (gloo on CPU, NCCL on CUDA). The scheduler,
    cache manager and sampler stay in this process. ``threads_per_rank`` is each rank's
    thread (and core) count; ``None`` gives each rank a NUMA node when there are as many
    nodes as ranks, else an equal share of the usable cores. Under tensor parallelism,
    ``kv_cache_memory`` is per rank, and LoRA, speculative decoding, async scheduling and
    weight updates are refused.
    """

    block_size: int = 16
    num_blocks: int | None = None
    kv_cache_memory: int | None = None
    max_batch_tokens: int = 512
    max_num_seqs: int = 128
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    scheduler_policy: str = "fifo"
    # Paged decode attention in C++ (built on first use; falls back to torch if it can't be).
    use_native_kernels: bool = True
    preemption_mode: str = "recompute"
    admission: str = "eager"
    swap_space: int = 1 << 30
    async_scheduling: bool = False
    # oneDNN-prepacked linear maps (float32, CPU); None: on there unless CBGEN_NO_PREPACK=1.
    prepack_linear: bool | None = None
    max_waiting_requests: int | None = None
    max_queued_tokens: int | None = None
    kv_cache_dtype: torch.dtype | str | None = None
    speculative: SpeculativeConfig | None = None
    max_loras: int = 8
    max_lora_rank: int = 64
    tensor_parallel_size: int = 1
    threads_per_rank: int | None = None

    def __post_init__(self) -> None:
        self.kv_cache_dtype = resolve_kv_cache_dtype(self.kv_cache_dtype)
        if self.speculative is not None and not isinstance(self.speculative, SpeculativeConfig):
            raise ValueError(
                "speculative must be a cbgen.SpeculativeConfig or None, "
                f"got {type(self.speculative).__name__}"
            )
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"{name} must be an int >= 0, got {value!r}")
        self._check_parallel()
        if self.block_size <= 0:
            raise ValueError(f"block_size must be positive, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_batch_tokens <= 0:
            raise ValueError(f"max_batch_tokens must be positive, got {self.max_batch_tokens}")
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_model_len is not None and self.max_model_len <= 1:
            raise ValueError(f"max_model_len must be at least 2, got {self.max_model_len}")
        for name in ("max_waiting_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            ):
                raise ValueError(f"{name} must be a positive int or None, got {value!r}")
        if self.preemption_mode not in PREEMPTION_MODES:
            raise ValueError(
                f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}"
            )
        if self.admission not in ADMISSION_MODES:
            raise ValueError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if self.swap_space < 0:
            raise ValueError(f"swap_space must be >= 0 bytes, got {self.swap_space}")
        if self.scheduler_policy not in SCHEDULER_POLICIES:
            raise ValueError(
                f"scheduler_policy must be one of {SCHEDULER_POLICIES}, "
                f"got {self.scheduler_policy!r}"
            )

    def _check_parallel(self) -> None:
        size, threads = self.tensor_parallel_size, self.threads_per_rank
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"tensor_parallel_size must be an int >= 1, got {size!r}")
        if threads is not None and (
            isinstance(threads, bool) or not isinstance(threads, int) or threads < 1
        ):
            raise ValueError(f"threads_per_rank must be a positive int or None, got {threads!r}")
        if size == 1:
            return
        for name, on in (
            ("async_scheduling", self.async_scheduling),
            ("speculative", self.speculative is not None),
        ):
            if on:
                raise ValueError(
                    f"{name} is not supported with tensor_parallel_size={size}; "
                    f"turn it off or use tensor_parallel_size=1"
                )

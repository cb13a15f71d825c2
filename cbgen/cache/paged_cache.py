"""Per-layer K/V tensors laid out in fixed-size blocks."""

from __future__ import annotations

import mmap
import warnings
from collections.abc import Sequence

import torch

from ..sysmem import meminfo_kib
from .groups import CacheGroup, LayerSpec, tensor_layout


def bytes_per_token(layers: Sequence[LayerSpec]) -> int:
    return sum(layer.bytes_per_token for layer in layers)


def default_cache_budget(device: torch.device) -> int:
    """A KV budget in bytes that leaves room for weights and activations.

    On CPU the budget is address space: pages are committed only when a block is
    first written, so the resident size follows the live requests, not this
    number. On CUDA it is a share of the memory left after loading the model.
    """
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free * 0.6)
    available = _available_host_memory()
    return int(min(8 << 30, max(256 << 20, available * 0.4)))


def _available_host_memory() -> int:
    available = meminfo_kib("MemAvailable")
    return 4 << 30 if available is None else available * 1024


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero tensor whose host pages are committed only when written.

    The cache must start out finite: attention reads whole blocks and masks the
    unused tail, and ``0 * NaN`` from uninitialised memory would still poison
    the result. ``torch.zeros`` would commit the whole budget up front on CPU;
    an anonymous mapping is zero-filled by the kernel page by page instead.
    """
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    buffer = mmap.mmap(-1, max(nbytes, 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        flat = torch.frombuffer(buffer, dtype=dtype, count=numel)
    return flat.view(shape)


def commit_tensors(tensors: Sequence[torch.Tensor]) -> int:
    """Zero ``tensors`` in place (their pages resident from now on); the bytes written."""
    total = 0
    for tensor in tensors:
        tensor.zero_()
        total += tensor.numel() * tensor.element_size()
    return total


class PagedKVCache:
    """K and V for every layer, each ``[kv_heads, num_blocks, block_size, dim]``.

    Token ``p`` of a request lives in block ``block_ids[p // block_size]`` (the
    block list of the layer's cache group) at offset ``p % block_size``; its flat
    slot is ``block * block_size + offset``. Heads lead so that gathering a
    batch's block tables along dim 1 gives each head's keys contiguous per
    sequence, ready for batched matmuls.

    With several cache groups, layers of different groups share physical tensors
    (``cbgen.cache.groups.tensor_layout``): ``keys[layer]`` may be the same tensor
    for several layers, which never use the same block id at the same time.
    """

    def __init__(
        self,
        layers: Sequence[LayerSpec],
        num_blocks: int,
        block_size: int,
        device: torch.device,
        groups: Sequence[CacheGroup] | None = None,
    ) -> None:
        self.layers = list(layers)
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.device = device
        self.tensor_of_layer, self.tensor_specs = tensor_layout(self.layers, groups)
        keys, values = [], []
        for spec in self.tensor_specs:
            shape = (spec.num_kv_heads, num_blocks, block_size)
            keys.append(_zeros((*shape, spec.key_dim), spec.dtype, device))
            values.append(_zeros((*shape, spec.value_dim), spec.dtype, device))
        # Each physical tensor once (layers of different groups may share one).
        self.block_tensors: list[torch.Tensor] = keys + values
        self.keys: list[torch.Tensor] = [keys[t] for t in self.tensor_of_layer]
        self.values: list[torch.Tensor] = [values[t] for t in self.tensor_of_layer]

    @property
    def bytes_per_block(self) -> int:
        return bytes_per_token(self.tensor_specs) * self.block_size

    def commit(self) -> int:
        """Write every block now, so all of the cache's host pages are resident from
        here on (a server's memory is then flat from its start, not growing as blocks
        are first used); returns the bytes written."""
        return commit_tensors(self.block_tensors)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def write(
        self, layer: int, slots: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> None:
        """Store ``key``/``value`` (``[kv_heads, tokens, dim]``) at the given flat slots, in
        the cache's dtype (``EngineConfig.kv_cache_dtype`` may differ from the model's)."""
        keys, values = self.keys[layer], self.values[layer]
        keys.view(keys.shape[0], -1, keys.shape[-1]).index_copy_(1, slots, key.to(keys.dtype))
        values.view(values.shape[0], -1, values.shape[-1]).index_copy_(
            1, slots, value.to(values.dtype)
        )

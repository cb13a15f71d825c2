"""The fast decoder's layer loop as one native call, for steps that only cbgen's kernels serve.

A step of one stream (or a few) reads every weight once and does little else, so the
Python between the kernels shows: on one SmolLM2 stream in bfloat16 (2 threads, the
2026-12-07 Intel Xeon) 1.3 ms of a 14.6 ms forward went to the loop's lookups, views,
the maps' routing and argument conversion, slow because each step's 270 MB of weights had
pushed the interpreter's objects out of the caches. ``LayerStack``
(``cbgen/executor/cpu/kernels/layer_stack.cpp``) runs the same loop in C++ over the very
kernels the Python loop calls, in the same order, so its output is the loop's to the bit.

It serves models whose every layer is plain (Llama's: RMSNorm, fused q/k/v, rotary
embedding, paged attention, o, RMSNorm, fused gate/up, SiLU through the native
``silu_mul`` (so bfloat16 activations), down: no q/k norms, experts, sandwich norms, other
activations, per-layer rotary types or tensor-parallel reduces) and every map one the
stack can call as the map calls itself: a bfloat16 ``PackedMap`` on the row kernel (up to
its rows), a native 4-bit ``Int4Map`` (any rows) or an ``Int8Map`` on its row kernel (up to
its limit). Steps of more rows, with a LoRA adapter on any map or with another attention
backend run the Python loop. ``CBGEN_LAYER_STACK=0`` turns it off.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from typing import Any

import torch

from ..attention import NativeCpuAttention
from ..metadata import AttentionMetadata
from .kernels import decode_kernel
from .prepack import LinearMap, PackedMap
from .quantization import Int4Map, Int8Map

ENV = "CBGEN_LAYER_STACK"


class RowLayerStack:
    """Callable on a step's residual stream; returns None where the step does not qualify."""

    def __init__(self, native: Any, maps: Sequence[LinearMap], max_rows: int) -> None:
        self._native = native
        self._maps = tuple(maps)
        self._max_rows = max_rows

    def __call__(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        metadata: AttentionMetadata,
    ) -> torch.Tensor | None:
        """The last layer's output after every layer ran on ``hidden`` (updated in place),
        or None, with nothing run, where the step needs the Python loop."""
        tokens = hidden.shape[0]
        if not 0 < tokens <= self._max_rows or not isinstance(metadata.backend, NativeCpuAttention):
            return None
        if any(linear_map.lora is not None for linear_map in self._maps):
            return None
        cache = metadata.cache
        slots, tables, lens = [], [], []
        for group in metadata.groups:
            table, length = group.row_tables(metadata.decode_only)
            if table is None or length is None:
                return None
            slots.append(group.slot_mapping)
            tables.append(table)
            lens.append(length)
        return self._native.forward(
            hidden,
            cos,
            sin,
            cache.keys,
            cache.values,
            slots,
            tables,
            lens,
            list(metadata.layer_group),
        )


def build_layer_stack(
    layers: Sequence[Any],
    layer_ops: Any,
    heads: int,
    kv_heads: int,
    head_dim: int,
    plain_mlp: bool,
) -> RowLayerStack | None:
    """A ``RowLayerStack`` over the fast decoder's ``layers`` (its ``_Layer`` records), or
    None where one of them is not plain, a map runs no native kernel the stack calls, the
    native module lacks ``LayerStack``, or ``CBGEN_LAYER_STACK=0``. ``plain_mlp``: the
    decoder's MLP is SiLU through the native ``silu_mul`` (bfloat16)."""
    native_class = getattr(layer_ops, "LayerStack", None)
    if native_class is None or not plain_mlp or os.environ.get(ENV) == "0" or not layers:
        return None
    module = decode_kernel()
    native = native_class(heads, kv_heads, head_dim)
    maps: list[LinearMap] = []
    max_rows = sys.maxsize
    for layer in layers:
        if not _plain(layer):
            return None
        layer_maps = (layer.qkv, layer.o, layer.gate_up, layer.down)
        specs = [spec for m in layer_maps if (spec := _stack_map(module, m)) is not None]
        if len(specs) != len(layer_maps):
            return None
        (qkv, _), (o, _), (gate_up, _), (down, _) = specs
        max_rows = min(max_rows, *(rows for _, rows in specs))
        maps.extend(layer_maps)
        native.add_layer(
            layer.index,
            layer.input_norm,
            layer.input_eps,
            qkv,
            o,
            layer.post_norm,
            layer.post_eps,
            gate_up,
            down,
            layer.intermediate,
            layer.scale,
            layer.sliding_window or 0,
            layer.softcap or 0.0,
        )
    return RowLayerStack(native, maps, max_rows)


def _plain(layer: Any) -> bool:
    """Llama's layer: nothing the Python loop does beyond the stack's calls."""
    return (
        layer.qk_norms is None
        and layer.moe is None
        and layer.act is None
        and layer.attn_out_norm is None
        and layer.mlp_out_norm is None
        and layer.o_reduce is None
        and layer.down_reduce is None
        and layer.rope is None
    )


def _stack_map(module: Any, linear_map: LinearMap | None) -> tuple[Any, int] | None:
    """``linear_map`` as the native ``StackMap`` that runs it as its ``__call__`` does on
    the fast decoder's rows, and the most rows it takes that way; None where it runs
    another kernel (oneDNN's, torch's) at every row count."""
    if isinstance(linear_map, PackedMap):
        if linear_map.rows_kernel is None or linear_map.weight is None:
            return None
        native = module.StackMap(
            "bf16_rows", linear_map.weight, None, linear_map.bias, linear_map.out_features
        )
        return native, linear_map.row_kernel_rows
    if isinstance(linear_map, Int4Map) and linear_map.path in ("bf16", "vnni", "avx2"):
        native = module.StackMap(
            f"int4_{linear_map.path}",
            linear_map.packed,
            linear_map.scales_minima,
            linear_map.bias,
            linear_map.out_features,
        )
        return native, sys.maxsize
    if isinstance(linear_map, Int8Map) and linear_map.rows_kernel is not None:
        if linear_map.rows_limit <= 0:
            return None
        native = module.StackMap(
            "int8_rows",
            linear_map.codes,
            linear_map.scales,
            linear_map.bias,
            linear_map.out_features,
        )
        return native, linear_map.rows_limit
    return None

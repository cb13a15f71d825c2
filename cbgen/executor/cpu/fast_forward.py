"""The decoder forward of Llama- and Gemma-family models, run without transformers' module code.

A 64-row decode step of SmolLM2 on 2 CPU cores spent about 50 of its ~185 ms
outside the matrix multiplies: each of the 30 layers made some 30 torch calls
for RMSNorm, the rotary embedding, views and residual adds on 64 x 576 tensors,
through a few hundred Python frames of module code. For the architectures
whose layers are exactly "RMSNorm, q/k/v with rotary embedding, attention, o,
residual, RMSNorm, SiLU-gated MLP, residual" (``SUPPORTED_MODEL_TYPES``), this
module runs the same arithmetic as ten calls a layer: the prepacked GEMMs
(fused q/k/v and gate/up), the paged attention, and two fused C++ ops
(``add_rms_norm``; ``rope_qkv``, which also stores the new K/V in the paged
cache; both in ``cbgen/executor/cpu/kernels/layer_ops.cpp``). That took the 64-row decode step
from 165 to 145 ms (``bench/micro_step.py --compare prepack,fast --threads 2``).

Gemma (1, 2 and 3) has the same layer with a few differences, each taken from the
model's own modules: RMSNorms that multiply by ``1 + weight`` (passed to ``add_rms_norm``
as that), embedding rows scaled by ``sqrt(hidden)``, a GELU (tanh form) MLP whose
activation module is called as the MLP calls it, and in Gemma 2 and 3 "sandwich" norms
of the attention's and the MLP's outputs, Gemma 2's soft-capping of the attention
logits (as the probe saw each layer pass it) and of the final logits, and Gemma 3's
rotary frequencies per layer type (local and global layers). Gemma 3 270M in
bfloat16, one stream on the AVX2 machine: 31 -> 44 tok/s.

Everything else stays transformers': the embedding and the rotary module
(``rotary_emb``, whatever its scaling type) are called as the model calls them,
and the weights are the model's own. Results follow the module path's formulas
operation by operation; only the RMSNorm's sum of squares is added in another
order (see ``layer_ops.cpp``).

The fast path is taken only when nothing could observe the difference: float32
or bfloat16 on CPU with prepacked (or quantized) linear maps and the native layer
ops, no hooks on any module, and every layer of the expected shape. In bfloat16
the residual stream, norms, rotary embedding and logits stay float32 and only
the GEMMs' inputs and outputs (and the K/V cache) are bfloat16: closer to the
float32 model than transformers' own bfloat16 modules, which round the residual
after every add; there ``silu(gate) * up`` is one more C++ op (``silu_mul``), in
float32 and rounded once. The executor's model adapter
registry decides that once (``cbgen.executor.adapters.FastDecoder``); otherwise
(and with ``CBGEN_NO_FAST_FORWARD=1``) the model's own ``forward`` runs.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from ..metadata import ProbeRecord
from ..parallel.sharding import REDUCE_HOOK_ATTR
from .embedding_rows import file_rows
from .layer_stack import build_layer_stack
from .moe_block import MoeCall, moe_call
from .prepack import LinearMap, PackedLinears

if TYPE_CHECKING:
    from ..batch import StepBatch

logger = logging.getLogger(__name__)

DISABLE_ENV = "CBGEN_NO_FAST_FORWARD"
SUPPORTED_MODEL_TYPES = frozenset(
    {
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "phi3",
        "gemma",
        "gemma2",
        "gemma3_text",
        # Mixtures of experts: their MoE blocks run as the model's own modules, or with
        # 4-bit experts as the model's router and one native call (``moe_block``).
        "mixtral",
        "qwen2_moe",
        "qwen3_moe",
        "olmoe",
    }
)
# Llama's RMSNorm multiplies by its weight; Gemma's by 1 + its weight (in float32).
_LLAMA_NORMS = frozenset(
    {
        "LlamaRMSNorm",
        "MistralRMSNorm",
        "Qwen2RMSNorm",
        "Qwen3RMSNorm",
        "Phi3RMSNorm",
        "MixtralRMSNorm",
        "Qwen2MoeRMSNorm",
        "Qwen3MoeRMSNorm",
        "OlmoeRMSNorm",
    }
)
_GEMMA_NORMS = frozenset({"GemmaRMSNorm", "Gemma2RMSNorm", "Gemma3RMSNorm"})
# The MLP activations: SiLU (a fused C++ op in bfloat16) or GELU's tanh form, whose
# module the fast path calls as the MLP does.
_SILU = ("SiLU", "SiLUActivation")
_GELU_TANH = ("GELUTanh", "PytorchGELUTanh")


@dataclass(frozen=True)
class _Layer:
    index: int  # the cache layer
    input_norm: torch.Tensor
    input_eps: float
    qkv: LinearMap
    o: LinearMap
    post_norm: torch.Tensor  # the MLP's input norm
    post_eps: float
    gate_up: LinearMap | None  # None where the MLP is a module's own (an MoE block)
    down: LinearMap | None
    intermediate: int
    scale: float
    sliding_window: int | None
    softcap: float | None = None  # Gemma 2's attention logit soft-capping
    rope: str | None = None  # the rotary embedding's layer type (Gemma 3), if it has them
    # Gemma 2 and 3's sandwich norms: an RMSNorm of the attention's and of the MLP's output
    # before each is added to the residual stream.
    attn_out_norm: tuple[torch.Tensor, float] | None = None
    mlp_out_norm: tuple[torch.Tensor, float] | None = None
    # The MLP's activation when it is not SiLU (Gemma: GELU, tanh form): the model's module.
    act: Callable[[torch.Tensor], torch.Tensor] | None = None
    # Qwen3: an RMSNorm over each head of q and of k, before the rotary embedding (OLMoE:
    # over all of q and all of k; the weights' widths say which).
    qk_norms: tuple[torch.Tensor, float, torch.Tensor, float] | None = None
    # A mixture of experts' block (``moe_block.moe_call``): the model's router and experts,
    # called whole or with 4-bit experts in one native call; the layer around it the fast
    # path's.
    moe: MoeCall | None = None
    # Tensor parallelism: the all-reduce (plus bias) after o and after down, when the
    # maps hold a rank's slice (``cbgen.executor.parallel.sharding.RowReduce.apply``).
    o_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None
    down_reduce: Callable[[torch.Tensor], torch.Tensor] | None = None


class FastForward:
    """Callable on a ``StepBatch``; returns the sampled rows' logits ``[samples, vocab]``.

    Build it with ``build_fast_forward``, which decides whether the model qualifies.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: list[_Layer],
        lm_head: LinearMap,
        layer_ops: Any,
        heads: int,
        kv_heads: int,
        head_dim: int,
        norm: tuple[torch.Tensor, float],
    ) -> None:
        base = model.model  # type: ignore[union-attr]
        weight = base.embed_tokens.weight
        self._embed = file_rows(weight) or functools.partial(F.embedding, weight=weight)
        # Gemma scales the embedding rows by sqrt(hidden), in the weights' dtype.
        scale = getattr(base.embed_tokens, "embed_scale", None)
        self._embed_scale = None if scale is None else scale.detach().to(weight.dtype)
        self._rotary = base.rotary_emb
        # The dtype of the GEMMs' inputs and outputs; the residual stream stays float32.
        self._dtype = weight.dtype
        self._norm, self._norm_eps = norm  # the final norm's (_rms_norm's) weight and eps
        self._final_softcap = getattr(model.config, "final_logit_softcapping", None)
        self._layers = layers
        self._rope_types = sorted({layer.rope for layer in layers if layer.rope is not None})
        self._lm_head = lm_head
        self._ops = layer_ops
        # bfloat16: silu(gate) * up in one call, rounded once. float32 keeps torch's silu,
        # whose result transformers' module gives to the bit.
        silu_mul = getattr(layer_ops, "silu_mul", None)
        self._silu_mul = silu_mul if weight.dtype == torch.bfloat16 else None
        self._heads, self._kv_heads, self._head_dim = heads, kv_heads, head_dim
        # The layer loop in one native call, for the steps only cbgen's own kernels serve.
        self._stack = build_layer_stack(
            layers, layer_ops, heads, kv_heads, head_dim, plain_mlp=self._silu_mul is not None
        )
        self.vocab_size = int(model.lm_head.out_features)  # type: ignore[union-attr]

    def __call__(self, batch: StepBatch) -> torch.Tensor:
        ops, metadata = self._ops, batch.attention
        cache, attend = metadata.cache, metadata.backend.attend
        # The native backend reads the K/V rope_qkv stored: one call, no K/V views.
        attend_stored = getattr(metadata.backend, "attend_stored", None)
        ids = batch.input_ids[0]
        tokens = ids.shape[0]
        rows = self._embed(ids)
        if self._embed_scale is not None:
            rows = rows * self._embed_scale
        hidden = rows.float()
        # One (cos, sin) for every layer, or one per layer type.
        cos_sin = {
            rope: _cos_sin(self._rotary, hidden, batch.position_ids, rope)
            for rope in self._rope_types or [None]
        }
        q_width = self._heads * self._head_dim
        kv_width = self._kv_heads * self._head_dim
        kv_shape = (tokens, self._kv_heads, self._head_dim)
        dtype = self._dtype
        delta: torch.Tensor | None = None
        if self._stack is not None:
            delta = self._stack(hidden, *cos_sin[None], metadata)
        for layer in self._layers if delta is None else ():
            x = ops.add_rms_norm(hidden, delta, layer.input_norm, layer.input_eps, dtype)
            cos, sin = cos_sin[layer.rope]
            qkv = layer.qkv(x)
            if layer.qk_norms is not None:
                q_weight, q_eps, k_weight, k_eps = layer.qk_norms
                q_parts = self._heads if q_weight.numel() == self._head_dim else 1
                k_parts = self._kv_heads if k_weight.numel() == self._head_dim else 1
                _norm_heads(qkv[:, :q_width].view(tokens, q_parts, -1), q_weight, q_eps, ops)
                k = qkv[:, q_width : q_width + kv_width]
                _norm_heads(k.view(tokens, k_parts, -1), k_weight, k_eps, ops)
            q = ops.rope_qkv(
                qkv,
                cos,
                sin,
                self._heads,
                self._kv_heads,
                cache.keys[layer.index],
                cache.values[layer.index],
                metadata.tables(layer.index).slot_mapping,
                self._head_dim,
            )
            if attend_stored is not None:
                out = attend_stored(
                    metadata, layer.index, q, layer.scale, layer.sliding_window, layer.softcap
                )
            else:
                k = qkv[:, q_width : q_width + kv_width].view(kv_shape)
                v = qkv[:, q_width + kv_width :].view(kv_shape)
                out = attend(
                    metadata,
                    layer.index,
                    q.transpose(0, 1),
                    k.transpose(0, 1),
                    v.transpose(0, 1),
                    layer.scale,
                    layer.sliding_window,
                    layer.softcap,
                    store=False,  # rope_qkv stored them
                )
            delta = layer.o(out.reshape(tokens, -1).to(dtype))
            if layer.o_reduce is not None:
                delta = layer.o_reduce(delta)
            if layer.attn_out_norm is not None:
                delta = ops.add_rms_norm(delta.float(), None, *layer.attn_out_norm, torch.float32)
            x = ops.add_rms_norm(hidden, delta, layer.post_norm, layer.post_eps, dtype)
            if layer.moe is not None:
                delta = layer.moe(x)
                continue
            assert layer.gate_up is not None and layer.down is not None
            gate_up = layer.gate_up(x)
            if layer.act is not None:
                act = layer.act(gate_up[:, : layer.intermediate])
                act.mul_(gate_up[:, layer.intermediate :])
            elif self._silu_mul is not None and gate_up.dtype == torch.bfloat16:
                act = self._silu_mul(gate_up, layer.intermediate)
            else:
                act = F.silu(gate_up[:, : layer.intermediate])
                act.mul_(gate_up[:, layer.intermediate :])
            delta = layer.down(act)
            if layer.down_reduce is not None:
                delta = layer.down_reduce(delta)
            if layer.mlp_out_norm is not None:
                delta = ops.add_rms_norm(delta.float(), None, *layer.mlp_out_norm, torch.float32)
        rows = batch.logits_indices
        if rows.numel() == 0:
            return hidden.new_empty(0, self.vocab_size)
        assert delta is not None
        x = ops.add_rms_norm(
            hidden.index_select(0, rows),
            delta.index_select(0, rows),
            self._norm,
            self._norm_eps,
            dtype,
        )
        # Sampling reads float32 logits whatever the weights' dtype.
        logits = self._lm_head(x).float()
        if self._final_softcap is not None:  # Gemma 2, as its forward does it
            logits = torch.tanh(logits / self._final_softcap) * self._final_softcap
        return logits


def _cos_sin(
    rotary: nn.Module, hidden: torch.Tensor, positions: torch.Tensor, rope: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotary module's cos and sin for ``positions`` as ``[tokens, head_dim]``."""
    args = (
        (hidden.unsqueeze(0), positions) if rope is None else (hidden.unsqueeze(0), positions, rope)
    )
    cos, sin = rotary(*args)
    return cos[0].contiguous(), sin[0].contiguous()


def build_fast_forward(
    model: nn.Module,
    packed: PackedLinears | None,
    probe: ProbeRecord,
    layer_ops: Any,
) -> FastForward | None:
    """A ``FastForward`` for ``model``, or None (logged) when it does not qualify.

    ``layer_ops`` has ``add_rms_norm`` and ``rope_qkv`` (a ``NativeLayerOps``, or the
    kernel module itself). The engine goes through ``plan_fast_forward`` instead.
    """
    if os.environ.get(DISABLE_ENV) == "1":
        return None
    try:
        return plan_fast_forward(model, packed, probe, layer_ops)
    except Unsupported as reason:
        logger.info("cbgen: decoder fast path off: %s", reason)
        return None


class Unsupported(Exception):
    """Why a model does not qualify for the fast path."""


def _require(condition: bool, reason: str) -> None:
    if not condition:
        raise Unsupported(reason)


def plan_fast_forward(
    model: nn.Module,
    packed: PackedLinears | None,
    probe: ProbeRecord,
    layer_ops: Any,
) -> FastForward:
    """The fast path for ``model``; raises ``Unsupported`` saying why it does not qualify."""
    _require(layer_ops is not None and hasattr(layer_ops, "rope_qkv"), "no native layer ops")
    _require(packed is not None and len(packed) > 0, "linear maps are not prepacked")
    assert packed is not None
    config = model.config
    _require(
        getattr(config, "model_type", None) in SUPPORTED_MODEL_TYPES,
        f"model type {getattr(config, 'model_type', None)!r} is not one of "
        f"{sorted(SUPPORTED_MODEL_TYPES)}",
    )
    _require(_hook_free(model), "a module has forward hooks")
    base = getattr(model, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        _require(hasattr(base, name), f"the base model has no {name}")
    assert base is not None
    _require(
        type(base.embed_tokens) is nn.Embedding
        or type(base.embed_tokens).__name__.endswith("TextScaledWordEmbedding"),
        "the embedding is not nn.Embedding (or Gemma's scaled one)",
    )
    _require(
        not getattr(config, "use_bidirectional_attention", False), "the attention is bidirectional"
    )
    dtype = base.embed_tokens.weight.dtype
    _require(
        dtype == packed.dtype and all(p.dtype == dtype for p in model.parameters()),
        f"weights are not all {str(packed.dtype).removeprefix('torch.')}",
    )
    norm = _rms_norm(base.norm)
    lm_head = packed.packed_weight(getattr(model, "lm_head", None))  # type: ignore[arg-type]
    _require(lm_head is not None, "the LM head is not prepacked")
    assert lm_head is not None

    first = base.layers[0].self_attn if len(base.layers) else None
    head_dim = int(getattr(first, "head_dim", 0))
    _require(head_dim > 0 and head_dim % 2 == 0, "no even head_dim on the attention module")
    # The heads this process holds: the config's, or a tensor-parallel rank's share.
    q_width, kv_width = _qkv_widths(first, config)  # type: ignore[arg-type]
    heads, kv_heads = q_width // head_dim, kv_width // head_dim
    _require(
        heads * head_dim == q_width and heads % max(kv_heads, 1) == 0,
        "query heads that are not groups of K/V heads",
    )
    by_type = _rotary_takes_layer_type(base.rotary_emb)

    _require(getattr(config, "clip_qkv", None) is None, "q, k and v are clipped (clip_qkv)")
    layers = []
    for layer in base.layers:
        attn, mlp = layer.self_attn, getattr(layer, "mlp", None)
        qk_norms = _qk_norms(attn, head_dim, q_width, kv_width)
        _require(id(attn) in probe.layer_of_module, "an attention module the probe did not see")
        rope = getattr(attn, "layer_type", None) if by_type else None
        _require(not by_type or isinstance(rope, str), "an attention module has no layer type")
        input_norm, input_eps = _rms_norm(layer.input_layernorm)
        # Gemma 2 and 3 norm the attention's output (post_attention_layernorm) and have the
        # MLP's input norm apart (pre_feedforward_layernorm); Llama's post-attention norm is
        # the MLP's input norm.
        sandwich = hasattr(layer, "pre_feedforward_layernorm")
        if sandwich:
            attn_out_norm = _rms_norm(layer.post_attention_layernorm)
            post_norm, post_eps = _rms_norm(layer.pre_feedforward_layernorm)
            mlp_out_norm = _rms_norm(layer.post_feedforward_layernorm)
        else:
            attn_out_norm = mlp_out_norm = None
            post_norm, post_eps = _rms_norm(layer.post_attention_layernorm)
        _require(
            getattr(attn, "head_dim", None) == head_dim
            and _qkv_widths(attn, config) == (heads * head_dim, kv_heads * head_dim),
            "attention heads differ between layers",
        )
        _require(
            not layer.training
            or all(m.p == 0 for m in layer.modules() if isinstance(m, nn.Dropout)),
            "a layer has dropout and is in training mode",
        )
        qkv, o = _qkv_map(attn, packed), packed.packed_weight(attn.o_proj)
        moe = mlp if _is_moe_block(mlp) else None
        gate_up: LinearMap | None = None
        down: LinearMap | None = None
        intermediate, act_name, act_fn = 0, _SILU[0], None
        if moe is not None:
            _require(not sandwich, "an MoE block between sandwich norms")
            _require(None not in (qkv, o), "a layer's linear maps are not packed and fused")
        else:
            # Phi-3's MLP calls it activation_fn (and multiplies up by it, the same product).
            act_fn = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
            act_name = type(act_fn).__name__
            _require(act_name in _SILU + _GELU_TANH, f"the MLP's activation is {act_name}")
            gate_up, intermediate = _gate_up_map(mlp, packed)
            down = packed.packed_weight(mlp.down_proj)
            _require(
                None not in (qkv, gate_up, o, down),
                "a layer's linear maps are not packed and fused",
            )
        index = probe.layer_of_module[id(attn)]
        layers.append(
            _Layer(
                index=index,
                input_norm=input_norm,
                input_eps=input_eps,
                qkv=qkv,  # type: ignore[arg-type]
                o=o,  # type: ignore[arg-type]
                post_norm=post_norm,
                post_eps=post_eps,
                gate_up=gate_up,
                down=down,
                intermediate=intermediate,
                scale=float(attn.scaling),
                sliding_window=probe.layers[index].sliding_window,
                softcap=probe.softcaps.get(index),
                rope=rope,
                attn_out_norm=attn_out_norm,
                mlp_out_norm=mlp_out_norm,
                act=None if act_name in _SILU else act_fn,
                qk_norms=qk_norms,
                o_reduce=_row_reduce(attn.o_proj),
                down_reduce=None if moe is not None else _row_reduce(mlp.down_proj),
                moe=None if moe is None else moe_call(moe),
            )
        )
    _require(len(layers) == len(probe.layers), "the probe saw other attention layers")
    for rope in {layer.rope for layer in layers}:  # one rotary probe a layer type, not a layer
        rotary = _rotary_width(base, rope)
        _require(
            rotary % 2 == 0 and 0 < rotary <= head_dim,
            f"a rotary embedding {rotary} wide on heads of {head_dim}",
        )
    return FastForward(model, layers, lm_head, layer_ops, heads, kv_heads, head_dim, norm)


def _qkv_widths(attn: nn.Module, config: Any) -> tuple[int, int]:
    """The widths of an attention module's q and of its k (and v) outputs. Phi-3 has one
    fused q/k/v map, split by the config's heads (a rank's slice of it is not supported)."""
    if hasattr(attn, "qkv_proj"):
        head_dim = int(attn.head_dim)
        q_width = int(config.num_attention_heads) * head_dim
        kv_width = int(config.num_key_value_heads) * head_dim
        _require(
            attn.qkv_proj.out_features == q_width + 2 * kv_width,
            "a fused q/k/v map that is not the config's heads",
        )
        return q_width, kv_width
    _require(
        attn.k_proj.out_features == attn.v_proj.out_features, "keys and values of other widths"
    )
    return int(attn.q_proj.out_features), int(attn.k_proj.out_features)


def _qkv_map(attn: nn.Module, packed: PackedLinears) -> LinearMap | None:
    """A layer's q/k/v map: the packer's fused group of the separate maps, or the model's
    own fused map (Phi-3's ``qkv_proj``)."""
    if hasattr(attn, "qkv_proj"):
        return packed.packed_weight(attn.qkv_proj)
    return packed.fused_weight((attn.q_proj, attn.k_proj, attn.v_proj))


def _gate_up_map(mlp: nn.Module, packed: PackedLinears) -> tuple[LinearMap | None, int]:
    """A dense MLP's gate/up map and intermediate width: the packer's fused group, or the
    model's own fused map (Phi-3's ``gate_up_proj``, gate first)."""
    if hasattr(mlp, "gate_up_proj"):
        width = int(mlp.gate_up_proj.out_features)
        _require(width % 2 == 0, "a fused gate/up map of odd width")
        return packed.packed_weight(mlp.gate_up_proj), width // 2
    return packed.fused_weight((mlp.gate_proj, mlp.up_proj)), int(mlp.gate_proj.out_features)


def _is_moe_block(mlp: nn.Module | None) -> bool:
    """A mixture of experts' block (a router and experts), which the fast path calls
    whole: transformers 5's Mixtral, Qwen2/3-MoE and OLMoE blocks take ``[batch, tokens,
    hidden]`` and return the routed sum (Qwen2-MoE's shared expert included)."""
    return isinstance(getattr(mlp, "experts", None), nn.Module) and hasattr(mlp, "gate")


def _qk_norms(
    attn: nn.Module, head_dim: int, q_width: int, kv_width: int
) -> tuple[torch.Tensor, float, torch.Tensor, float] | None:
    """The RMSNorms of q and of k (weights and epsilons), or None without them: Qwen3's
    over each head, OLMoE's over all of q and all of k."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if q_norm is None and k_norm is None:
        return None
    q_weight, q_eps = _rms_norm(q_norm)
    k_weight, k_eps = _rms_norm(k_norm)
    _require(
        q_weight.shape in ((head_dim,), (q_width,))
        and k_weight.shape in ((head_dim,), (kv_width,)),
        "q/k norms neither over each head nor over all of q and k",
    )
    return q_weight, q_eps, k_weight, k_eps


def _norm_heads(x: torch.Tensor, weight: torch.Tensor, eps: float, ops: Any) -> None:
    """transformers' RMSNorm over the last dimension of ``x`` ``[tokens, heads, head_dim]``
    (a view into the fused q/k/v output), written in place. float32: operation by
    operation as the module computes it, so the result is the same to the bit. bfloat16:
    in float32 and rounded once at the end, by one ``add_rms_norm`` call (they were seven
    torch calls each, twice a layer)."""
    if x.dtype != torch.float32:
        rows = x.float().reshape(-1, x.shape[-1])
        x.copy_(ops.add_rms_norm(rows, None, weight, eps, x.dtype).view_as(x))
        return
    variance = x.pow(2).mean(-1, keepdim=True)
    x.copy_(weight * (x * torch.rsqrt(variance + eps)))


def _hook_free(model: nn.Module) -> bool:
    """No hook on any module, but tensor parallelism's all-reduce (which the fast path
    runs itself, ``_row_reduce``)."""
    from torch.nn.modules import module as torch_module

    if torch_module._global_forward_hooks or torch_module._global_forward_pre_hooks:
        return False
    return not any(
        (m._forward_hooks and _row_reduce(m) is None)
        or m._forward_pre_hooks
        or hasattr(m, "_hf_hook")
        for m in model.modules()
    )


def _row_reduce(module: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The all-reduce of a tensor-parallel row-wise map when it is the module's only hook."""
    hooks = list(module._forward_hooks.values())
    if len(hooks) == 1 and getattr(hooks[0], REDUCE_HOOK_ATTR, False):
        return hooks[0].apply  # type: ignore[no-any-return]
    return None


def _rms_norm(module: object) -> tuple[torch.Tensor, float]:
    """The weight and epsilon that ``add_rms_norm`` (``weight * (x / rms(x))``) takes for
    one of transformers' RMSNorms. Llama's multiplies by its weight; Gemma's by ``1 +
    weight`` in float32, made here once (a change of the weights rebuilds the engine's
    executor, and this with it). Raises ``Unsupported`` for any other norm."""
    name = type(module).__name__
    weight = getattr(module, "weight", None)
    _require(
        isinstance(weight, torch.Tensor) and name in _LLAMA_NORMS | _GEMMA_NORMS,
        f"a norm is a {name}, not an RMSNorm of a known kind",
    )
    assert isinstance(weight, torch.Tensor)
    if name in _GEMMA_NORMS:
        return 1.0 + weight.detach().float(), float(module.eps)  # type: ignore[attr-defined]
    return weight.detach(), float(module.variance_epsilon)  # type: ignore[attr-defined]


def _rotary_takes_layer_type(rotary: nn.Module) -> bool:
    """Gemma 3's rotary module gives each layer type its own frequencies."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def _rotary_width(base: nn.Module, rope: str | None) -> int:
    """How much of each head the rotary embedding turns: all of it, or a part
    (Phi-4-mini's 3/4), which ``rope_qkv`` turns as ``apply_rotary_pos_emb`` does."""
    with torch.inference_mode():
        cos, sin = _cos_sin(
            base.rotary_emb, torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.long), rope
        )
    return int(cos.shape[-1]) if cos.shape == sin.shape else 0

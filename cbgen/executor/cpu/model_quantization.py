"""Quantizing a whole model: every linear map (``quantization.QuantizedLinear``) and every
mixture-of-experts layer's experts (``quantized_experts.QuantizedExperts``).

Apart from both so that neither imports the other: the experts' maps are
``QuantizedLinear`` modules, and a model's quantization covers both kinds.
"""

from __future__ import annotations

import logging

from torch import nn

from .prepack import file_backed_ranges, page_out, plain_linear
from .quantization import (
    FOUR_BIT_MODES,
    INT4_GROUP_SIZES,
    QuantizedLinear,
    shape_fits,
    validate_mode,
)
from .quantized_experts import quantize_experts

logger = logging.getLogger(__name__)


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    getter = getattr(model, "get_output_embeddings", None)
    try:
        return getter() if callable(getter) else None
    except (AttributeError, NotImplementedError):
        return None


def _check_group_divides(
    model: nn.Module, mode: str, head_mode: str, head: nn.Module | None, group_size: int
) -> None:
    """Refuse, before touching the model, a 4-bit group that would leave maps
    unquantized which groups of 32 take (SmolLM2's 576 columns and 128, say)."""
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module.weight.device.type != "cpu":
            continue
        module_mode = head_mode if module is head else mode
        if not plain_linear(module) or module_mode not in FOUR_BIT_MODES:
            continue
        if not _shape_ok(module, module_mode, group_size) and _shape_ok(module, module_mode, 32):
            raise ValueError(
                f"group_size {group_size} does not divide the {module.in_features} input "
                f"columns of {name}: take a group that does (32 does), or it would stay "
                "unquantized"
            )


def _shape_ok(linear: nn.Linear, mode: str, group_size: int) -> bool:
    return shape_fits(linear.out_features, linear.in_features, mode, group_size)


def quantize_model(
    model: nn.Module, mode: str, group_size: int = 32, lm_head: str | None = None
) -> int:
    """Replace every CPU ``nn.Linear`` of ``model`` by a ``QuantizedLinear`` in ``mode``,
    and every MoE layer's experts by a ``QuantizedExperts`` (``quantized_experts``);
    return how many modules were replaced.

    The LM head (``get_output_embeddings()``) is int8 in every mode unless ``lm_head``
    says otherwise: 4-bit logits cost the most quality for the fewest bytes (greedy
    agreement with float32 over 32 tokens of 64 short prompts went from 7 to 23 tokens on
    average), which is why GGUF's Q4 files keep their output matrix at 8 bits or more.
    ``lm_head="int4"`` is the option for a single stream bound by the head's bytes (the
    int8 head of SmolLM2 is a third of an int4 decode step); its quality cost is in the
    README's quality table. A tied LM head is quantized as its own copy; the embedding
    keeps the full-precision matrix.
    A map whose shape the kernels cannot take (4-bit: input columns not in whole groups
    or outputs not in blocks of 16; int8: input columns not in blocks of 16) stays as
    it is, and is logged.
    """
    validate_mode(mode)
    head_mode = validate_mode(lm_head, "lm_head") or "int8"
    if mode in FOUR_BIT_MODES and group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group_size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if "w4a8" in (mode, head_mode) and group_size != 32:
        raise ValueError(f"w4a8 quantizes activations per group of 32, got group_size {group_size}")
    head = _output_embeddings(model)
    if group_size != 32:
        _check_group_divides(model, mode, head_mode, head, group_size)
    replaced = 0
    skipped: list[str] = []
    # Weights loaded from safetensors are views of the mapped file: each one read to make
    # its codes stays in the resident set until the mapping goes, so a 1B model's whole
    # bf16 file (2.5 GB) sat beside its codes at the peak. Dropping each map's pages once
    # it is quantized keeps the peak near the codes (``page_out``: unmodified file pages
    # only; a later read maps them again from the page cache).
    file_maps = file_backed_ranges()
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, nn.Linear) or child.weight.device.type != "cpu":
                continue
            if not plain_linear(child):
                continue
            full = f"{parent_name}.{name}" if parent_name else name
            child_mode = head_mode if child is head else mode
            if not _shape_ok(child, child_mode, group_size):
                skipped.append(full)
                continue
            setattr(parent, name, QuantizedLinear.from_linear(child, child_mode, group_size))
            replaced += 1
            page_out(child.weight.detach(), file_maps)
    if skipped:
        logger.info("cbgen: %d linear maps kept unquantized (shape): %s", len(skipped), skipped)
    experts, kept = quantize_experts(
        model, mode, group_size, lambda weight: page_out(weight, file_maps)
    )
    replaced += experts
    if kept:
        logger.warning("cbgen: %d experts modules kept unquantized: %s", len(kept), kept)
    config = getattr(model, "config", None)
    if config is not None:
        config.cbgen_quantization = mode
    return replaced

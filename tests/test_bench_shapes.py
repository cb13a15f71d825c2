"""Model shapes for the benchmark: random-weight folders and the GGUF llama.cpp reads.

The GGUF is checked by reading it back with ``transformers``' own GGUF loader, which undoes
llama.cpp's layout (names, the q/k pair order of the ``llama`` architecture, RoPE base):
the model it builds must compute the folder model's logits.
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cbgen.bench import shapes
from cbgen.bench.harness import Bench, add_arguments
from cbgen.bench.shapes import ModelShape, lookup, shape_folder, shape_gguf, shape_info

TINY = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 49200,  # more than the tokenizer's 49,152: the GGUF pads its token list
    "tie_word_embeddings": True,
    "rms_norm_eps": 1e-5,
    "rope_theta": 5000.0,  # not the default, so a lost RoPE base shows in the logits
    "max_position_embeddings": 256,
    "bos_token_id": 1,
    "eos_token_id": 2,
}


def test_every_named_shape_builds_its_config():
    for name, shape in shapes.SHAPES.items():
        config = lookup(f"shape:{name}").config()
        assert config.model_type == shape.model_type
        assert config.hidden_size == shape.fields["hidden_size"]
    with pytest.raises(ValueError, match="shape:llama3.2-1b"):
        lookup("shape:llama-70b")


def test_shape_folder_is_built_once_and_loads(tmp_path):
    shape = ModelShape("tiny-llama", "llama", TINY, "nobody/tiny")
    folder = shape_folder(shape, root=tmp_path)
    info = shape_info(folder)
    assert info is not None and info["shape"] == "tiny-llama" and info["parameters"] > 0
    stamp = (folder / "model.safetensors").stat().st_mtime_ns
    assert shape_folder(shape, root=tmp_path) == folder
    assert (folder / "model.safetensors").stat().st_mtime_ns == stamp  # not rebuilt
    model = AutoModelForCausalLM.from_pretrained(folder, local_files_only=True)
    assert model.config.vocab_size == 49200
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    assert len(tokenizer) == 49152
    # A different seed is a different model: the folder is built again.
    shape_folder(shape, root=tmp_path, seed=1)
    assert (folder / "model.safetensors").stat().st_mtime_ns != stamp


def _logits(model: torch.nn.Module) -> torch.Tensor:
    ids = torch.tensor([[1, 504, 3458, 314, 2118, 28, 253, 1345, 4744, 17, 9]])
    with torch.no_grad():
        return model(ids).logits[0].float()


@pytest.mark.parametrize("model_type", ["llama", "qwen2"])
def test_gguf_holds_the_folders_weights(tmp_path, model_type):
    fields = dict(TINY)
    if model_type == "qwen2":
        fields["use_sliding_window"] = False
    shape = ModelShape(f"tiny-{model_type}", model_type, fields, "nobody/tiny")
    folder = shape_folder(shape, root=tmp_path)
    if model_type == "qwen2":  # give the q/k/v biases values, so their names are checked
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16)
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj):
                    proj.bias.normal_(0.0, 0.5)
        model.save_pretrained(folder)
    gguf = shape_gguf(folder)
    assert gguf.name == f"tiny-{model_type}-bf16.gguf"
    expected = _logits(AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32))
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf.name, dtype=torch.float32)
    assert loaded.config.vocab_size == 49200
    got = _logits(loaded)
    assert torch.allclose(got, expected, atol=1e-4, rtol=1e-4), (got - expected).abs().max()
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def _bench_args(model: str, peers: str = "") -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return parser.parse_args(["--model", model, "--peers", peers, "--systems", "cbgen"])


def test_the_bench_gives_llamacpp_the_shapes_gguf_to_quantize(tmp_path, monkeypatch):
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(tmp_path))
    tiny = ModelShape("tiny-llama", "llama", TINY, "nobody/tiny")
    monkeypatch.setitem(shapes.SHAPES, "tiny-llama", tiny)
    bench = Bench(_bench_args("shape:tiny-llama", peers="llamacpp"))
    folder = tmp_path / "shapes" / "tiny-llama"
    assert bench.args.model == str(folder)
    spec = bench.spec("peer", "llamacpp", [])
    assert spec["model_folder"] == str(folder)
    assert spec["model_gguf"] == str(folder / "tiny-llama-bf16.gguf")
    assert spec["gguf_quantize"] == "q4_0"
    assert bench.meta()["shape"]["shape"] == "tiny-llama"
    # Without the llama.cpp peer no GGUF is written; the bundled model has no shape.
    bundled = Bench(_bench_args("smollm2"))
    assert bundled.spec("system", "cbgen", [])["gguf_quantize"] is None
    with pytest.raises(SystemExit, match="unknown model shape"):
        Bench(_bench_args("shape:nothing"))
    assert json.loads((folder / shapes.MARKER).read_text())["like"] == "nobody/tiny"

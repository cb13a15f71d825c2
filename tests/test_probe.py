"""The KV layout is read off the model by running it: heads, head sizes and window per layer."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from conftest import make_tiny_model, random_prompts, reference_greedy

import cbgen
from cbgen import EngineConfig, SamplingParams
from cbgen.cache.groups import AttentionKind, build_groups
from cbgen.executor.runner import Executor

SMALL = dict(vocab_size=256, max_position_embeddings=512, initializer_range=0.2)
LLAMA_LIKE = dict(**SMALL, hidden_size=64, intermediate_size=128, num_attention_heads=4)


def _bigcode():  # multi-query attention, GPT-2 style names (n_embd, n_head, n_layer)
    return tf.GPTBigCodeConfig(
        vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=512, multi_query=True
    )


def _qwen2_partly_sliding():  # layer 0 full, later layers windowed (max_window_layers)
    return tf.Qwen2Config(
        **LLAMA_LIKE,
        num_hidden_layers=3,
        num_key_value_heads=2,
        use_sliding_window=True,
        sliding_window=8,
        max_window_layers=1,
    )


# (name, config or conftest arch, per layer: (kv_heads, key_dim, value_dim, window))
CASES = [
    ("llama-gqa", "llama", [(2, 16, 16, None)] * 2),
    (
        "llama-mqa",
        lambda: tf.LlamaConfig(**LLAMA_LIKE, num_hidden_layers=2, num_key_value_heads=1),
        [(1, 16, 16, None)] * 2,
    ),
    ("gpt_bigcode-mqa", _bigcode, [(1, 16, 16, None)] * 2),
    ("gpt2-mha", "gpt2", [(4, 16, 16, None)] * 2),  # n_head, n_embd
    ("phi", "phi", [(4, 16, 16, None)] * 2),  # partial rotary, dense heads
    ("opt", "opt", [(4, 16, 16, None)] * 2),
    ("gpt_neox", "gpt_neox", [(4, 16, 16, None)] * 2),
    # head_dim 32 with hidden 64 and 4 heads: not hidden / heads
    (
        "gemma-head_dim",
        lambda: tf.GemmaConfig(
            **LLAMA_LIKE, num_hidden_layers=2, num_key_value_heads=1, head_dim=32
        ),
        [(1, 32, 32, None)] * 2,
    ),
    ("mistral-sliding", "mistral-sliding", [(2, 16, 16, 12)] * 2),
    ("gemma2", "gemma2", [(2, 16, 16, 12), (2, 16, 16, None)]),
    ("gemma3", "gemma3", [(2, 16, 16, 16)] * 3 + [(2, 16, 16, None)]),
    ("qwen2-partly-sliding", _qwen2_partly_sliding, [(2, 16, 16, None)] + [(2, 16, 16, 8)] * 2),
]


def _model(source) -> torch.nn.Module:
    if isinstance(source, str):
        return make_tiny_model(source)
    torch.manual_seed(0)
    return tf.AutoModelForCausalLM.from_config(source(), dtype=torch.float32).eval()


@pytest.mark.parametrize(("name", "source", "expected"), CASES, ids=[c[0] for c in CASES])
def test_probe_reads_the_kv_layout_of_every_layer(name, source, expected):
    model = _model(source)
    runner = Executor(model, use_native_kernels=False)
    try:
        got = [
            (s.num_kv_heads, s.key_dim, s.value_dim, s.sliding_window) for s in runner.probe.layers
        ]
        assert got == expected
        assert {s.dtype for s in runner.probe.layers} == {torch.float32}
        assert sorted(runner.probe.layer_of_module.values()) == list(range(len(expected)))
    finally:
        runner.close()
    assert model.config._attn_implementation != "cbgen_paged"


def test_probe_sees_the_dtype_it_runs_in():
    model = make_tiny_model("qwen3").to(torch.bfloat16)
    runner = Executor(model, use_native_kernels=False)
    try:
        assert {s.dtype for s in runner.probe.layers} == {torch.bfloat16}
    finally:
        runner.close()


@pytest.mark.parametrize(("arch", "softcaps"), [("gemma2", {0: 5.0, 1: 5.0}), ("llama", {})])
def test_probe_records_the_soft_capping_each_layer_passed(arch, softcaps):
    """The fast decoder passes each layer's attention soft-capping on from the probe."""
    runner = Executor(make_tiny_model(arch), use_native_kernels=False)
    try:
        assert runner.probe.softcaps == softcaps
    finally:
        runner.close()


def test_groups_follow_the_probed_kinds():
    layers = Executor(make_tiny_model("gemma3"), use_native_kernels=False).probe.layers
    groups = build_groups(layers)
    # One full layer and three windowed ones: groups of min(1, 3) = 1 layer, full first.
    assert [(g.kind, g.window, g.layers) for g in groups] == [
        (AttentionKind.FULL, None, (3,)),
        (AttentionKind.SLIDING_WINDOW, 16, (0,)),
        (AttentionKind.SLIDING_WINDOW, 16, (1,)),
        (AttentionKind.SLIDING_WINDOW, 16, (2,)),
    ]


@pytest.mark.parametrize("source", [_bigcode, _qwen2_partly_sliding], ids=["bigcode", "qwen2"])
def test_probed_layouts_generate_exactly(source):
    model = _model(source)
    prompts = random_prompts(5, 1, 30, seed=3)
    expected = [reference_greedy(model, p, 20) for p in prompts]
    config = EngineConfig(block_size=4, num_blocks=96, max_batch_tokens=16)
    outputs = cbgen.generate_batch(model, prompts, SamplingParams(max_new_tokens=20), config)
    assert [o.token_ids for o in outputs] == expected


def test_tensor_layout_shares_tensors_across_groups_only():
    import torch

    from cbgen.cache.groups import AttentionKind, CacheGroup, LayerSpec, tensor_layout

    full = LayerSpec(2, 16, 16, torch.float32)
    window = LayerSpec(2, 16, 16, torch.float32, sliding_window=8)
    wide = LayerSpec(4, 16, 16, torch.float32, sliding_window=8)
    layers = [full, window, window, full, wide]
    # one group (or none): one tensor per layer
    assert tensor_layout(layers, None) == ([0, 1, 2, 3, 4], layers)
    groups = [
        CacheGroup(0, AttentionKind.FULL, (0, 3)),
        CacheGroup(1, AttentionKind.SLIDING_WINDOW, (1, 2), window=8),
        CacheGroup(2, AttentionKind.SLIDING_WINDOW, (4,), window=8),
    ]
    tensor_of_layer, tensors = tensor_layout(layers, groups)
    # group 1 reuses group 0's two tensors (same shape); the wide layer needs its own
    assert tensor_of_layer[0] != tensor_of_layer[3]  # layers of one group never share
    assert {tensor_of_layer[1], tensor_of_layer[2]} == {tensor_of_layer[0], tensor_of_layer[3]}
    assert tensor_of_layer[4] not in tensor_of_layer[:4] and len(tensors) == 3
    for layer, t in enumerate(tensor_of_layer):
        spec = tensors[t]
        assert (spec.num_kv_heads, spec.key_dim, spec.value_dim) == (
            layers[layer].num_kv_heads,
            layers[layer].key_dim,
            layers[layer].value_dim,
        )

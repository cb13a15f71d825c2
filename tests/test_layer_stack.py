"""The fast decoder's layer loop in one native call (``cbgen.executor.cpu.layer_stack``):
which models and steps it serves, and that its output is the Python loop's to the bit."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, random_prompts, run_until_done

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.layer_stack import ENV, RowLayerStack
from cbgen.executor.cpu.model_quantization import quantize_model

kernel = decode_kernel()
pytestmark = pytest.mark.skipif(
    kernel is None or not kernel.bf16_rows_available(),
    reason="native kernels without the bfloat16 row kernel",
)

PLAIN = ["llama", "qwen2", "mistral-sliding", "phi3"]  # qwen2: biases; mistral: a window
NOT_PLAIN = ["qwen3", "gemma", "gemma2", "mixtral"]  # q/k norms, GELU, sandwich norms, experts


def bf16_model(arch: str, seed: int = 0, mode: str | None = None) -> torch.nn.Module:
    """A tiny random ``arch`` in bfloat16, its maps quantized to ``mode`` if given."""
    model = make_tiny_model(arch, seed=seed).to(torch.bfloat16)
    if mode is not None:
        assert quantize_model(model, mode) > 0
    return model


def stack_of(engine: EngineCore) -> RowLayerStack | None:
    fast = engine.executor.runner.fast_forward
    assert fast is not None, engine.executor.runner.describe()
    return fast._stack


@pytest.mark.parametrize("arch", PLAIN + NOT_PLAIN)
def test_built_for_plain_bfloat16_layers_only(arch):
    with EngineCore(bf16_model(arch)) as engine:
        assert (stack_of(engine) is not None) == (arch in PLAIN)


def test_not_built_in_float32_or_when_turned_off(monkeypatch):
    with EngineCore(make_tiny_model("llama")) as engine:
        assert stack_of(engine) is None  # float32 maps are oneDNN's, not the row kernel's
    monkeypatch.setenv(ENV, "0")
    with EngineCore(bf16_model("llama")) as engine:
        assert stack_of(engine) is None


def stack_and_loop_steps(model, prompts, config, max_new_tokens=8):
    """Every step of a run, through the stack and then the Python loop on the same batch and
    cache: ``(stack logits or None where the stack declined, loop logits, rows, decode-only)``."""
    steps = []
    with EngineCore(model, config) as engine:
        runner = engine.executor.runner
        fast = runner.fast_forward
        stack = stack_of(engine)
        assert stack is not None

        served = []

        def counted(*args):
            out = RowLayerStack.__call__(stack, *args)
            served.append(out is not None)
            return out

        def both(batch):
            fast._stack = counted
            logits = fast(batch).clone()
            fast._stack = None  # the loop rewrites the same K/V into the same slots
            try:
                loop = fast(batch)
            finally:
                fast._stack = stack
            ran = served.pop()
            rows = int(batch.input_ids.shape[-1])
            steps.append((logits if ran else None, loop, rows, batch.attention.decode_only))
            return loop

        runner.fast_forward = both
        params = SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True)
        for prompt in prompts:
            engine.add_request(prompt, params)
        run_until_done(engine)
    return steps


@pytest.mark.parametrize(
    ("arch", "mode"),
    [(arch, None) for arch in PLAIN]
    + [("llama", "int4"), ("qwen2", "int4"), ("llama", "w4a8"), ("llama", "int8")],
)
def test_step_logits_equal_the_python_loop_bit_for_bit(arch, mode):
    """Chunked prefill (chunks of up to 4 rows), decodes of 1-3 streams and mixed steps:
    wherever the stack ran, its logits are the loop's exactly (bfloat16 maps on the row
    kernel; 4-bit maps, with Qwen2's biases added after the kernel as the maps add them)."""
    config = EngineConfig(max_batch_tokens=4, block_size=4)
    model = bf16_model(arch, seed=1, mode=mode)
    steps = stack_and_loop_steps(model, random_prompts(3, 2, 9, seed=4), config)
    ran = [(rows, decode_only) for stack, _, rows, decode_only in steps if stack is not None]
    for stack, loop, _, _ in steps:
        if stack is not None:
            assert torch.equal(stack, loop)
    assert {True, False} <= {decode_only for _, decode_only in ran}  # decodes and chunks
    assert max(rows for rows, _ in ran) > 1


def test_four_bit_maps_take_every_step():
    config = EngineConfig(max_batch_tokens=64, block_size=4)
    model = bf16_model("llama", mode="int4")
    steps = stack_and_loop_steps(model, random_prompts(2, 30, 40, seed=5), config, 3)
    assert all(stack is not None for stack, _, _, _ in steps)
    assert max(rows for _, _, rows, _ in steps) > 30  # the prompts' prefill too
    for stack, loop, _, _ in steps:
        assert torch.equal(stack, loop)


def test_steps_of_more_rows_than_the_row_kernel_run_the_loop():
    config = EngineConfig(max_batch_tokens=64, block_size=4)
    steps = stack_and_loop_steps(bf16_model("llama"), random_prompts(1, 30, 40, seed=5), config, 3)
    by_rows = {rows: stack is not None for stack, _, rows, _ in steps}
    assert by_rows[1] is True  # one stream's decodes
    assert any(rows > 8 and not ran for rows, ran in by_rows.items())  # the prompt's prefill


def test_a_float32_cache_gives_the_loops_bits():
    """bfloat16 weights over a float32 K/V cache (``kv_cache_dtype``): attention's float32
    rows go to o rounded to bfloat16, in the stack as in the loop."""
    config = EngineConfig(max_batch_tokens=4, block_size=4, kv_cache_dtype=torch.float32)
    model = bf16_model("llama", seed=2)
    steps = stack_and_loop_steps(model, random_prompts(2, 2, 9, seed=6), config)
    assert steps and all(stack is not None for stack, _, _, _ in steps)
    for stack, loop, _, _ in steps:
        assert torch.equal(stack, loop)


def test_a_lora_adapter_on_any_map_sends_the_step_to_the_loop():
    with EngineCore(bf16_model("llama")) as engine:
        stack = stack_of(engine)
        assert stack is not None
        fast = engine.executor.runner.fast_forward
        batches = []

        def capture(batch):
            batches.append(batch)
            return fast(batch)

        engine.executor.runner.fast_forward = capture
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=2, ignore_eos=True))
        engine.step()
        metadata = batches[0].attention
        hidden = torch.zeros(3, fast._layers[0].input_norm.numel())
        down = fast._layers[-1].down
        down.lora = lambda x, out: None
        try:
            assert stack(hidden, hidden, hidden, metadata) is None
        finally:
            down.lora = None
        assert torch.count_nonzero(hidden) == 0  # nothing ran


def test_generation_is_the_same_with_the_stack_off_through_preemption(monkeypatch):
    model = bf16_model("qwen2", seed=3)
    prompts = random_prompts(6, 1, 20, seed=2)
    config = EngineConfig(max_batch_tokens=4, block_size=4, num_blocks=12, max_num_seqs=3)

    def run() -> list[list[int]]:
        with EngineCore(model, config) as engine:
            for prompt in prompts:
                engine.add_request(prompt, SamplingParams(max_new_tokens=10, ignore_eos=True))
            results = run_until_done(engine)
            assert engine.stats["preemptions"] > 0
            return [r.token_ids for r in results.values()]

    with_stack = run()
    monkeypatch.setenv(ENV, "0")
    assert run() == with_stack


def bf16_map(rows: int, columns: int):
    return kernel.StackMap(
        "bf16_rows", torch.zeros(rows, columns, dtype=torch.bfloat16), None, None, rows
    )


def layer_args(hidden=16, heads=2, kv_heads=1, head_dim=8, intermediate=24, qkv_rows=None):
    norm = torch.ones(hidden)
    qkv = bf16_map(qkv_rows or (heads + 2 * kv_heads) * head_dim, hidden)
    o, gate_up = bf16_map(hidden, heads * head_dim), bf16_map(2 * intermediate, hidden)
    down = bf16_map(hidden, intermediate)
    return (0, norm, 1e-6, qkv, o, norm, 1e-6, gate_up, down, intermediate, 0.5, 0, 0.0)


def test_the_native_stack_refuses_bad_maps_layers_and_caches():
    with pytest.raises(RuntimeError, match="must be contiguous bfloat16"):
        kernel.StackMap("bf16_rows", torch.zeros(4, 8), None, None, 4)
    with pytest.raises(RuntimeError, match="no kernel kind 'fp8'"):
        kernel.StackMap("fp8", torch.zeros(4, 8), None, None, 4)
    with pytest.raises(RuntimeError, match="needs its scales"):
        kernel.StackMap("int4_bf16", torch.zeros(4, 8, dtype=torch.uint8), None, None, 4)
    with pytest.raises(RuntimeError, match="heads must be a positive multiple"):
        kernel.LayerStack(3, 2, 8)
    native = kernel.LayerStack(2, 1, 8)
    with pytest.raises(RuntimeError, match="qkv's outputs"):
        native.add_layer(*layer_args(qkv_rows=16))
    native.add_layer(*layer_args())
    assert len(native) == 1
    hidden = torch.zeros(1, 16)
    cos = sin = torch.ones(1, 8)
    with pytest.raises(RuntimeError, match="outside the cache"):
        native.forward(hidden, cos, sin, [], [], [], [], [], [])
    with pytest.raises(RuntimeError, match="must pair up"):
        native.forward(hidden, cos, sin, [torch.zeros(1)], [], [], [], [], [0])


def test_the_bundled_model_in_bfloat16_takes_the_stack():
    model = cbgen.load_model("smollm2", dtype=torch.bfloat16)[0]
    with EngineCore(model) as engine:
        assert stack_of(engine) is not None

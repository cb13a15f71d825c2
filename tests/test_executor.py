"""The executor seam: each backend's ``supports``, the registry's choice and its report, and
the native attention kernel against the torch reference (the oracle) on the same steps."""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import make_tiny_model, random_prompts, run_until_done

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.groups import LayerSpec, build_groups
from cbgen.cache.paged_cache import PagedKVCache
from cbgen.executor import registry
from cbgen.executor.adapters import FastDecoder, HFModules
from cbgen.executor.attention import NativeCpuAttention, TorchReferenceAttention
from cbgen.executor.batch import BatchBuilder
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.executor.cpu.prepack import prepack_supported
from cbgen.executor.greedy import NativeArgmax, TorchArgmax
from cbgen.executor.linear import OneDnnBf16Linear, OneDnnFp32Linear, TorchLinear
from cbgen.executor.metadata import ProbeRecord
from cbgen.executor.native import NativeKernels, NativeLayerOps
from cbgen.requests.request import Request
from cbgen.requests.scheduler_output import ScheduledRequest, SchedulerOutput

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
F32, BF16 = torch.float32, torch.bfloat16
needs_kernel = pytest.mark.skipif(decode_kernel() is None, reason="native kernels not built")
needs_onednn = pytest.mark.skipif(not prepack_supported(), reason="torch built without oneDNN")


# -- supports(): who refuses what, and says why -----------------------------------------------


def test_native_backends_refuse_cuda_without_loading_the_kernels():
    model = torch.nn.Linear(2, 2)
    kernels = NativeKernels()
    for backend in (NativeCpuAttention(kernels), NativeLayerOps(kernels), NativeArgmax(kernels)):
        reason = backend.supports(model, F32, CUDA)
        assert reason is not None and "CPU" in reason and "cuda" in reason
    assert kernels.loaded is None  # no compiler started for a CUDA model


def test_native_backends_refuse_when_switched_off():
    kernels = NativeKernels(enabled=False)
    for backend in (NativeCpuAttention(kernels), NativeLayerOps(kernels), NativeArgmax(kernels)):
        assert "use_native_kernels=False" in backend.supports(torch.nn.Linear(2, 2), F32, CPU)


@needs_kernel
def test_native_backends_on_cpu():
    model, kernels = torch.nn.Linear(2, 2), NativeKernels()
    assert NativeCpuAttention(kernels).supports(model, F32, CPU) is None
    assert NativeCpuAttention(kernels).supports(model, BF16, CPU) is None  # bf16 caches too
    assert NativeArgmax(kernels).supports(model, BF16, CPU) is None  # logits are float32
    assert NativeLayerOps(kernels).supports(model, F32, CPU) is None
    assert NativeLayerOps(kernels).supports(model, BF16, CPU) is None
    assert "float16" in NativeLayerOps(kernels).supports(model, torch.float16, CPU)


@needs_onednn
def test_onednn_linear_refuses_other_dtypes_devices_and_switches(monkeypatch):
    model = torch.nn.Linear(2, 2)
    monkeypatch.delenv("CBGEN_NO_PREPACK", raising=False)
    assert OneDnnFp32Linear().supports(model, F32, CPU) is None
    assert "float32" in OneDnnFp32Linear().supports(model, BF16, CPU)
    assert "bfloat16" in OneDnnFp32Linear(True).supports(model, BF16, CPU)
    assert "CPU" in OneDnnFp32Linear().supports(model, F32, CUDA)
    assert "prepack_linear=False" in OneDnnFp32Linear(False).supports(model, F32, CPU)
    monkeypatch.setenv("CBGEN_NO_PREPACK", "1")
    assert "CBGEN_NO_PREPACK=1" in OneDnnFp32Linear().supports(model, F32, CPU)
    assert OneDnnFp32Linear(True).supports(model, F32, CPU) is None  # explicit wins
    assert OneDnnBf16Linear(True).supports(model, BF16, CPU) is None
    assert "bfloat16" in OneDnnBf16Linear(True).supports(model, F32, CPU)


@pytest.mark.parametrize("device", [CPU, CUDA])
@pytest.mark.parametrize("dtype", [F32, BF16])
def test_the_torch_backends_serve_everything(device, dtype):
    model = torch.nn.Linear(2, 2)
    for backend in (TorchReferenceAttention(), TorchLinear(), TorchArgmax(), HFModules(model)):
        assert backend.supports(model, dtype, device) is None


def _fast_decoder(model, kernels=None, packed=True):
    """A FastDecoder given the backends the registry would have chosen before it."""
    kernels = kernels or NativeKernels()
    linear = OneDnnFp32Linear(True)
    ops = NativeLayerOps(kernels)
    assert ops.supports(model, F32, CPU) is None
    if packed:
        linear.apply(model)
    probe = ProbeRecord()
    # The probe of a real executor: every attention module, in order.
    for index, layer in enumerate(model.model.layers):
        probe.layer_of_module[id(layer.self_attn)] = index
        probe.layers.append(LayerSpec(1, 1, 1, F32))
    return FastDecoder(probe, linear, ops), linear


@needs_kernel
@needs_onednn
def test_fast_decoder_refusals(monkeypatch):
    monkeypatch.delenv("CBGEN_NO_FAST_FORWARD", raising=False)
    model = make_tiny_model("llama")
    decoder, linear = _fast_decoder(model)
    try:
        assert decoder.supports(model, F32, CPU) is None and decoder.fast_forward is not None
        assert "cuda" in decoder.supports(model, F32, CUDA)
        assert "float16" in decoder.supports(model, torch.float16, CPU)
        handle = model.model.layers[1].mlp.register_forward_hook(lambda *args: None)
        assert "hooks" in decoder.supports(model, F32, CPU)
        handle.remove()
        monkeypatch.setenv("CBGEN_NO_FAST_FORWARD", "1")
        assert "CBGEN_NO_FAST_FORWARD=1" in decoder.supports(model, F32, CPU)
        monkeypatch.delenv("CBGEN_NO_FAST_FORWARD")
        assert "layer ops" in FastDecoder(decoder.probe, linear, None).supports(model, F32, CPU)
        assert "prepacked" in FastDecoder(decoder.probe, TorchLinear(), decoder.layer_ops).supports(
            model, F32, CPU
        )
    finally:
        linear.close()
    granite = make_tiny_model("granite")
    decoder, linear = _fast_decoder(granite)
    try:
        assert "'granite'" in decoder.supports(granite, F32, CPU)
    finally:
        linear.close()


# -- the registry's choice, made once and reported --------------------------------------------


@needs_kernel
@needs_onednn
def test_the_engine_reports_its_backends(caplog, monkeypatch):
    monkeypatch.delenv("CBGEN_NO_PREPACK", raising=False)
    monkeypatch.delenv("CBGEN_NO_FAST_FORWARD", raising=False)
    with (
        caplog.at_level(logging.INFO, logger="cbgen"),
        EngineCore(make_tiny_model("llama")) as engine,
    ):
        chosen = {role: s.backend.name for role, s in engine.executor.runner.selections.items()}
        assert engine.executor.batch_builder.attention is engine.executor.runner.attention
        assert engine.executor.sampler._argmax is engine.executor.runner.greedy.argmax
    assert chosen == {
        "attention": "native-cpu-paged",
        "linear": "onednn-fp32-prepacked",
        "layer_ops": "native-layer-ops",
        "greedy": "native-argmax",
        "model": "fast-decoder",
    }
    assert any("model=fast-decoder" in r.getMessage() for r in caplog.records)


def test_switched_off_kernels_fall_back_with_reasons():
    config = EngineConfig(use_native_kernels=False, prepack_linear=False, num_blocks=64)
    with EngineCore(make_tiny_model("gemma3"), config) as engine:
        report = engine.executor.runner.describe().splitlines()
        selections = engine.executor.runner.selections
        assert selections["attention"].backend.name == "torch-reference"
        assert selections["linear"].backend.name == "torch-linear"
        assert selections["layer_ops"].backend is None
        assert selections["model"].backend.name == "hf-modules"
        assert engine.executor.kernels is None
        engine.add_request([3, 4, 5], SamplingParams(max_new_tokens=3, ignore_eos=True), "a")
        assert len(run_until_done(engine)["a"].token_ids) == 3
    assert report[0] == (
        "attention=torch-reference (refused native-cpu-paged: native kernels are turned off "
        "(EngineConfig.use_native_kernels=False))"
    )
    assert "prepack_linear=False" in report[1] and report[2].startswith("layer_ops=none")


def test_a_registered_candidate_is_asked_first():
    class Named(TorchReferenceAttention):
        name = "first-in-line"

    def factory(ctx):
        return Named()

    registry.register("attention", factory)
    try:
        assert registry.candidates("attention")[0] is factory
        with EngineCore(make_tiny_model("llama"), EngineConfig(num_blocks=64)) as engine:
            assert engine.executor.runner.attention.name == "first-in-line"
    finally:
        registry.unregister("attention", factory)
    with pytest.raises(ValueError, match="unknown backend role"):
        registry.register("nonsense", factory)


# -- the native kernel against the torch reference, on the same steps --------------------------

BS = 4


def _step(windowed: bool):
    """A cache with random contents and one mixed step: two decodes (one far past the
    window), a fresh prefill chunk and a continued chunk over cached blocks."""
    torch.manual_seed(0)
    window = 6 if windowed else None
    layers = [LayerSpec(2, 8, 8, F32), LayerSpec(2, 8, 8, F32, window)]
    groups = build_groups(layers)
    cache = PagedKVCache(layers, 64, BS, CPU, groups)
    for tensor in (*cache.keys, *cache.values):
        tensor.normal_()
    specs = [(23, 22, 1), (9, 0, 6), (14, 8, 6), (5, 4, 1)]  # tokens, computed, new
    chunks, next_block = [], 1
    for i, (tokens, computed, new) in enumerate(specs):
        request = Request(str(i), list(range(tokens)), SamplingParams(), arrival_order=i)
        request.num_computed_tokens = computed
        tables = []
        for _ in groups:
            count = -(-tokens // BS)
            tables.append(list(range(next_block, next_block + count)))
            next_block += count
        chunks.append(ScheduledRequest.of(request, computed, new, tables, BS))
    return cache, groups, SchedulerOutput(scheduled=chunks), window


@needs_kernel
@pytest.mark.parametrize("windowed", [False, True], ids=["one-group", "two-groups"])
@pytest.mark.parametrize("decode_only", [False, True], ids=["mixed", "decodes"])
@pytest.mark.parametrize("softcap", [None, 2.0])
def test_native_attention_matches_the_reference(windowed, decode_only, softcap):
    cache, groups, scheduled, window = _step(windowed)
    if decode_only:
        scheduled.scheduled = [c for c in scheduled.scheduled if c.num_tokens == 1]
    native = NativeCpuAttention(NativeKernels())
    assert native.supports(None, F32, CPU) is None
    layer_of_module = {0: 0, 1: 1}
    reference_batch = BatchBuilder(cache, layer_of_module, TorchReferenceAttention(), groups)
    native_batch = BatchBuilder(cache, layer_of_module, native, groups)
    reference_meta = reference_batch.build(scheduled).attention
    native_meta = native_batch.build(scheduled).attention
    assert len(native_meta.groups) == len(groups)
    if not decode_only:  # every group gets per-row tables: the kernel serves every group
        assert all(t.row_block_tables is not None for t in native_meta.groups)
    tokens = sum(c.num_tokens for c in scheduled.scheduled)
    for layer in (0, 1):
        q = torch.randn(4, tokens, 8)
        k, v = torch.randn(2, tokens, 8), torch.randn(2, tokens, 8)
        layer_window = window if layer == 1 else None
        args = (layer, q, k, v, 8**-0.5, layer_window, softcap)
        expected = reference_meta.backend.attend(reference_meta, *args)
        got = native_meta.backend.attend(native_meta, *args)
        assert got.shape == expected.shape == (tokens, 4, 8)
        torch.testing.assert_close(got, expected, rtol=2e-5, atol=2e-5)


@needs_kernel
@pytest.mark.parametrize("arch", ["gemma3", "mistral-sliding"])
def test_windowed_models_are_exact_with_the_kernel_in_mixed_steps(arch):
    """Prefill rows of every cache group go through the kernel (one metadata shape), and
    greedy outputs stay those of ``generate()``."""
    from conftest import reference_greedy

    model = make_tiny_model(arch)
    prompts = random_prompts(4, 10, 40, seed=5)
    expected = [reference_greedy(model, p, 8) for p in prompts]
    config = EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=24)
    kernel_steps = 0
    with EngineCore(model, config) as engine:
        build = engine.executor.batch_builder.build

        def counting(scheduled):
            nonlocal kernel_steps
            batch = build(scheduled)
            kernel_steps += all(t.row_block_tables is not None for t in batch.attention.groups)
            return batch

        engine.executor.batch_builder.build = counting
        for i, p in enumerate(prompts):
            engine.add_request(p, SamplingParams(max_new_tokens=8), str(i))
        results = run_until_done(engine)
    assert kernel_steps > 1
    assert [results[str(i)].token_ids for i in range(len(prompts))] == expected

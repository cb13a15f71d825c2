"""``EngineConfig(kv_cache_dtype=...)``: the cache's dtype independent of the weights'."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, random_prompts, run_until_done

from cbgen import EngineConfig, EngineCore, SamplingParams


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, None), ("auto", None), ("bfloat16", torch.bfloat16), (torch.float16, torch.float16)],
)
def test_values_resolve_to_dtypes(value, expected):
    assert EngineConfig(kv_cache_dtype=value).kv_cache_dtype == expected


@pytest.mark.parametrize("value", ["int3", torch.int8, "float64", 16])
def test_bad_values_are_refused(value):
    with pytest.raises(ValueError, match="kv_cache_dtype must be"):
        EngineConfig(kv_cache_dtype=value)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_float32_weights_with_a_bfloat16_cache(arch, native):
    """Half the bytes per token, and every step's logits (fast decoder or transformers'
    modules, native kernel or the torch reference) within 2% (relative norm) of the same
    step with a float32 cache: K/V lose mantissa bits, nothing else changes."""
    model = make_tiny_model(arch)
    prompts = random_prompts(5, 3, 30, seed=7)
    params = SamplingParams(max_new_tokens=6, ignore_eos=True)

    def run(kv_cache_dtype):
        config = EngineConfig(
            max_batch_tokens=24,
            block_size=4,
            kv_cache_dtype=kv_cache_dtype,
            use_native_kernels=native,
        )
        logits = []
        with EngineCore(model, config) as engine:
            runner = engine.executor.runner
            forward = runner._forward  # the path the executor chose

            def record(batch):
                out = forward(batch)
                logits.append(out.clone())
                return out

            runner.fast_forward = record
            for prompt in prompts:
                engine.add_request(prompt, params)
            results = run_until_done(engine)
            return engine.executor.cache, logits, results

    cache16, logits16, results16 = run(torch.bfloat16)
    cache32, logits32, results32 = run(None)
    assert {t.dtype for t in cache16.block_tensors} == {torch.bfloat16}
    assert cache16.bytes_per_block * 2 == cache32.bytes_per_block
    assert len(logits16) == len(logits32)
    for got, want in zip(logits16, logits32, strict=True):
        assert float((got - want).norm() / want.norm()) < 0.02
    assert all(len(r.token_ids) == 6 for r in results16.values())

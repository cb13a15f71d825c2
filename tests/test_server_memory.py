"""What ``cbgen serve`` does to keep its memory flat: the KV cache resident from the start,
oneDNN's primitive cache capped, the heap trimmed when the engine goes idle."""

from __future__ import annotations

import os

import pytest
from conftest import make_tiny_model, run_until_done

import cbgen
from cbgen.frontends.server.native_memory import (
    DEFAULT_PRIMITIVE_CACHE,
    HeapTrimmer,
    bound_native_memory,
)
from cbgen.sysmem import proc_status_kib


def test_the_kv_cache_is_resident_once_committed():
    engine = cbgen.EngineCore(make_tiny_model("llama"), cbgen.EngineConfig(num_blocks=16384))
    try:
        cache = engine.executor.cache
        size = sum(t.numel() * t.element_size() for t in cache.block_tensors)
        assert size > 64 << 20  # large enough to see in RSS
        before = proc_status_kib("VmRSS")
        written = engine.commit_cache_memory()
        after = proc_status_kib("VmRSS")
        assert written == size
        assert (after - before) * 1024 > 0.9 * size  # the pages are in memory now
        assert all(not t.any() for t in cache.block_tensors)  # still zero: nothing changed
        engine.add_request([1, 2, 3], cbgen.SamplingParams(max_new_tokens=3), "r")
        assert len(run_until_done(engine)["r"].token_ids) == 3
    finally:
        engine.close()


def test_the_primitive_cache_is_capped_unless_the_user_set_it(monkeypatch):
    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    assert bound_native_memory()["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == DEFAULT_PRIMITIVE_CACHE
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == str(DEFAULT_PRIMITIVE_CACHE)
    monkeypatch.setenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "7")
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in bound_native_memory()
    assert os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "7"


def test_the_heap_is_trimmed_when_the_engine_goes_idle_or_has_run_long():
    state = {"busy": False}
    trimmer = HeapTrimmer(lambda: state["busy"], interval=1.0, every=3.0)
    busy = trimmer.check(False)
    assert trimmer.trims == 0  # idle all along: nothing freed since
    state["busy"] = True
    busy = trimmer.check(busy)
    busy = trimmer.check(busy)
    assert trimmer.trims == 0
    busy = trimmer.check(busy)  # three seconds of constant load
    assert trimmer.trims == 1
    state["busy"] = False
    busy = trimmer.check(busy)  # gone idle
    assert trimmer.trims == 2
    trimmer.check(busy)
    assert trimmer.trims == 2
    with pytest.raises(ValueError):
        HeapTrimmer(lambda: False, interval=0)

"""The native paged decode kernel agrees with the pure-torch path.

Caches are random and block tables scattered, with context lengths that end
mid-block and past whole SIMD chunks, so the kernel's partial-chunk, tail and
window paths all run. ``check_kernel`` takes the module so that builds with other
compiler flags (AVX2 only, no SIMD) can be checked the same way by hand.
"""

from __future__ import annotations

import os
import platform
import shutil
from pathlib import Path
from types import ModuleType

import pytest
import torch
from conftest import make_tiny_model, random_prompts, reference_greedy

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.cache.groups import LayerSpec
from cbgen.cache.paged_cache import PagedKVCache
from cbgen.executor.attention_hook import GroupTables, _decode_attention
from cbgen.executor.cpu import kernels
from cbgen.executor.cpu.kernels import compile_flags, decode_kernel, machine_key

kernel = decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="native kernel could not be built")


@pytest.mark.skipif(
    platform.system() != "Linux" or platform.machine() not in ("x86_64", "AMD64"),
    reason="the kernels are only required where CI runs (x86-64 Linux)",
)
def test_the_native_kernels_build_where_ci_runs():
    """On x86-64 Linux a failed build is a failure, not ~115 kernel tests quietly skipped."""
    assert os.environ.get(kernels.DISABLE_ENV) != "1", f"{kernels.DISABLE_ENV}=1 is set"
    assert kernel is not None, f"the native kernels did not build: {kernels.build_error}"


def check_kernel(
    module: ModuleType,
    dtype: torch.dtype,
    heads: int,
    kv_heads: int,
    window: int | None,
    softcap: float | None,
    lens: list[int],
    block_size: int = 4,
    dim: int = 16,
    value_dim: int | None = None,
    seed: int = 0,
    sinks: bool = False,
) -> None:
    """Run the kernel and ``_decode_attention`` on one random paged cache and compare
    (``sinks``: with a random attention-sink logit per head, as GPT-OSS has)."""
    torch.manual_seed(seed)
    value_dim = value_dim or dim
    needed = sum(-(-n // block_size) for n in lens)
    num_blocks = needed + 3
    cache = PagedKVCache(
        [LayerSpec(kv_heads, dim, value_dim, dtype)], num_blocks, block_size, torch.device("cpu")
    )
    cache.keys[0].normal_()
    cache.values[0].normal_()
    perm = torch.randperm(num_blocks).tolist()
    tables, start = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(perm[start : start + count])
        start += count
    width = max(map(len, tables))
    # Padding entries point at a real block, as a stale table would: never read.
    padded = torch.tensor([t + [perm[-1]] * (width - len(t)) for t in tables])
    context = torch.tensor(lens)
    positions = torch.arange(width * block_size)
    padding = torch.zeros(len(lens), width * block_size)
    padding.masked_fill_(positions >= context.unsqueeze(1), float("-inf"))
    meta = GroupTables(
        slot_mapping=torch.empty(0, dtype=torch.long),
        decode_block_tables=padded,
        decode_context_lens=context,
        decode_padding_mask=padding.view(1, len(lens), 1, -1),
    )
    scale = dim**-0.5
    q = torch.randn(heads, len(lens), dim).to(dtype)
    sink = torch.randn(heads) * 2 if sinks else None
    expected = _decode_attention(
        q, cache.keys[0], cache.values[0], meta, scale, window, softcap, sink
    )
    got = module.paged_decode_attention(
        q.transpose(0, 1).contiguous(),
        cache.keys[0],
        cache.values[0],
        padded,
        context,
        scale,
        window or 0,
        softcap or 0.0,
        sink,
    )
    assert got.dtype == dtype and got.shape == (len(lens), heads, value_dim)
    # float32: the same sums in another order. bfloat16: both sides round the
    # output to bfloat16 (8 bits), and the torch path also rounds probabilities.
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.transpose(0, 1).float(), expected.float(), atol=tol, rtol=tol)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "window", "softcap"),
    [
        (4, 2, None, None),
        (6, 1, None, None),
        (4, 4, 5, None),  # GQA ratio 1, window cutting into a block
        (9, 3, None, None),  # SmolLM2's ratio 3
        (16, 2, None, None),  # ratio 8
        (9, 3, 21, None),  # window longer than some contexts
        (4, 2, None, 3.0),
    ],
)
@pytest.mark.parametrize("dim", [16, 64, 40])  # one SIMD chunk, several, a scalar tail
def test_kernel_matches_torch_decode(dtype, heads, kv_heads, window, softcap, dim):
    lens = [1, 7, 13, 4, 16, 17, 33, 70]
    check_kernel(kernel, dtype, heads, kv_heads, window, softcap, lens, dim=dim)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "kv_heads", "window"), [(4, 2, None), (8, 1, 5), (6, 6, None)])
@pytest.mark.parametrize("dim", [16, 40])
def test_kernel_attention_sinks_match_torch(dtype, heads, kv_heads, window, dim):
    # One more logit per head in every softmax (GPT-OSS's s_aux), windows included.
    lens = [1, 7, 13, 33, 70]
    check_kernel(kernel, dtype, heads, kv_heads, window, None, lens, dim=dim, sinks=True)


@needs_kernel
def test_kernel_sinks_must_be_one_float32_logit_per_head():
    query = torch.randn(1, 4, 16)
    cache = torch.randn(2, 2, 4, 16)
    args = (query, cache, cache, torch.tensor([[0, 1]]), torch.tensor([5]), 0.25, 0, 0.0)
    with pytest.raises(RuntimeError, match="one logit per head"):
        kernel.paged_decode_attention(*args, torch.zeros(3))
    with pytest.raises(RuntimeError, match="one logit per head"):
        kernel.paged_decode_attention(*args, torch.zeros(4, dtype=torch.float64))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 128])  # two and eight SIMD chunks a row
@pytest.mark.parametrize(("heads", "kv_heads"), [(9, 3), (16, 2), (7, 7)])
def test_kernel_value_pass_register_blocks(dtype, heads, kv_heads, dim):
    # The value pass keeps up to 16 accumulators in registers: heads per KV head are
    # taken four (dim 32), or two (dim 128), at a time, with a shorter last chunk. In
    # bfloat16 (AVX512-BF16) dims 32, 64 and 128 take the dot-product path, whose sums
    # hold even and odd columns apart: up to four heads at a time at dim 32, two at 128.
    lens = [1, 15, 16, 17, 48, 90]
    check_kernel(kernel, dtype, heads, kv_heads, None, None, lens, dim=dim)


def _blocks_in_a_row(lens: list[int], block: int, width: int) -> list[list[int]]:
    """Block tables for sequences of ``lens`` tokens whose blocks follow one another
    (sequence after sequence), each row padded to ``width`` with block 0."""
    tables, start = [], 0
    for n in lens:
        count = -(-n // block)
        tables.append(list(range(start, start + count)) + [0] * (width - count))
        start += count
    return tables


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "window", "sinks"),
    [(9, 3, None, False), (4, 1, None, True), (16, 2, 20, False), (6, 6, None, True)],
)
def test_kernel_gives_the_same_bits_however_the_heads_are_shared_out(
    dtype, heads, kv_heads, window, sinks
):
    """The kernel splits its work by query head among the threads (one stream of
    SmolLM2's 3 KV heads on two threads, a single KV head on several), so a KV head's
    query heads may be split between threads: every thread count, and each sequence
    alone, gives the same bits."""
    torch.manual_seed(5)
    block, lens, dim = 16, [3, 40, 129, 70], 64
    blocks = sum(-(-n // block) for n in lens)
    keys = torch.randn(kv_heads, blocks, block, dim).to(dtype)
    values = torch.randn(kv_heads, blocks, block, dim).to(dtype)
    q = torch.randn(len(lens), heads, dim).to(dtype)
    sink = torch.randn(heads) if sinks else None
    table, context = torch.tensor(_blocks_in_a_row(lens, block, 9)), torch.tensor(lens)

    def attend(rows: slice) -> torch.Tensor:
        return kernel.paged_decode_attention(
            q[rows], keys, values, table[rows], context[rows], dim**-0.5, window or 0, 0.0, sink
        )

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        want = attend(slice(None))
        for shared_by in (2, 3, 5, 7):
            torch.set_num_threads(shared_by)
            assert torch.equal(attend(slice(None)), want), shared_by
            for row in range(len(lens)):
                alone = attend(slice(row, row + 1))
                assert torch.equal(alone, want[row : row + 1]), (shared_by, row)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
@pytest.mark.parametrize("dim", [32, 64, 128])
def test_kernel_bfloat16_is_as_close_to_float32_as_the_float_path(dim):
    # Scores from bfloat16 products (exact in float32), probabilities and sums in
    # float32: against attention in float64 on the same bfloat16 inputs, the error is
    # the output's own bfloat16 rounding, a few parts in a thousand at most.
    torch.manual_seed(3)
    heads, kv_heads, block, lens = 8, 2, 16, [5, 33, 100]
    blocks = sum(-(-n // block) for n in lens)
    keys = torch.randn(kv_heads, blocks, block, dim).to(torch.bfloat16)
    values = torch.randn(kv_heads, blocks, block, dim).to(torch.bfloat16)
    q = torch.randn(len(lens), heads, dim).to(torch.bfloat16)
    tables = _blocks_in_a_row(lens, block, 8)
    got = kernel.paged_decode_attention(
        q, keys, values, torch.tensor(tables), torch.tensor(lens), dim**-0.5, 0, 0.0, None
    )
    for s, n in enumerate(lens):
        k = keys[:, tables[s]].flatten(1, 2)[:, :n].double()
        v = values[:, tables[s]].flatten(1, 2)[:, :n].double()
        qs = q[s].double().view(kv_heads, heads // kv_heads, dim)
        want = (torch.softmax(qs @ k.transpose(1, 2) * dim**-0.5, -1) @ v).reshape(heads, dim)
        err = (got[s].double() - want).abs() / want.abs().clamp_min(1e-2)
        assert err.max() < 8e-3


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_long_contexts_real_block_size(dtype):
    # SmolLM2's geometry with the engine's 16-token blocks, a few hundred tokens.
    lens = [31, 129, 250, 401, 17, 600]
    check_kernel(kernel, dtype, 9, 3, None, None, lens, block_size=16, dim=64, seed=1)


@needs_kernel
def test_kernel_value_dim_differs_from_key_dim():
    check_kernel(kernel, torch.float32, 4, 2, None, None, [5, 23, 40], dim=32, value_dim=48)


@needs_kernel
def test_kernel_float16_and_float64_fall_back_to_scalar_loops():
    for dtype in (torch.float16, torch.float64):
        torch.manual_seed(0)
        q = torch.randn(2, 4, 16, dtype=dtype)
        keys = torch.randn(2, 8, 4, 16, dtype=dtype)
        values = torch.randn(2, 8, 4, 16, dtype=dtype)
        tables = torch.tensor([[3, 1, 0], [5, 6, 0]])
        lens = torch.tensor([9, 6])
        got = kernel.paged_decode_attention(q, keys, values, tables, lens, 0.25, 0, 0.0)
        for s in range(2):
            k = keys[:, tables[s]].flatten(1, 2)[:, : lens[s]].float()  # [kv, ctx, dim]
            v = values[:, tables[s]].flatten(1, 2)[:, : lens[s]].float()
            qs = q[s].float().view(2, 2, 16)  # [kv, group, dim]
            probs = torch.softmax(qs @ k.transpose(1, 2) * 0.25, dim=-1)
            want = (probs @ v).reshape(4, 16)
            torch.testing.assert_close(got[s].float(), want, atol=2e-3, rtol=2e-3)


def test_build_is_keyed_by_machine():
    key = machine_key()
    assert len(key) == 16 and key == machine_key()
    if platform.machine().lower() in ("x86_64", "amd64"):
        assert "-march=native" in compile_flags()


def test_build_is_keyed_by_where_the_sources_are(tmp_path):
    """torch's ``load`` rebuilds when the source paths differ, even for the same bytes: a
    second checkout sharing the cache gets a folder of its own instead of rebuilding the
    first one's in turn."""
    here = Path(kernels.__file__).parent
    for name in kernels.SOURCES + kernels.HEADERS:
        shutil.copy(here / name, tmp_path / name)
    copied = machine_key(tmp_path)
    assert copied != machine_key() and copied == machine_key(tmp_path)
    with open(tmp_path / kernels.SOURCES[0], "a") as source:
        source.write("// edited\n")
    assert machine_key(tmp_path) != copied


@needs_kernel
def test_kernel_rejects_tables_outside_the_cache():
    """The kernel reads through the block tables without bounds checks in its loops,
    so it checks every block a sequence reads (and each length) before it starts."""
    cache = torch.zeros(2, 4, 4, 16)  # [kv_heads, blocks, block_size, dim]
    query = torch.zeros(1, 4, 16)
    lens = torch.tensor([6])
    scale = 0.25
    ok = torch.tensor([[3, 1]])
    assert kernel.paged_decode_attention(query, cache, cache, ok, lens, scale, 0, 0.0).shape == (
        1,
        4,
        16,
    )
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.paged_decode_attention(
            query, cache, cache, torch.tensor([[3, 4]]), lens, scale, 0, 0.0
        )
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernel.paged_decode_attention(
            query, cache, cache, torch.tensor([[-1, 0]]), lens, scale, 0, 0.0
        )
    with pytest.raises(RuntimeError, match="does not fit"):
        kernel.paged_decode_attention(query, cache, cache, ok, torch.tensor([9]), scale, 0, 0.0)
    # A window that starts past a bad block never reads it.
    windowed = torch.tensor([[99, 2]])
    kernel.paged_decode_attention(query, cache, cache, windowed, lens, scale, 2, 0.0)


@needs_kernel
@pytest.mark.parametrize("arch", ["llama", "phi3"])  # the fast path, and transformers' forward
def test_prefill_rows_attend_through_the_kernel_exactly(monkeypatch, arch):
    # Chunked prefill into a 24-token budget: fresh chunks, continued chunks reading
    # cached blocks, and mixed steps with decode rows; a shared prefix adds cached blocks.
    model = make_tiny_model(arch)
    prefix = random_prompts(1, 9, 9, seed=12)[0]
    prompts = [prefix + p for p in random_prompts(5, 3, 40, seed=11)]
    expected = [reference_greedy(model, p, 6) for p in prompts]

    def no_sdpa(*args, **kwargs):
        raise AssertionError("a prefill span went to SDPA")

    config = EngineConfig(block_size=4, max_batch_tokens=24)
    steps_with_row_tables = 0
    with EngineCore(model, config) as engine:
        # (after the engine's probe forward, which attends through SDPA)
        monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", no_sdpa)
        build = engine.executor.batch_builder.build

        def counting_build(scheduled):
            nonlocal steps_with_row_tables
            batch = build(scheduled)
            (group,) = batch.attention.groups
            tables = group.row_block_tables
            if tables is not None:
                steps_with_row_tables += 1
                assert tables.shape[0] == batch.input_ids.shape[1]
                assert torch.equal(group.row_context_lens, batch.position_ids[0] + 1)
            return batch

        engine.executor.batch_builder.build = counting_build
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, SamplingParams(max_new_tokens=6), str(i))
        outputs = {}
        while engine.has_unfinished():
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert steps_with_row_tables > 2
    assert [outputs[str(i)] for i in range(len(prompts))] == expected


def test_a_build_lock_left_by_a_killed_build_is_removed():
    """torch's ``lock`` file of a build that was killed made every later load wait forever
    (a server killed during its first start never started again)."""
    import subprocess
    import sys

    from cbgen.models.loader import cache_dir

    if decode_kernel() is None:
        pytest.skip("no native kernels on this machine")
    stale = cache_dir() / "kernels" / machine_key() / "lock"
    stale.write_text("")
    code = "from cbgen.executor.cpu.kernels import _build; _build(); print('loaded')"
    # The bound only keeps a regression from hanging the suite: a load takes seconds.
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "loaded" in done.stdout, done.stderr[-2000:]
    assert not stale.exists()

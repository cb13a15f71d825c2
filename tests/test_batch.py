"""The batch builder: one scheduler decision packed into the flat tensors of a step."""

from __future__ import annotations

import torch

from cbgen import SamplingParams
from cbgen.cache.groups import LayerSpec
from cbgen.cache.paged_cache import PagedKVCache
from cbgen.executor.attention import NativeCpuAttention
from cbgen.executor.batch import BatchBuilder
from cbgen.executor.native import NativeKernels
from cbgen.requests.request import Request
from cbgen.requests.scheduler_output import ScheduledRequest, SchedulerOutput

BS = 4


def _builder(attention=None):
    layers = [LayerSpec(2, 8, 8, torch.float32)]
    cache = PagedKVCache(layers, num_blocks=16, block_size=BS, device=torch.device("cpu"))
    return BatchBuilder(cache, {0: 0}, attention)


_BLOCKS: dict[int, list[int]] = {}


def _request(rid, tokens, computed, blocks):
    request = Request(rid, list(tokens), SamplingParams(), arrival_order=0)
    request.num_computed_tokens = computed
    _BLOCKS[id(request)] = list(blocks)
    return request


def _chunk(request, num_tokens):
    """The scheduler's value for ``num_tokens`` tokens of ``request`` from its computed ones."""
    start = request.num_computed_tokens
    end = start + num_tokens
    carry = None
    if request.pending_index is not None and start <= request.pending_index < end:
        carry = (request.pending_index - start, request.pending_row)
    return ScheduledRequest(
        request.request_id,
        request.token_ids[start:end],
        start,
        [_BLOCKS[id(request)][: -(-end // BS)]],
        sample=end == request.num_tokens,
        params=request.params,
        carry=carry,
    )


def test_a_mixed_step_packs_decodes_and_prefill_chunks():
    # a: decoding its 7th token (6 computed) in blocks 3, 5; b: first chunk of 5 of its 9
    # prompt tokens in blocks 8, 9; c: the last 2 tokens of its 6-token prompt, 4 computed
    a = _request("a", range(10, 17), 6, [3, 5])
    b = _request("b", range(20, 29), 0, [8, 9])
    c = _request("c", range(30, 36), 4, [1, 2])
    scheduled = SchedulerOutput(scheduled=[_chunk(a, 1), _chunk(b, 5), _chunk(c, 2)])
    batch = _builder().build(scheduled)
    assert batch.input_ids.tolist() == [[16, 20, 21, 22, 23, 24, 34, 35]]
    assert batch.position_ids.tolist() == [[6, 0, 1, 2, 3, 4, 4, 5]]
    # only chunks that reach their request's last token are sampled: a and c
    assert batch.logits_indices.tolist() == [0, 7]
    assert [chunk.request_id for chunk in batch.sampled] == ["a", "c"]
    meta = batch.attention
    tables = meta.groups[0]  # one cache group
    assert meta.tables(0) is tables
    # slot = block * block_size + offset, position by position
    assert tables.slot_mapping.tolist() == [5 * BS + 2, 32, 33, 34, 35, 36, 2 * BS + 0, 2 * BS + 1]
    assert meta.decode_rows.tolist() == [0] and not meta.decode_only
    assert tables.decode_block_tables.tolist() == [[3, 5]]
    assert tables.decode_context_lens.tolist() == [7]
    # without the kernel, a decode row's padding mask hides keys past its context
    mask = tables.decode_padding_mask.view(-1)
    assert torch.isinf(mask[7:]).all() and (mask[:7] == 0).all()
    spans = [(s.q_start, s.q_len, s.context_len) for s in meta.prefills]
    assert spans == [(1, 5, 5), (6, 2, 6)]
    assert meta.prefills[0].mask is None  # a fresh chunk attends its own keys causally
    assert meta.prefills[1].mask.tolist() == [[True] * 5 + [False], [True] * 6]
    (fresh, k0), (cached, k1) = tables.prefill_blocks
    assert tables.row_block_tables is None  # the torch reference reads no per-row tables
    assert fresh is None and cached.tolist() == [1, 2] and (k0, k1) == (0, 0)


def test_a_decode_only_step_with_the_kernel_needs_no_mask():
    a = _request("a", range(10, 15), 4, [3, 5])
    b = _request("b", range(20, 22), 1, [7])
    batch = _builder(NativeCpuAttention(NativeKernels())).build(
        SchedulerOutput(scheduled=[_chunk(a, 1), _chunk(b, 1)])
    )
    meta = batch.attention
    tables = meta.groups[0]
    assert meta.decode_only and meta.prefills == []
    assert tables.decode_block_tables.tolist() == [[3, 5], [7, 0]]  # padded with block 0
    assert tables.decode_context_lens.tolist() == [5, 2]
    assert tables.decode_padding_mask is None  # the kernel stops at each context length
    assert tables.row_block_tables is None  # decode rows read the decode tables
    assert batch.logits_indices.tolist() == [0, 1]


def test_a_placeholder_token_is_carried_from_the_previous_step():
    a = _request("a", [10, 11, 0], 2, [3])  # the last token is still being sampled
    a.pending_index, a.pending_row = 2, 4
    batch = _builder().build(SchedulerOutput(scheduled=[_chunk(a, 1)]))
    assert batch.carry_rows.tolist() == [0] and batch.carry_sources.tolist() == [4]

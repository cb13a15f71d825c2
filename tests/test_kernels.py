"""The native paged decode kernel agrees with the pure-torch path."""

from __future__ import annotations

import pytest
import torch

from cbgen.attention import AttentionMetadata, _decode_attention
from cbgen.cache.paged_cache import LayerSpec, PagedKVCache
from cbgen.kernels import decode_kernel

kernel = decode_kernel()
pytestmark = pytest.mark.skipif(kernel is None, reason="native kernel could not be built")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("heads", "kv_heads", "window", "softcap"),
    [(4, 2, None, None), (6, 1, None, None), (4, 4, 5, None), (4, 2, None, 3.0)],
)
def test_kernel_matches_torch_decode(dtype, heads, kv_heads, window, softcap):
    torch.manual_seed(0)
    block_size, dim = 4, 16
    cache = PagedKVCache(
        [LayerSpec(kv_heads, dim, dim, dtype)], 32, block_size, torch.device("cpu")
    )
    cache.keys[0].normal_()
    cache.values[0].normal_()
    lens = [1, 7, 13, 4]
    perm = torch.randperm(32).tolist()
    tables, start = [], 0
    for n in lens:
        count = -(-n // block_size)
        tables.append(perm[start : start + count])
        start += count
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    context = torch.tensor(lens)
    positions = torch.arange(width * block_size)
    padding = torch.zeros(len(lens), width * block_size)
    padding.masked_fill_(positions >= context.unsqueeze(1), float("-inf"))
    meta = AttentionMetadata(
        cache=cache,
        layer_of_module={},
        slot_mapping=torch.empty(0, dtype=torch.long),
        decode_block_tables=padded,
        decode_context_lens=context,
        decode_padding_mask=padding.view(1, len(lens), 1, -1),
    )
    q = torch.randn(heads, len(lens), dim).to(dtype)
    expected = _decode_attention(q, cache.keys[0], cache.values[0], meta, 0.25, window, softcap)
    got = kernel.paged_decode_attention(
        q.transpose(0, 1).contiguous(),
        cache.keys[0],
        cache.values[0],
        padded,
        context,
        0.25,
        window or 0,
        softcap or 0.0,
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.transpose(0, 1).float(), expected.float(), atol=tol, rtol=tol)

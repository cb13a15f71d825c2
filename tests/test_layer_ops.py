"""The fused layer ops (``cbgen/executor/cpu/kernels/layer_ops.cpp``) against transformers' own formulas."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

from cbgen.executor.cpu.kernels import decode_kernel

kernels = decode_kernel()
pytestmark = pytest.mark.skipif(kernels is None, reason="native kernels could not be built")


def reference_rope(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' apply_rotary_pos_emb on a fused q/k/v: the rotated queries
    ``[tokens, heads, dim]`` and keys ``[tokens, kv_heads, dim]``."""
    tokens, dim = qkv.shape[0], cos.shape[-1]
    q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    q, k = apply_rotary_pos_emb(
        q, k.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)
    )
    return q[0].transpose(0, 1), k[0].transpose(0, 1)


@pytest.mark.parametrize(("tokens", "heads", "kv_heads", "dim"), [(1, 9, 3, 64), (37, 4, 2, 16)])
def test_rope_qkv_is_bitwise_apply_rotary_pos_emb(tokens, heads, kv_heads, dim):
    torch.manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 4
    cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
    q_ref, k_ref = reference_rope(qkv, cos, sin, heads, kv_heads)
    fused = qkv.clone()
    q = kernels.rope_qkv(fused, cos, sin, heads, kv_heads)
    assert q.shape == (tokens, heads, dim) and q.is_contiguous()
    assert torch.equal(q, q_ref)
    k = fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    assert torch.equal(k, k_ref)  # keys rotated in place
    v_cols = slice((heads + kv_heads) * dim, None)
    assert torch.equal(fused[:, v_cols], qkv[:, v_cols])  # values untouched


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("dim", "rotary"), [(16, 8), (64, 48), (32, 2)])
def test_rope_qkv_on_part_of_each_head_is_bitwise_phi3s(dtype, dim, rotary):
    """A rotary embedding narrower than the head (Phi-4-mini: 3/4 of it) turns the
    first ``rotary`` of each head's dims and passes the rest, as Phi-3's
    apply_rotary_pos_emb does; the keys and values reach the cache the same way."""
    from transformers.models.phi3.modeling_phi3 import apply_rotary_pos_emb as phi3_rope

    torch.manual_seed(dim + rotary)
    tokens, heads, kv_heads = 5, 4, 2
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 4).to(dtype)
    cos, sin = torch.randn(tokens, rotary), torch.randn(tokens, rotary)
    q = qkv[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    # In float32, then rounded once: the kernel's arithmetic for bfloat16 rows.
    q_ref, k_ref = phi3_rope(
        q.float(), k.transpose(0, 1).unsqueeze(0).float(), cos.unsqueeze(0), sin.unsqueeze(0)
    )
    q_ref, k_ref = q_ref[0].transpose(0, 1).to(dtype), k_ref[0].transpose(0, 1).to(dtype)
    blocks, block_size = 3, 4
    keys = torch.zeros(kv_heads, blocks, block_size, dim, dtype=dtype)
    values = torch.zeros_like(keys)
    slots = torch.tensor([7, 0, 11, 3, 5])
    fused = qkv.clone()
    got = kernels.rope_qkv(fused, cos, sin, heads, kv_heads, keys, values, slots, head_dim=dim)
    assert torch.equal(got, q_ref)
    passed = qkv[:, : heads * dim].view(tokens, heads, dim)[..., rotary:]
    assert torch.equal(got[..., rotary:], passed)
    k_got = fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    assert torch.equal(k_got, k_ref)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    flat_keys, flat_values = keys.view(kv_heads, -1, dim), values.view(kv_heads, -1, dim)
    assert torch.equal(flat_keys[:, slots].transpose(0, 1), k_ref)
    assert torch.equal(flat_values[:, slots].transpose(0, 1), v)
    with pytest.raises(RuntimeError, match="even width up to head_dim"):
        kernels.rope_qkv(qkv.clone(), cos, sin, heads, kv_heads, head_dim=rotary // 2)


@pytest.mark.parametrize("rows", [1, 64, 300])
@pytest.mark.parametrize("with_delta", [False, True])
def test_add_rms_norm_matches_llama_rms_norm(rows, with_delta):
    torch.manual_seed(rows)
    norm = LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576)
    residual, delta = torch.randn(rows, 576) * 3, torch.randn(rows, 576)
    expected_residual = residual + delta if with_delta else residual.clone()
    with torch.no_grad():
        expected = norm(expected_residual)
    out = kernels.add_rms_norm(residual, delta if with_delta else None, norm.weight.data, 1e-5)
    assert torch.equal(residual, expected_residual)  # the residual add happens in place
    # Only the variance's sum runs in another order: a few ulps at most.
    torch.testing.assert_close(out, expected, rtol=4e-7, atol=1e-6)


def test_bad_inputs_raise_instead_of_reading_out_of_bounds():
    x = torch.randn(4, 32)
    with pytest.raises(RuntimeError, match="weight"):
        kernels.add_rms_norm(x, None, torch.ones(16), 1e-6)
    with pytest.raises(RuntimeError, match="float32"):
        kernels.add_rms_norm(x.double(), None, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="residual must be float32"):
        kernels.add_rms_norm(x.bfloat16(), None, torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="delta"):
        kernels.add_rms_norm(x, torch.randn(3, 32), torch.ones(32), 1e-6)
    with pytest.raises(RuntimeError, match="qkv width"):
        kernels.rope_qkv(torch.randn(4, 100), torch.randn(4, 16), torch.randn(4, 16), 2, 1)


def test_rope_qkv_stores_keys_and_values_where_the_cache_write_would():
    from cbgen.cache.groups import LayerSpec
    from cbgen.cache.paged_cache import PagedKVCache

    torch.manual_seed(1)
    tokens, heads, kv_heads, dim = 5, 4, 2, 8
    spec = LayerSpec(kv_heads, dim, dim, torch.float32)
    fused_cache = PagedKVCache([spec], num_blocks=6, block_size=4, device=torch.device("cpu"))
    written_cache = PagedKVCache([spec], num_blocks=6, block_size=4, device=torch.device("cpu"))
    slots = torch.tensor([3, 9, 10, 22, 0])
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim)
    cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
    q = kernels.rope_qkv(
        qkv, cos, sin, heads, kv_heads, fused_cache.keys[0], fused_cache.values[0], slots
    )
    k = qkv[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    v = qkv[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    written_cache.write(0, slots, k.transpose(0, 1), v.transpose(0, 1))
    assert torch.equal(fused_cache.keys[0], written_cache.keys[0])
    assert torch.equal(fused_cache.values[0], written_cache.values[0])
    assert q.shape == (tokens, heads, dim)
    with pytest.raises(RuntimeError, match="outside the cache"):
        kernels.rope_qkv(
            qkv,
            cos,
            sin,
            heads,
            kv_heads,
            fused_cache.keys[0],
            fused_cache.values[0],
            torch.tensor([0, 1, 2, 3, 24]),
        )


# -- the bfloat16 fast path: bfloat16 GEMM inputs/outputs and caches, float32 arithmetic ----

BF16_ULP = 2**-8  # bfloat16 keeps 8 significant bits: one rounding is within this, relative


@pytest.mark.parametrize("weight_dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_bfloat16_delta_and_output(weight_dtype):
    """A bfloat16 delta is widened and added to the float32 residual; the result is the
    float32 norm rounded once to bfloat16."""
    torch.manual_seed(5)
    residual = torch.randn(64, 576) * 3
    delta = torch.randn(64, 576).to(torch.bfloat16)
    weight = torch.randn(576).to(weight_dtype)
    expected_residual = residual + delta.float()
    w = weight.float()
    variance = expected_residual.pow(2).mean(-1, keepdim=True)
    expected = w * (expected_residual * torch.rsqrt(variance + 1e-5))
    out = kernels.add_rms_norm(residual, delta, weight, 1e-5, torch.bfloat16)
    assert out.dtype == torch.bfloat16 and residual.dtype == torch.float32
    assert torch.equal(residual, expected_residual)
    torch.testing.assert_close(out.float(), expected, rtol=BF16_ULP, atol=1e-6)


@pytest.mark.parametrize(
    ("qkv_dtype", "cache_dtype"),
    [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)],
)
def test_rope_qkv_bfloat16(qkv_dtype, cache_dtype):
    """Rotation in float32, rounded once: queries come back in the cache's dtype and the
    cache holds the rotated keys and the values, each within one bfloat16 rounding."""
    from cbgen.cache.groups import LayerSpec
    from cbgen.cache.paged_cache import PagedKVCache

    torch.manual_seed(2)
    tokens, heads, kv_heads, dim = 7, 4, 2, 16
    cache = PagedKVCache(
        [LayerSpec(kv_heads, dim, dim, cache_dtype)], 4, 4, device=torch.device("cpu")
    )
    slots = torch.tensor([0, 5, 6, 7, 8, 12, 15])
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 4).to(qkv_dtype)
    cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
    wide = qkv.float()
    q_ref = wide[:, : heads * dim].view(tokens, heads, dim).transpose(0, 1).unsqueeze(0)
    k_ref = wide[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    q_ref, k_ref = apply_rotary_pos_emb(
        q_ref, k_ref.transpose(0, 1).unsqueeze(0), cos.unsqueeze(0), sin.unsqueeze(0)
    )
    q = kernels.rope_qkv(qkv, cos, sin, heads, kv_heads, cache.keys[0], cache.values[0], slots)
    assert q.dtype == cache_dtype
    torch.testing.assert_close(q.float(), q_ref[0].transpose(0, 1), rtol=BF16_ULP, atol=1e-6)
    stored_k = cache.keys[0].view(kv_heads, -1, dim)[:, slots].transpose(0, 1).float()
    stored_v = cache.values[0].view(kv_heads, -1, dim)[:, slots].transpose(0, 1).float()
    torch.testing.assert_close(stored_k, k_ref[0].transpose(0, 1), rtol=2 * BF16_ULP, atol=1e-6)
    v_ref = wide[:, (heads + kv_heads) * dim :].view(tokens, kv_heads, dim)
    torch.testing.assert_close(stored_v, v_ref, rtol=BF16_ULP, atol=0)


@pytest.mark.parametrize("dim", [32, 48, 64, 128])  # 48: one 16-wide vector and a tail
def test_rope_qkv_bfloat16_vectors_round_as_apply_rotary_pos_emb(dim):
    """bfloat16 in and out: the float32 rotation rounded once, to the bit (the vector
    path makes the same products and sums as the scalar one, and rounds as torch does)."""
    torch.manual_seed(dim)
    tokens, heads, kv_heads = 33, 9, 3  # 33 rows: two threads' shares and one more
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * dim) * 4).to(torch.bfloat16)
    cos, sin = torch.randn(tokens, dim), torch.randn(tokens, dim)
    q_ref, k_ref = reference_rope(qkv.float(), cos, sin, heads, kv_heads)
    fused = qkv.clone()
    q = kernels.rope_qkv(fused, cos, sin, heads, kv_heads)
    assert torch.equal(q, q_ref.to(torch.bfloat16))
    k = fused[:, heads * dim : (heads + kv_heads) * dim].view(tokens, kv_heads, dim)
    assert torch.equal(k, k_ref.to(torch.bfloat16))
    values = slice((heads + kv_heads) * dim, None)
    assert torch.equal(fused[:, values], qkv[:, values])


@pytest.mark.parametrize(("rows", "intermediate"), [(1, 1536), (64, 1536), (3, 40), (33, 17)])
def test_silu_mul_is_float32_silu_times_up_rounded_once(rows, intermediate):
    """silu(gate) * up in float32, rounded once to bfloat16: within one bfloat16 step of
    torch's float32 result (the exp is another float32 implementation's, so a value
    next to a rounding boundary may round the other way), and the same for large
    gates of either sign, where exp(-gate) overflows."""
    torch.manual_seed(rows)
    gate_up = (torch.randn(rows, 2 * intermediate) * 3).to(torch.bfloat16)
    gate_up[0, :4] = torch.tensor([100.0, -100.0, 0.0, -0.0])
    got = kernels.silu_mul(gate_up, intermediate)
    wide = gate_up.float()
    want = torch.nn.functional.silu(wide[:, :intermediate]) * wide[:, intermediate:]
    assert got.dtype == torch.bfloat16 and got.shape == (rows, intermediate)
    assert got.is_contiguous()
    torch.testing.assert_close(got.float(), want, rtol=BF16_ULP, atol=1e-30)
    same = (got == want.to(torch.bfloat16)).float().mean().item()
    assert same > 0.99  # nearly all round exactly as torch's float32 result does


def test_silu_mul_rounds_nan_and_denormals_as_torch():
    """The vector store's rounding at its edges, in every lane of a vector: a NaN gate
    gives the quiet NaN 0x7FC0 (as c10::BFloat16's scalar conversion makes it; torch's
    vectorized one keeps other bits), products below float32's normal range keep their
    denormal bfloat16 value (not flushed to zero), and a product past bfloat16's
    largest value rounds to infinity."""
    intermediate = 48  # a 16-wide vector, two 8-wide ones, no tail
    gate = torch.full((intermediate,), 1e-20)
    up = torch.full((intermediate,), 1e-20)
    gate[::3] = float("nan")
    gate[1::3], up[1::3] = 3e38, 1.5  # silu(g) = g: 4.5e38 is past bfloat16's 3.39e38
    gate_up = torch.cat([gate, up])[None].to(torch.bfloat16)
    got = kernels.silu_mul(gate_up, intermediate)[0]
    wide = gate_up.float()[0]
    want = (torch.nn.functional.silu(wide[:intermediate]) * wide[intermediate:]).to(torch.bfloat16)
    bits = got.view(torch.int16)
    assert (bits[::3] == 0x7FC0).all() and want[::3].isnan().all()
    assert torch.equal(bits[1::3], want[1::3].view(torch.int16))
    assert torch.equal(bits[2::3], want[2::3].view(torch.int16))
    assert got[1::3].isinf().all()
    assert (got[2::3] != 0).all() and (
        got[2::3].float().abs() < torch.finfo(torch.float32).tiny
    ).all()


def test_silu_mul_refuses_what_it_cannot_read():
    with pytest.raises(RuntimeError, match="bfloat16"):
        kernels.silu_mul(torch.randn(2, 8), 4)
    with pytest.raises(RuntimeError, match="2 \\* intermediate"):
        kernels.silu_mul(torch.randn(2, 8).to(torch.bfloat16), 3)
    with pytest.raises(RuntimeError, match="contiguous rows"):
        kernels.silu_mul(torch.randn(8, 2).to(torch.bfloat16).t(), 4)

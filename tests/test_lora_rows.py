"""The batched LoRA products (``cbgen.executor.lora``) against a per-row loop."""

from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from cbgen.executor.lora import LoraRows, MapLora, ModuleLora, lora_rows


@st.composite
def steps(draw):
    """Requests of a step as (row count, adapter slot or -1), and the slots' ranks."""
    num_slots = draw(st.integers(1, 4))
    requests = draw(
        st.lists(
            st.tuples(st.integers(1, 5), st.integers(-1, num_slots - 1)), min_size=1, max_size=8
        )
    )
    ranks = draw(st.lists(st.integers(0, 6), min_size=num_slots, max_size=num_slots))
    return num_slots, requests, ranks


@settings(max_examples=60, deadline=None)
@given(steps(), st.integers(0, 2**16))
def test_batched_products_equal_a_loop_per_row(step, seed):
    num_slots, requests, ranks = step
    generator = torch.Generator().manual_seed(seed)
    in_features, out_features = 7, 5
    module = ModuleLora("m", in_features, out_features, num_slots, torch.float64)
    weights = {}
    for slot, rank in enumerate(ranks):
        if rank == 0:
            continue  # a slot whose adapter does not target this module
        a = torch.randn(rank, in_features, generator=generator, dtype=torch.float64)
        b = torch.randn(out_features, rank, generator=generator, dtype=torch.float64)
        scale = float(slot + 1) / 2
        module.load(slot, a, b, scale)
        weights[slot] = (a, b, scale)
    segments, row_slots = [], []
    for count, slot in requests:
        segments.append((len(row_slots), count, slot))
        row_slots += [slot] * count
    rows = LoraRows.of(segments, len(row_slots), torch.device("cpu"))
    x = torch.randn(len(row_slots), in_features, generator=generator, dtype=torch.float64)
    base = torch.randn(len(row_slots), out_features, generator=generator, dtype=torch.float64)

    expected = base.clone()
    for row, slot in enumerate(row_slots):
        if slot in weights:
            a, b, scale = weights[slot]
            expected[row] += scale * (b @ (a @ x[row]))

    out = base.clone()
    with lora_rows(rows):
        MapLora([(slice(None), module)])(x, out)
    if rows is None:
        assert all(slot < 0 for slot in row_slots)
    torch.testing.assert_close(out, expected)


def test_fused_siblings_take_their_own_columns():
    q = ModuleLora("q", 3, 2, 2, torch.float64)
    v = ModuleLora("v", 3, 4, 2, torch.float64)
    a, b = torch.ones(1, 3, dtype=torch.float64), torch.ones(2, 1, dtype=torch.float64)
    q.load(1, a, b, 1.0)
    x = torch.ones(3, 3, dtype=torch.float64)
    out = torch.zeros(3, 6, dtype=torch.float64)
    rows = LoraRows.of([(0, 1, -1), (1, 2, 1)], 3, torch.device("cpu"))
    with lora_rows(rows):
        MapLora([(slice(0, 2), q), (slice(2, 6), v)])(x, out)
    assert out[0].tolist() == [0.0] * 6  # a base row
    assert out[1].tolist() == out[2].tolist() == [3.0, 3.0, 0.0, 0.0, 0.0, 0.0]


def test_outside_a_step_nothing_is_added():
    module = ModuleLora("m", 2, 2, 1, torch.float32)
    module.load(0, torch.ones(1, 2), torch.ones(2, 1), 1.0)
    out = torch.zeros(1, 2)
    MapLora([(slice(None), module)])(torch.ones(1, 2), out)
    assert out.tolist() == [[0.0, 0.0]]

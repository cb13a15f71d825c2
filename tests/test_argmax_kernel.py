"""The native ``argmax_rows`` gives exactly ``torch.argmax(logits, dim=-1)``."""

from __future__ import annotations

import pytest
import torch
from conftest import make_tiny_model, run_until_done

from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.executor.cpu.kernels import decode_kernel
from cbgen.requests.request import FinishReason
from cbgen.sampling.sampler import Sampler

kernel = decode_kernel()
needs_kernel = pytest.mark.skipif(kernel is None, reason="native kernel could not be built")


def _check(logits: torch.Tensor) -> None:
    assert torch.equal(kernel.argmax_rows(logits), torch.argmax(logits, dim=-1))


@needs_kernel
@pytest.mark.parametrize("vocab", [1, 15, 16, 17, 100, 49152])  # tails around the SIMD width
def test_random_rows(vocab):
    torch.manual_seed(vocab)
    _check(torch.randn(9, vocab))


@needs_kernel
def test_ties_take_the_first_maximum():
    logits = torch.zeros(4, 40)
    logits[0, [3, 20, 39]] = 5.0  # in the SIMD body, twice
    logits[1, [35, 38]] = 1.0  # in the scalar tail
    logits[2, [0, 1]] = -0.0  # -0.0 and +0.0 are equal: the first one wins
    logits[3] = float("-inf")  # all -inf: index 0
    _check(logits)
    assert kernel.argmax_rows(logits).tolist() == [3, 35, 0, 0]


@needs_kernel
def test_nan_wins_like_torch():
    logits = torch.randn(3, 50)
    logits[0, 7] = float("nan")
    logits[0, 30] = float("nan")
    logits[1, 49] = float("nan")  # in the tail
    logits[2, 10] = float("inf")
    _check(logits)


@needs_kernel
def test_non_contiguous_and_empty_batches():
    logits = torch.randn(50, 6).t()  # [6, 50], strided
    _check(logits)
    assert kernel.argmax_rows(torch.empty(0, 10)).shape == (0,)


@needs_kernel
def test_rejects_what_it_cannot_rank():
    with pytest.raises(RuntimeError, match="float32"):
        kernel.argmax_rows(torch.randn(2, 5, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="rows, vocab"):
        kernel.argmax_rows(torch.randn(5))
    with pytest.raises(RuntimeError, match="non-empty"):
        kernel.argmax_rows(torch.empty(2, 0))


@needs_kernel
def test_the_engine_samples_greedy_rows_with_it(llama):
    with EngineCore(llama, EngineConfig()) as engine:
        assert engine.executor.sampler._argmax is kernel.argmax_rows
    calls = []

    def counting(logits: torch.Tensor) -> torch.Tensor:
        calls.append(logits.shape)
        return kernel.argmax_rows(logits)

    sampler = Sampler(argmax=counting)
    logits = torch.randn(3, 30)
    params = [SamplingParams(), SamplingParams(temperature=0.8), SamplingParams()]
    out = sampler(logits, params, [None] * 3)
    assert calls == [(3, 30)]
    assert out.tokens[0] == logits[0].argmax() and out.tokens[2] == logits[2].argmax()
    assert len(calls) == 1


@needs_kernel
def test_a_bfloat16_engine_samples_float32_logits_with_it(llama):
    """The argmax is chosen once, by device (``cbgen.executor.greedy``): the sampler no
    longer checks each step's dtype, because the executor's logits are float32 whatever
    the model's dtype (the kernel would raise on others)."""
    model = make_tiny_model("llama").to(torch.bfloat16)
    with EngineCore(model, EngineConfig(num_blocks=64)) as engine:
        assert engine.executor.sampler._argmax is kernel.argmax_rows
        engine.add_request([5, 6, 7], SamplingParams(max_new_tokens=4, ignore_eos=True), "a")
        outputs = run_until_done(engine)
    assert len(outputs["a"].token_ids) == 4 and outputs["a"].finish_reason == FinishReason.LENGTH

"""Per-request logits processors: exact against ``model.generate(logits_processor=...)``,
and a processor that fails finishes only its own request, with ``"error"``."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompts, reference_greedy, run_until_done
from transformers import LogitsProcessor as HFLogitsProcessor
from transformers import LogitsProcessorList

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams
from cbgen.requests.request import FinishReason

CONFIG = EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=32)


def no_repeat(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Forbid the previous token: depends on the history, so it checks what is passed."""
    logits[token_ids[-1]] = float("-inf")
    return logits


def favour_successor(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """Push up the id after the previous token: changes the output whenever history is used."""
    logits[(token_ids[-1] + 1) % logits.shape[0]] += 5.0
    return logits


def ban_even(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    out = logits.clone()
    out[0::2] = float("-inf")
    return out


class _HFProcessor(HFLogitsProcessor):
    """The same rule, row by row, in transformers' batch form (the reference)."""

    def __init__(self, rules) -> None:
        self.rules = rules

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor):
        scores = scores.clone()
        for row in range(scores.shape[0]):
            history = input_ids[row].tolist()
            for rule in self.rules:
                scores[row] = rule(history, scores[row])
        return scores


def _reference(model, prompt, new_tokens, rules):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            logits_processor=LogitsProcessorList([_HFProcessor(rules)]),
        )
    return out[0, len(prompt) :].tolist()


def test_processors_match_generate_and_leave_other_requests_alone(llama):
    prompts = random_prompts(6, 3, 30, seed=31)
    rules = [[favour_successor, no_repeat], [ban_even, no_repeat], []] * 2
    want = [
        _reference(llama, p, 20, r) if r else reference_greedy(llama, p, 20)
        for p, r in zip(prompts, rules, strict=True)
    ]
    params = [SamplingParams(max_new_tokens=20, logits_processors=r) for r in rules]
    outputs = cbgen.generate_batch(llama, prompts, params, CONFIG)
    assert [o.token_ids for o in outputs] == want
    assert all(t % 2 == 1 for t in outputs[1].token_ids)
    # The rule changed something, or this test would prove nothing.
    assert want[0] != reference_greedy(llama, prompts[0], 20)
    assert any(b == a + 1 for a, b in zip(want[0], want[0][1:], strict=False))


def _boom(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    if len(token_ids) > 20:
        raise RuntimeError("user code broke")
    return logits


def _wrong_shape(token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    return logits[:10]


@pytest.mark.parametrize(
    ("processor", "message"), [(_boom, "user code broke"), (_wrong_shape, "shape")]
)
def test_a_failing_processor_finishes_only_its_request(llama, processor, message):
    prompts = random_prompts(4, 12, 12, seed=32)
    want = [reference_greedy(llama, p, 16) for p in prompts]
    with EngineCore(llama, CONFIG) as engine:
        for i, p in enumerate(prompts):
            rules = (processor,) if i == 1 else ()
            engine.add_request(
                p, SamplingParams(max_new_tokens=16, logits_processors=rules), str(i)
            )
        results = run_until_done(engine)
        assert engine.allocator.num_free == engine.allocator.num_blocks
    failed = results["1"]
    assert failed.finish_reason is FinishReason.ERROR
    assert message in failed.error and "logits processor" in failed.error
    assert failed.token_ids == want[1][: len(failed.token_ids)]  # the tokens before it broke
    for i in (0, 2, 3):
        assert results[str(i)].token_ids == want[i]
        assert results[str(i)].error is None


def test_online_engine_reports_the_error_and_keeps_serving(llama):
    prompt = random_prompts(1, 12, 12, seed=33)[0]
    want = reference_greedy(llama, prompt, 16)
    with cbgen.Engine(llama, config=CONFIG) as engine:
        bad = engine.add_request(
            prompt, SamplingParams(max_new_tokens=16, logits_processors=[_boom])
        )
        good = engine.add_request(prompt, SamplingParams(max_new_tokens=16))
        failed = engine.get_result(bad, timeout=60)
        assert failed.finish_reason is FinishReason.ERROR and "user code broke" in failed.error
        assert engine.get_result(good, timeout=60).token_ids == want
        engine.sync()
        assert engine.core.allocator.num_free == engine.core.allocator.num_blocks


def test_processors_must_be_callable():
    with pytest.raises(ValueError, match="logits_processors"):
        SamplingParams(logits_processors=["not a function"]).validate()

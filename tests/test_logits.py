"""Batch logits processors: penalties, biases, bans and min-p, held to transformers'
processors of the same names (greedy tokens equal ``model.generate()``) and to OpenAI's
definitions where transformers has none."""

from __future__ import annotations

import pytest
import torch
from conftest import ARCHITECTURES, chat_prompts, make_tiny_model, random_prompts, reference_greedy
from transformers import GenerationConfig
from transformers.generation.logits_process import MinPLogitsWarper

import cbgen
from cbgen import EngineConfig, SamplingParams
from cbgen.sampling.logits import (
    LogitsRows,
    PresenceFrequencyPenalty,
    apply_processors,
    default_processors,
)
from cbgen.sampling.sampler import Sampler


def _generate(model, prompt, gc):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            generation_config=gc,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def _configs(model, prompts, max_new_tokens):
    """One GenerationConfig per prompt, each exercising another processor."""
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    plain = reference_greedy(model, prompts[1], max_new_tokens)
    base = dict(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=eos)
    return [
        GenerationConfig(**base, repetition_penalty=1.6),
        # Ban the token the model picks after its own first token, and its third token.
        GenerationConfig(**base, bad_words_ids=[[plain[0], plain[1]], [plain[2]]]),
        # EOS made likely, then held off for 6 tokens.
        GenerationConfig(**base, sequence_bias={(eos,): 12.0}, min_new_tokens=6),
        GenerationConfig(**base, repetition_penalty=0.7, suppress_tokens=[plain[0]]),
        GenerationConfig(**base),
    ]


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_processors_match_generate(arch):
    model = make_tiny_model(arch)
    prompts = random_prompts(5, 3, 30, seed=7)
    configs = _configs(model, prompts, 16)
    expected = [_generate(model, p, gc) for p, gc in zip(prompts, configs, strict=True)]
    params = [SamplingParams.from_generation_config(gc) for gc in configs]
    outputs = cbgen.generate_batch(
        model, prompts, params, EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=24)
    )
    for i, (want, got) in enumerate(zip(expected, outputs, strict=True)):
        assert got.token_ids == want, f"prompt {i}: {configs[i]}"
    assert len(outputs[2].token_ids) >= 6


def test_penalties_with_async_scheduling_and_preemption(llama):
    prompts = random_prompts(8, 10, 40, seed=8)
    gc = GenerationConfig(max_new_tokens=20, do_sample=False, repetition_penalty=1.4)
    expected = [_generate(llama, p, gc) for p in prompts]
    params = SamplingParams.from_generation_config(gc)
    for config in (
        EngineConfig(block_size=4, num_blocks=20, max_batch_tokens=32),
        EngineConfig(block_size=4, num_blocks=256, max_batch_tokens=32, async_scheduling=True),
    ):
        outputs = cbgen.generate_batch(llama, prompts, params, config)
        assert [o.token_ids for o in outputs] == expected


def _openai_penalties(presence, frequency, num_prompt):
    """OpenAI's definition as a per-request processor (the slow path), the reference."""

    def processor(token_ids, logits):
        out = logits.clone()
        counts = {}
        for token in token_ids[num_prompt:]:
            counts[token] = counts.get(token, 0) + 1
        for token, count in counts.items():
            out[token] -= presence + frequency * count
        return out

    return processor


def test_presence_and_frequency_penalties_match_openai_definition(llama):
    prompts = random_prompts(4, 5, 20, seed=9)
    settings = [(1.5, 0.0), (0.0, 0.8), (0.6, 0.6), (-0.5, 0.3)]
    fast = [
        SamplingParams(max_new_tokens=24, presence_penalty=p, frequency_penalty=f)
        for p, f in settings
    ]
    slow = [
        SamplingParams(max_new_tokens=24, logits_processors=[_openai_penalties(p, f, len(prompt))])
        for (p, f), prompt in zip(settings, prompts, strict=True)
    ]
    got = cbgen.generate_batch(llama, prompts, fast)
    want = cbgen.generate_batch(llama, prompts, slow)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    plain = cbgen.generate_batch(llama, prompts, SamplingParams(max_new_tokens=24))
    assert [o.token_ids for o in got] != [o.token_ids for o in plain]


def test_presence_frequency_pass_on_a_tensor():
    logits = torch.zeros(2, 10)
    params = [SamplingParams(presence_penalty=1.0, frequency_penalty=0.5), SamplingParams()]
    rows = LogitsRows(params, [2, 2], [3, 0], [[7, 7, 1, 1, 3], [4, 4]])
    PresenceFrequencyPenalty().apply(logits, [0], rows)
    # Output tokens 1, 1, 3 (the prompt's 7s do not count): 1 twice, 3 once.
    assert logits[0, 1].item() == pytest.approx(-2.0)
    assert logits[0, 3].item() == pytest.approx(-1.5)
    assert logits[0, 7].item() == 0.0 and logits[1].abs().sum().item() == 0.0


def test_logit_bias_forces_and_bans_tokens(llama):
    prompts = random_prompts(3, 4, 12, seed=10)
    forced = cbgen.generate_batch(
        llama, prompts, SamplingParams(max_new_tokens=5, logit_bias={42: 100.0})
    )
    assert all(o.token_ids == [42] * 5 for o in forced)
    plain = cbgen.generate_batch(llama, prompts, SamplingParams(max_new_tokens=5))
    banned = {t for o in plain for t in o.token_ids}
    out = cbgen.generate_batch(
        llama,
        prompts,
        SamplingParams(max_new_tokens=5, logit_bias=dict.fromkeys(banned, -1e9)),
    )
    assert not banned & {t for o in out for t in o.token_ids}


def test_min_tokens_holds_off_stop_ids_and_then_stops(llama):
    prompt = random_prompts(1, 5, 5, seed=11)[0]
    eager = SamplingParams(max_new_tokens=20, stop_token_ids=[42], logit_bias={42: 100.0})
    (out,) = cbgen.generate_batch(llama, [prompt], eager)
    assert out.token_ids == [42] and out.finish_reason == "stop"
    held = SamplingParams(
        max_new_tokens=20, stop_token_ids=[42], logit_bias={42: 100.0}, min_tokens=4
    )
    (out,) = cbgen.generate_batch(llama, [prompt], held)
    assert len(out.token_ids) == 5 and out.token_ids[-1] == 42 and 42 not in out.token_ids[:4]


def test_min_p_keeps_the_same_tokens_as_transformers():
    torch.manual_seed(0)
    logits = torch.randn(6, 50) * 3
    min_ps = [0.0, 0.05, 0.1, 0.3, 0.7, 1.0]
    for row, min_p in enumerate(min_ps):
        if min_p == 0.0:
            continue
        want = MinPLogitsWarper(min_p)(None, logits[row : row + 1].clone()).isfinite()[0]
        sampler = Sampler(torch.Generator().manual_seed(row))
        params = [SamplingParams(temperature=1.0, min_p=min_p)] * 400
        drawn = set(sampler(logits[row].repeat(400, 1), params, [None] * 400).tokens)
        assert drawn <= set(want.nonzero().flatten().tolist())
        if want.sum() > 1:
            assert len(drawn) > 1


def test_processors_skip_rows_that_use_none():
    logits = torch.randn(3, 20)
    before = logits.clone()
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0), SamplingParams()]
    rows = LogitsRows(params, [2, 2, 2], [1, 1, 1], [None, [5, 6, 7], None])
    apply_processors(default_processors([0]), logits, rows)
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    changed = (logits[1] != before[1]).nonzero().flatten().tolist()
    assert changed == [5, 6, 7]


def test_generation_config_refuses_what_cbgen_cannot_do():
    with pytest.raises(ValueError, match="num_beams=4"):
        SamplingParams.from_generation_config(GenerationConfig(num_beams=4))
    with pytest.raises(ValueError, match="no_repeat_ngram_size=3"):
        SamplingParams.from_generation_config(GenerationConfig(no_repeat_ngram_size=3))
    with pytest.raises(ValueError, match="sequence_bias"):
        SamplingParams.from_generation_config(GenerationConfig(sequence_bias={(1, 2): 1.0}))
    params = SamplingParams.from_generation_config(
        GenerationConfig(
            max_new_tokens=7,
            do_sample=True,
            temperature=0.5,
            min_p=0.1,
            repetition_penalty=1.2,
            min_new_tokens=3,
            bad_words_ids=[[4, 5]],
            stop_strings=["END"],
            num_beams=1,
        )
    )
    assert (params.max_new_tokens, params.temperature, params.min_p) == (7, 0.5, 0.1)
    assert (params.repetition_penalty, params.min_tokens) == (1.2, 3)
    assert params.bad_words == ((4, 5),) and params.stop == ["END"]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(repetition_penalty=0.0), "repetition_penalty must be > 0"),
        (dict(presence_penalty=float("nan")), "presence_penalty must be a finite"),
        (dict(min_p=1.5), "min_p must be in"),
        (dict(min_tokens=200, max_new_tokens=10), "min_tokens"),
        (dict(logit_bias={-1: 1.0}), "logit_bias must hold non-negative"),
        (dict(logit_bias={999: 1.0}), "outside the vocabulary"),
        (dict(bad_words=[[]]), "bad_words must hold non-empty"),
        (dict(stop_token_ids=[5000]), "stop_token_ids holds token id 5000"),
        (dict(logprobs=-1), "logprobs must be an int >= 0"),
        (dict(prompt_logprobs=10_000), "prompt_logprobs must be at most"),
        (dict(stop=[""]), "stop strings must not be empty"),
    ],
)
def test_invalid_processor_settings_are_refused(llama, kwargs, message):
    with pytest.raises(ValueError, match=message):
        cbgen.generate_batch(llama, [[1, 2, 3]], SamplingParams(**kwargs))


def test_stop_strings_in_generate_batch(smollm2):
    model, tokenizer = smollm2
    (prompt,) = chat_prompts(tokenizer, ["Count from 1 to 20, separated by commas."])
    (full,) = cbgen.generate_batch(
        model, [prompt], SamplingParams(max_new_tokens=40), tokenizer=tokenizer
    )
    assert full.text == tokenizer.decode(full.token_ids, skip_special_tokens=True)
    stop = "5"
    assert stop in full.text
    outputs = cbgen.generate_batch(
        model,
        [prompt, prompt],
        [
            SamplingParams(max_new_tokens=40, stop=[stop]),
            SamplingParams(max_new_tokens=40, stop=stop, include_stop_str_in_output=True),
        ],
        tokenizer=tokenizer,
    )
    cut = full.text.index(stop)
    for out, text in zip(outputs, (full.text[:cut], full.text[: cut + 1]), strict=True):
        assert out.finish_reason == "stop" and out.text == text
        # The ids end with the token that completed the stop string.
        ids = out.token_ids
        assert ids == full.token_ids[: len(ids)]
        assert stop in tokenizer.decode(ids) and stop not in tokenizer.decode(ids[:-1])


def test_stop_strings_need_a_tokenizer(llama):
    with pytest.raises(ValueError, match="stop strings need a tokenizer"):
        cbgen.generate_batch(llama, [[1, 2, 3]], SamplingParams(stop=["x"]))

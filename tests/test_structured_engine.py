"""Structured output through the engine: sampled outputs match their schema or regex,
plain requests in the same batch stay exact, and bad specs fail alone."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
from conftest import chat_prompts

import cbgen
from cbgen import EngineConfig, EngineCore, SamplingParams, StructuredOutput

SCHEMA = {  # nested objects, enums and arrays; every field bounded, so outputs can finish
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["cat", "dog", "bird"]},
        "age": {"type": "integer", "minimum": 0, "maximum": 30},
        "tags": {"type": "array", "items": {"enum": ["calm", "loud", "old"]}, "maxItems": 3},
        "owner": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 10},
                "verified": {"type": "boolean"},
                "scores": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 2,
                },
            },
            "required": ["city", "verified", "scores"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "kind", "age", "tags", "owner"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def prompt(smollm2):
    return chat_prompts(smollm2[1], ["Describe a pet of yours as JSON."])[0]


def _sample_schema(smollm2, prompt, n):
    model, tokenizer = smollm2
    params = SamplingParams(
        max_new_tokens=120,
        temperature=1.0,
        seed=0,
        n=n,
        structured_output=StructuredOutput(json_schema=SCHEMA),
    )
    (out,) = cbgen.generate_batch(
        model, [prompt], params, EngineConfig(max_num_seqs=n), tokenizer=tokenizer
    )
    assert len(out.completions) == n
    texts = set()
    for completion in out.completions:
        assert completion.finish_reason == "eos", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
        texts.add(completion.text)
    assert len(texts) > n // 2  # sampled, not one output n times


def test_sampled_json_schema_outputs_validate(smollm2, prompt):
    _sample_schema(smollm2, prompt, 12)


@pytest.mark.slow
def test_hundred_sampled_json_schema_outputs_all_validate(smollm2, prompt):
    _sample_schema(smollm2, prompt, 100)


def test_regex_json_object_and_grammar(smollm2, prompt):
    model, tokenizer = smollm2
    pattern = r"(yes|no), [0-9]{2,4} (cats|dogs)"
    specs = [
        StructuredOutput(regex=pattern),
        StructuredOutput(json_object=True),
        StructuredOutput(grammar='start: "ok " NUMBER\nNUMBER: /[1-9][0-9]?/'),
    ]
    (short,) = chat_prompts(
        tokenizer, ['Reply with a JSON object with one key "answer": what is 2+2?']
    )
    outputs = cbgen.generate_batch(
        model,
        [prompt, short, prompt],
        [SamplingParams(max_new_tokens=60, structured_output=s) for s in specs],
        tokenizer=tokenizer,
    )
    assert re.fullmatch(pattern, outputs[0].text)
    assert isinstance(json.loads(outputs[1].text), dict)
    assert re.fullmatch(r"ok [1-9][0-9]?", outputs[2].text)
    assert all(o.finish_reason == "eos" for o in outputs)


def test_plain_requests_beside_grammar_requests_stay_exact(smollm2, prompt):
    model, tokenizer = smollm2
    plain = SamplingParams(max_new_tokens=24)
    (alone,) = cbgen.generate_batch(model, [prompt], plain)
    for config in (EngineConfig(), EngineConfig(async_scheduling=True)):
        outputs = cbgen.generate_batch(
            model,
            [prompt, prompt, prompt],
            [
                SamplingParams(max_new_tokens=24, structured_output=StructuredOutput(regex="a+")),
                plain,
                SamplingParams(
                    max_new_tokens=24, structured_output=StructuredOutput(json_object=True)
                ),
            ],
            config,
            tokenizer=tokenizer,
        )
        assert outputs[1].token_ids == alone.token_ids
        assert re.fullmatch("a+", outputs[0].text)


def test_unfinished_grammar_ends_with_length_and_the_text_so_far(smollm2, prompt):
    model, tokenizer = smollm2
    spec = StructuredOutput(json_schema=SCHEMA)
    (out,) = cbgen.generate_batch(
        model,
        [prompt],
        SamplingParams(max_new_tokens=5, structured_output=spec),
        tokenizer=tokenizer,
    )
    assert out.finish_reason == "length" and len(out.token_ids) == 5
    assert out.text.startswith('{"') and out.text == tokenizer.decode(out.token_ids)


def test_invalid_specs_fail_alone(smollm2, prompt):
    model, tokenizer = smollm2
    with EngineCore(model, EngineConfig(), tokenizer) as engine:
        with pytest.raises(ValueError, match=r"request 'bad'.*regex"):
            engine.add_request(
                prompt, SamplingParams(structured_output=StructuredOutput(regex="(")), "bad"
            )
        with pytest.raises(ValueError, match="exactly one"):
            engine.add_request(
                prompt,
                SamplingParams(structured_output=StructuredOutput(regex="a", json_object=True)),
            )
        engine.add_request(prompt, SamplingParams(max_new_tokens=3), "good")
        while engine.has_unfinished():
            engine.step()
        assert engine.allocator.num_free == engine.allocator.num_blocks
    with pytest.raises(ValueError, match="structured output needs a tokenizer"):
        cbgen.generate_batch(
            model, [prompt], SamplingParams(structured_output=StructuredOutput(json_object=True))
        )


def test_a_grammar_after_the_reasoning_section(smollm2):
    """The model thinks freely (the same tokens as without a grammar, up to the end
    marker), then the grammar governs the answer."""
    model, tokenizer = smollm2
    messages = [
        {"role": "system", "content": "Think inside <think></think> first, then answer."},
        {"role": "user", "content": "What is 2 plus 2?"},
        {"role": "assistant", "content": "<think>2 plus 2 makes 4.</think>The answer is 4."},
        {"role": "user", "content": "What is 3 plus 3?"},
    ]
    prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True
    )["input_ids"]
    free = cbgen.generate_batch(
        model, [prompt], SamplingParams(max_new_tokens=40), tokenizer=tokenizer
    )[0].completions[0]
    assert free.text.startswith("<think>") and "</think>" in free.text, free.text
    thought = free.text[: free.text.index("</think>") + len("</think>")]
    for section in (
        cbgen.ReasoningSection("</think>", "<think>"),
        cbgen.ReasoningSection("</think>"),
    ):
        spec = StructuredOutput(regex="[0-9]+ apples", after_reasoning=section)
        (out,) = cbgen.generate_batch(
            model, [prompt], SamplingParams(max_new_tokens=40, structured_output=spec),
            tokenizer=tokenizer,
        )  # fmt: skip
        text = out.completions[0].text
        assert text.startswith(thought), (text, thought)
        assert re.fullmatch("[0-9]+ apples", text[len(thought) :]), text
        assert out.completions[0].finish_reason == "eos"

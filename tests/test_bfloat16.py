"""bfloat16 is opt-in: it must run every path and stay close to float32 greedy output."""

from __future__ import annotations

import pytest
import torch
from conftest import chat_prompts, make_tiny_model, random_prompts

import cbgen
from cbgen import EngineConfig, SamplingParams


def test_bfloat16_model_runs_with_a_bfloat16_cache():
    model = make_tiny_model("llama").to(torch.bfloat16)
    prompts = random_prompts(6, 1, 40, seed=31)
    with cbgen.EngineCore(
        model, EngineConfig(block_size=8, num_blocks=64, max_batch_tokens=32)
    ) as eng:
        assert all(layer.dtype == torch.bfloat16 for layer in eng.executor.cache.layers)
        for i, p in enumerate(prompts):
            eng.add_request(p, SamplingParams(max_new_tokens=12, ignore_eos=True), str(i))
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
    # The cache held real K/V: each request's first token is the bfloat16 model's own
    # next-token argmax on its prompt (chunked prefill through the paged cache included).
    with torch.no_grad():
        for i, p in enumerate(prompts):
            logits = model(torch.tensor([p])).logits[0, -1]
            assert done[str(i)].token_ids[0] == int(logits.float().argmax()), f"prompt {i}"


@pytest.mark.slow
def test_bfloat16_follows_float32_on_the_bundled_model(smollm2):
    model32, tokenizer = smollm2
    model16, _ = cbgen.load_model("smollm2", dtype=torch.bfloat16)
    questions = [
        "What is the capital of France?",
        "Write a haiku about autumn leaves.",
        "Explain photosynthesis in one sentence.",
        "hi",
        "Translate 'good morning' into Spanish.",
        "What is 17 times 23?",
        "Give me three tips for better sleep.",
        "Who wrote Romeo and Juliet?",
        "Summarize the plot of Cinderella in two sentences.",
        "What is a prime number?",
        "Name the planets of the solar system.",
        "Why is the sky blue?",
        "Write a Python function that reverses a string.",
        "What's the difference between weather and climate?",
        "Suggest a name for a pet turtle.",
        "Describe the taste of a lemon.",
    ]
    prompts = chat_prompts(tokenizer, questions)
    params = SamplingParams(max_new_tokens=32, ignore_eos=True)
    ref = [o.token_ids for o in cbgen.generate_batch(model32, prompts, params)]
    out = [o.token_ids for o in cbgen.generate_batch(model16, prompts, params)]
    full = sum(a == b for a, b in zip(ref, out, strict=True))
    # Measured with transformers' bf16 modules: 8 of 16 prompts kept all 32 tokens; the
    # fast path keeps the residual stream in float32 (50% of 64 chat64 prompts in
    # bench/quality.py). bfloat16 still rounds the GEMMs' inputs and outputs, so it is
    # opt-in (float32 is the default and the exact one).
    assert full >= 6, f"only {full}/16 prompts matched float32 for 32 tokens"

"""``cbgen.bench.quality``: perplexity through the engine equals the model's own, and each precision
mode of the bundled model stays within its stated distance of float32."""

from __future__ import annotations

import math

import pytest
import torch
from conftest import make_tiny_model, random_prompts

import cbgen
from cbgen import EngineConfig
from cbgen.bench.quality import greedy_agreement, greedy_outputs, perplexity


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_perplexity_through_the_engine_equals_the_model_forward(arch):
    model = make_tiny_model(arch)
    text = random_prompts(1, 70, 70, seed=9)[0]
    got = perplexity(model, text, segment_len=32, config=EngineConfig(block_size=4))
    nll = []
    with torch.no_grad():
        for start in range(0, len(text), 32):
            segment = text[start : start + 32]
            if len(segment) < 2:
                continue
            logits = model(torch.tensor([segment])).logits[0, :-1].float()
            logprobs = torch.log_softmax(logits, dim=-1)
            nll += [-float(logprobs[i, t]) for i, t in enumerate(segment[1:])]
    assert got.tokens == len(nll) == 31 + 31 + 5
    assert math.isclose(got.value, math.exp(sum(nll) / len(nll)), rel_tol=1e-4)


def test_greedy_agreement_counts_the_common_prefix():
    assert greedy_agreement([[1, 2, 3], [4, 5, 6]], [[1, 2, 9], [4, 5, 6]]) == 2.5
    assert greedy_agreement([[1]], [[2]]) == 0
    with pytest.raises(ValueError):
        greedy_agreement([[1]], [])
    with pytest.raises(ValueError, match="fewer than 2"):
        perplexity(make_tiny_model("llama"), [5])


# The bound each mode is held to on the bundled model: perplexity within this fraction of
# float32's on 512 tokens of bench/prompts/perplexity.txt, and at least this mean greedy
# agreement with float32 over the first 16 tokens of 8 chat64 prompts. bench/quality.py
# measures the full table (3,210 tokens, 64 prompts x 32 tokens): +0.04%, +0.08%, +0.35%
# and +0.29% perplexity; 30.6, 23.3, 14.3 and 22.2 tokens of 32 in the same order. The
# 4-bit LM head option: +5.93% and 8.8 tokens of 32 (1.9 of 16 on the 8 prompts here
# with an earlier build of the int4 kernel: the bound is a sample's, not the table's).
BOUNDS = {
    "float32 + bf16 KV": (0.01, 12),
    "bfloat16": (0.01, 6),
    "int8": (0.02, 4),
    "int4": (0.02, 6),
    "int4 + 4-bit LM head": (0.10, 1.5),
    "w4a8": (0.06, 4),
}


@pytest.fixture(scope="module")
def quality_inputs():
    from pathlib import Path

    from cbgen.bench.workloads import build_workload

    _, tokenizer = cbgen.load_model("smollm2")
    root = Path(__file__).resolve().parent.parent / "bench"
    lines = (root / "prompts" / "perplexity.txt").read_text().splitlines()
    text = "\n".join(line for line in lines if not line.startswith("# "))
    text_ids = tokenizer(text)["input_ids"][:512]
    prompts = build_workload("chat64", tokenizer, num_prompts=8).prompts
    reference, _ = cbgen.load_model("smollm2", tokenizer=False)
    return (
        text_ids,
        prompts,
        perplexity(reference, text_ids, 256).value,
        greedy_outputs(reference, prompts, 16),
    )


@pytest.mark.parametrize("mode", list(BOUNDS))
def test_each_mode_stays_within_its_bound_of_float32(mode, quality_inputs):
    text_ids, prompts, reference_ppl, reference_outputs = quality_inputs
    config = None
    if mode == "float32 + bf16 KV":
        model, _ = cbgen.load_model("smollm2", tokenizer=False)
        config = EngineConfig(kv_cache_dtype=torch.bfloat16)
    elif mode == "bfloat16":
        model, _ = cbgen.load_model("smollm2", dtype=torch.bfloat16, tokenizer=False)
    elif mode == "w4a8":
        model, _ = cbgen.load_model("smollm2", quantization="w4a8", tokenizer=False)
    elif mode == "int4 + 4-bit LM head":
        model, _ = cbgen.load_model(
            "smollm2", quantization="int4", lm_head_quantization="int4", tokenizer=False
        )
    else:
        model, _ = cbgen.load_model("smollm2", quantization=mode, tokenizer=False)
    ppl_bound, agreement_bound = BOUNDS[mode]
    ppl = perplexity(model, text_ids, 256, config).value
    agreement = greedy_agreement(reference_outputs, greedy_outputs(model, prompts, 16, config))
    assert abs(ppl / reference_ppl - 1) <= ppl_bound, (ppl, reference_ppl)
    assert agreement >= agreement_bound, agreement

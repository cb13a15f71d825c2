"""Speculative decoding on a CUDA device: exact greedy output with every proposer.

Run on a machine with a GPU (the device tool's H200: torch 2.11, transformers 5.17):

    PYTHONPATH=.:tests python3 bench/cuda_speculative_check.py [cuda|cpu]

For tiny random-weight models of several architectures (full attention, sliding window,
hybrid, learned positions) it runs echo prompts (a text, the model's own continuation,
the text again) through the engine on the device with prompt lookup, a layer-skip draft,
a draft that is a copy of the target and a draft of other weights, plainly, with chunked
prefill and under preemption, and checks every output against ``model.generate()`` there,
and that both KV caches give back every block. Then sampled requests (temperature 1,
seeded) with a draft model must finish with valid tokens. Prints one line per check and
exits non-zero on a failure.
"""

from __future__ import annotations

import copy
import sys

import torch
import transformers
from conftest import make_tiny_model, random_prompts

from cbgen import EngineConfig, EngineCore, SamplingParams, SpeculativeConfig

ARCHS = ["llama", "qwen3", "gemma2", "gemma3", "mistral-sliding", "gpt2"]
MAX_NEW = 24


def greedy(model, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def run(model, prompts, spec, params, **overrides):
    base = dict(block_size=4, num_blocks=128, max_batch_tokens=64)
    base.update(overrides)
    with EngineCore(model, EngineConfig(speculative=spec, **base)) as engine:
        for i, prompt in enumerate(prompts):
            engine.add_request(prompt, params, str(i))
        results = {}
        while engine.has_unfinished():
            for out in engine.step():
                if out.finished:
                    results[out.request_id] = out
        allocators = [engine.allocator]
        draft_allocator = getattr(engine.proposer, "allocator", None)
        if draft_allocator is not None:
            allocators.append(draft_allocator)
        freed = all(a.num_free == a.num_blocks for a in allocators)
        stats = dict(engine.stats)
    return [results[str(i)] for i in range(len(prompts))], freed, stats


def main() -> int:
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {device}")
    failures = 0
    for arch in ARCHS:
        model = make_tiny_model(arch).to(device)
        prompts = [x + greedy(model, x, 8) + x for x in random_prompts(4, 4, 12, seed=7)]
        want = [greedy(model, p, MAX_NEW) for p in prompts]
        specs = {
            "ngram": SpeculativeConfig(method="ngram"),
            "layer_skip": SpeculativeConfig(method="layer_skip", num_layers=1),
            "draft-same": SpeculativeConfig(method="draft", draft_model=copy.deepcopy(model)),
            "draft-other": SpeculativeConfig(
                method="draft", draft_model=make_tiny_model(arch, seed=3).to(device)
            ),
        }
        for name, spec in specs.items():
            for mode, overrides in {
                "plain": {},
                "chunked": dict(max_batch_tokens=8),
                "preempted": dict(num_blocks=24, max_batch_tokens=24),
            }.items():
                params = SamplingParams(max_new_tokens=MAX_NEW)
                outputs, freed, stats = run(model, prompts, spec, params, **overrides)
                same = sum(o.token_ids == w for o, w in zip(outputs, want, strict=True))
                ok = same == len(prompts) and freed and stats["spec_proposed_tokens"] > 0
                failures += not ok
                print(
                    f"{'ok  ' if ok else 'FAIL'} {arch:16} {name:12} {mode:9} "
                    f"exact {same}/{len(prompts)}, blocks back {freed}, "
                    f"kept {stats['spec_accepted_tokens']}/{stats['spec_proposed_tokens']}"
                )
        sampled = SamplingParams(max_new_tokens=MAX_NEW, temperature=1.0, seed=3)
        outputs, freed, stats = run(model, prompts, specs["layer_skip"], sampled)
        vocab = model.config.vocab_size
        ok = freed and all(
            len(o.token_ids) and all(0 <= t < vocab for t in o.token_ids) for o in outputs
        )
        failures += not ok
        print(f"{'ok  ' if ok else 'FAIL'} {arch:16} sampled with layer_skip: blocks back {freed}")
    print("PASS" if failures == 0 else f"{failures} FAILED")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

"""Penalties, logprobs and structured output on a CUDA device, against transformers there.

Run on a machine with a GPU (the device tool's H200: torch 2.11, transformers 5.17):

    PYTHONPATH=.:tests:<dir with llguidance> python3 bench/cuda_sampling_check.py \
        [cuda|cpu] [--tokenizer DIR]

For tiny random-weight models of several architectures it checks, on the device:
greedy tokens under repetition penalty, bad words, min_new_tokens and a single-token
sequence bias equal ``model.generate()`` with the same ``GenerationConfig``; generated
and prompt logprobs equal a plain forward's ``log_softmax`` (max error printed, bound
1e-4); and, with the SmolLM2 tokenizer from ``--tokenizer`` (a folder with
tokenizer.json), sampled outputs under a regex all match it. Exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import re
import sys

import torch
import transformers
from conftest import make_tiny_model, random_prompts
from transformers import GenerationConfig

import cbgen
from cbgen import EngineConfig, SamplingParams, StructuredOutput

ARCHS = ["llama", "qwen3", "gemma2", "mistral-sliding", "gpt2"]
TOLERANCE = 1e-4


def _generate(model, prompt, gc):
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt], device=model.device),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long, device=model.device),
            generation_config=gc,
            pad_token_id=0,
        )
    return out[0, len(prompt) :].tolist()


def check_processors(model, arch: str) -> bool:
    prompts = random_prompts(4, 3, 30, seed=7)
    eos = model.config.eos_token_id
    eos = eos[0] if isinstance(eos, list) else eos
    base = dict(max_new_tokens=16, do_sample=False, eos_token_id=eos)
    plain = _generate(model, prompts[1], GenerationConfig(**base))
    configs = [
        GenerationConfig(**base, repetition_penalty=1.6),
        GenerationConfig(**base, bad_words_ids=[[plain[0], plain[1]], [plain[2]]]),
        GenerationConfig(**base, sequence_bias={(eos,): 12.0}, min_new_tokens=6),
        GenerationConfig(**base, repetition_penalty=0.7),
    ]
    want = [_generate(model, p, gc) for p, gc in zip(prompts, configs, strict=True)]
    params = [SamplingParams.from_generation_config(gc) for gc in configs]
    config = EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=24)
    got = [o.token_ids for o in cbgen.generate_batch(model, prompts, params, config)]
    ok = got == want
    print(f"  {arch:16s} penalties vs generate: {'ok' if ok else 'MISMATCH'}")
    return ok


def check_logprobs(model, arch: str) -> bool:
    prompts = random_prompts(4, 2, 40, seed=3)
    params = SamplingParams(max_new_tokens=10, logprobs=3, prompt_logprobs=2)
    config = EngineConfig(block_size=4, num_blocks=128, max_batch_tokens=16)
    worst = 0.0
    outputs = cbgen.generate_batch(model, prompts, params, config)
    for prompt, out in zip(prompts, outputs, strict=True):
        ids = prompt + out.token_ids
        with torch.inference_mode():
            logits = model(torch.tensor([ids], device=model.device)).logits[0].float()
        reference = torch.log_softmax(logits, dim=-1).cpu()
        n = len(prompt)
        for i, (token, entry) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            worst = max(worst, abs(entry[token] - reference[n + i - 1, token].item()))
        for pos in range(1, n):
            value = out.prompt_logprobs[pos][prompt[pos]]
            worst = max(worst, abs(value - reference[pos - 1, prompt[pos]].item()))
    ok = worst < TOLERANCE
    print(f"  {arch:16s} logprobs max |error| {worst:.2e}: {'ok' if ok else 'TOO FAR'}")
    return ok


def check_structured(device: str, tokenizer_dir: str) -> bool:
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    model = make_tiny_model("llama", vocab_size=49152).to(device)
    pattern = r"(yes|no), [0-9]{2,4} (cats|dogs)"
    params = SamplingParams(
        max_new_tokens=40,
        temperature=1.0,
        seed=0,
        n=32,
        structured_output=StructuredOutput(regex=pattern),
    )
    ok = True
    for asynchronous in (False, True):
        config = EngineConfig(async_scheduling=asynchronous)
        (out,) = cbgen.generate_batch(model, [[1, 2, 3]], params, config, tokenizer=tokenizer)
        good = sum(
            c.finish_reason == "eos" and re.fullmatch(pattern, c.text) is not None
            for c in out.completions
        )
        ok = ok and good == len(out.completions)
        print(f"  regex, async={asynchronous}: {good}/{len(out.completions)} match")
    return ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("device", nargs="?", default="cuda")
    parser.add_argument("--tokenizer", default=None)
    args = parser.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.device}")
    ok = True
    for arch in ARCHS:
        model = make_tiny_model(arch).to(args.device)
        if arch == "gemma2" and args.device != "cpu":
            model.set_attn_implementation("eager")  # SDPA on CUDA drops Gemma 2's softcap
        ok = check_processors(model, arch) and ok
        ok = check_logprobs(model, arch) and ok
    if args.tokenizer:
        ok = check_structured(args.device, args.tokenizer) and ok
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

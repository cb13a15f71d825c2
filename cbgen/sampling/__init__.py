"""Sampling: parameters, generation-config defaults, logits processors, the sampler, logprobs, grammars."""

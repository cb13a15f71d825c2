"""Speculative decoding: proposers (n-gram, draft model, layer skip), adaptive draft lengths and the draft model's own runner."""
